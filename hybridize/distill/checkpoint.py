"""Atomic training checkpoints on top of `accelerator.save_state` (works with DeepSpeed unchanged).

Layout: `<run_dir>/checkpoints/step-000120/` holds accelerate's state (model, optimizer, registered
objects such as the LR scheduler, every process's RNG states) plus `trainer_state.json` (step, tokens
seen, ...). A checkpoint is written to `step-000120.tmp/` and renamed only when complete, so a crash while
saving never leaves a half checkpoint that `--resume` would pick up.

A run folder that already holds a run (checkpoints or metrics.jsonl) is never restarted silently:
`guard_run_dir` asks for `--resume` (continue) or `--overwrite` (delete the old run's checkpoints and
metrics first, so pruning and a later `--resume` only ever see the new run's).
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from hybridize.errors import UserError

_STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first (unfinished `.tmp` folders are ignored)."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))
             and (p / "trainer_state.json").is_file()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def save_checkpoint(accelerator, run_dir: str | Path, step: int, state: dict, keep: int = 2) -> Path:
    """Write a complete checkpoint for `step` atomically; prune to the `keep` newest."""
    root = checkpoint_dir(run_dir)
    final = root / f"step-{step:06d}"
    tmp = root / f"step-{step:06d}.tmp"
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / "trainer_state.json").write_text(json.dumps({**state, "step": step}, indent=1))
        if final.exists():  # re-saving the same step (e.g. final save right after a periodic one)
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, path: str | Path) -> dict:
    """Restore accelerate state from `path`; returns its trainer_state dict."""
    path = Path(path)
    meta = path / "trainer_state.json"
    if not meta.is_file():
        raise UserError(f"{path} is not a complete checkpoint (no trainer_state.json)")
    accelerator.load_state(str(path))
    return json.loads(meta.read_text())


def run_history(run_dir: str | Path) -> list[str]:
    """What an earlier run left in `run_dir` that a fresh start would clobber or be confused by."""
    run_dir = Path(run_dir)
    found = []
    root = checkpoint_dir(run_dir)
    if root.is_dir() and any(root.iterdir()):
        found.append("checkpoints/")
    if (run_dir / "metrics.jsonl").is_file():
        found.append("metrics.jsonl")
    return found


def guard_run_dir(run_dir: str | Path, resume: bool, overwrite: bool) -> None:
    """Before a stage starts: refuse to start over in a folder holding an earlier run unless `overwrite`
    (then that run's checkpoints and metrics are deleted); `resume` continues it instead."""
    if resume and overwrite:
        raise UserError("pass either --resume (continue the run) or --overwrite (start over), not both")
    found = run_history(run_dir)
    if resume or not found:
        return
    if not overwrite:
        raise UserError(f"{run_dir} already holds a run ({', '.join(found)}): pass --resume to continue, "
                        f"or --overwrite to start over")
    clear_run(run_dir)


def clear_run(run_dir: str | Path) -> None:
    """Delete an earlier run's checkpoints, metrics and loss curve (final/ stays until a new one replaces it)."""
    run_dir = Path(run_dir)
    shutil.rmtree(checkpoint_dir(run_dir), ignore_errors=True)
    for name in ("metrics.jsonl", "loss.png"):
        (run_dir / name).unlink(missing_ok=True)
