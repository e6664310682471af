"""Where a prefill's host time goes, the teacher beside its hybrid: host syncs and Python, per model.

At the 135M shape the hybrid's prefill takes about the same wall time at 1k and at 8k tokens (H200, batch 1:
`profile_prefill`, benchmarks/RESULTS.md): the host sets it, not the device. For each model and cell this prints
- the median wall time of a prefill (the engine's, as `profile_prefill` runs it), the device's kernel time (a
  profiled prefill) and the kernel count, so wall / kernels is the host's time per launch;
- every host sync (`torch.cuda.set_sync_debug_mode`), counted by the innermost frame of ours or of transformers;
- the top functions of one prefill by their own host time (cProfile): where the Python goes.
Each cell's row is appended to `--jsonl` as it finishes.

    python -m benchmarks.generation.prefill_host --shape smollm2-135m --prompt-lens 1024,4096 --batches 1,8
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch

from benchmarks.generation import rollouts
from benchmarks.generation.profile_prefill import _prefill_fn, prefill_profile
from hybridize.generation.profile import table

#: frames that name a sync's cause: ours, transformers', the benchmark's
OWN = ("hybridize/", "transformers/", "benchmarks/")


def _own_frame(stack) -> str:
    for fr in reversed(stack):
        if any(k in fr.filename.replace("\\", "/") for k in OWN):
            tail = "/".join(fr.filename.replace("\\", "/").split("/")[-2:])
            return f"{tail}:{fr.lineno} {fr.name}"
    return "(no frame of ours)"


def host_syncs(once) -> Counter:
    """Run `once` with the sync debug mode on; each sync counted by its innermost frame of ours."""
    seen: Counter = Counter()
    old = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        seen[_own_frame(traceback.extract_stack()[:-1])] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            once()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = old
    return seen


def python_top(once, top: int) -> list[dict]:
    """One prefill under cProfile: the functions with the most own host time."""
    prof = cProfile.Profile()
    prof.enable()
    once()
    prof.disable()
    stats = pstats.Stats(prof).stats   # {(file, line, name): (cc, nc, tottime, cumtime, callers)}
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"function": f"{'/'.join(f.replace(chr(92), '/').split('/')[-2:])}:{ln} {name}", "calls": nc,
             "own ms": round(tt * 1e3, 2), "cumulative ms": round(ct * 1e3, 2)}
            for (f, ln, name), (cc, nc, tt, ct, _) in rows]


def cell(pair: dict, T: int, B: int, warmup: int, repeats: int, top: int) -> dict:
    device = next(iter(pair.values())).device
    torch.manual_seed(1)
    vocab = next(iter(pair.values())).config.vocab_size
    ids = torch.randint(10, vocab - 10, (B, T), device=device)
    mask = torch.ones_like(ids)
    mask[0, :T // 8] = 0                     # the speed table's prompt: one row left-padded by an eighth
    row = {"prompt_len": T, "batch": B, "models": {}}
    for name, m in pair.items():
        once = _prefill_fn(m, ids, mask)
        for _ in range(max(1, warmup)):
            once()
        walls = []
        for _ in range(max(1, repeats)):
            t0 = time.perf_counter()
            once()
            walls.append(time.perf_counter() - t0)
        prof = prefill_profile(m, once, 1)
        wall_ms = statistics.median(walls) * 1e3
        row["models"][name] = {
            "wall_ms": wall_ms, "device_ms": prof["profiled_total_ms"], "kernels": prof["kernels"],
            "host_us_per_kernel": 1e3 * wall_ms / max(1, prof["kernels"]),
            "syncs": dict(host_syncs(once).most_common()), "python": python_top(once, top)}
    return row


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v.strip()]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="smollm2-135m", help="a rollouts.py shape")
    rollouts.add_plan_args(ap)
    ap.add_argument("--models", default="teacher,hybrid", help="which of the pair to run, in this order")
    ap.add_argument("--batches", default="1", help="comma-separated batch sizes")
    ap.add_argument("--prompt-lens", default="1024", help="comma-separated prompt lengths")
    ap.add_argument("--warmup", type=int, default=2, help="untimed prefills per model and cell")
    ap.add_argument("--repeats", type=int, default=5, help="timed prefills per model and cell (median)")
    ap.add_argument("--top", type=int, default=20, help="functions listed per model")
    ap.add_argument("--jsonl", default="", help="also append each cell's row here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("prefill_host measures the host against a GPU: no CUDA device here")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if any(m not in ("teacher", "hybrid") for m in models):
        ap.error(f"--models takes teacher and/or hybrid, got {models}")
    teacher, hybrid = rollouts.build_pair(args.shape, args.plan, args.mixer, torch.bfloat16, torch.device("cuda"),
                                          rollouts.plan_settings(args))
    pair = {name: {"teacher": teacher, "hybrid": hybrid}[name] for name in models}
    print(f"prefill host time: {args.shape}, bf16, {torch.cuda.get_device_name()}, plan {args.plan} ({args.mixer})")
    rows = []
    for B in _ints(args.batches):
        for T in _ints(args.prompt_lens):
            row = {"shape": args.shape, "device": torch.cuda.get_device_name(), **cell(pair, T, B, args.warmup,
                                                                                      args.repeats, args.top)}
            rows.append(row)
            if args.jsonl:
                Path(args.jsonl).parent.mkdir(parents=True, exist_ok=True)
                with open(args.jsonl, "a") as f:
                    f.write(json.dumps(row) + "\n")
            for name, r in row["models"].items():
                print(f"\n## {T} x {B}, {name}: wall {r['wall_ms']:.2f} ms, device {r['device_ms']:.2f} ms, "
                      f"{r['kernels']} kernels, {r['host_us_per_kernel']:.1f} us of wall per kernel, "
                      f"{sum(r['syncs'].values())} host syncs")
                if r["syncs"]:
                    print(table([{"sync at": k, "count": v} for k, v in r["syncs"].items()]))
                print(table(r["python"]))
    return rows


if __name__ == "__main__":
    main()
