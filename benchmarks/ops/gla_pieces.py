"""GLA in pieces (`ops/gla/triton_fwd.py` + `triton_bwd.py`, built toward SSE's target) vs fla's chunk_gla.

For each T, side by side in one process, forward only and forward+backward, bf16, H=16, K=V=128, gates
logsigmoid / 16 as GLA's and SSE's mixers make them:
- `T tokens`: `[1, T, H, D]`, one sequence;
- `SSE 2T layout`: the 2T-row varlen call SSE's varlen path makes at n4k1 (the shared path's T tokens, then the
  routed tokens as four partition segments of random length), one `cu_seqlens`.
Device ms (torch.profiler, sum of kernel times) and wall ms (do_bench median), the ratio ours / chunk_gla, and
the max relative difference of ours to chunk_gla's (the output; forward+backward: the worst of dq, dk, dv, dg).
    python -m benchmarks.ops.gla_pieces --T 4096,16384,32768
Needs CUDA, triton and fla-core.
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.ops import kernels as bk   # the same GLA inputs and calls
from benchmarks.timing import bench, gpu_stack, md_header, profile


def sse_cu(T, n=4, seed=0):
    """cu_seqlens of SSE's 2T layout for one sequence: the shared path, then n partitions of random size."""
    g = torch.Generator().manual_seed(seed)
    cuts = torch.sort(torch.randint(0, T + 1, (n - 1,), generator=g)).values
    sizes = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([T])]))
    return torch.cat([torch.tensor([0, T]), T + sizes.cumsum(0)]).cuda()


def _diff(a, b) -> float:
    """max |a - b| / max |a| over a list of tensor pairs (worst pair)."""
    return max(((x.float() - y.float()).abs().max() / x.float().abs().max()).item() for x, y in zip(a, b))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", default="4096,16384", help="comma-separated sequence lengths")
    ap.add_argument("--directions", default="fwd,fwd+bwd", help="fwd and/or fwd+bwd")
    ap.add_argument("--layouts", default="T,2T", help="T (T tokens) and/or 2T (SSE's 2T layout)")
    args = ap.parse_args()
    from hybridize.ops.gla.triton_bwd import gla_triton

    print(f"{gpu_stack('ops/gla_pieces.py')} | B=1 H={bk.H} D={bk.D} bf16 (gates fp32); ms")
    print()
    print(md_header(["T", "layout", "direction", "chunk_gla dev", "ours dev", "ours / chunk_gla (dev)", "chunk_gla wall",
                     "ours wall", "max rel. diff"], "rllrrrrrr"))
    for T in [int(t) for t in args.T.split(",")]:
        names = {"T": "T tokens", "2T": "SSE 2T layout"}
        for layout in (names[n] for n in args.layouts.split(",")):
            rows = T if layout == "T tokens" else 2 * T
            cu = None if layout == "T tokens" else sse_cu(T)
            x = bk.gla_inputs(rows)
            leaves = list(x.values())
            do = torch.randn_like(x["v"])
            ops = {"fla": lambda: bk.run_gla(**x) if cu is None else bk.run_gla_varlen(**x, cu_seqlens=cu),
                   "ours": lambda: gla_triton(x["q"], x["k"], x["v"], x["g"], cu_seqlens=cu)[0]}
            for direction in args.directions.split(","):
                if direction == "fwd":
                    def make(op):
                        def f():
                            with torch.no_grad():
                                return op()
                        return f
                else:
                    def make(op):
                        def f():
                            for t in leaves:
                                t.grad = None
                            op().backward(do)
                            return [t.grad for t in leaves]
                        return f
                fla, ours = make(ops["fla"]), make(ops["ours"])
                a, b = fla(), ours()
                diff = _diff([a] if direction == "fwd" else a, [b] if direction == "fwd" else b)
                pf, po = profile(fla), profile(ours)
                wf, wo = bench(fla), bench(ours)
                print(f"| {T} | {layout} | {direction} | {pf['device_ms']:.3f} | {po['device_ms']:.3f} | "
                      f"{po['device_ms'] / pf['device_ms']:.2f} | {wf:.3f} | {wo:.3f} | {diff:.1e} |")
                tops = ", ".join(f"{t['kernel'][:24]} {t['ms']:.3f}" for t in po["top"][:6])
                print(f"  {T} {layout} {direction} ours: {tops}")


if __name__ == "__main__":
    main()
