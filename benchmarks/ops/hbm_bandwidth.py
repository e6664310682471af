"""What HBM bandwidth plain PyTorch reads reach on this GPU: the denominator the decode steps' bytes floors could use.

The speed table's bytes floor (`generation/speed_table.py`, issue 24 item 3: a step at most 1.5x its floor) divides
the bytes a step must read by the data sheet's bandwidth (H100 SXM 3,350 GB/s, H200 4,800 GB/s). No kernel reaches
the data sheet. This times what a long read does reach, so a step's distance from its floor splits into what the
hardware withholds from any kernel and what our kernels leave:

- `sum`: a bf16 tensor summed in fp32 (read only);
- `copy`: a bf16 tensor copied into another (read + write; both counted).

Each line: bytes moved, device ms (`gpu_timer.time_cold`: CUDA events around each call, the median of `--reps`),
GB/s and its share of the data sheet figure.

    python -m benchmarks.ops.hbm_bandwidth --gb 4 --out $OUT/hbm_bandwidth.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.generation.speed_table import hbm_gbs
from benchmarks.timing import md_table
from hybridize.ops.common.gpu_timer import time_cold


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--gb", type=float, default=4.0, help="size of the tensor read, GB (past every cache)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None, help="JSON of the rows")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("hbm_bandwidth times HBM: it needs a CUDA GPU")
    name = torch.cuda.get_device_name()
    sheet = hbm_gbs(name, 0.0)
    x = torch.randn(int(args.gb * 1e9) // 2, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    nbytes = x.numel() * 2
    cases = [("sum", lambda: x.sum(dtype=torch.float32), nbytes),
             ("copy", lambda: y.copy_(x), 2 * nbytes)]
    rows = []
    for label, fn, moved in cases:
        ms = time_cold(fn, reps=args.reps)
        gbs = moved / ms / 1e6
        rows.append({"case": label, "bytes": moved, "ms": round(ms, 3), "gbs": round(gbs),
                     "of_sheet": round(gbs / sheet, 3)})
    header = f"device: {name} | torch {torch.__version__} | data sheet {sheet:.0f} GB/s | bf16, {args.gb} GB tensor"
    print(header)
    print(md_table(["case", "bytes", "device ms", "GB/s", "of the data sheet"],
                   [[r["case"], r["bytes"], r["ms"], r["gbs"], f"{r['of_sheet']:.1%}"] for r in rows]))
    result = {"header": header, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
