"""Decode-step GEMMs: F.linear (cuBLAS) vs the Triton weight-streaming kernel, per weight shape.

    python -m benchmarks.ops.decode_gemm                     # Qwen3-1.7B and SmolLM2-135M hybrid shapes, 8 rows
    python -m benchmarks.ops.decode_gemm --rows 1,8,16 --out decode_gemm.json

Each time is the mean over a CUDA graph of back-to-back calls (launch overhead out, as in the fast rollout
loop), bf16, cycling through enough copies of the weight (>= `--cold-mb` MB in all) that none is still in
L2 when it is read again: a decode step reads each weight once, from HBM. (Timing one weight over and
over measures L2 instead: session 4's first run did that and showed a kernel as fast as cuBLAS that then
made the real step 1.4 ms slower.) Columns: microseconds per call, effective HBM bandwidth (weight bytes / time), the
speed-up, the max error of each against fp32 (F.linear in fp32 on the same bf16 values), and what the
per-shape choice picked (cuBLAS or a Triton config, timed by `decode_linear_triton` on first use), with
the timings of every candidate in the JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.timing import graph_time_us

# (name, N, K): weights of a decode step, [out_features, in_features]
SHAPES = {
    "qwen3-1.7b": [("mlp gate/up", 6144, 2048), ("mlp down", 2048, 6144), ("attn q / o", 2048, 2048),
                   ("attn k / v", 1024, 2048), ("sse fused stage 1", 6312, 2048), ("sse stage 2", 10240, 160),
                   ("lm_head", 151936, 2048)],
    "smollm2-135m": [("mlp gate/up", 1536, 576), ("mlp down", 576, 1536), ("attn q / o", 576, 576),
                     ("attn k / v", 192, 576), ("lm_head", 49152, 576)],
}


def cold_copies(w: torch.Tensor, cold_mb: int) -> list[torch.Tensor]:
    """`w` and enough clones of it (>= `cold_mb` MB in all) that a graph cycling through them reads each from HBM."""
    return [w] + [w.clone() for _ in range(max(1, -(-cold_mb * 2**20 // (w.numel() * w.element_size()))) - 1)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="qwen3-1.7b,smollm2-135m")
    ap.add_argument("--rows", default="8", help="rows per call (decode batch), comma-separated, each <= 16")
    ap.add_argument("--cold-mb", type=int, default=256, help="weight copies cycled per timing, MB in all")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/ops/decode_gemm.py needs a CUDA GPU")
    from hybridize.ops.decode_gemm import route as dl
    from hybridize.ops.decode_gemm import triton_gemm as kern

    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows_out = []
    for shape in args.shapes.split(","):
        for name, N, K in SHAPES[shape]:
            w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) / K ** 0.5
            copies = cold_copies(w, args.cold_mb)
            for M in [int(r) for r in args.rows.split(",")]:
                x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
                ref = F.linear(x.float(), w.float())
                err = lambda y: (y.float() - ref).abs().max().item()  # noqa: E731
                y_t = dl.decode_linear(x, w, None, "auto")   # the first call times the candidates
                t_cublas = graph_time_us([lambda c=c: F.linear(x, c) for c in copies])
                t_triton = graph_time_us([lambda c=c: dl.decode_linear(x, c, None, "auto") for c in copies])
                best = kern.choices().get(f"{N}x{K} m={M} bfloat16", {})
                gb = N * K * 2 / 1e9
                rows_out.append({"shape": shape, "weight": name, "N": N, "K": K, "rows": M,
                                 "cublas_us": t_cublas, "triton_us": t_triton, "speedup": t_cublas / t_triton,
                                 "cublas_TBps": gb / t_cublas * 1e3, "triton_TBps": gb / t_triton * 1e3,
                                 "cublas_err": err(F.linear(x, w)), "triton_err": err(y_t),
                                 "config": best.get("choice", "-"), "candidates_us": best.get("us", {}),
                                 "copies": len(copies)})
                r = rows_out[-1]
                print(f"{shape:13s} {name:18s} N={N:6d} K={K:5d} M={M:2d}  cuBLAS {t_cublas:7.2f} us "
                      f"({r['cublas_TBps']:.2f} TB/s)  triton {t_triton:7.2f} us ({r['triton_TBps']:.2f} TB/s)  "
                      f"x{r['speedup']:.2f}  err {r['cublas_err']:.2e}/{r['triton_err']:.2e}  {r['config']}",
                      flush=True)
    header = (f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; bf16; CUDA graph cycling "
              f">= {args.cold_mb} MB of weight copies (cold L2)")
    print("\n" + header + "\n")
    print("| shape | weight | N x K | rows | cuBLAS us | TB/s | picked us | TB/s | speed-up | picked |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows_out:
        print(f"| {r['shape']} | {r['weight']} | {r['N']} x {r['K']} | {r['rows']} | {r['cublas_us']:.2f} | "
              f"{r['cublas_TBps']:.2f} | {r['triton_us']:.2f} | {r['triton_TBps']:.2f} | {r['speedup']:.2f}x | {r['config']} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"header": header, "rows": rows_out}, indent=1))


if __name__ == "__main__":
    main()
