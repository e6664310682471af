"""Fill the speed table on several GPUs of one host at once (`speed_table --gpus N`).

The table has 144 engine rows of about a minute each (warm-up, graph capture, compile): more than one session's
device time on one GPU. With `--gpus N` the parent starts N workers, each `speed_table` itself with `--shard I/N`
and `CUDA_VISIBLE_DEVICES=I`. A worker measures every N-th cell of the todo list. The list is in the table's
batch-major order, so every worker gets a share of each batch size and of each context. It skips the paths that
`--out` or its own shard file already holds, and appends its rows to `<out>.shard<I>.jsonl`, one per finished path.
The parent waits for the workers, then moves the shard files' complete rows into `--out`. It does that at its start
too, since a call cut short leaves them behind. On SIGTERM or SIGINT it stops the workers and still merges what
they finished.

Timing: each worker has a GPU of its own and replays its decode steps from CUDA graphs, so the workers do not share
the device. They share the host, though: its cores, memory bandwidth and power. Every path's warm-up (inductor
compiles, `TORCHINDUCTOR_COMPILE_THREADS` set to the host's cores / N unless given) is slower than alone. So are
the steps themselves, and not evenly.

Measured on 4 x H100 at 8db8097, against one process alone on one H100 (benchmarks/RESULTS.md, "The speed table"):
- uncompiled engine paths, whose steps are host-bound: 6-19% slower;
- compiled paths: 0-9% slower.

A cell's hybrid / teacher ratio can therefore be off by up to about 10%. Use the workers to fill the grid, and one
process (or `compile_auto`) to decide a single cell. Each row records `concurrent_workers`, so the report names the
rows that ran beside others.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from hybridize.errors import read_jsonl


def parse_shard(text: str) -> tuple[int, int] | None:
    """"I/N" -> (I, N) with 0 <= I < N; "" -> None (not a worker)."""
    if not text:
        return None
    try:
        i, n = (int(p) for p in text.split("/"))
    except ValueError:
        raise SystemExit(f"--shard takes I/N (this worker's index and the number of workers), got {text!r}") from None
    if not 0 <= i < n:
        raise SystemExit(f"--shard I/N needs 0 <= I < N, got {text!r}")
    return i, n


def shard_path(out: Path, i: int, suffix: str = "jsonl") -> Path:
    """Worker i's rows (`jsonl`) or screen output (`log`) beside `out`."""
    return out.with_name(f"{out.name}.shard{i}.{suffix}")


def shard_todo(todo: list[tuple], i: int, n: int) -> list[tuple]:
    """The items of worker i of n: those of every n-th cell (cell = the items' first three fields, (B, shape, T)),
    counting cells in the todo list's order; a cell's paths stay together, so one worker builds a cell's models."""
    index: dict[tuple, int] = {}
    for item in todo:
        index.setdefault(item[:3], len(index))
    return [item for item in todo if index[item[:3]] % n == i]


def merge_shards(out: Path) -> int:
    """Append the complete rows of every `<out>.shard*.jsonl` to `out` and delete those files; the number of rows."""
    moved = 0
    for part in sorted(out.parent.glob(f"{out.name}.shard*.jsonl")):
        rows = read_jsonl(part, partial=True)   # a row cut off by a killed worker is skipped
        if rows:
            with out.open("a") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
        moved += len(rows)
        part.unlink()
    return moved


def worker_argv(argv: list[str], i: int, n: int) -> list[str]:
    """The parent's arguments without `--gpus`, plus `--shard i/n`."""
    kept, skip = [], False
    for tok in argv:
        if skip:
            skip = False
        elif tok == "--gpus":
            skip = True
        elif not tok.startswith("--gpus="):
            kept.append(tok)
    return kept + ["--shard", f"{i}/{n}"]


def run_workers(argv: list[str], n: int, out: Path) -> None:
    """Start n workers (one per GPU), wait for them, merge their rows into `out`. A worker's screen output goes to
    `<out>.shard<I>.log`; a worker that fails is named with the end of its log, and the others' rows are kept."""
    out.parent.mkdir(parents=True, exist_ok=True)
    merged = merge_shards(out)
    if merged:
        print(f"merged {merged} rows a cut-short call left in shard files into {out}", flush=True)
    env = dict(os.environ)
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, (os.cpu_count() or n) // n)))
    procs = []
    for i in range(n):
        log = shard_path(out, i, "log").open("w")
        cmd = [sys.executable, "-m", "benchmarks.generation.speed_table", *worker_argv(argv, i, n)]
        procs.append((subprocess.Popen(cmd, env={**env, "CUDA_VISIBLE_DEVICES": str(i)}, stdout=log,
                                       stderr=subprocess.STDOUT), log))
    print(f"{n} workers started, one per GPU; their output: {out.name}.shard<I>.log", flush=True)

    def stop(signum, frame):   # the call's time limit: stop the workers, keep what they finished
        for p, _ in procs:
            p.terminate()
        raise KeyboardInterrupt
    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for i, (p, _) in enumerate(procs):
            rc = p.wait()
            print(f"worker {i}/{n} finished (exit {rc})", flush=True)
            if rc:
                tail = shard_path(out, i, "log").read_text().strip().splitlines()[-3:]
                print(f"worker {i} failed: " + " | ".join(tail), flush=True)
    except KeyboardInterrupt:
        for p, _ in procs:
            p.wait()
        print("stopped: the workers' finished rows are kept", flush=True)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for _, log in procs:
            log.close()
        print(f"{merge_shards(out)} rows merged into {out}", flush=True)
