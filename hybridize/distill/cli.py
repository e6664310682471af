"""CLI of the distillation stages: `hybridize distill align|e2e|sft|traces|long-questions` and `hybridize demo`.

Every stage takes an optional `--recipe` (a YAML file, or a name under `recipes/`, e.g.
`smollm2-135m/align`) and then `key=value` overrides (dotted for sections: `train.lr=3e-4`,
`data.seq_len=512`); `--resume` continues the run in `train.run_dir` from its newest complete checkpoint
(with the same settings, except the learning rate, schedule and bookkeeping: see RESUME), `--overwrite`
starts over in a folder holding an earlier run (without either, such a folder is refused); `--show`
prints every setting with its default and help. Multi-GPU / DeepSpeed: run the same command
under `accelerate launch --config_file recipes/accelerate/<file>.yaml -m hybridize.cli distill ...`
(recipes/accelerate/README.md); `hybridize export` turns any of their checkpoints into a HF folder.
"""
from __future__ import annotations

from typing import Optional

import typer

from hybridize.errors import UserError

from .checkpoint import guard_run_dir, run_history
from .config import (
    AlignConfig,
    DemoConfig,
    E2EConfig,
    LongQuestionsConfig,
    SFTStageConfig,
    TracesConfig,
    check_resume_settings,
    describe,
    load_config,
)

RECIPE = typer.Option(None, "--recipe", "-r", help="YAML recipe: a path or a name under recipes/ "
                                                   "(e.g. smollm2-135m/align)")
RESUME = typer.Option(False, "--resume", help="continue from the newest complete checkpoint in train.run_dir. "
                      "Settings must match the run's config.yaml, except train.lr, min_lr_ratio, scheduler, "
                      "warmup_steps, max_steps, weight_decay, adam_betas, max_grad_norm and bookkeeping (save_every, "
                      "keep_checkpoints, log_every, threads, progress, max_minutes, nan_policy): those take effect "
                      "from the resumed step on (sft: only max_steps, max_grad_norm and bookkeeping); any other "
                      "change is refused, and so is a teacher whose weights differ from those the run started "
                      "with (RUN_DIR/teacher.json)")
OVERWRITE = typer.Option(False, "--overwrite", help="start over in a train.run_dir that holds an earlier run "
                                                   "(its checkpoints/ and metrics.jsonl are deleted first)")
SHOW = typer.Option(False, "--show", help="print every setting (key, its value after the recipe and overrides, help) and exit")
OVERRIDES = typer.Argument(None, help="key=value overrides, applied after the recipe (e.g. train.lr=3e-4)",
                           show_default=False)


DEMO_OVERRIDES = typer.Argument(None, help="key=value overrides (e.g. align_steps=100 out=runs/demo2)",
                                show_default=False)


def _show(cls, cfg=None) -> None:
    """Every setting with its value (the resolved `cfg` when given, else the default) and help."""
    for key, default, help_ in describe(cls):
        value = default
        if cfg is not None:
            value = cfg
            for part in key.split("."):
                value = getattr(value, part)
        typer.echo(f"{key:28s} {value!r:24s} {help_}")


def _start(cfg, resume: bool, overwrite: bool, trainer: str = "loop"):
    """Check `cfg`'s run folder before anything loads or is written there (config.yaml is rewritten by the
    stage): no earlier run clobbered (checkpoint.guard_run_dir), no resume with settings it cannot honour."""
    from pathlib import Path

    guard_run_dir(cfg.train.run_dir, resume, overwrite)
    if resume and "checkpoints/" in run_history(cfg.train.run_dir):
        check_resume_settings(cfg, Path(cfg.train.run_dir) / "config.yaml", trainer)
    return cfg


def register(app: typer.Typer) -> None:
    distill = typer.Typer(help="Distil a converted model from its teacher: align (A), e2e (B), sft (C), traces.",
                          no_args_is_help=True)

    @distill.command("align")
    def align_cmd(overrides: Optional[list[str]] = OVERRIDES, recipe: Optional[str] = RECIPE,
                  resume: bool = RESUME, overwrite: bool = OVERWRITE, show: bool = SHOW):
        """Stage A, attention transfer: each converted layer matches its teacher attention's output."""
        if show:
            return _show(AlignConfig, load_config(AlignConfig, recipe, overrides))
        # deferred: the command's modules load when it runs, so `hybridize --help` stays light
        from .align import run_align
        r = run_align(_start(load_config(AlignConfig, recipe, overrides), resume, overwrite), resume=resume)
        typer.echo(f"align: {r.step} steps, {r.tokens} tokens, last loss {r.last_loss:.4g}; run in {r.run_dir}")

    @distill.command("e2e")
    def e2e_cmd(overrides: Optional[list[str]] = OVERRIDES, recipe: Optional[str] = RECIPE,
                resume: bool = RESUME, overwrite: bool = OVERWRITE, show: bool = SHOW):
        """Stage B: KL to the teacher's logits + CE on packed long sequences (context schedule, LoRA or full)."""
        if show:
            return _show(E2EConfig, load_config(E2EConfig, recipe, overrides))
        # deferred: the command's modules load when it runs, so `hybridize --help` stays light
        from .e2e import run_e2e
        r = run_e2e(_start(load_config(E2EConfig, recipe, overrides), resume, overwrite), resume=resume)
        typer.echo(f"e2e: {r.step} steps, {r.tokens} tokens, last loss {r.last_loss:.4g}; run in {r.run_dir}")

    @distill.command("sft")
    def sft_cmd(overrides: Optional[list[str]] = OVERRIDES, recipe: Optional[str] = RECIPE,
                resume: bool = RESUME, overwrite: bool = OVERWRITE, show: bool = SHOW):
        """Stage C: SFT on reasoning traces (a dataset or `distill traces` output) with TRL's SFTTrainer."""
        if show:
            return _show(SFTStageConfig, load_config(SFTStageConfig, recipe, overrides))
        # deferred: the command's modules load when it runs, so `hybridize --help` stays light
        from .sft import run_sft
        r = run_sft(_start(load_config(SFTStageConfig, recipe, overrides), resume, overwrite, "sft"), resume=resume)
        typer.echo(f"sft: {r.global_step} steps, train loss {r.training_loss:.4g}")

    @distill.command("traces")
    def traces_cmd(overrides: Optional[list[str]] = OVERRIDES, recipe: Optional[str] = RECIPE,
                   show: bool = SHOW):
        """The teacher writes completions for prompts (JSONL; rerun to continue an interrupted file)."""
        if show:
            return _show(TracesConfig, load_config(TracesConfig, recipe, overrides))
        # deferred: the command's modules load when it runs, so `hybridize --help` stays light
        from .traces import run_traces
        path = run_traces(load_config(TracesConfig, recipe, overrides))
        typer.echo(f"traces: {path}")

    @distill.command("long-questions", short_help="Prompts that ask a question after a long text (JSONL for "
                                                  "`distill traces`, for the long-context stage).")
    def long_questions_cmd(overrides: Optional[list[str]] = OVERRIDES, recipe: Optional[str] = RECIPE,
                           show: bool = SHOW):
        """Prompts that ask a question after a long text (JSONL for `distill traces`, whose answers then train
        the long-context stage)."""
        cfg = load_config(LongQuestionsConfig, recipe, overrides)
        if show:
            return _show(LongQuestionsConfig, cfg)
        if not cfg.texts:
            raise UserError("long-questions: name the documents, e.g. texts=../shared/data/wikitext2/valid.txt")
        from .long_questions import run_long_questions
        run_long_questions(cfg)

    app.add_typer(distill, name="distill")

    @app.command("export", short_help="Convert a training checkpoint (plain accelerate or DeepSpeed ZeRO-1/2/3) "
                                      "to a plain HF folder.")
    def export_cmd(checkpoint: str = typer.Option(..., "--checkpoint", "-c",
                                                  help="RUN_DIR/checkpoints/step-N (or RUN_DIR: its newest)"),
                   out: str = typer.Option(..., "--out", "-o", help="output folder (config, safetensors, tokenizer)"),
                   student: str = typer.Option("", "--student", help="the folder the run started from "
                                                                     "(default: `student` in RUN_DIR/config.yaml)"),
                   dtype: str = typer.Option("", "--dtype", help="float32 | bfloat16 (default: the run's train.dtype)"),
                   overwrite: bool = typer.Option(False, "--overwrite", help="replace a non-empty --out folder that "
                                                  "is not an earlier export (its contents are deleted)")):
        """Convert a training checkpoint (plain accelerate or DeepSpeed ZeRO-1/2/3) to a plain HF folder.
        An existing --out is replaced only when empty, an earlier export, or with --overwrite."""
        # deferred: the command's modules load when it runs, so `hybridize --help` stays light
        from .export import export_checkpoint
        path = export_checkpoint(checkpoint, out, student=student, dtype=dtype, overwrite=overwrite)
        typer.echo(f"export: {path}")

    @app.command("demo", short_help="Main job: convert the embedded SmolLM2-135M (5:1 SSE-H), distil it on the "
                                    "CPU and compare it with its teacher.")
    def demo_cmd(overrides: Optional[list[str]] = DEMO_OVERRIDES, recipe: Optional[str] = RECIPE,
                 show: bool = SHOW):
        """Main job: convert the embedded SmolLM2-135M (5:1 SSE-H), distil it (stage A + stage B) on the CPU,
        and print teacher vs student held-out perplexity and chat answers (writes runs/demo/; the teacher's
        dense copy, ~0.5 GB, is cached in ~/.cache/hybridize)."""
        cfg = load_config(DemoConfig, recipe, overrides)
        if show:
            return _show(DemoConfig, cfg)
        # deferred: the command's modules load when it runs, so `hybridize --help` stays light
        from .demo import run_demo
        run_demo(cfg)
