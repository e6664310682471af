"""`hybridize grpo`: GRPO reasoning fine-tune of a (hybrid) model on math prompts, through TRL.

    hybridize grpo --model runs/demo --recipe smollm2-135m/grpo
    hybridize grpo --model runs/demo --recipe smollm2-135m/grpo grpo.max_steps=20 lora.enabled=true
    hybridize grpo --model runs/demo --recipe smollm2-135m/grpo output_dir=runs/grpo1 --resume
    hybridize grpo --settings            # every key with its default and help

Settings: dataclass defaults < recipe YAML < `key=value` overrides (dotted for sections). `--model` and
`--output-dir` are shortcuts for `model=` / `output_dir=`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def register(app: typer.Typer) -> None:
    """Add the top-level `grpo` command to the main `hybridize` app."""

    @app.command("grpo", context_settings={"allow_extra_args": False})
    def grpo(
        overrides: Optional[list[str]] = typer.Argument(None, help="key=value settings, e.g. grpo.max_steps=50 "
                                                                    "data.train=[gsm8k,math] lora.enabled=true"),
        model: Optional[str] = typer.Option(None, "--model", help="hybrid folder from `hybridize convert`, "
                                                                  "'default', or a hub id"),
        recipe: Optional[str] = typer.Option(None, "--recipe", help="YAML recipe: a path or a name under recipes/ "
                                                                    "(e.g. smollm2-135m/grpo)"),
        output_dir: Optional[str] = typer.Option(None, "--output-dir", help="run folder (overrides output_dir=)"),
        resume: bool = typer.Option(False, "--resume", help="continue from the newest checkpoint-N in the run folder"),
        resume_from: Optional[Path] = typer.Option(None, "--resume-from", help="continue from this checkpoint folder"),
        settings: bool = typer.Option(False, "--settings", help="list every setting with its default and exit"),
        show: bool = typer.Option(False, "--show", help="print the resolved settings and exit"),
    ):
        """GRPO on math prompts with verified-answer rewards (TRL GRPOTrainer; fast hybrid rollouts)."""
        # deferred: the command's modules load when it runs, so `hybridize --help` stays light (rl.trainer imports trl)
        import yaml

        from hybridize.rl.config import GRPORunConfig, describe, load_grpo_config, to_dict

        if settings:
            for key, default, help_ in describe(GRPORunConfig):
                typer.echo(f"{key} = {default!r}\n    {help_}")
            return
        items = list(overrides or [])
        if model is not None:
            items.append(f"model={model}")
        if output_dir is not None:
            items.append(f"output_dir={output_dir}")
        cfg = load_grpo_config(recipe, items)
        if show:
            typer.echo(yaml.safe_dump(to_dict(cfg), sort_keys=False))
            return
        # deferred: the command's modules load when it runs, so `hybridize --help` stays light (rl.trainer imports trl)
        from hybridize.rl.trainer import run_grpo

        summary = run_grpo(cfg, resume=str(resume_from) if resume_from is not None else resume)
        scores = summary.get("scores", {})
        msg = f"{summary['steps']} steps, reward {summary['reward_first']} -> {summary['reward_last']}"
        if "before" in scores and "after" in scores:
            msg += (f"; held-out correct {scores['before']['correct']:.3f} -> {scores['after']['correct']:.3f}"
                    f" ({scores['after']['n']} prompts)")
        typer.secho(msg, fg=typer.colors.GREEN, err=True)
        typer.secho(f"run written to {cfg.output_dir}/ (final/, metrics.jsonl, reward.png, summary.json)",
                    fg=typer.colors.GREEN, err=True)
