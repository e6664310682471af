"""Whole mixer layers on the GPU, each next to its backbone (issue 6's comparisons at the layer level).

The kernel benchmarks (`kernels.py`, `ccq_triton.py`) time the ops alone. Seed 000's Table 5 (CCQ,
"+1.2 ms / +2.2 ms per 4K layer step") and what a user pays in training are per *layer*: the input
projections, feature maps, gates, norms and `o_proj` around the op. This script builds each mixer as
the converter does (`hybridize.mixers.build_mixer`, default settings, chunked mode), feeds
x `[1, T, hidden]` and times forward and forward+backward (gradients of x and of every parameter):

- `gla` vs `ccq_gla`, `gdn` vs `ccq_gdn`  (CCQ overhead = ccq layer / backbone layer - 1);
- `gla` vs `sse` (n4k1, shared partition, varlen layout: the paper's long-context layout);
- `gdn` vs `qdelta`.

Shapes: hidden 2048 = 16 heads x 128 (MHA), bf16 parameters and activations, batch 1. Each cell gives
wall ms (median of `triton.testing.do_bench`, host included) and device ms (torch.profiler: the sum of
the call's kernel times, what the GPU spends once the host runs ahead as it does in a training step).
The op-only rows for the same shapes are in `ccq_triton.py` / `kernels.py`.

    python -m benchmarks.layers.layers --T 4096,16384 [--mixers gla,ccq_gla,gdn,ccq_gdn,sse,qdelta] [--out layers.json]

Needs CUDA, triton and fla-core.
"""
from __future__ import annotations

import argparse
import json

import torch

from benchmarks.timing import bench, gpu_stack, md_header, profile

HIDDEN, HEADS, HEAD_DIM = 2048, 16, 128
#: (layer, the layer it is compared with)
PAIRS = {"ccq_gla": "gla", "ccq_gdn": "gdn", "sse": "gla", "qdelta": "gdn"}
SETTINGS = {"sse": {"num_partitions": 4, "top_k": 1, "layout": "varlen"}}


def build(name: str) -> torch.nn.Module:
    from hybridize.mixers import build_mixer

    torch.manual_seed(0)
    m = build_mixer(name, SETTINGS.get(name), hidden_size=HIDDEN, num_heads=HEADS, num_kv_heads=HEADS,
                    head_dim=HEAD_DIM)
    return m.to(device="cuda", dtype=torch.bfloat16)


def time_layer(name: str, T: int) -> dict:
    layer = build(name)
    x = torch.randn(1, T, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cot = torch.randn(1, T, HIDDEN, device="cuda", dtype=torch.bfloat16)
    leaves = [x, *layer.parameters()]

    def fwd():
        with torch.no_grad():
            layer(x, mode="chunk")

    def fwd_bwd():
        for t in leaves:   # as do_bench's grad_to_none: the profile times no .grad accumulation across calls
            t.grad = None
        out = layer(x, mode="chunk")
        loss = (out.hidden * cot).sum()
        if out.aux_loss is not None:
            loss = loss + out.aux_loss
        loss.backward()

    pf, pfb = profile(fwd), profile(fwd_bwd)
    return dict(layer=name, T=T, fwd_wall=bench(fwd), fwd_dev=pf["device_ms"],
                fb_wall=bench(fwd_bwd, grad_to_none=leaves), fb_dev=pfb["device_ms"],
                fwd_top=pf["top"][:6], fb_top=pfb["top"][:8])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", default="4096,16384", help="comma-separated sequence lengths")
    ap.add_argument("--mixers", default="gla,ccq_gla,gdn,ccq_gdn,sse,qdelta",
                    help="layers to time (a compared layer also times its backbone)")
    ap.add_argument("--out", default=None, help="also write the rows (with the top kernels) as JSON here")
    args = ap.parse_args()
    header = gpu_stack("layers/layers.py")
    names = []
    for n in args.mixers.split(","):
        for m in (PAIRS.get(n), n):
            if m is not None and m not in names:
                names.append(m)
    print(f"{header} | layer: hidden {HIDDEN} = {HEADS} heads x {HEAD_DIM}, B=1, bf16, chunked mode; ms; "
          f"wall = do_bench median, dev = sum of kernel times (profiler)")
    print()
    print(md_header(["T", "layer", "fwd wall", "fwd dev", "fwd+bwd wall", "fwd+bwd dev", "vs", "fwd dev ratio",
                     "fwd+bwd dev ratio"], "rlrrrrlrr"))
    out = []
    for T in [int(t) for t in args.T.split(",")]:
        rows = {n: time_layer(n, T) for n in names}
        for n, r in rows.items():
            base = PAIRS.get(n)
            ratio = ("", "", "")
            if base in rows:
                b = rows[base]
                ratio = (base, f"{r['fwd_dev'] / b['fwd_dev']:.2f}", f"{r['fb_dev'] / b['fb_dev']:.2f}")
            print(f"| {T} | {n} | {r['fwd_wall']:.3f} | {r['fwd_dev']:.3f} | {r['fb_wall']:.3f} | "
                  f"{r['fb_dev']:.3f} | {' | '.join(ratio)} |")
            out.append(dict(device=torch.cuda.get_device_name(), **r))
        for n, r in rows.items():
            tops = ", ".join(f"{t['kernel'][:30]} {t['ms']:.3f}" for t in r["fb_top"])
            print(f"  {T} {n} fwd+bwd top kernels: {tops}")
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
