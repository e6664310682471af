"""Does compiling the decode step pay off in a GRPO run? (issue 24 item 3: the compile policy for GRPO)

The same GRPO run (recipe `smollm2-135m/grpo`: arithmetic prompts, 8 completions each, `--tokens` per completion)
on a hybrid of the embedded default, once per `compile_decode` setting in turn, in one process (`--modes
off,on,off`: the first run absorbs what both settings pay once per process, the Triton kernels' compilation and
autotuning, and the break-even compares the compiled run with the uncompiled run after it). Per run: the rollout
seconds of the first step (where the compile happens) and the median of the later steps, rollout tokens/s, and the
whole run's seconds. The break-even is the first step's extra time over the per-step saving, in steps and in decode
steps (steps x tokens): what `compile_decode=auto`'s threshold (`compile_min_decode_steps`, hybridize/rl/config.py)
should be. Rewards do not matter here (a converted, undistilled hybrid samples to the token budget, which is what a
rollout's decode cost is). Measured: benchmarks/RESULTS.md, "Compiled decode in GRPO".

    python -m benchmarks.generation.grpo_compile --gguf /root/p/smollm2.gguf --steps 30 --out $OUT/grpo_compile.json

Prints a markdown table (device, dtype, shapes in the header) and writes `--out` JSON after each run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.timing import free_memory, md_table


def args_parser():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default="default", help="teacher source (the embedded default's GGUF path or 'default')")
    ap.add_argument("--hybrid", default="", help="a hybrid folder to train instead of converting the teacher")
    ap.add_argument("--plan", default="5:1")
    ap.add_argument("--modes", default="off,on,off", help="compile_decode settings, run in this order")
    ap.add_argument("--steps", type=int, default=30, help="GRPO steps per run")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step (x 8 completions)")
    ap.add_argument("--tokens", type=int, default=256, help="max_completion_length")
    ap.add_argument("--out", default="grpo_compile.json")
    return ap


def prepare(args, work: Path) -> Path:
    """The hybrid to train: `--hybrid`, or the teacher converted with `--plan` (SSE), saved with its tokenizer."""
    if args.hybrid:
        return Path(args.hybrid)
    from hybridize.convert.convert import convert_model
    from hybridize.convert.sources import load_model

    teacher, tok = load_model(args.gguf, dtype=torch.float32, device="cpu")
    hybrid = convert_model(teacher, args.plan, mixer="sse", teacher_source=args.gguf)
    hybrid.save_pretrained(work / "hybrid")
    tok.save_pretrained(work / "hybrid")
    return work / "hybrid"


def one_run(args, model: Path, out_dir: Path, mode: str) -> dict:
    from hybridize.rl.config import load_grpo_config
    from hybridize.rl.trainer import read_metrics, run_grpo

    cfg = load_grpo_config("smollm2-135m/grpo", [
        f"model={model}", f"output_dir={out_dir}", f"compile_decode={mode}", f"grpo.max_steps={args.steps}",
        f"grpo.max_completion_length={args.tokens}", f"grpo.per_device_train_batch_size={8 * args.prompts}",
        "save_steps=0", "progress=false", "data.eval=", f"data.limit={args.steps * args.prompts}"])
    t0 = time.perf_counter()
    summary = run_grpo(cfg)
    wall = time.perf_counter() - t0
    rows = [r for r in read_metrics(out_dir / "metrics.jsonl") if "rollout/seconds" in r]
    secs = [r["rollout/seconds"] for r in rows]
    later = secs[1:] or secs
    lengths = [r.get("completions/mean_length", 0.0) for r in rows]
    return {"mode": mode, "steps": summary["steps"], "run_s": round(wall, 1),
            "train_s": round(summary["train_seconds"], 1),
            "first_rollout_s": round(secs[0], 2) if secs else None,
            "median_rollout_s": round(statistics.median(later), 3) if later else None,
            "mean_length": round(statistics.median(lengths), 1) if lengths else None,
            "rollout_tok_s": round(statistics.median(r["rollout/tokens_per_s"] for r in rows[1:] or rows), 0)
            if rows else None,
            "why": summary.get("compile_decode", {}).get("why")}


def break_even(rows: list[dict], tokens: int) -> dict | None:
    """Steps (and decode steps) after which the compiled run's first-step cost is paid back by its faster steps,
    against the first uncompiled run after it (None without such a pair)."""
    on = next((i for i, r in enumerate(rows) if r["mode"] == "on"), None)
    off = next((r for r in rows[on + 1:] if r["mode"] == "off"), None) if on is not None else None
    if off is None:
        return None
    on = rows[on]
    off_first, off_med = off["first_rollout_s"], off["median_rollout_s"]
    extra, saving = on["first_rollout_s"] - off_first, off_med - on["median_rollout_s"]
    if saving <= 0:
        return {"extra_first_step_s": round(extra, 2), "saving_per_step_s": round(saving, 3), "steps": None}
    steps = max(extra, 0.0) / saving
    return {"extra_first_step_s": round(extra, 2), "saving_per_step_s": round(saving, 3), "steps": round(steps, 1),
            "decode_steps": round(steps * tokens)}


def main(argv=None):
    args = args_parser().parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("grpo_compile: needs a CUDA device (the compiled decode step runs in the CUDA graph)")
    work = Path(tempfile.mkdtemp(prefix="grpo-compile-"))
    model = prepare(args, work)
    rows = []
    for i, mode in enumerate(args.modes.split(",")):
        rows.append(one_run(args, model, work / f"run{i}-{mode}", mode))
        free_memory("cuda")
        result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "plan": args.plan,
                  "steps": args.steps, "completions_per_step": 8 * args.prompts, "tokens": args.tokens,
                  "rows": rows, "break_even": break_even(rows, args.tokens)}
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{result['device']}, torch {result['torch']}, bf16, SmolLM2-135M {args.plan} SSE hybrid, GRPO "
          f"{args.steps} steps x {8 * args.prompts} completions x {args.tokens} tokens\n")
    cols = ["mode", "steps", "run_s", "train_s", "first_rollout_s", "median_rollout_s", "mean_length", "rollout_tok_s"]
    print(md_table(cols, [[r[c] for c in cols] for r in rows]))
    print(f"\nbreak-even: {result['break_even']}")


if __name__ == "__main__":
    main()
