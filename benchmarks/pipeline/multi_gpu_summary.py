"""The rows of one-GPU and multi-GPU runs of a stage side by side, from each run's `metrics.jsonl`.

    python -m benchmarks.pipeline.multi_gpu_summary RUNS [--out summary.md]   # RUNS/<run>/metrics.jsonl
    python -m benchmarks.pipeline.multi_gpu_summary RUN --steps               # one run's logged steps

A run named `*_2gpu` (`*_<n>gpu`) ran on n GPUs, any other on one; `ref_1gpu`, when present, is the reference the
others' losses are compared with. Per run: the loss of every step, the largest relative difference from the
reference over the first five steps, tokens/s per GPU (the mean over the last two thirds of the steps: the first
ones compile and warm up) and the peak memory of each rank. `--steps` prints what a TRL run (SFT, GRPO) logged
per step: loss, reward, rollout/fast, the learning rate. Used by `scale_gpu.sh` and `two_gpu_stages.sh`.
"""
from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

from hybridize.errors import read_jsonl


def gpus(name: str) -> int:
    m = re.search(r"_(\d+)gpu$", name)
    return int(m.group(1)) if m else 1


def load_runs(root: Path) -> dict[str, list[dict]]:
    """{run name: its metrics rows}, the reference first, then by name."""
    runs = {p.parent.name: read_jsonl(p, partial=True) for p in root.glob("*/metrics.jsonl")}
    return dict(sorted(runs.items(), key=lambda kv: (kv[0] != "ref_1gpu", kv[0])))


def summary(runs: dict[str, list[dict]]) -> str:
    loss = {n: {r["step"]: r["loss"] for r in rows if "loss" in r and "step" in r} for n, rows in runs.items()}
    ref = loss.get("ref_1gpu", {})
    last = max((max(v, default=0) for v in loss.values()), default=0)
    lines = ["| step | " + " | ".join(runs) + " |", "| ---: |" + " ---: |" * len(runs)]
    lines += [f"| {s} | " + " | ".join(f"{loss[n][s]:.5f}" if s in loss[n] else "" for n in runs) + " |"
              for s in range(1, last + 1)]
    lines += ["",
              "| run | GPUs | max rel. diff to ref_1gpu, steps 1-5 | tokens/s per GPU | peak memory per GPU (GiB) |",
              "| --- | ---: | ---: | ---: | --- |"]
    for n, rows in runs.items():
        timed = [r for r in rows if "tok_per_s" in r]
        tail = timed[len(timed) // 3:] or timed
        tps = sum(r["tok_per_s"] for r in tail) / max(len(tail), 1) / gpus(n)
        peak = next((r["peak_mem_gb_per_rank"] for r in rows if "peak_mem_gb_per_rank" in r), [])
        diffs = [abs(loss[n][s] - ref[s]) / abs(ref[s]) for s in range(1, 6) if s in ref and s in loss[n] and ref[s]]
        diff = f"{max(diffs):.2e}" if diffs and n != "ref_1gpu" else ""
        lines.append(f"| {n} | {gpus(n)} | {diff} | {tps:,.0f} | {', '.join(f'{p:.2f}' for p in peak)} |")
    return "\n".join(lines)


def steps(rows: list[dict]) -> str:
    keys = ("loss", "reward", "rollout/fast", "learning_rate", "lr", "grad_norm")
    out = []
    for r in rows:
        if "step" not in r:
            continue
        vals = [f"{k} {r[k]:.4g}" for k in keys if isinstance(r.get(k), (int, float)) and not math.isnan(r[k])]
        if vals:
            out.append(f"   step {r['step']}: " + ", ".join(vals))
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("root", help="a folder of runs (RUNS/<run>/metrics.jsonl), or with --steps one run")
    ap.add_argument("--steps", action="store_true", help="print one run's logged steps")
    ap.add_argument("--out", default=None, help="also write the summary (markdown) here")
    a = ap.parse_args(argv)
    root = Path(a.root)
    if a.steps:
        text = steps(read_jsonl(root / "metrics.jsonl", partial=True)) if (root / "metrics.jsonl").is_file() else ""
        text = text or f"   {root}: no steps logged"
    else:
        runs = load_runs(root)
        text = summary(runs) if runs else f"{root}: no run with a metrics.jsonl"
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
