"""Where the SSE layer op's time goes on the GPU: device kernels vs wall time, against chunk_gla alone.

    python -m benchmarks.ops.profile_sse --T 4096,16384 --out profile_sse.json [--gather auto,shared,on,off] [--no-fla]

For each T: `ops.sse.reference.sse_varlen` (n4k1, shared partition, routing from random logits; the same setup
as `python -m benchmarks.ops.kernels --sections sse`), fla's chunk_gla on T tokens, and chunk_gla on SSE's own 2T-token
varlen layout (shared path + routed tokens grouped by partition: the floor of that layout), forward and forward+backward,
bf16, H=16, D=128. Per case: wall ms per call (host included), device ms per call (sum of kernel times),
kernel count, and the top kernels by time. A wall time far above the device time means the host (Python,
launches, syncs) is the bound; device time above ~2x chunk_gla's means kernels to fuse. `--gather` times SSE
under each setting of the kernel option `sse_gla_gather` in the same process (auto: the default; on: the layout
read in place both ways; shared: only the shared path in place, the sparse rows packed; off: packed rows both
ways), and each SSE
forward+backward also reports its peak memory above the inputs (`torch.cuda.max_memory_allocated`, one call).
The last lines are SSE's device time over chunk_gla's per T. fla's autotuning is whatever the kernel option
`autotune_top` says (`HYBRIDIZE_AUTOTUNE_TOP`; unset: full), printed in the header; `--no-fla` skips its cases,
`--no-layout` only chunk_gla on SSE's layout (fla's full autotuning of a backward costs minutes per shape). `--out`
is rewritten after every case, so a run cut short keeps what it measured.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from benchmarks.ops import kernels as bk   # the same inputs as its sse and gla sections
from benchmarks.timing import profile


def same_layout_inputs(T, n):
    """Fresh GLA inputs in the exact token layout SSE's varlen call hands to chunk_gla: the shared path's T
    tokens, then the T routed tokens grouped by partition (segment lengths from one top-1 routing of random
    logits), as `cu_seqlens`. The floor of the layout: what fla's kernels cost before any routing work."""
    from hybridize.ops.sse import reference as sse
    logits = torch.randn(1, T, n, device="cuda")
    plan = sse.varlen_plan(sse.route(logits, 1), torch.tensor([0, T], device="cuda"))
    x = bk.gla_inputs(2 * T)
    x["cu_seqlens"] = torch.cat([torch.tensor([0, T], device="cuda"), plan.seg_cu[1:] + T])
    return x


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", default="4096,16384")
    ap.add_argument("--n", type=int, default=4, help="partitions")
    ap.add_argument("--top", type=int, default=12, help="kernels listed per case")
    ap.add_argument("--out", default="")
    ap.add_argument("--gather", default="auto",
                    help="settings of the kernel option sse_gla_gather to time SSE under (auto | on | shared | off, "
                         "comma list)")
    ap.add_argument("--no-fla", action="store_true", help="skip fla's chunk_gla cases (and their autotuning)")
    ap.add_argument("--no-layout", action="store_true", help="skip chunk_gla on SSE's 2T layout only")
    args = ap.parse_args(argv)

    from hybridize.ops import gpu
    from hybridize.ops.common.options import current_kernel_options, use_kernel_options
    assert gpu.activate()
    top = current_kernel_options().autotune_top
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "fla_autotune": f"capped to {top} configs" if top else "full", "cases": []}
    print(f"{res['device']}, torch {res['torch']}, fla autotuning {res['fla_autotune']}, bf16, H={bk.H}, D={bk.D}")

    def under(mode, fn):
        def run():
            with use_kernel_options(sse_gla_gather=mode):
                fn()
        return run

    def peak_mb(fn):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    sse = f"sse_varlen_n{args.n}k1"
    for T in [int(t) for t in args.T.split(",")]:
        call, inputs, leaves = bk.sse_setup(T, args.n, "varlen")
        f, fb, _ = bk.fwd_bwd(call, inputs, leaves)
        cases = []
        for mode in args.gather.split(","):
            tag = "" if mode == "auto" else f", gather {mode}"
            cases += [(f"{sse} fwd{tag}", under(mode, f)), (f"{sse} fwd+bwd{tag}", under(mode, fb))]
        if not args.no_fla:
            gf, gfb, _ = bk.fwd_bwd(bk.run_gla, bk.gla_inputs(T))
            cases += [("chunk_gla fwd", gf), ("chunk_gla fwd+bwd", gfb)]
        if not (args.no_fla or args.no_layout):
            lf, lfb, _ = bk.fwd_bwd(bk.run_gla_varlen, same_layout_inputs(T, args.n))
            cases += [("chunk_gla, SSE's 2T layout fwd", lf), ("chunk_gla, SSE's 2T layout fwd+bwd", lfb)]
        for name, fn in cases:
            r = {"case": name, "T": T, **profile(fn, top=args.top)}
            if name.startswith(sse) and "fwd+bwd" in name:
                r["peak_mb"] = peak_mb(fn)
            res["cases"].append(r)
            peak = f", peak {r['peak_mb']:.0f} MiB above the inputs" if "peak_mb" in r else ""
            print(f"\n### {name}, T={T}: wall {r['wall_ms']:.3f} ms, device {r['device_ms']:.3f} ms, "
                  f"{r['kernels']:.0f} kernels, {r['item_calls']:.0f} .item() per call{peak}")
            for t in r["top"]:
                print(f"  {t['ms']:8.3f} ms  x{t['per_call']:4.0f}  {t['kernel']}")
            sys.stdout.flush()
            if args.out:
                Path(args.out).write_text(json.dumps(res, indent=1))
    print("\nSSE's device time over chunk_gla's on the T input tokens:")
    dev = {(r["case"], r["T"]): r["device_ms"] for r in res["cases"]}
    for (case, T), ms in dev.items():
        base = dev.get(("chunk_gla fwd+bwd" if "fwd+bwd" in case else "chunk_gla fwd", T))
        if case.startswith(sse):
            vs = f"  chunk_gla {base:8.3f} ms  {ms / base:.2f}x" if base else ""
            print(f"  T={T:6d}  {case:40s} {ms:8.3f} ms{vs}")


if __name__ == "__main__":
    main()
