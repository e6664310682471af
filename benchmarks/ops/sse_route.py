"""SSE's row movers (`ops/sse/triton_route.py`) at each launch setting, then the whole op against another launch.

    python -m benchmarks.ops.sse_route --out $OUT/sse_route.json              # 16k tokens, every setting
    python -m benchmarks.ops.sse_route --T 16384 --op-rounds 3                # the same, then the op A/B

The cases are the mover calls one training step of SSE's varlen op makes (n4k1 with the shared path, H=16, D=128,
so a row is 2048 elements; routing from random logits as in `benchmarks.ops.kernels`):
- pack bf16: the forward's pack of the sparse q / k (scaled by the router probability; v the same unscaled) and the
  backward's pack of the output gradient;
- pack fp32: the forward's pack of the gates g;
- sum bf16 + base: the forward's combine (sparse rows onto the shared ones) and v's gradient (one tensor, both paths);
- sum bf16 + dots: q / k's gradients (scaled rows, with the router probability's gradient as row dots);
- sum fp32: g's gradient.
Each setting (column block x warps) is timed as the mean over a CUDA graph of back-to-back calls
alternating two input copies (each tensor is 64-128 MiB, over the L2's size), in microseconds and in GB/s of the
bytes the call must read and write; the first row of a case is the default (`move_config`).

`--op-rounds N`: SSE's op forward+backward at --T (device ms, the torch.profiler kernel sum, as `profile_sse`),
alternating N rounds between the default launches and `--op-vs` (default 1024x4, the launch before 4 KB blocks) on
every mover, put in force by replacing `triton_route.move_config` in this process only. `--out` is rewritten after
every case.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from unittest import mock

import torch

from benchmarks.timing import graph_time_us, md_header, profile

H, D = 16, 128


def settings(args):
    from hybridize.ops.sse.triton_route import MoveConfig
    grid = itertools.product(*[[int(v) for v in a.split(",")] for a in (args.block, args.warps)])
    return [MoveConfig(*g) for g in grid]


def cases(T: int, dev: str = "cuda"):
    """{name: (kind, fn(cfg) over two input copies, bytes per call)}; kind = (mover, itemsize) keys the picks."""
    from hybridize.ops.sse import reference as sse
    from hybridize.ops.sse.triton_route import _gather_sum, _pack
    bf, f32 = torch.bfloat16, torch.float32
    plan = sse.varlen_plan(sse.route(torch.randn(1, T, 4, device=dev), 1), torch.tensor([0, T], device=dev),
                           shared=True)
    keep = None if plan.keep is None else plan.keep.to(torch.int8)
    w = torch.rand(T, device=dev)
    C = H * D

    def rows(n, dtype):
        return [torch.randn(1, n, H, D, device=dev).to(dtype) for _ in range(2)]
    xb, xf, yb = rows(T, bf), rows(T, f32), rows(T, bf)
    ab, af = rows(2 * T, bf), rows(2 * T, f32)
    el = {bf: 2, f32: 4}
    return {
        "pack bf16, scaled (q, k)": (("pack", 2), lambda c: [lambda x=x: _pack(None, x, w, keep, plan.order, 1, c)
                                                              for x in xb], 2 * T * C * el[bf]),
        "pack fp32 (g)": (("pack", 4), lambda c: [lambda x=x: _pack(None, x, None, keep, plan.order, 1, c)
                                                    for x in xf], 2 * T * C * el[f32]),
        "sum bf16 + base (combine, v's gradient)": (
            ("sum", 2), lambda c: [lambda a=a: _gather_sum(a, T, a[:, :T], None, keep, plan.inv, 1, T, cfg=c)
                                    for a in ab], 3 * T * C * el[bf]),
        "sum bf16 + dots (q's, k's gradients)": (
            ("sum dots", 2), lambda c: [lambda a=a, y=y: _gather_sum(a, T, None, w, keep, plan.inv, 1, T, y=y, cfg=c)
                                         for a, y in zip(ab, yb)], 3 * T * C * el[bf]),
        "sum fp32 (g's gradient)": (
            ("sum", 4), lambda c: [lambda a=a: _gather_sum(a, T, None, None, keep, plan.inv, 1, T, cfg=c)
                                     for a in af], 2 * T * C * el[f32]),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, default=16384, help="tokens")
    ap.add_argument("--block", default="512,1024,2048", help="columns a program handles at a time")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--op-rounds", type=int, default=0, help="rounds of the op A/B (0: none)")
    ap.add_argument("--op-vs", default="1024x4", help="the launch (BLOCKxWARPS) the op A/B puts on every mover")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/ops/sse_route.py needs a CUDA GPU")
    from hybridize.ops import gpu
    from hybridize.ops.sse import triton_route
    assert gpu.activate()
    C = H * D
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "T": args.T, "H": H, "D": D,
           "cases": {}, "picks": {}}
    print(f"{res['device']}, torch {res['torch']}, T={args.T}, H={H}, D={D}, n4k1 with the shared path")
    grid = settings(args)
    for name, (kind, fns, nbytes) in cases(args.T).items():
        print(f"\n### {name}\n" + md_header(["block x warps", "us", "GB/s", "vs default"]))
        rows, base = [], None
        default = triton_route.move_config(C, kind[1])
        for cfg in [default] + [g for g in grid if g != default]:
            try:
                us = graph_time_us(fns(cfg), reps=args.reps)
            except Exception as e:  # a setting the compiler refuses (shared memory, registers): say so, go on
                print(f"| {tuple(cfg)} | failed: {type(e).__name__} | | |")
                continue
            base = base or us
            rows.append({"cfg": list(cfg), "us": us, "gbps": nbytes / us / 1e3})
            print(f"| {'x'.join(map(str, cfg))} | {us:.1f} | {nbytes / us / 1e3:.0f} | {us / base:.3f} |")
            sys.stdout.flush()
        best = min(rows, key=lambda r: r["us"])
        res["cases"][name] = {"mover": kind[0], "itemsize": kind[1], "bytes": nbytes, "rows": rows, "best": best}
        res["picks"][f"{kind[0]} {kind[1]}"] = best["cfg"]
        print(f"best {best['cfg']}: {best['us']:.1f} us, {best['gbps']:.0f} GB/s ({best['us'] / base:.3f}x default)")
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1))
    if args.op_rounds:
        op_ab(args, res)


def op_ab(args, res):
    """SSE's op forward+backward, the default launches against `--op-vs` for every mover, alternating rounds."""
    from benchmarks.ops import kernels as bk
    from hybridize.ops.sse import triton_route
    from hybridize.ops.sse.triton_route import MoveConfig
    call, inputs, leaves = bk.sse_setup(args.T, 4, "varlen")
    _, fb, _ = bk.fwd_bwd(call, inputs, leaves)
    alt = MoveConfig(*(int(v) for v in args.op_vs.split("x")))
    res["op"] = {"vs": list(alt), "default": [], "vs_ms": []}
    print(f"\n### SSE's op forward+backward at T={args.T}, device ms\n"
          + md_header(["round", "default", f"{args.op_vs} everywhere"]))
    for r in range(args.op_rounds):
        d = profile(fb)["device_ms"]
        with mock.patch.object(triton_route, "move_config", lambda C, itemsize: alt):
            v = profile(fb)["device_ms"]
        res["op"]["default"].append(d)
        res["op"]["vs_ms"].append(v)
        print(f"| {r + 1} | {d:.3f} | {v:.3f} ({v / d - 1:+.1%}) |")
        sys.stdout.flush()
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
