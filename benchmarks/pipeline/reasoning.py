"""Issue 23, item 4: the reasoning stages measured on the generated arithmetic task (`hybridize.eval.arith`),
teacher and hybrid side by side. Every step is a `hybridize` command (what a user would type); state lives
in `--work`, a step whose output exists is skipped, and each track runs in its own process so the two share
one GPU:

    python -m benchmarks.pipeline.reasoning teacher --teacher T   # eval, rejection-sampled traces, GRPO control
    python -m benchmarks.pipeline.reasoning hybrid --teacher T    # convert, stage A + B, eval, SFT, eval, GRPO, eval
    python -m benchmarks.pipeline.reasoning report                # reasoning.md / .json / .png from the outputs

Stages of the hybrid (the issue's rows): `converted` (the plan, no training), `distilled` (stage A + B,
sized by --align-steps / --e2e-steps), `sft` (TRL SFTTrainer on the teacher's traces of `arith:train`, kept
only where the number-only checker grades them correct), `grpo` (TRL GRPOTrainer with the fast rollouts on
`arith:train`). Control: the teacher with the same GRPO budget. Evaluations run beside the training chain
(their own processes on the same GPU), so the wall times of the steps overlap. Every model is scored on the held-out
`arith:test` split (disjoint from train by construction; 50 problems per level where the split holds that
many: levels 1-3 hold 22 / 16 / 18) with the number-only answer
format, greedy and avg@k sampled; the AIME / MATH path runs at the SSE paper's protocol (temperature 1.0,
top-p 0.7, avg@k) on MATH-500 levels 1-2 and AIME24 for the teacher and the final hybrid, with a generation
cap stated in the report. The training text of stages A + B is the recovery pipeline's (no arithmetic, no
evaluation text). The `hybrid` track waits for the teacher's traces before its SFT step.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

from benchmarks.pipeline.recovery_variants import training_text
from benchmarks.pipeline.steps import run_step
from benchmarks.timing import md_header, md_table
from hybridize.errors import read_jsonl

FORMAT = ["--answer-format", "number"]
NUMBER = "Answer with the number only."


def args_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("track", choices=["teacher", "hybrid", "report"])
    p.add_argument("--teacher", default="default")
    p.add_argument("--work", default="/root/reason")
    p.add_argument("--data", default="../shared/data", help="folder with general_text/, wikitext2/, math500/, aime24/")
    p.add_argument("--plan", default="5:1", help="convert --layers (a plan file's text or a spelling)")
    p.add_argument("--align-steps", type=int, default=120)
    p.add_argument("--e2e-steps", type=int, default=80)
    p.add_argument("--trace-prompts", type=int, default=300, help="train problems per level for the traces")
    p.add_argument("--trace-samples", type=int, default=4, help="sampled teacher completions per train problem")
    p.add_argument("--sft-steps", type=int, default=150)
    p.add_argument("--grpo-steps", type=int, default=60)
    p.add_argument("--grpo-lr", type=float, default=1e-5)
    p.add_argument("--long-grpo", default="400:2e-5",
                   help="STEPS:LR of a second, longer GRPO run of the hybrid from the same SFT model (stage `grpo_long`, "
                        "run grpo_hybrid_long; '' = none); the teacher control matches the first run only")
    p.add_argument("--k", type=int, default=8, help="samples per problem of the sampled arith score (avg@k)")
    p.add_argument("--math-k", type=int, default=4, help="avg@k on MATH-500 L1-2 and AIME24")
    p.add_argument("--math-tokens", type=int, default=1024, help="generation cap on MATH-500 / AIME24")
    # smaller sizes for a CPU smoke run of every step (e.g. --arith arith:test:n=2 --k 2 --align-tokens 512 ...)
    p.add_argument("--arith", default="arith:test", help="the held-out set scored at every stage")
    p.add_argument("--align-tokens", type=int, default=8192, help="tokens per stage-A step (1024 per sequence)")
    p.add_argument("--e2e-tokens", type=int, default=16384, help="tokens per stage-B step (2048 per sequence)")
    p.add_argument("--grpo-batch", type=int, default=64, help="completions per GRPO step (8 per prompt)")
    p.add_argument("--math-limit", type=int, default=0, help="first N problems of each math set (0 = all)")
    return p


EVALS: list[threading.Thread] = []


def aside(fn, *args) -> None:
    """Run an evaluation beside the track's training chain (its own process on the same GPU); `main` waits for
    them all. A failed one ends its thread with its log named, not the track."""
    t = threading.Thread(target=fn, args=args)
    t.start()
    EVALS.append(t)


def score(a, work: Path, stage: str, model: str, sampled: bool = True) -> None:
    """Held-out arith:test, greedy and avg@k (sampled at temperature 1.0, top-p 1.0)."""
    kinds = [("greedy", ["--greedy"])] + ([(f"avg{a.k}", ["--samples", str(a.k), "--top-p", "1.0"])] if sampled else [])
    for kind, extra in kinds:
        out = work / "eval" / stage / kind
        run_step(work, f"eval-{stage}-{kind}", ["eval", "math", "-m", model, "-d", a.arith, *FORMAT, *extra,
                                            "--max-new-tokens", "32", "--batch-size", "512", "--out", str(out)],
            out / "summary.json")


def math_path(a, work: Path, stage: str, model: str) -> None:
    """MATH-500 levels 1-2 and AIME24 at the SSE paper's protocol (boxed answers, T 1.0, top-p 0.7, avg@k)."""
    subset = work / "math500_L1-2.jsonl"
    if not subset.is_file():
        rows = read_jsonl(Path(a.data) / "math500" / "math500.jsonl")
        subset.write_text("".join(json.dumps(r) + "\n" for r in rows if r.get("level") in (1, 2)))
    for name, ds in (("math500_L1-2", str(subset)), ("aime24", str(Path(a.data) / "aime24" / "aime24.jsonl"))):
        out = work / "eval" / stage / name
        run_step(work, f"eval-{stage}-{name}", ["eval", "math", "-m", model, "-d", ds, "--samples", str(a.math_k),
                                            "--temperature", "1.0", "--top-p", "0.7", "--max-new-tokens",
                                            str(a.math_tokens), "--batch-size", "256", "--out", str(out),
                                            *(["--limit", str(a.math_limit)] if a.math_limit else [])],
            out / "summary.json")


def grpo(a, work: Path, name: str, model: str, steps: int | None = None, lr: float | None = None) -> Path:
    run = work / name
    run_step(work, name, ["grpo", "--model", model, "--recipe", "smollm2-135m/grpo", "--output-dir", str(run),
                     f"data.instruction={NUMBER}", "data.eval=", f"grpo.max_steps={steps or a.grpo_steps}",
                     f"grpo.learning_rate={lr or a.grpo_lr}", "grpo.max_completion_length=64",
                     f"grpo.per_device_train_batch_size={a.grpo_batch}", "save_steps=0", "progress=false"],
        run / "final" / "config.json")
    return run / "final"


def teacher_track(a, work: Path) -> None:
    aside(score, a, work, "teacher", a.teacher)
    traces = work / "traces.jsonl"
    run_step(work, "traces", ["distill", "traces", f"teacher={a.teacher}",
                         f"prompts=arith:train:n={a.trace_prompts}", "prompt_field=prompt", "answer_format=number",
                         "keep=correct", f"samples_per_prompt={a.trace_samples}", "temperature=1.0",
                         "max_new_tokens=32", "batch_size=512", "dtype=bfloat16", "num_prompts=0", f"out={traces}"],
        work / "traces.done")
    (work / "traces.done").touch()
    aside(math_path, a, work, "teacher", a.teacher)
    aside(score, a, work, "teacher_grpo", str(grpo(a, work, "grpo_teacher", a.teacher)))


def hybrid_track(a, work: Path) -> None:
    common = ["data.txt_document=wikitext", "data.eval=python-reference", "train.progress=false", "train.save_every=0",
              "train.mixed_precision=bf16", "train.max_minutes=6", "--overwrite",
              "data.train=[" + ",".join(training_text(Path(a.data))) + "]", f"teacher={a.teacher}"]
    conv, align, e2e = work / "converted", work / "align", work / "e2e"
    run_step(work, "convert", ["convert", "--src", a.teacher, "--layers", a.plan, "--mixer", "sse", "--out", str(conv),
                          "--overwrite"], conv / "config.json")
    aside(score, a, work, "converted", str(conv), False)   # greedy only: the converted model is near 0
    run_step(work, "align", ["distill", "align", "-r", "smollm2-135m/align", f"student={conv}", f"train.run_dir={align}",
                        f"train.max_steps={a.align_steps}", f"data.seq_len={min(1024, a.align_tokens)}",
                        f"data.batch_tokens={a.align_tokens}",
                        "gradient_checkpointing=false", *common], align / "final" / "config.json")
    run_step(work, "e2e", ["distill", "e2e", "-r", "smollm2-135m/e2e", f"student={align / 'final'}", f"train.run_dir={e2e}",
                      f"train.max_steps={a.e2e_steps}", "gradient_checkpointing=true", "data.seq_len_schedule=[]",
                      f"data.seq_len={min(2048, a.e2e_tokens)}", f"data.batch_tokens={a.e2e_tokens}", *common],
        e2e / "final" / "config.json")
    aside(score, a, work, "distilled", str(e2e / "final"))
    na = work / "needle_attention"   # issue 22's question: do the kept softmax layers still read the needle?
    aside(run_step, work, "needle-attention", ["eval", "needle-attention", "--teacher", a.teacher, "-m", str(e2e / "final"),
                                          "--length", "4096", "--samples", "16", "--out", str(na)],
          na / "needle_attention.json")
    while not (work / "traces.done").exists():   # the teacher track writes the traces
        if (work / "teacher.failed").exists():
            sys.exit("the teacher track failed before its traces were written: no SFT")
        time.sleep(5)
    sft = work / "sft"
    run_step(work, "sft", ["distill", "sft", "-r", "smollm2-135m/sft", f"student={e2e / 'final'}",
                      f"traces={work / 'traces.jsonl'}", "prompt_field=prompt", "completion_field=completion",
                      "max_length=128", "batch_size=32", f"train.run_dir={sft}", f"train.max_steps={a.sft_steps}",
                      "train.grad_accum=1", "train.lr=3e-5", "train.warmup_steps=10", "train.save_every=0",
                      "--overwrite"], sft / "final" / "config.json")
    aside(score, a, work, "sft", str(sft / "final"))
    final = grpo(a, work, "grpo_hybrid", str(sft / "final"))
    aside(score, a, work, "grpo", str(final))
    aside(math_path, a, work, "hybrid_grpo", str(final))
    if a.long_grpo:
        steps, lr = a.long_grpo.split(":")
        aside(score, a, work, "grpo_long", str(grpo(a, work, "grpo_hybrid_long", str(sft / "final"), int(steps), float(lr))))


# ---- report ------------------------------------------------------------------------------------------------

STAGES = [("teacher", "teacher"), ("converted", "hybrid: converted"), ("distilled", "hybrid: distilled (A + B)"),
          ("sft", "hybrid: + SFT on traces"), ("grpo", "hybrid: + GRPO"), ("grpo_long", "hybrid: + longer GRPO (--long-grpo)"),
          ("teacher_grpo", "teacher + GRPO (control, the first run's budget)")]


def read_summary(work: Path, stage: str, kind: str) -> dict | None:
    p = work / "eval" / stage / kind / "summary.json"
    return json.loads(p.read_text()) if p.is_file() else None


def metric(s: dict | None, key: str, level=None) -> float | None:
    if s is None:
        return None
    if level is None:
        return s.get(key)
    return next((r.get(key) for r in s.get("by_level", []) if r["level"] == level), None)


def report(a, work: Path) -> dict:
    k = a.k
    rows = []
    for stage, label in STAGES:
        g, s = read_summary(work, stage, "greedy"), read_summary(work, stage, f"avg{k}")
        if g is None and s is None:
            continue
        rows.append({"stage": stage, "label": label, "greedy": metric(g, "avg@1"), f"avg@{k}": metric(s, f"avg@{k}"),
                     "format_rate": metric(g, "format_rate"),
                     "greedy_by_level": {lv: metric(g, "avg@1", lv) for lv in range(1, 7)},
                     f"avg@{k}_by_level": {lv: metric(s, f"avg@{k}", lv) for lv in range(1, 7)}})
    math_rows = []
    for stage in ("teacher", "hybrid_grpo"):
        for ds in ("math500_L1-2", "aime24"):
            s = read_summary(work, stage, ds)
            if s is not None:
                math_rows.append({"model": stage, "dataset": ds, "problems": s["problems"], "samples": s["samples"],
                                  "avg": s.get(f"avg@{s['samples']}"), "format_rate": s.get("format_rate"),
                                  "mean_tokens": s.get("mean_tokens"), "truncated_rate": s.get("truncated_rate")})
    steps = read_jsonl(work / "steps.jsonl", partial=True)
    n_kept = len(read_jsonl(work / "traces.jsonl", partial=True))
    n_rej = len(read_jsonl(work / "traces.rejected.jsonl", partial=True))
    out = {"arith": rows, "math": math_rows, "steps": steps, "traces": {"kept": n_kept, "rejected": n_rej},
           "grpo": {run: read_grpo(work / run) for run in ("grpo_hybrid", "grpo_hybrid_long", "grpo_teacher")},
           "settings": {key: v for key, v in vars(a).items() if key != "track"}}
    (work / "reasoning.json").write_text(json.dumps(out, indent=1))
    na = work / "needle_attention" / "needle_attention.md"
    (work / "reasoning.md").write_text(markdown(out, k) + (f"\nDistilled hybrid, {na.read_text()}" if na.is_file() else ""))
    plot(out, k, work / "reasoning.png")
    print((work / "reasoning.md").read_text())
    return out


def read_grpo(run: Path) -> dict:
    """Per-step reward / completion length from the GRPO run's metrics.jsonl, and its wall time."""
    p = run / "metrics.jsonl"
    rows = read_jsonl(p, partial=True)
    keep = ("step", "reward", "rewards/correctness_reward/mean", "rewards/format_reward/mean",
            "completions/mean_length", "rollout/tokens_per_s", "train_runtime")
    return {"rows": [{key: r[key] for key in keep if key in r} for r in rows]}


def pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}"


def markdown(out: dict, k: int) -> str:
    lines = [f"Held-out `arith:test` (up to 50 problems per level: 22 / 16 / 18 / 50 / 50 / 50), number-only answers, accuracy in %: greedy and "
             f"avg@{k} (temperature 1.0, top-p 1.0).", "",
             md_header(["model", "greedy", f"avg@{k}", *(f"L{lv} greedy / avg@{k}" for lv in range(1, 7))])]
    for r in out["arith"]:
        lv = " | ".join(f"{pct(r['greedy_by_level'][i])} / {pct(r[f'avg@{k}_by_level'][i])}" for i in range(1, 7))
        lines.append(f"| {r['label']} | {pct(r['greedy'])} | {pct(r[f'avg@{k}'])} | {lv} |")
    t = out["traces"]
    if t["kept"] or t["rejected"]:
        lines += ["", f"Traces: {t['kept']} of {t['kept'] + t['rejected']} teacher completions graded correct and kept "
                      f"({t['kept'] / max(1, t['kept'] + t['rejected']):.1%})."]
    if out["math"]:
        lines += ["", "AIME / MATH path (boxed answers, temperature 1.0, top-p 0.7):", "",
                  md_header(["model", "dataset", "problems", "k", "avg@k (%)", "format rate", "mean tokens",
                             "truncated"], "llrrrrrr")]
        for r in out["math"]:
            lines.append(f"| {r['model']} | {r['dataset']} | {r['problems']} | {r['samples']} | {pct(r['avg'])} | "
                         f"{pct(r['format_rate'])} | {r['mean_tokens']:.0f} | {pct(r['truncated_rate'])} |")
    lines += ["", md_table(["step", "seconds"], [[s["step"], s["seconds"]] for s in out["steps"]])]
    return "\n".join(lines) + "\n"


def plot(out: dict, k: int, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    rows = out["arith"]
    w = 0.8 / max(1, len(rows))
    for j, r in enumerate(rows):
        vals = [r["greedy_by_level"][lv] or 0 for lv in range(1, 7)] + [r["greedy"] or 0]
        ax.bar([i + j * w for i in range(7)], [100 * v for v in vals], w, label=r["label"])
    ax.set_xticks([i + 0.4 - w / 2 for i in range(7)], [f"L{lv}" for lv in range(1, 7)] + ["all"])
    ax.set_ylabel("held-out accuracy, greedy (%)")
    ax.set_title("arith:test by level")
    ax.legend(fontsize=7)
    for run, g in out["grpo"].items():
        pts = [(r["step"], r["reward"]) for r in g["rows"] if "reward" in r and "step" in r]
        if pts:
            ax2.plot(*zip(*pts), marker=".", label=run)
    ax2.set_xlabel("GRPO step")
    ax2.set_ylabel("mean rollout reward (correct + 0.1 format)")
    ax2.set_title("GRPO reward")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv=None):
    a = args_parser().parse_args(argv)
    work = Path(a.work)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    if a.track == "teacher":
        try:
            teacher_track(a, work)
        except SystemExit:
            (work / "teacher.failed").touch()
            raise
        finally:
            [t.join() for t in EVALS]
    elif a.track == "hybrid":
        try:
            hybrid_track(a, work)
        finally:
            [t.join() for t in EVALS]
    else:
        report(a, work)


if __name__ == "__main__":
    main()
