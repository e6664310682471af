"""The teacher's and the hybrid's decode step on our engine, one process per row, alternating (issue 24 items 3, 4).

A ratio from one process of each is one draw: a process's decode GEMM picks, its allocator and the machine all move a
step by a few percent (two H200s of one code gave the 1.7B hybrid's 2k x 1 step 1.697 and 1.641 ms). This runs
`compile_auto` (one compile mode) for the teacher, the hybrid and any hybrid variants, in turn, `--rounds` times, each
in a fresh process, and reports every row beside the medians:

    python -m benchmarks.generation.decode_pair --prompt-len 2048 --batch 1 --rounds 2 --out $OUT/pair_2k1 \\
        --variant nogate="--mixer-settings sse.output_gate=false"          # one H200: RESULTS.md, "ranks GPU time"
    python -m benchmarks.generation.decode_pair --shape tiny --prompt-len 16 --new-tokens 2 --calls 1 \\
        --mode off --dtype float32 --rounds 1 --out /tmp/pair                # CPU smoke run

`--variant NAME=ARGS` adds a hybrid row with more `compile_auto` arguments (shell-quoted; `--model teacher` among them
makes it a teacher row, e.g. `tnopdl="--model teacher --kernel-options pdl=false"`). Each row's own JSON
(`compile_auto --out`: its calls, steady ms and decode GEMM picks) lands in `--out` as soon as it ends, and `pair.json`
and `pair.md` are rewritten after every row, so a call that runs out of time keeps the finished rows. A row that fails
or passes `--timeout` is reported and skipped. The table: ms per step of each round, the median, and the teacher's
median over the row's (higher = the row decodes faster); below it, for each weight shape two or more processes timed,
how many picked its most common config.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from benchmarks.generation.rollouts import SHAPES
from benchmarks.timing import md_table


def args_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--shape", default="qwen3-1.7b", choices=list(SHAPES) + ["tiny"])
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--calls", type=int, default=2, help="generate calls per row; the steady step is their median "
                                                          "after the first compiled one")
    ap.add_argument("--mode", default="on", choices=["off", "auto", "on"], help="FastGenConfig.compile of every row")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--rounds", type=int, default=2, help="times each row runs, in turn with the others")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS",
                    help="a hybrid row with more compile_auto arguments, e.g. nogate=\"--mixer-settings "
                         "sse.output_gate=false\" (repeatable; a teacher row with --model teacher in ARGS)")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds one row's process may take")
    ap.add_argument("--out", required=True, help="folder for every row's JSON, pair.json and pair.md")
    return ap


def parse_variants(specs: list[str]) -> dict[str, list[str]]:
    """{"teacher": [...], "hybrid": [...], NAME: [...]}: each row's model and extra compile_auto arguments."""
    rows = {"teacher": ["--model", "teacher"], "hybrid": ["--model", "hybrid"]}
    for spec in specs:
        name, sep, extra = spec.partition("=")
        if not sep or not name.isidentifier() or name in rows:
            raise SystemExit(f"--variant takes NAME=ARGS with a new name (letters, digits, _), got {spec!r}")
        rows[name] = ["--model", "hybrid", *shlex.split(extra)]
    return rows


def run_row(args, name: str, extra: list[str], round_: int, out: Path) -> dict:
    """One compile_auto process; its row: {name, round, ms, seconds, gemm_choices} or {..., error}."""
    path = out / f"{name}_{round_}.json"
    cmd = [sys.executable, "-m", "benchmarks.generation.compile_auto", "--shape", args.shape,
           "--prompt-len", str(args.prompt_len), "--batch", str(args.batch), "--new-tokens", str(args.new_tokens),
           "--calls", str(args.calls), "--modes", args.mode, "--dtype", args.dtype, *extra, "--out", str(path)]
    row = {"name": name, "round": round_, "command": shlex.join(cmd[1:])}
    path.unlink(missing_ok=True)   # a rerun into the same folder must not read an earlier run's row
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {**row, "error": f"timed out after {args.timeout:.0f} s"}
    row["seconds"] = round(time.perf_counter() - t0, 1)
    if done.returncode != 0 or not path.exists():
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return {**row, "error": f"exit {done.returncode}: {tail[0]}"}
    result = json.loads(path.read_text())
    return {**row, "ms": result["modes"][0]["steady_decode_ms"], "header": result["header"],
            "gemm_choices": {shape: c["choice"] for shape, c in result.get("gemm_choices", {}).items()}}


def summarize(rows: list[dict]) -> dict:
    """Per row name: its ms per round, median and the teacher's median over it; the GEMM picks' agreement."""
    names = list(dict.fromkeys(r["name"] for r in rows))
    ms = {n: [r["ms"] for r in rows if r["name"] == n and r.get("ms") is not None] for n in names}
    med = {n: statistics.median(v) if v else None for n, v in ms.items()}
    teacher = med.get("teacher")
    models = {n: {"ms": ms[n], "median_ms": med[n],
                  "teacher_over_row": round(teacher / med[n], 3) if teacher and med[n] else None,
                  "failed": [r["error"] for r in rows if r["name"] == n and "error" in r]} for n in names}
    picks: dict[str, Counter] = {}
    for r in rows:
        for shape, choice in r.get("gemm_choices", {}).items():
            picks.setdefault(shape, Counter())[choice] += 1
    agreement = {shape: {"processes": sum(c.values()), "most_common": c.most_common(1)[0][0],
                         "agree": c.most_common(1)[0][1]} for shape, c in picks.items() if sum(c.values()) > 1}
    return {"models": models, "gemm_agreement": agreement}


def markdown(summary: dict, header: str, rounds: int) -> str:
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    rows = []
    for name, m in summary["models"].items():
        per_round = [fmt(v) for v in m["ms"]] + ["failed"] * len(m["failed"])
        rows.append([name, ", ".join(per_round) or "-", fmt(m["median_ms"]),
                     "-" if m["teacher_over_row"] is None else f"{m['teacher_over_row']:.3f}x"])
    lines = [header, "", md_table(["row", f"ms per step, round 1-{rounds}", "median", "teacher / row"], rows)]
    if summary["gemm_agreement"]:
        lines += ["", md_table(["decode GEMM shape", "processes", "same pick", "most common pick"],
                               [[s, a["processes"], a["agree"], a["most_common"]]
                                for s, a in summary["gemm_agreement"].items()])]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    args = args_parser().parse_args(argv)
    variants = parse_variants(args.variant)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    header = (f"decode_pair: {args.shape}, prompt {args.prompt_len} x batch {args.batch}, {args.new_tokens} new tokens "
              f"x {args.calls} calls, compile {args.mode}, {args.dtype}; one process per row, rounds alternating")
    summary = {}
    for round_ in range(1, args.rounds + 1):
        for name, extra in variants.items():
            row = run_row(args, name, extra, round_, out)
            rows.append(row)
            print(f"round {round_} {name}: " + (f"{row['ms']:.3f} ms per step ({row['seconds']} s)"
                                                if "ms" in row else f"failed, {row['error']}"), flush=True)
            if "header" in row and not header.startswith("device"):
                header = row["header"].split(" | ")[0] + " | " + header
            summary = summarize(rows)
            (out / "pair.json").write_text(json.dumps({"args": vars(args), "rows": rows, "summary": summary},
                                                      indent=1))
            (out / "pair.md").write_text(markdown(summary, header, args.rounds))
    print(markdown(summary, header, args.rounds), end="")
    return summary


if __name__ == "__main__":
    main()
