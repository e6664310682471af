"""Does a busy core stall the CPU forward? Teacher vs its 5:1 SSE hybrid, 1 and 2 threads, idle and loaded.

The embedded default (SmolLM2-135M-Instruct) and its `5:1` SSE conversion (no calibration: speed only),
fp32, batch 1. "loaded" starts one busy-looping process per `--load` core for the duration of the
timing (a user's other work); each cell is the median of `--repeats` forwards (after two warm-ups),
timed with fixed thread counts and with the default choice (`auto`: `hybridize.cpu.pick_threads`).
Prints a markdown table with the slowdown under load side by side (also written to --out).

    python -m benchmarks.pipeline.cpu_threads --tokens 128 --repeats 5
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import time
from pathlib import Path

import torch

from benchmarks.timing import md_header, median_time
from hybridize.convert.convert import convert_model
from hybridize.convert.sources import load_model
from hybridize.cpu import pick_threads


def _spin(stop):
    while not stop.is_set():
        pass


class BusyCores:
    """`n` processes spinning in Python while the block runs."""

    def __init__(self, n: int):
        self.n = n

    def __enter__(self):
        ctx = mp.get_context("spawn")
        self.stop = ctx.Event()
        self.procs = [ctx.Process(target=_spin, args=(self.stop,), daemon=True) for _ in range(self.n)]
        for p in self.procs:
            p.start()
        time.sleep(0.5 if self.n else 0.0)
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for p in self.procs:
            p.join(timeout=5)


@torch.no_grad()
def median_forward(model, ids: torch.Tensor, threads: int, repeats: int) -> float:
    torch.set_num_threads(threads)
    return median_time(lambda: model(input_ids=ids), repeats, warmup=2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128, help="sequence length of the timed forward")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", default="1,2,auto", help="thread counts to time; auto = hybridize.cpu.pick_threads() "
                                                          "(the default of every training loop), picked under the load")
    ap.add_argument("--load", type=int, default=1, help="busy cores in the loaded runs")
    ap.add_argument("--out", default="runs/cpu_threads.md")
    args = ap.parse_args()

    teacher, _ = load_model("default")
    hybrid = convert_model(teacher, "5:1", mixer="sse", mixer_settings={"chunk_size": 16}).eval()
    ids = torch.randint(0, teacher.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    rows = []
    for threads in args.threads.split(","):
        cell = {}
        for load in (0, args.load):
            with BusyCores(load):
                n = pick_threads() if threads == "auto" else int(threads)
                for name, model in (("teacher", teacher), ("hybrid", hybrid)):
                    cell[(name, load)] = median_forward(model, ids, n, args.repeats)
                cell[("threads", load)] = n
        rows.append((threads, cell))
        print(f"threads {threads}: " + ", ".join(f"{k[0]}/{'loaded' if k[1] else 'idle'} {v * 1e3:.0f} ms"
                                                  for k, v in cell.items() if k[0] != "threads"), flush=True)
    lines = [f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; torch {torch.__version__}; "
             f"{args.tokens} tokens, batch 1, fp32, median of {args.repeats}; loaded = {args.load} busy core(s)", "",
             md_header(["threads", "teacher idle (ms)", "teacher loaded (ms)", "teacher slowdown", "hybrid idle (ms)",
                        "hybrid loaded (ms)", "hybrid slowdown"], "rrrrrrr")]
    for threads, c in rows:
        if threads == "auto":
            threads = f"auto ({cell[('threads', 0)]} idle, {cell[('threads', args.load)]} loaded)"
        lines.append(f"| {threads} | {c[('teacher', 0)] * 1e3:.0f} | {c[('teacher', args.load)] * 1e3:.0f} | "
                     f"{c[('teacher', args.load)] / c[('teacher', 0)]:.2f}x | {c[('hybrid', 0)] * 1e3:.0f} | "
                     f"{c[('hybrid', args.load)] * 1e3:.0f} | {c[('hybrid', args.load)] / c[('hybrid', 0)]:.2f}x |")
    table = "\n".join(lines)
    print("\n" + table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table + "\n")


if __name__ == "__main__":
    main()
