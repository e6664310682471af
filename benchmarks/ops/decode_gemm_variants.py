"""Decode GEMM variants at a few rows: every candidate config of the shipped weight-streaming kernel, extra configs,
and the same loop with the weight read through a TMA descriptor, against cuBLAS, per weight of the 1.7B hybrid.

    python -m benchmarks.ops.decode_gemm_variants [--rows 8] [--out rows.json]

The question: is the decode step's GEMM time (about 44% of the H200's bandwidth in the 16k x 8 step) the kernel's
loop, which more bytes in flight or Hopper's TMA would speed up, or a cost per launch that no loop removes? Timing
as in `decode_gemm.py`: the mean over a CUDA graph of back-to-back calls cycling through >= `--cold-mb` MB of weight
copies (every read from HBM), bf16; each variant's output checked against fp32 F.linear first. The TMA variant
(`_tma_gemm`) is the shipped loop with `tl.load` of the weight tile replaced by a host `TensorDescriptor`'s load
(Triton pipelines it with mbarriers); it exists only here. Prints the best of each family per weight, with TB/s.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.timing import graph_time_us, md_header

# (name, N, K): the 1.7B 5:1 SSE hybrid's decode GEMMs with its defaults (gate / up and q / k / v stacked)
SHAPES = [("mlp gate/up stacked", 12288, 2048), ("mlp down", 2048, 6144), ("attn o", 2048, 2048),
          ("attn q/k/v stacked", 4096, 2048), ("sse stage 1", 6312, 2048), ("lm_head", 151936, 2048)]
#: configs tried beside the shipped list (BN, BK, num_warps, num_stages); the ones that won are now in it
EXTRA = [(32, 512, 4, 3), (32, 512, 8, 3), (64, 256, 8, 4), (32, 256, 8, 5), (16, 512, 4, 5), (128, 128, 8, 5),
         (16, 256, 4, 6)]
TMA = list(itertools.product([16, 32, 64, 128], [64, 128, 256], [4], [3, 4, 6]))


def _tma_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def _tma_gemm(x, w_desc, out, M, N, stride_xm, stride_om, K: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr):
        # out [M, N] = x [M, K] @ W^T, one program per BN weight rows, W's [BN, BK] tiles by TMA
        off_n = tl.program_id(0) * BN
        offs_m = tl.arange(0, BM)
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        for k0 in range(0, K, BK):
            b_w = w_desc.load([off_n, k0])
            offs_k = k0 + tl.arange(0, BK)
            b_x = tl.load(x + offs_m[None, :] * stride_xm + offs_k[:, None], mask=offs_m[None, :] < M, other=0.0)
            acc = tl.dot(b_w, b_x, acc)
        offs_n = off_n + tl.arange(0, BN)
        tl.store(out + offs_m[None, :] * stride_om + offs_n[:, None], acc.to(out.dtype.element_ty),
                 mask=(offs_n < N)[:, None] & (offs_m < M)[None, :])

    def launch(x, desc, out, bn, bk, warps, stages):
        M, K = x.shape
        N = out.shape[1]
        _tma_gemm[(triton.cdiv(N, bn),)](x, desc, out, M, N, x.stride(0), out.stride(0), K, BM=16, BN=bn, BK=bk,
                                         num_warps=warps, num_stages=stages)
    return launch


def time_weight(N: int, K: int, rows: int, cold_mb: int) -> dict[str, float | str]:
    """us per call of cuBLAS and of every variant on an [N, K] weight (a string where a variant failed)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from benchmarks.ops.decode_gemm import cold_copies
    from hybridize.ops.decode_gemm import triton_gemm as kern

    dev = torch.device("cuda")
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) / K ** 0.5
    copies = cold_copies(w, cold_mb)
    x = torch.randn(rows, K, device=dev, dtype=torch.bfloat16)
    ref = F.linear(x.float(), w.float())
    out = torch.empty(rows, N, device=dev, dtype=torch.bfloat16)
    times: dict[str, float | str] = {"cublas": graph_time_us([lambda c=c: F.linear(x, c) for c in copies])}

    def timed(name, run_on):     # run_on(i): the variant on copies[i] into `out`
        try:
            run_on(0)
            torch.cuda.synchronize()
            err = (out.float() - ref).abs().max().item()
            if err > 5e-2:
                raise AssertionError(f"max error {err:.3g}")
            times[name] = graph_time_us([lambda i=i: run_on(i) for i in range(len(copies))])
        except Exception as e:      # shared memory a config needs, a wrong result: shown, not timed
            times[name] = f"failed: {type(e).__name__}: {str(e)[:80]}"

    extra = [dict(BN=bn, BK=bk, SPLIT=1, num_warps=wp, num_stages=st) for bn, bk, wp, st in EXTRA]
    for cfg in kern.CONFIGS + extra:
        if cfg["SPLIT"] == 1:    # split-K adds a sum kernel: slower in every earlier timing
            timed(("" if cfg in kern.CONFIGS else "extra ") + kern._name(cfg),
                  lambda i, cfg=cfg: kern._launch(x, copies[i], None, out, cfg))
    launch = _tma_kernels()
    for bn, bk, wp, st in TMA:
        descs = [TensorDescriptor.from_tensor(c, [bn, bk]) for c in copies]
        timed(f"tma BN{bn}_BK{bk}_w{wp}_s{st}", lambda i, d=descs, a=(bn, bk, wp, st): launch(x, d[i], out, *a))
    return times


def best(times: dict, prefix: str) -> tuple[float, str]:
    """The fastest timed entry whose name starts with `prefix` ("" : the shipped configs)."""
    pool = [(t, n) for n, t in times.items() if isinstance(t, float) and n != "cublas"
            and (n.startswith(prefix) if prefix else not n.startswith(("extra ", "tma ")))]
    return min(pool, default=(float("nan"), "-"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=8, help="rows per call (decode batch), at most 16")
    ap.add_argument("--cold-mb", type=int, default=512, help="weight copies cycled per timing, MB in all")
    ap.add_argument("--out", default="", help="write every variant's time per weight here as JSON too")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/ops/decode_gemm_variants.py needs a CUDA GPU")
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, {args.rows} rows, cold L2; us per call "
          "(TB/s)\n")
    print(md_header(["weight", "N x K", "cuBLAS", "shipped configs", "extra configs", "TMA"], "llrrrr"))
    rows = {}
    for name, N, K in SHAPES:
        times = rows[name] = time_weight(N, K, args.rows, args.cold_mb)
        gb = N * K * 2 / 1e9
        cells = [f"{t:.2f} ({gb / t * 1e3:.2f}) {n}" for t, n in (best(times, p) for p in ("", "extra ", "tma "))]
        print(f"| {name} | {N} x {K} | {times['cublas']:.2f} | " + " | ".join(cells) + " |", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": args.rows,
                                              "us": rows}, indent=1))


if __name__ == "__main__":
    main()
