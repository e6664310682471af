"""The split-KV decode attention kernel's launch settings, swept per decode shape.

    python -m benchmarks.ops.attn_decode                               # 1.7B and 135M shapes, 16k x 8 and 1k x 1
    python -m benchmarks.ops.attn_decode --cells 16384x8 --shapes qwen3-1.7b --out attn_decode.json

`hybridize.ops.attn_decode.triton_split_kv.attn_decode` at every (block_n, num_warps, num_stages, splits
per SM) of the sweep, for one query token per row over a `[B, Hkv, L, D]` bf16 key/value buffer holding T
visible keys (L = T + 64 slots, as the engine allocates prompt + new tokens). Each time is the mean over a CUDA
graph of back-to-back calls, cycling through enough copies of K/V (>= `--cold-mb` MB in all) that every read
comes from HBM, as in a decode step where the layers between evict it. Columns: microseconds per call, the
effective bandwidth (visible K/V bytes / time), the ratio to the kernel's default settings, and the max error
against `attn_decode_reference` (fp32 math). The first row of each cell is the default.
"""
from __future__ import annotations

import argparse
import inspect
import itertools
import json
import sys
from pathlib import Path

import torch

from benchmarks.timing import graph_time_us, md_header

# name -> (query heads, KV heads, head dim)
SHAPES = {"qwen3-1.7b": (16, 8, 128), "smollm2-135m": (9, 3, 64)}


def configs(args) -> list[dict]:
    grid = itertools.product([int(x) for x in args.block_n.split(",")], [int(x) for x in args.warps.split(",")],
                             [int(x) for x in args.stages.split(",")], [int(x) for x in args.per_sm.split(",")])
    return [dict(block_n=bn, num_warps=w, num_stages=s, per_sm=p) for bn, w, s, p in grid]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="qwen3-1.7b,smollm2-135m")
    ap.add_argument("--cells", default="16384x8,1024x1", help="context x batch, comma-separated")
    ap.add_argument("--block-n", default="32,64,128")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="2,3,4")
    ap.add_argument("--per-sm", default="4,8,16", help="phase-1 programs per SM the split count aims at")
    ap.add_argument("--cold-mb", type=int, default=256, help="K/V copies cycled per timing, MB in all")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/ops/attn_decode.py needs a CUDA GPU")
    from hybridize.ops.attn_decode import triton_split_kv as ak

    dev = torch.device("cuda")
    sms = ak.sm_count(dev)
    print(f"device: {torch.cuda.get_device_name()} ({sms} SMs) | torch {torch.__version__} | bf16")
    block_n, stages = ak.launch_settings(2)   # attn_decode's own for bf16
    default = dict(block_n=block_n, num_warps=inspect.signature(ak.attn_decode).parameters["num_warps"].default,
                   num_stages=stages)
    results = []
    for shape, cell in itertools.product(args.shapes.split(","), args.cells.split(",")):
        Hq, Hkv, D = SHAPES[shape]
        T, B = (int(x) for x in cell.split("x"))
        L = T + 64
        torch.manual_seed(0)
        q = torch.randn(B, Hq, D, device=dev, dtype=torch.bfloat16)
        kv = [(torch.randn(B, Hkv, L, D, device=dev, dtype=torch.bfloat16),
               torch.randn(B, Hkv, L, D, device=dev, dtype=torch.bfloat16))]
        per_copy = 2 * B * Hkv * L * D * 2
        kv += [(k.clone(), v.clone()) for k, v in kv * (max(1, -(-args.cold_mb * 2**20 // per_copy)) - 1)]
        length = torch.full((1,), T, dtype=torch.int64, device=dev)
        ref = ak.attn_decode_reference(q, kv[0][0], kv[0][1], length).float()
        nbytes = 2 * B * Hkv * T * D * 2
        print(f"\n{shape} T={T} B={B}: Hq={Hq} Hkv={Hkv} D={D}, {nbytes / 2**20:.1f} MiB of K/V, "
              f"default splits {ak.num_splits(L, B, Hkv, dev)}, {len(kv)} copies cycled")
        print(md_header(["block_n", "warps", "stages", "per SM", "splits", "us", "TB/s", "vs default", "max err"]))
        base = None
        for c in [dict(default, per_sm=4)] + configs(args):
            splits = max(1, min(-(-c["per_sm"] * sms // (B * Hkv)), -(-L // max(256, c["block_n"]))))
            kw = dict(block_n=c["block_n"], num_warps=c["num_warps"], num_stages=c["num_stages"], splits=splits)
            try:
                err = (ak.attn_decode(q, *kv[0], length, **kw).float() - ref).abs().max().item()
                us = graph_time_us([lambda k=k, v=v: ak.attn_decode(q, k, v, length, **kw) for k, v in kv])
            except Exception as e:   # e.g. out of shared memory at a large block and many stages
                print(f"| {c['block_n']} | {c['num_warps']} | {c['num_stages']} | {c['per_sm']} | {splits} | "
                      f"failed: {type(e).__name__} |  |  |  |")
                continue
            base = base or us
            row = dict(shape=shape, T=T, B=B, splits=splits, us=us, tbs=nbytes / us / 1e6, err=err, **c)
            results.append(row)
            print(f"| {c['block_n']} | {c['num_warps']} | {c['num_stages']} | {c['per_sm']} | {splits} | {us:.1f} | "
                  f"{row['tbs']:.2f} | {base / us:.2f}x | {err:.1e} |", flush=True)
        best = min((r for r in results if (r["shape"], r["T"], r["B"]) == (shape, T, B)), key=lambda r: r["us"])
        print(f"best: block_n={best['block_n']} warps={best['num_warps']} stages={best['num_stages']} "
              f"per_sm={best['per_sm']}: {best['us']:.1f} us, {best['tbs']:.2f} TB/s ({base / best['us']:.2f}x)")
        del kv
        torch.cuda.empty_cache()
        if args.out:
            Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": results}, indent=1))


if __name__ == "__main__":
    main()
