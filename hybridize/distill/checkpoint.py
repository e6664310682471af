"""Atomic training checkpoints on top of `accelerator.save_state` (works with DeepSpeed unchanged).

Layout: `<run_dir>/checkpoints/step-000120/` holds accelerate's state (model, optimizer, every process's
RNG states) plus `scheduler.json` (the LR schedule) and `trainer_state.json` (step, tokens seen, ...);
`load_checkpoint` reads them back with loaders that cannot run code (never a free unpickle). A checkpoint
is written to `step-000120.tmp/` and renamed only when complete, so a crash while saving never leaves a
half checkpoint that `--resume` would pick up.

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
from typing import Literal

from hybridize.errors import UserError

_STEP_DIR = re.compile(r"^step-(\d+)$")
# HF Trainer's folder name (what transformers.trainer_utils.get_last_checkpoint matches)
_TRAINER_DIR = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | Path, layout: Literal["steps", "trainer"] = "steps") -> list[Path]:
    """Complete checkpoints (folders holding `trainer_state.json`), oldest first.

    `layout="steps"`: this module's `<run_dir>/checkpoints/step-000120/` (distillation runs; unfinished
    `.tmp` folders are ignored). `layout="trainer"`: HF Trainer's `<run_dir>/checkpoint-120/` (GRPO runs
    through TRL; the Trainer writes `trainer_state.json` last, so a folder without it is unfinished)."""
    if layout == "steps":
        root, pattern = checkpoint_dir(run_dir), _STEP_DIR
    elif layout == "trainer":
        root, pattern = Path(run_dir), _TRAINER_DIR
    else:
        raise ValueError(f"layout={layout!r}: expected 'steps' or 'trainer'")
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := pattern.match(p.name))
             and (p / "trainer_state.json").is_file()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: str | Path, layout: Literal["steps", "trainer"] = "steps") -> Path | None:
    """The newest complete checkpoint of a run folder, or None; `layout` as in `list_checkpoints`."""
    ckpts = list_checkpoints(run_dir, layout)
    return ckpts[-1] if ckpts else None


def save_checkpoint(accelerator, run_dir: str | Path, step: int, state: dict, keep: int = 2,
                    scheduler=None) -> Path:
    """Write a complete checkpoint for `step` atomically; prune to the `keep` newest. The LR `scheduler`'s
    state goes to scheduler.json (plain data: loading it can run no code, unlike a pickle)."""
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
        if scheduler is not None:
            (tmp / SCHEDULER_JSON).write_text(json.dumps(scheduler.state_dict()))
        (tmp / "trainer_state.json").write_text(json.dumps({**state, "step": step}, indent=1))
        if final.exists():  # re-saving the same step (e.g. final save right after a periodic one)
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, path: str | Path, scheduler=None) -> dict:
    """Restore the prepared models, optimizers, `scheduler`, RNG states and accelerate's step counter from
    `path`; returns its trainer_state dict.

    Every part goes through a loader that cannot run code: safetensors for weights, JSON for the scheduler
    and trainer state, `torch.load(weights_only=True)` for optimizer, RNG and grad-scaler states (what
    `accelerator.load_state` would unpickle freely for registered objects). A part that is not plain data
    is refused with one line. DeepSpeed checkpoints are read by DeepSpeed's own engine, which unpickles
    freely: `check_deepspeed_pickles` opens every pickle in the folder safely first."""
    path = Path(path)
    meta = path / "trainer_state.json"
    if not meta.is_file():
        raise UserError(f"{path} is not a complete checkpoint (no trainer_state.json)")
    try:
        state = json.loads(meta.read_text())
        _load_models_and_optimizers(accelerator, path)
        if scheduler is not None:
            scheduler.load_state_dict(_scheduler_state(path))
        _load_rng_states(accelerator, path)
    except UserError:
        raise
    except Exception as e:  # a damaged or foreign file: one line, no stack trace
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise UserError(f"cannot load checkpoint {path}: {type(e).__name__}: {first}") from None
    return state


SCHEDULER_JSON = "scheduler.json"


REMEDY = "delete that checkpoint (or start the run over with --overwrite)"


def safe_torch_load(file: Path, map_location="cpu", extra_globals=(), mmap: bool = False, remedy: str = REMEDY):
    """`torch.load` of plain data only (tensors, numbers, containers, numpy RNG arrays, and the classes of
    `extra_globals`): a pickle that would build any other object - and so could run code - is refused with
    one line, ending in `remedy` (what the user can do)."""
    import pickle

    import torch
    from accelerate.utils.other import TORCH_SAFE_GLOBALS

    try:
        with torch.serialization.safe_globals([*TORCH_SAFE_GLOBALS, *extra_globals]):
            return torch.load(file, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        why = re.search(r"Unsupported global: (?:GLOBAL )?(\S+)", str(e))
        what = f" (it builds {why.group(1)})" if why else ""
        raise UserError(f"refusing to load {file}: it holds pickled objects other than tensors and plain data"
                        f"{what}, which could run code when unpickled, so nothing was loaded; {remedy}") from None


def check_deepspeed_pickles(folder: str | Path, skip: tuple[str, ...] = (), remedy: str = REMEDY) -> None:
    """Before DeepSpeed's own loaders (`load_checkpoint`, `zero_to_fp32`: `torch.load(weights_only=False)`)
    read `folder`: open every pickle below it (by suffix, torch's zip format or a pickle header) with
    `safe_torch_load`, memory-mapped so tensors are not read; the first that is not plain data is refused.
    Besides accelerate's numpy RNG classes, only the plain-data classes real ZeRO-2/3 `*optim_states.pt`
    hold are allowed: the ZeRO stage enum, the fp32 partitions' fragment addresses (a dataclass of ints)
    and the loss scaler. None defines __reduce__/__setstate__: unpickling one only sets plain attributes.

    DeepSpeed reads the tag folder named in `folder/latest` (`latest_universal`) as `os.path.join(folder,
    tag)`: a tag that leads outside `folder` (absolute, `..`) is walked too. `skip`: paths relative to
    `folder` ('/'-separated) of files that the caller's loader provably never opens (`HF_TRAINER_UNREAD`)."""
    import zipfile

    # deferred: deepspeed is optional (DeepSpeed runs only)
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    allowed = [ZeroStageEnum, fragment_address, LossScaler, DynamicLossScaler]
    folder = Path(folder)
    roots = [folder]
    for name in ("latest", "latest_universal"):  # engine.load_checkpoint / zero_to_fp32: tag = latest's text
        if (folder / name).is_file():
            tag = (folder / name).read_text(errors="replace").strip()
            if tag:  # DeepSpeed's os.path.join(folder, tag), named by its real path in a refusal
                roots.append(Path(os.path.realpath(folder / tag)))
    skipped = {folder / rel for rel in skip}
    seen = set()
    for top in roots:
        for root, dirs, files in os.walk(top, followlinks=True):  # DeepSpeed follows a linked tag folder too
            if os.path.realpath(root) in seen:  # a symlink loop, or a tag folder already walked
                dirs[:] = []
                continue
            seen.add(os.path.realpath(root))
            for file in sorted(Path(root) / name for name in files):
                suffix = file.suffix.lower()
                if (not file.is_file() or file in skipped
                        or suffix in (".safetensors", ".json", ".py", ".txt", ".yaml")):
                    continue
                with open(file, "rb") as f:
                    head = f.read(1)
                is_zip = zipfile.is_zipfile(file)
                if is_zip or suffix in (".pt", ".pth", ".bin", ".pkl", ".ckpt") or head == b"\x80":
                    safe_torch_load(file, extra_globals=allowed, mmap=is_zip, remedy=remedy)


# Files of an HF Trainer `checkpoint-N/` that no resume reads (transformers 5.23, trainer.py): only
# `training_args.bin`, the pickled TrainingArguments that `Trainer._save_checkpoint` -> `save_model` -> `_save`
# writes with `torch.save(self.args, ...)`. `Trainer.train(resume_from_checkpoint=...)` reads
# `trainer_state.json` (`train`, `_init_training_state`: `TrainerState.load_from_json`); the weights without
# DeepSpeed (`_load_from_checkpoint`: safetensors, `torch.load(weights_only=True)`, peft's `load_adapter`), with
# DeepSpeed `latest` + `global_step*/` (`_prepare_for_training` -> integrations/deepspeed.py
# `deepspeed_load_checkpoint` -> `engine.load_checkpoint`); `optimizer.pt`/`scheduler.pt`
# (`_load_optimizer_and_scheduler`), `scaler.pt` (`_load_scaler`) and `rng_state*.pth` (`_run_epoch` ->
# `_load_rng_state`). Nothing in transformers, TRL, accelerate or peft loads `training_args.bin`
# (TRAINING_ARGS_NAME is only ever saved).
HF_TRAINER_UNREAD = ("training_args.bin",)


def check_trainer_resume(trainer, checkpoint: str | Path | None, remedy: str = REMEDY) -> None:
    """Before `trainer.train(resume_from_checkpoint=checkpoint)` (an HF/TRL Trainer): under DeepSpeed, whose
    `engine.load_checkpoint` unpickles freely, every pickle of `checkpoint` the Trainer may read is opened
    safely first (`check_deepspeed_pickles`). Without DeepSpeed nothing is added: the Trainer (transformers
    5.23) reads every part through a loader that cannot run code - safetensors, JSON, or
    `torch.load(weights_only=True)` in `_load_from_checkpoint`, `_load_optimizer_and_scheduler`,
    `_load_scaler` and `_load_rng_state` (peft's `load_adapter` too)."""
    if checkpoint is not None and trainer.is_deepspeed_enabled:
        check_deepspeed_pickles(checkpoint, skip=HF_TRAINER_UNREAD, remedy=remedy)


def _load_models_and_optimizers(acc, path: Path) -> None:
    """Weights (safetensors, or a weights-only .bin) and optimizer states of what `acc` prepared."""
    from accelerate.utils import DistributedType

    if acc.distributed_type == DistributedType.DEEPSPEED:  # the engine holds model + optimizer shards
        check_deepspeed_pickles(path)  # DeepSpeed's loader unpickles freely
        for i, model in enumerate(acc._models):
            model.load_checkpoint(str(path), "pytorch_model" if i == 0 else f"pytorch_model_{i}")
        return
    from safetensors.torch import load_model

    for i, model in enumerate(acc._models):
        suffix = f"_{i}" if i else ""
        if (path / f"model{suffix}.safetensors").is_file():
            load_model(model, path / f"model{suffix}.safetensors", device="cpu")
        else:
            model.load_state_dict(safe_torch_load(path / f"pytorch_model{suffix}.bin"))
    for i, opt in enumerate(acc._optimizers):
        opt.load_state_dict(safe_torch_load(path / (f"optimizer_{i}.bin" if i else "optimizer.bin")))
    if acc.scaler is not None:
        acc.scaler.load_state_dict(safe_torch_load(path / "scaler.pt"))


def _scheduler_state(path: Path) -> dict:
    """The LR scheduler's state: scheduler.json, or the weights-only pickle older checkpoints hold."""
    if (path / SCHEDULER_JSON).is_file():
        try:
            return json.loads((path / SCHEDULER_JSON).read_text())
        except (ValueError, UnicodeDecodeError):
            raise UserError(f"{path / SCHEDULER_JSON} is not JSON: delete that checkpoint or start over "
                            f"with --overwrite") from None
    if (path / "custom_checkpoint_0.pkl").is_file():  # written by accelerate before scheduler.json existed
        return safe_torch_load(path / "custom_checkpoint_0.pkl")
    raise UserError(f"{path} holds no LR scheduler state ({SCHEDULER_JSON})")


def _load_rng_states(acc, path: Path) -> None:
    """This process's RNG states and accelerate's step counter (it decides gradient-accumulation syncs)."""
    import random

    import numpy as np
    import torch

    file = path / f"random_states_{acc.process_index}.pkl"
    if not file.is_file():
        print(f"warning: {file} is missing: random states not restored")
        return
    states = safe_torch_load(file)
    acc.step = int(states.get("step", 0))
    random.setstate(states["random_state"])
    np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    if torch.cuda.is_available() and "torch_cuda_manual_seed" in states:
        torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])


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
    """Delete an earlier run's checkpoints, metrics, loss curve, teacher record and data mix (final/ stays until a
    new one replaces it)."""
    run_dir = Path(run_dir)
    shutil.rmtree(checkpoint_dir(run_dir), ignore_errors=True)
    for name in ("metrics.jsonl", "loss.png", "teacher.json", "data.json"):
        (run_dir / name).unlink(missing_ok=True)
