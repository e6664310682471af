"""Issue 22, part 4: the embedded default converted three ways, each trained under the same budget, then
compared with the teacher by `hybridize eval recovery`. Every step is a `hybridize` command (what a user
would type), run in turn; state lives in `--work`, a step whose output exists is skipped, so the phases can
be spread over several 10-minute device calls on a warm machine:

    python -m benchmarks.pipeline.recovery_variants --teacher T select            # hybridize select --keep 5
    python -m benchmarks.pipeline.recovery_variants --teacher T train fixed       # convert 5:1 + stage A + stage B
    python -m benchmarks.pipeline.recovery_variants --teacher T train select      # convert <selected> + A + B
    python -m benchmarks.pipeline.recovery_variants --teacher T long select       # + long-context stage -> select_long
    python -m benchmarks.pipeline.recovery_variants --teacher T eval fixed        # one variant vs the teacher, alone
    python -m benchmarks.pipeline.recovery_variants --teacher T eval              # merge those, report all variants

The recipe that met issue 22's target (run (xiv) in RESULTS.md) is `--preset recovered`: `train pattern`, `long
pattern` and `eval pattern_long`, each with `--preset recovered --data <folder with gsm8k/, general_text/, wikitext2/>`.

Variants (the issue's (i)-(iii)): `fixed` = today's 5:1 plan; `select` = the 5 softmax layers `hybridize
select` measured; `select_long` = `select` plus the long-context recipe (smollm2-135m/long); `fixed_long` = `fixed` plus it;
`pattern` (`--pattern`) = the same 5 softmax layers with the other 25 alternating sliding-window attention (512
tokens plus 4 attention sinks) and SSE, the SSE paper's sse/swa/softmax recipe; `pattern_long` = `pattern` plus the
long-context recipe. `--chat-traces N` adds a chat mix to any variant's stages A and B: the teacher's answers to N
GSM8K train questions in the chat template (`hybridize distill traces`); `--python-docs` adds the built-in
standard-library docstrings (prose about Python; the held-out Python reference stays out) and `--python-source`
2 MB of its source files; `eval teacher` computes the teacher's rows alone (beside training), which the variants'
evals start from; `--long-mix` gives the long-context stage that extra text too (otherwise it trains on whole
articles only); `--long-questions N` adds the teacher's answers to N questions asked after 1k-7k tokens of those
articles to the long stage; `--recall-drills F` plants recall drills in every stage's text
(`hybridize/distill/recall_drills.py`). Stages A and B
use the shipped recipes with the sizes below; the training text is whole long documents from the data folder
(general_text wiki/c4 demos and wikitext-2 *valid* articles; wikitext-2 test and the haystack essays are
evaluation text and never train). Budgets are step counts (the same for every variant) with a wall-clock cap
(`train.max_minutes`) as a guard; the times each step took go to `<work>/steps.jsonl`.

Measured on one H100 (RESULTS.md, "Recovery: the three variants"): `select` 178 s; per variant convert 62 s,
stage A (250 x 8192 tokens) 222 s, stage B (160 x 16384) 302 s, long (80 x 16384) 142 s, with two variants side
by side on the GPU (`bash benchmarks/pipeline/device_default.sh $OUT pipeline`, which runs the phases in a background
process session so that they outlive the 10-minute device calls); each eval with 40 needle prompts per
length, about 7 minutes (run (xi) on one H200, with the default 96: about 8 minutes per model, the teacher's
included). On the torch kernels stage A needs --accum 4 and runs about 5x slower.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from benchmarks.pipeline.steps import run_step
from hybridize.eval.recovery import merge_reports

VARIANTS = ("fixed", "select", "fixed_long", "select_long", "pattern", "pattern_long")
TRAINABLE = ("fixed", "select", "pattern")

#: named recipes (`--preset`), expanded before the command line's own options, which override them.
#: `recovered`: run (xiv) in RESULTS.md, the first student at or above 0.9x its teacher on every row of issue 22's
#: target (one H100, 18.3 GPU-minutes with its teacher traces): 8 softmax layers (the teacher's induction layers and
#: 16), 17 windows of 512 tokens + 4 sinks (its previous-token layers first), 5 SSE layers (3, 5, 7, 14, 25); the chat
#: mix, the standard library's docstrings and 4 MB of its source in every stage, the teacher's answers to 240
#: long-context questions in the long stage.
PRESETS = {
    "recovered": ["--align-steps", "200", "--e2e-steps", "400", "--long-steps", "150", "--minutes", "9",
                  "--chat-traces", "2000", "--python-docs", "--python-source", "4M", "--long-mix",
                  "--long-questions", "240",
                  "--pattern", "attn=16,17,18,20,21,22,23,24;swa=0,1,2,4,6,8,9,10,11,12,13,15,19,26,27,28,29"],
}


def args_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("phase", choices=["select", "train", "long", "eval"])
    p.add_argument("variant", nargs="?", choices=VARIANTS + ("teacher",),
                   help="train/long: which variant (fixed, select, pattern); eval: that variant alone, into "
                        "<work>/recovery_<variant> (side by side with the others; `teacher`: the teacher's rows "
                        "alone, which the variants' evals then start from); eval without one: merge those "
                        "and report every trained variant")
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="a named recipe, expanded before the other options (which override it): `recovered` is run "
                        "(xiv) of RESULTS.md, e.g. `train pattern --preset recovered`, then `long pattern`, then "
                        "`eval pattern_long`, each with the same --preset")
    p.add_argument("--teacher", default="default")
    p.add_argument("--work", default="/root/rv")
    p.add_argument("--data", default="../shared/data", help="folder with general_text/ and wikitext2/")
    p.add_argument("--keep", type=int, default=5, help="softmax layers (5 = the 5:1 plan's count on 30 layers)")
    p.add_argument("--pattern", default="attn=16,17,18,20,23;swa=0,2,4,6,8,10,12,14,19,22,25,27,29",
                   help="the `pattern` variant's plan: by default `select`'s 5 softmax layers of the embedded default, "
                        "the other 25 alternating sliding-window attention and SSE (the SSE paper's sse/swa/softmax "
                        "recipe, 13 swa + 12 sse)")
    p.add_argument("--pattern-settings", default="swa.window=512 swa.sinks=4",
                   help="the `pattern` variant's --mixer-settings (space-separated)")
    p.add_argument("--select-args", default="", help="extra `hybridize select` options")
    p.add_argument("--recovery-args", default="--needle-samples 96 --arith-samples 20 --generation hf",
                   help="`hybridize eval recovery` options: 96 needle prompts per length (three generation batches of "
                        "32; a 0.9x ratio against a teacher at 1.0 then has Fisher's p = 0.002, at 40 prompts 0.12) "
                        "and 114 arithmetic problems. Runs (i)-(x) in RESULTS.md used 40 and 60")
    p.add_argument("--eval-seconds", type=float, default=0.0, help="eval recovery's --time-budget; 0 = none")
    p.add_argument("--align-steps", type=int, default=200)
    p.add_argument("--e2e-steps", type=int, default=150)
    p.add_argument("--long-steps", type=int, default=90)
    p.add_argument("--hidden-weight", type=float, default=0.0,
                   help="stage B's hidden_weight (the inputs of the kept softmax layers against the teacher's); run it "
                        "in its own --work to compare with a run without it")
    p.add_argument("--attn-weight", type=float, default=0.0,
                   help="stage B's attn_weight (the kept softmax layers' attention maps against the teacher's, on "
                        "sampled query rows; hybridize/distill/attention_transfer.py); run it in its own --work")
    p.add_argument("--attn-rows", default="all", choices=("all", "repeats"),
                   help="stage B's attn_rows: which query rows the attention term draws")
    p.add_argument("--chat-traces", type=int, default=0,
                   help="a chat mix: the teacher's answers to this many GSM8K train questions (`hybridize distill "
                        "traces`, greedy, chat template; <work>/traces/chat.jsonl) join stage A's and B's training "
                        "text; 0 = none. Run it in its own --work to compare with a run without it")
    p.add_argument("--python-docs", action="store_true",
                   help="add the built-in `python-docs` text (the standard library's docstrings, none sharing a long "
                        "line with the held-out Python reference) to stage A's and B's training text: the suite's "
                        "out-of-domain perplexity row then has prose about Python in training, never its own text")
    p.add_argument("--python-source", nargs="?", const="", default=None, metavar="SIZE",
                   help="add the built-in `python-source` text (2 MB of the standard library's own source files, "
                        "none sharing a long line with the held-out Python reference) to stage A's and B's text; "
                        "SIZE (e.g. 4M) takes another share")
    p.add_argument("--long-mix", action="store_true",
                   help="the long stage also trains on stages A and B's extra text (--chat-traces, --python-docs, "
                        "--python-source), "
                        "not only on whole articles: at 4k-8k the student fails in the answer's form (RESULTS.md, "
                        "variant (viii)), and the articles alone hold no chat")
    p.add_argument("--long-questions", type=int, default=0,
                   help="the long stage also trains on the teacher's answers to N questions asked after 1k-7k tokens "
                        "of the whole-article text (`hybridize distill long-questions`, then `distill traces`): the "
                        "first answer token after a long context is where the 4k-8k needle answers go wrong "
                        "(0 = none)")
    p.add_argument("--recall-drills", type=float, default=0.0,
                   help="data.recall_drills of every training step (hybridize/distill/recall_drills.py: records "
                        "planted in the training text and stated again later; 0 = none)")
    p.add_argument("--recall-reach", type=int, default=6000,
                   help="data.recall_reach of stages A and B in characters (about 1.5k tokens, inside stage B's "
                        "2048-token rows); the long stage, whose rows grow to 8192 tokens, gets 4x")
    p.add_argument("--seed", type=int, default=0,
                   help="train.seed of stages A, B and long (data order and init noise): another seed in its own "
                        "--work replicates a variant")
    p.add_argument("--minutes", type=float, default=8.0, help="wall-clock guard of each training step (a run stopped by it writes final/ at the step it reached)")
    p.add_argument("--deadline", type=float, default=0.0,
                   help="Unix time after which no new step starts (exit code 3), so a step never straddles the end "
                        "of a device call; 0 = none")
    p.add_argument("--accum", type=int, default=1, choices=(1, 2, 4),
                   help="micro-batches per optimizer step (tokens per step stay the same: align 8192, e2e and long "
                        "16384); 4 for the torch kernels, which hold far more activation memory")
    p.add_argument("--kernels", default="auto", help="HYBRIDIZE_KERNELS for every step: auto (Triton + fla-core; "
                                                     "the first use compiles and tunes for about 1.5 min) or torch "
                                                     "(no tuning, but about 5x slower per token and --accum 4 needed)")
    return p


def training_text(data: Path) -> list[str]:
    srcs = [data / "general_text" / "wiki_demo.jsonl", data / "general_text" / "c4_demo.jsonl",
            data / "wikitext2" / "valid.txt"]
    missing = [str(s) for s in srcs if not s.is_file()]
    if missing:
        sys.exit(f"training text missing: {', '.join(missing)} (pass --data)")
    return [str(s) for s in srcs]


def chat_traces(a, work: Path, env: dict) -> list[str]:
    """The chat mix (`--chat-traces N`): the teacher's greedy answers to the first N GSM8K train questions, each row's
    `text` the whole conversation in the chat template, as one more training source ([] when N is 0). The traces
    command resumes by itself, so the step always runs (a finished file is reported and kept)."""
    if not a.chat_traces:
        return []
    prompts = Path(a.data) / "gsm8k" / "train.jsonl"
    if not prompts.is_file():
        sys.exit(f"--chat-traces needs {prompts} (pass --data)")
    out = work / "traces" / "chat.jsonl"
    step(work, env, "chat-traces", None,
         ["distill", "traces", f"teacher={a.teacher}", f"prompts={prompts}", f"num_prompts={a.chat_traces}",
          "max_new_tokens=256", "batch_size=64", "dtype=bfloat16", f"out={out}"])
    return [str(out)]


DEADLINE = 0.0  # set from --deadline in main()


def step(work: Path, env: dict, name: str, done: Path | None, args: list[str]) -> None:
    """A training step of the pipeline (`steps.run_step`), not started past --deadline; skipped when `done` exists."""
    run_step(work, name, args, done, env=env, deadline=DEADLINE)


def plan_of(a, work: Path, variant: str) -> str:
    if variant == "fixed":
        return "5:1"
    if variant == "pattern":
        return a.pattern
    plan = work / "select" / "plan.txt"
    if not plan.is_file():
        sys.exit(f"{plan} is missing: run the `select` phase first")
    return plan.read_text().strip()


def drills(a, reach: int) -> list[str]:
    """The recall-drill overrides of a training step ([] without --recall-drills)."""
    return [f"data.recall_drills={a.recall_drills}", f"data.recall_reach={reach}"] if a.recall_drills else []


def extra_text(a, work: Path, env: dict) -> list[str]:
    """The sources stages A and B add to the articles: python-docs, python-source and the chat traces, when asked
    for."""
    builtin = ["python-docs"] if a.python_docs else []
    if a.python_source is not None:
        builtin.append(f"python-source:{a.python_source}" if a.python_source else "python-source")
    return builtin + chat_traces(a, work, env)


def run_train(a, work: Path, env: dict, variant: str) -> None:
    text = "[" + ",".join(training_text(Path(a.data)) + extra_text(a, work, env)) + "]"
    common = [f"teacher={a.teacher}", f"data.train={text}", "data.txt_document=wikitext", "data.eval=python-reference",
              "train.progress=false", "train.save_every=0", f"train.max_minutes={a.minutes}",
              "train.mixed_precision=bf16", f"train.seed={a.seed}", *drills(a, a.recall_reach)]
    v = work / variant
    step(work, env, f"{variant}-convert", v / "converted" / "config.json",
         ["convert", "--src", a.teacher, "--layers", plan_of(a, work, variant), "--mixer", "sse",
          "--out", str(v / "converted"), "--overwrite",
          *(x for kv in (a.pattern_settings.split() if variant == "pattern" else []) for x in ("--mixer-settings", kv))])
    step(work, env, f"{variant}-align", v / "align" / "final" / "config.json",
         ["distill", "align", "-r", "smollm2-135m/align", f"student={v / 'converted'}",
          f"train.run_dir={v / 'align'}", f"train.max_steps={a.align_steps}", "data.seq_len=1024",
          f"data.batch_tokens={8192 // a.accum}", f"train.grad_accum={a.accum}", "gradient_checkpointing=false",
          "--overwrite", *common])
    step(work, env, f"{variant}-e2e", v / "e2e" / "final" / "config.json",
         ["distill", "e2e", "-r", "smollm2-135m/e2e", f"student={v / 'align' / 'final'}",
          f"train.run_dir={v / 'e2e'}", f"train.max_steps={a.e2e_steps}", f"train.grad_accum={a.accum}",
          "gradient_checkpointing=true", "data.seq_len_schedule=[]", "data.seq_len=2048",
          f"data.batch_tokens={16384 // a.accum}", f"hidden_weight={a.hidden_weight}",
          f"attn_weight={a.attn_weight}", f"attn_rows={a.attn_rows}",
          "--overwrite", *common])


def long_questions(a, work: Path, env: dict, articles: list[str]) -> list[str]:
    """The teacher's answers to `--long-questions N` questions asked after long stretches of the whole-article text,
    as one more long-stage source ([] when N is 0): the prompts file, then its traces (both steps resume)."""
    if not a.long_questions:
        return []
    prompts, out = work / "traces" / "long_questions.jsonl", work / "traces" / "long_answers.jsonl"
    step(work, env, "long-questions", prompts,
         ["distill", "long-questions", f"texts=[{','.join(articles)}]", f"num_prompts={a.long_questions}",
          f"out={prompts}"])
    step(work, env, "long-answers", None,
         ["distill", "traces", f"teacher={a.teacher}", f"prompts={prompts}", f"num_prompts={a.long_questions}",
          "max_new_tokens=64", "batch_size=16", "dtype=bfloat16", f"out={out}"])
    return [str(out)]


def run_long(a, work: Path, env: dict, variant: str) -> None:
    src = work / variant / "e2e" / "final"
    if not src.is_dir():
        sys.exit(f"{src} is missing: run `train {variant}` first")
    n = a.long_steps
    articles = training_text(Path(a.data))[::2]   # the whole-article sources
    sources = articles + (extra_text(a, work, env) if a.long_mix else []) + long_questions(a, work, env, articles)
    step(work, env, f"{variant}_long", work / f"{variant}_long" / "long" / "final" / "config.json",
         ["distill", "e2e", "-r", "smollm2-135m/long", f"student={src}", f"teacher={a.teacher}",
          f"train.run_dir={work / f'{variant}_long' / 'long'}", f"train.max_steps={n}",
          f"data.train=[{','.join(sources)}]",
          f"data.seq_len_schedule=[[0,2048],[{n // 3},4096],[{2 * n // 3},8192]]", f"data.batch_tokens={16384 // min(a.accum, 2)}",
          f"train.grad_accum={min(a.accum, 2)}", "gradient_checkpointing=true", "train.progress=false",
          "train.save_every=0", f"train.max_minutes={a.minutes}", f"train.seed={a.seed}",
          *drills(a, 4 * a.recall_reach), "--overwrite"])


def final_dirs(work: Path) -> dict[str, Path]:
    out = {}
    for v in VARIANTS:
        d = work / v / ("long" if v.endswith("_long") else "e2e") / "final"
        if (d / "config.json").is_file():
            out[v] = d
    return out


def parse_args(argv=None):
    """The options, with `--preset`'s recipe placed before the command line's own (so those win)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    known, _ = args_parser().parse_known_args(argv)
    return args_parser().parse_args([*PRESETS.get(known.preset, []), *argv])


def main(argv=None):
    global DEADLINE
    a = parse_args(argv)
    DEADLINE = a.deadline
    work = Path(a.work)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HYBRIDIZE_KERNELS": a.kernels, "PYTHONUNBUFFERED": "1"}
    if a.phase == "select":
        step(work, env, "select", work / "select" / "plan.txt",
             ["select", "--src", a.teacher, "--keep", str(a.keep), "--mixer", "sse", "--out", str(work / "select"),
              *a.select_args.split()])
    elif a.phase in ("train", "long"):
        if a.variant not in TRAINABLE:
            sys.exit(f"{a.phase}: name the variant ({', '.join(TRAINABLE)})")
        (run_train if a.phase == "train" else run_long)(a, work, env, a.variant)
    elif a.variant is not None:
        run_eval_one(a, work, env, a.variant)
    else:
        run_eval_all(a, work, env)


def recovery_args(a) -> list[str]:
    return [*a.recovery_args.split(), *(["--time-budget", str(a.eval_seconds)] if a.eval_seconds else [])]


def run_eval_one(a, work: Path, env: dict, variant: str) -> None:
    """One variant against the teacher into <work>/recovery_<variant>, started from the teacher's rows: those of
    `eval teacher` (<work>/recovery_teacher) or else <work>/recovery_base.json (an earlier run's) when there is one,
    so only the missing values are computed (rows of another prompt count are redone). `teacher`: the teacher's
    rows alone, to run beside the training steps."""
    model = []
    if variant != "teacher":
        d = final_dirs(work).get(variant)
        if d is None:
            sys.exit(f"{variant} has no trained model under {work}")
        model = ["--model", f"{variant}={d}"]
    out = work / f"recovery_{variant}"
    out.mkdir(parents=True, exist_ok=True)
    bases = [b for b in (work / "recovery_teacher" / "recovery.json", work / "recovery_base.json")
             if b.is_file() and b.parent != out]
    if bases and not (out / "recovery.json").is_file():
        shutil.copy(bases[0], out / "recovery.json")
    run_step(work, f"recovery_{variant}", ["eval", "recovery", "--teacher", a.teacher, *model,
                                           "--out", str(out), *recovery_args(a)], env=env)


def run_eval_all(a, work: Path, env: dict) -> None:
    """Every trained variant in one report: the per-variant reports (and the base) merged first, so the run
    only computes what none of them holds."""
    models = final_dirs(work)
    if not models:
        sys.exit(f"no trained variant under {work}")
    # the per-variant reports first: a row's prompt count is the first file's (merge_reports), and the base may be
    # an older run's on fewer prompts
    parts = [p for p in [*sorted(work.glob("recovery_*/recovery.json")), work / "recovery" / "recovery.json",
                         work / "recovery_base.json"] if p.is_file()]
    if parts:
        merge_reports(parts, work / "recovery" / "recovery.json")
    run_step(work, "recovery", ["eval", "recovery", "--teacher", a.teacher,
                                *[x for k, d in models.items() for x in ("--model", f"{k}={d}")],
                                "--out", str(work / "recovery"), *recovery_args(a)], env=env, models=list(models))
    print((work / "recovery" / "recovery.md").read_text())

if __name__ == "__main__":
    main()
