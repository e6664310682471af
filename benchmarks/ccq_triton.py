"""CCQ covariance read: fused Triton kernel vs the current GPU path vs the GLA backbone (issue 6).

Rows, each forward and forward+backward milliseconds (median of `triton.testing.do_bench`), side by side
in one process at the same shape `[B, T, H, D]`:
- `ccq fused (auto split)`: `kernels.triton.ccq_read.ccq_triton`, forward split into pieces;
- `ccq fused (no split)`:   the same, one pass per sequence (segment_len=0);
- `ccq current`:            `fla_adapter.ccq_chunk` (second `chunk_gla` with values = keys + fp32 epilogue);
- `gla chunk_gla`:          the GLA backbone the overhead is measured against (per-key gate);
plus the overhead column ccq / GLA and the fused-vs-current max relative difference of the forward.

    python benchmarks/ccq_triton.py --T 4096,16384 --H 16 --D 128 --dtype bf16 [--out ccq.json]

Needs CUDA, triton and fla-core. The first call of each shape autotunes (a few seconds per kernel).
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def bench(fn, grad_to_none=None):
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median")


def timed(fn, leaves):
    """(forward ms, forward+backward ms) of `fn() -> o`, with a fixed random cotangent."""
    with torch.enable_grad():
        cot = torch.randn_like(fn().float()).to(leaves[0].dtype)

    def fwd():
        with torch.no_grad():
            fn()

    def fwd_bwd():
        fn().backward(cot)
    return bench(fwd), bench(fwd_bwd, grad_to_none=leaves)


def run(B, T, H, D, dtype):
    from hybridize.kernels import fla_adapter
    from hybridize.kernels.triton.ccq_read import ccq_triton

    torch.manual_seed(0)
    dev = "cuda"
    q = torch.randn(B, T, H, D, device=dev, dtype=dtype).requires_grad_()
    k = F.normalize(torch.randn(B, T, H, D, device=dev) + 0.3, dim=-1).to(dtype).requires_grad_()
    v = torch.randn(B, T, H, D, device=dev, dtype=dtype).requires_grad_()
    kg = (torch.randn(B, T, H, D, device=dev, dtype=dtype) * D ** -0.5).requires_grad_()
    g = (F.logsigmoid(torch.randn(B, T, H, D, device=dev)) / 16).requires_grad_()
    fns = {
        "ccq fused (auto split)": (lambda: ccq_triton(q, k)[0], [q, k]),
        "ccq fused (no split)": (lambda: ccq_triton(q, k, segment_len=0)[0], [q, k]),
        "ccq current": (lambda: fla_adapter.ccq_chunk(q, k)[0], [q, k]),
        "gla chunk_gla": (lambda: fla_adapter.gla_chunk(q, kg, v, g)[0], [q, kg, v, g]),
    }
    with torch.no_grad():
        a, b = fns["ccq fused (auto split)"][0]().float(), fns["ccq current"][0]().float()
        diff = ((a - b).abs().max() / b.abs().max()).item()
    rows = {name: timed(fn, leaves) for name, (fn, leaves) in fns.items()}
    return rows, diff


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", default="4096,16384", help="comma-separated sequence lengths")
    ap.add_argument("--B", type=int, default=1, help="batch size")
    ap.add_argument("--H", type=int, default=16, help="heads")
    ap.add_argument("--D", type=int, default=128, help="head dim (K = V)")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="activation dtype")
    ap.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/ccq_triton.py needs a CUDA device")
    import triton

    dtype = DTYPES[args.dtype]
    print(f"device: {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}")
    print(f"shape [B, T, H, D] = [{args.B}, T, {args.H}, {args.D}], dtype {args.dtype}; ms fwd / fwd+bwd "
          "(median); overhead = row / gla chunk_gla")
    print()
    print("| T | op | fwd ms | fwd+bwd ms | fwd / GLA | fwd+bwd / GLA |")
    print("| --- | --- | --- | --- | --- | --- |")
    out = []
    for T in [int(t) for t in args.T.split(",")]:
        rows, diff = run(args.B, T, args.H, args.D, dtype)
        gf, gb = rows["gla chunk_gla"]
        for name, (f, fb) in rows.items():
            print(f"| {T} | {name} | {f:.3f} | {fb:.3f} | {f / gf:.2f} | {fb / gb:.2f} |")
            out.append(dict(T=T, op=name, fwd_ms=f, fwd_bwd_ms=fb, B=args.B, H=args.H, D=args.D,
                            dtype=args.dtype, device=torch.cuda.get_device_name()))
        print(f"| {T} | fused vs current, max rel. diff of the forward | {diff:.1e} | | | |")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
