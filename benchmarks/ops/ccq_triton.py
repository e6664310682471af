"""CCQ covariance read: the fused Triton kernel at several piece lengths vs its two backbones (issue 6).

For each T, side by side in one process at `[1, T, H, D]`, forward and forward+backward:
- `ccq seg=<n>`: `ops.ccq.triton_read.ccq_triton` with the sequence cut into pieces of n tokens in
  both directions (`auto`: the default choice; `0`: one pass per sequence);
- `ccq seg=auto, products=<mode>`: the same with the kernel option `ccq_products=split` (bf16 hi/lo pairs for the
  products with a carried fp32 operand, tf32 in the dk pass) and `=tf32` (fp32 tiles at tf32); the rows
  without it use the default, one bf16 product;
- `gla`: the GLA backbone (`dispatch.run("gla", "chunk")`, fla's chunk_gla);
- `gdn`: the Gated DeltaNet backbone (`dispatch.run("delta", "chunk")`: fla forward, our erase backward);
each with wall ms (median of `triton.testing.do_bench`, host included) and device ms (torch.profiler: the
sum of the call's kernel times, i.e. what the GPU spends once the host runs ahead, as it does in a
training step). Overhead columns: the CCQ row over each backbone, by device time. Also, per product
setting, the max relative difference (max |a - b| / max |b|) to the fp64 PyTorch chunked op of the output
and of dq, dk for a random cotangent.

    python -m benchmarks.ops.ccq_triton --T 4096,16384 --segments auto,0,128,256,512,1024 [--out ccq.json]

Needs CUDA, triton and fla-core. The first call of each kernel variant autotunes (seconds).
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from benchmarks.ops import kernels as bk   # the same backbone inputs and calls
from benchmarks.timing import bench, gpu_stack, md_header, profile
from hybridize.ops.common.options import use_kernel_options

MODES = ("single", "split", "tf32")   # ccq_products kernel options (HYBRIDIZE_CCQ_PRODUCTS), the default first


def errors(fn, ref, q, k):
    """Max relative difference of o, dq, dk (random cotangent) between fn (bf16) and ref in fp64."""
    cot = torch.randn(q.shape, device=q.device, dtype=torch.float64)
    out = {}
    for name, f, dt in (("test", fn, q.dtype), ("ref", lambda a, b: ref(a, b)[0], torch.float64)):
        qq, kk = q.detach().to(dt).requires_grad_(), k.detach().to(dt).requires_grad_()
        o = f(qq, kk)
        dq, dk = torch.autograd.grad((o.double() * cot).sum(), (qq, kk))
        out[name] = (o.detach(), dq, dk)
    return {n: ((a.double() - b).abs().max() / b.abs().max()).item()
            for n, a, b in zip(("o", "dq", "dk"), out["test"], out["ref"])}


def run(T, segments):
    from hybridize.ops.ccq.reference import chunk_ccq
    from hybridize.ops.ccq.triton_read import ccq_triton

    torch.manual_seed(0)
    x = bk.gla_inputs(T)
    inp = dict(q=x["q"], k=F.normalize(x["k"].detach().float() + 0.3, dim=-1).to(bk.DT).requires_grad_())
    cases = {}
    for s in segments:
        seg = None if s == "auto" else int(s)
        cases[f"ccq seg={s}"] = (lambda q, k, seg=seg: ccq_triton(q, k, segment_len=seg)[0], inp)
    def with_products(mode):  # the same op with another ccq_products kernel option (HYBRIDIZE_CCQ_PRODUCTS)
        def call(q, k):
            with use_kernel_options(ccq_products=mode):
                return ccq_triton(q, k)[0]
        return call
    for mode in MODES[1:]:
        cases[f"ccq seg=auto, products={mode}"] = (with_products(mode), inp)
    cases["gla"] = (bk.run_gla, x)
    cases["gdn"] = (bk.run_delta, bk.delta_inputs(T))
    diff = {mode: errors(with_products(mode), chunk_ccq, inp["q"], inp["k"]) for mode in MODES}
    rows = {}
    for name, (fn, args) in cases.items():
        f, fb, leaves = bk.fwd_bwd(fn, args)
        pf, pfb = profile(f), profile(fb)
        rows[name] = dict(fwd_wall=bench(f), fwd_dev=pf["device_ms"], fb_wall=bench(fb, grad_to_none=leaves),
                          fb_dev=pfb["device_ms"], fwd_top=pf["top"][:4], fb_top=pfb["top"][:6])
    return rows, diff


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", default="4096,16384", help="comma-separated sequence lengths")
    ap.add_argument("--segments", default="auto,0,128,256,512,1024",
                    help="piece lengths of the fused read to time (auto: the default choice, 0: no split)")
    ap.add_argument("--out", default=None, help="also write the rows (with the top kernels) as JSON here")
    args = ap.parse_args()
    print(f"{gpu_stack('ops/ccq_triton.py')} | B=1 H={bk.H} D={bk.D} bf16; ms; wall = do_bench median, dev = sum of kernel times (profiler)")
    print()
    print(md_header(["T", "op", "fwd wall", "fwd dev", "fwd+bwd wall", "fwd+bwd dev", "fwd / GLA", "fwd+bwd / GLA",
                     "fwd / GDN", "fwd+bwd / GDN"], "rlrrrrrrrr"))
    out = []
    for T in [int(t) for t in args.T.split(",")]:
        rows, diff = run(T, args.segments.split(","))
        g, d = rows["gla"], rows["gdn"]
        for name, r in rows.items():
            print(f"| {T} | {name} | {r['fwd_wall']:.3f} | {r['fwd_dev']:.3f} | {r['fb_wall']:.3f} | "
                  f"{r['fb_dev']:.3f} | {r['fwd_dev'] / g['fwd_dev']:.2f} | {r['fb_dev'] / g['fb_dev']:.2f} | "
                  f"{r['fwd_dev'] / d['fwd_dev']:.2f} | {r['fb_dev'] / d['fb_dev']:.2f} |")
            out.append(dict(T=T, op=name, device=torch.cuda.get_device_name(), **r))
        out.append(dict(T=T, errors_vs_fp64=diff))
        errs = "; ".join(f"{m}: " + ", ".join(f"{n} {v:.1e}" for n, v in diff[m].items()) for m in MODES)
        print(f"| {T} | vs the fp64 PyTorch op, max rel. diff: {errs} | | | | | | | | |")
        for name, r in rows.items():
            if name.startswith("ccq"):
                tops = ", ".join(f"{t['kernel'][:28]} {t['ms']:.3f}" for t in r["fb_top"])
                print(f"  {T} {name} fwd+bwd kernels: {tops}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
