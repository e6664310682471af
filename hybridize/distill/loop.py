"""The training loop shared by the hand-written stages (align, e2e): accelerate, gradient accumulation,
LR schedule, atomic checkpoints, exact `--resume`, metrics JSONL, loss-curve PNG, progress bar.

A stage hands over the module to optimise (`module`: what accelerate prepares and checkpoints), a
`step_fn(module, batch) -> (loss, {name: float})`, and a data object with `batch(step, micro)` and
`tokens_per_step(step)`. Data are a pure function of the step, and a checkpoint restores model,
optimizer, scheduler and RNG states (safe loaders only, checkpoint.load_checkpoint), so a resumed run
repeats the uninterrupted one exactly - unless train.lr or the schedule changed, which then take effect
from the resumed step (apply_train_settings). A diverged state is never checkpointed (DivergenceGuard).

DeepSpeed: an `accelerate launch --config_file recipes/accelerate/zero*.yaml` run goes through the same
calls (`prepare`, `backward`, `save_state`); `train.deepspeed=<ds.json>` does the same in ONE process
without a launcher (sets the rank-0 environment itself). The optimizer (AdamW from `train.*`) and the LR
schedule are ours, so a DeepSpeed config must not define `optimizer` or `scheduler`; its "auto" values
are filled here (micro-batch size 1 row-pack, clipping = train.max_grad_norm) or by accelerate (precision
from train.mixed_precision, grad accumulation). DeepSpeed clips and steps inside `backward`, so
`nan_policy=skip` is not available there, and the logged grad_norm is DeepSpeed's (None on some stages).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from hybridize.convert.select.record import atomic_write
from hybridize.cpu import ThreadGuard, pick_threads
from hybridize.errors import UserError

from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .config import TrainArgs
from .data import sources_line
from .metrics import MetricsLog, Throughput, plot_losses


def make_accelerator(train: TrainArgs):
    from accelerate import Accelerator

    if train.mixed_precision not in ("no", "bf16", "fp16"):
        raise UserError(f"train.mixed_precision must be no | bf16 | fp16, got {train.mixed_precision!r}")
    plugin = None
    if train.deepspeed and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        plugin = single_process_deepspeed(train.deepspeed)
    return Accelerator(mixed_precision=train.mixed_precision, gradient_accumulation_steps=train.grad_accum,
                       deepspeed_plugin=plugin)


def single_process_deepspeed(path: str):
    """A DeepSpeedPlugin for a run started WITHOUT a launcher: sets the rank-0, world-size-1 environment
    that `accelerate launch` would set (DeepSpeed initialises torch.distributed from it)."""
    check_deepspeed_file(path, "train.deepspeed")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UserError("train.deepspeed is for one process; for several use "
                        "`accelerate launch --config_file recipes/accelerate/zero*.yaml` and leave it empty")
    from accelerate.utils import DeepSpeedPlugin

    single_process_env()
    # zero3_init_flag off: models are built whole (the teacher must stay whole; the mixers initialise their
    # new parameters in place in __init__, which DeepSpeed's zero.Init partitioning does not allow)
    return DeepSpeedPlugin(hf_ds_config=str(path), zero3_init_flag=False)


def single_process_env() -> None:
    """The rank-0, world-size-1 environment `accelerate launch` would set (DeepSpeed initialises
    torch.distributed from it); keys already set are kept."""
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(_free_port()))):
        os.environ.setdefault(key, value)
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# DeepSpeed's defaults, for "auto" keys accelerate derives from `model.config.hidden_size` when the prepared
# module has no config (stage A prepares the LayerAligner, not the model)
_SIZE_DEFAULTS = {"reduce_bucket_size": 500_000_000, "stage3_prefetch_bucket_size": 50_000_000,
                  "stage3_param_persistence_threshold": 100_000}


def prepare_deepspeed_config(acc, train: TrainArgs, module: nn.Module) -> None:
    """Fill the DeepSpeed "auto" values accelerate cannot infer without a DataLoader, and refuse
    settings that would fight ours (DeepSpeed's own optimizer / LR scheduler)."""
    plugin = getattr(acc.state, "deepspeed_plugin", None)
    if plugin is None:
        return
    ds = plugin.deepspeed_config
    for key in ("optimizer", "scheduler"):
        if key in ds:
            raise UserError(f"the DeepSpeed config defines `{key}`: remove it (hybridize builds AdamW and the LR "
                            f"schedule from train.*)")
    if ds.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        ds["train_micro_batch_size_per_gpu"] = 1  # one packed row-block per micro-batch; only DeepSpeed's logs use it
    if ds.get("gradient_clipping", "auto") == "auto":
        ds["gradient_clipping"] = float(train.max_grad_norm)
    zero = ds.get("zero_optimization", {})
    if not hasattr(getattr(module, "config", None), "hidden_size"):
        for key, value in _SIZE_DEFAULTS.items():
            if zero.get(key) == "auto":
                zero[key] = value
    if train.nan_policy == "skip":
        raise UserError("nan_policy=skip is not available under DeepSpeed (it steps inside backward): use error")


def make_scheduler(optimizer, train: TrainArgs):
    from transformers import get_scheduler

    name = {"cosine": "cosine_with_min_lr", "linear": "linear", "constant": "constant_with_warmup"}.get(train.scheduler)
    if name is None:
        raise UserError(f"train.scheduler must be cosine | linear | constant, got {train.scheduler!r}")
    kwargs = {"scheduler_specific_kwargs": {"min_lr_rate": train.min_lr_ratio}} if name == "cosine_with_min_lr" else {}
    return get_scheduler(name, optimizer, num_warmup_steps=train.warmup_steps,
                         num_training_steps=train.max_steps, **kwargs)


def apply_train_settings(sched, train: TrainArgs, base_lrs: list[float]) -> None:
    """After a resume: the optimizer and LR schedule follow the current train.* (lr, weight decay, betas and
    the schedule's shape: warm-up, max_steps, floor), not the values the checkpoint restored; the schedule
    keeps its position. With unchanged settings this reproduces the restored values exactly."""
    sched.base_lrs = list(base_lrs)
    groups = sched.optimizer.param_groups
    for g, base, fn in zip(groups, base_lrs, sched.lr_lambdas):
        g.update(initial_lr=base, lr=base * fn(sched.last_epoch), weight_decay=train.weight_decay,
                 betas=tuple(train.adam_betas))
    sched._last_lr = [g["lr"] for g in groups]


def zero_stage(acc) -> int:
    """The DeepSpeed ZeRO stage of an accelerator (0 without DeepSpeed)."""
    plugin = getattr(acc.state, "deepspeed_plugin", None)
    return int(plugin.zero_stage or 0) if plugin is not None else 0


def teacher_dtype(acc, teacher: nn.Module) -> torch.dtype:
    """The teacher is never prepared by accelerate: every rank holds a whole copy. Under DeepSpeed with
    bf16 (where the student's weights are bf16 too) that copy is bf16; otherwise it keeps its dtype."""
    if zero_stage(acc) and acc.mixed_precision == "bf16":
        return torch.bfloat16
    return next(teacher.parameters()).dtype


def check_deepspeed_file(path: str, setting: str) -> None:
    """For a DeepSpeed JSON handed to an HF / TRL trainer (`setting` names it in errors): DeepSpeed installed,
    the file present; started without a launcher, the rank-0 environment a launcher would set."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        raise UserError(f"{setting} needs DeepSpeed: pip install deepspeed (or pip install 'hybridize[deepspeed]')")
    if not Path(path).is_file():
        raise UserError(f"{setting}: no such DeepSpeed config {path} (see recipes/accelerate/ds_zero*.json)")
    if "WORLD_SIZE" not in os.environ:
        single_process_env()


@contextmanager
def zero3_gathered(model: nn.Module, engine=None):
    """Whole parameters inside the block when `model` holds ZeRO-3 shards (a collective: every rank must
    enter it), for saving or scoring a model a trainer has partitioned; read-only (what the block changes
    is dropped at its end). A no-op otherwise.

    `engine`: the DeepSpeed engine that trained `model` (`deepspeed_engine`). A forward just before the block (a
    held-out evaluation before the final save) can leave its parameter prefetcher with all-gathers in flight; the
    block first waits for them and releases every parameter (the engine's `empty_partition_cache`), since a
    parameter still in flight is skipped by the gather and then cannot be partitioned again (DeepSpeed's "Cannot
    partition a param in flight"; `tests/distill/test_zero3_save.py`)."""
    params = [p for p in model.parameters() if hasattr(p, "ds_id")]
    if not params:
        yield
        return
    # deferred: deepspeed is optional (DeepSpeed runs only)
    import deepspeed

    if engine is not None:
        engine.empty_partition_cache()
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        yield


def deepspeed_engine(owner):
    """The DeepSpeed engine behind an accelerator (`deepspeed_engine_wrapped.engine`) or an HF / TRL trainer
    (`model_wrapped`), None without one."""
    wrapped = getattr(owner, "deepspeed_engine_wrapped", None)
    if wrapped is not None:
        return getattr(wrapped, "engine", None)
    engine = getattr(owner, "model_wrapped", None)
    return engine if hasattr(engine, "empty_partition_cache") else None


def gathered_state_dict(acc, model: nn.Module) -> dict | None:
    """Under ZeRO-3 the parameters of `model` are shards outside forward: gather them (a collective:
    every rank must call this) and return the full state dict on the main process (None elsewhere).
    Without ZeRO-3 return None: `save_pretrained` reads the parameters directly."""
    if zero_stage(acc) != 3:
        return None
    with zero3_gathered(model, deepspeed_engine(acc)):
        if not acc.is_main_process:
            return None
        return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def save_final(model, tokenizer, out: Path, state_dict: dict | None = None) -> None:
    """save_pretrained into `out` through a temporary folder (atomic, like the checkpoints);
    `state_dict`: the weights to write instead of the model's own (gathered ZeRO-3 shards)."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, state_dict=state_dict)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    except Exception as e:  # e.g. a hand-built test model that HF cannot serialise
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"warning: final model not saved ({type(e).__name__}: {str(e)[:120]})")
        return
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def save_final_model(acc, model: nn.Module, tokenizer, out: Path) -> None:
    """`save_pretrained` into `out` from the main process only (gathering ZeRO-3 shards first)."""
    state = gathered_state_dict(acc, model)
    if acc.is_main_process:
        save_final(model, tokenizer, out, state_dict=state)
    acc.wait_for_everyone()


def param_groups(module: nn.Module, lr: float, lr_scales: dict[str, float] | None) -> list[dict]:
    """AdamW groups of the trainable parameters, one per learning-rate multiplier (in first-seen order,
    so the grouping - and a checkpoint's optimizer state - is the same on every run)."""
    groups: dict[float, list] = {}
    for name, p in module.named_parameters():
        if p.requires_grad:
            groups.setdefault(float((lr_scales or {}).get(name, 1.0)), []).append(p)
    return [{"params": ps, "lr": lr * scale} for scale, ps in groups.items()]


@dataclass
class LoopResult:
    step: int
    tokens: int
    seconds: float
    last_loss: float
    run_dir: Path
    stopped_on_time: bool = False   # `train.max_minutes` ended the run before `train.max_steps`
    max_steps: int = 0

    @property
    def finished(self) -> bool:
        """The run reached its last step or its time budget: its model is the run's result (`final/`)."""
        return self.stopped_on_time or self.step >= self.max_steps


class NonFiniteLoss(UserError):
    """The loss or the weights went non-finite or diverged: the message names the last good checkpoint."""


class DivergenceGuard:
    """Decides whether the current state may be checkpointed, so that a checkpoint is never a diverged
    state and "the last good checkpoint" after a NaN really is from before the divergence. A state is
    refused when a trainable weight is not finite, the largest grew past GROWTH x its size at the start
    of this run (at least 1), the last gradient norm is not finite, or the mean loss of the last WINDOW
    steps is SPIKE x above the best such mean. The limits only catch blow-ups: healthy runs are far below."""

    GROWTH, SPIKE, WINDOW = 100.0, 20.0, 16

    def __init__(self, acc, params: list[torch.Tensor]):
        self.acc, self.params = acc, params
        self.start = self._largest()
        self.losses: list[float] = []
        self.best = float("inf")
        self.grad_norm: float | None = None

    def _largest(self) -> float:
        """The largest |weight| over the trainable parameters of every process (nan when any is not finite)."""
        with torch.no_grad():
            shards = [getattr(p, "ds_tensor", p) for p in self.params]  # ZeRO-3: this rank's shard
            peaks = [t.detach().abs().amax().float() for t in shards if t.numel()]
            top = torch.stack(peaks).max() if peaks else torch.zeros(())  # max propagates nan
            if self.acc.num_processes > 1:
                top = self.acc.gather(top.reshape(1).to(self.acc.device)).max()
        return float(top)

    def note(self, loss: float, grad_norm: float | None) -> None:
        """Record a finished step's mean loss and gradient norm."""
        self.grad_norm = grad_norm
        if math.isfinite(loss):
            self.losses = (self.losses + [loss])[-self.WINDOW:]
            if len(self.losses) == self.WINDOW:
                self.best = min(self.best, sum(self.losses) / self.WINDOW)

    def problem(self) -> str | None:
        """Why the current state must not be saved, or None when it is healthy."""
        top = self._largest()
        if not math.isfinite(top):
            return "some trainable weights are not finite"
        if top > self.GROWTH * max(1.0, self.start):
            return f"the largest trainable weight is {top:.3g} (it was {self.start:.3g} at the start)"
        if self.grad_norm is not None and not math.isfinite(self.grad_norm):
            return f"the gradient norm is {self.grad_norm}"
        recent = sum(self.losses) / max(len(self.losses), 1)
        if len(self.losses) == self.WINDOW and recent > self.SPIKE * self.best:
            return (f"the mean loss of the last {self.WINDOW} steps is {recent:.4g}, over {self.SPIKE:g}x its best "
                    f"{self.best:.4g}")
        return None


def last_good(run_dir: Path) -> str:
    """The end of a divergence message: which checkpoint to resume from (only healthy states are saved)."""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        return ("no checkpoint was saved before it: lower train.lr or check the data, then rerun with "
                "--overwrite")
    return (f"the last good checkpoint, saved before the divergence, is {ckpt}: lower train.lr (a new lr is "
            f"used on --resume) or check the data, then rerun with --resume")


def move(batch: dict, device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def run_loop(train: TrainArgs, module: nn.Module, step_fn: Callable, data, *, resume: bool = False,
             accelerator=None, eval_fn: Callable[[int], dict] | None = None, eval_every: int = 0,
             desc: str = "train", stop_after: int | None = None,
             lr_scales: dict[str, float] | None = None) -> LoopResult:
    """Optimise the trainable parameters of `module` for `train.max_steps` optimizer steps.

    `lr_scales` maps parameter names to learning-rate multipliers (one AdamW group per multiplier;
    the schedule scales every group alike).
    `stop_after` ends the loop early after that many steps of THIS call (as if killed after a
    checkpoint; tests use it to interrupt and resume)."""
    from tqdm.auto import tqdm

    run_dir = Path(train.run_dir)
    acc = accelerator or make_accelerator(train)
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise UserError("nothing to train: no parameter has requires_grad=True")
    opt = torch.optim.AdamW(param_groups(module, train.lr, lr_scales), lr=train.lr, betas=tuple(train.adam_betas),
                            weight_decay=train.weight_decay)
    sched = make_scheduler(opt, train)
    base_lrs = [g["initial_lr"] for g in opt.param_groups]  # lr x scale ("lr" is already the warm-up's)
    prepare_deepspeed_config(acc, train, module)
    module, opt = acc.prepare(module, opt)
    data.rank, data.world, data.grad_accum = acc.process_index, acc.num_processes, train.grad_accum

    log = MetricsLog(run_dir / "metrics.jsonl", enabled=acc.is_main_process)
    sources = getattr(data, "sources", None)
    if sources and acc.is_main_process:   # the mix in tokens per source, beside the run's config
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(run_dir / "data.json",
                     json.dumps({"tokens": sum(x["tokens"] for x in sources), "sources": sources}, indent=1))
        acc.print(sources_line(sources))
    step, tokens = 0, 0
    if resume:
        ckpt = latest_checkpoint(run_dir)
        if ckpt is None:
            acc.print(f"no checkpoint in {run_dir}/checkpoints: starting from step 0")
        else:
            state = load_checkpoint(acc, ckpt, scheduler=sched)
            apply_train_settings(sched, train, base_lrs)
            step, tokens = int(state["step"]), int(state.get("tokens", 0))
            acc.print(f"resumed from {ckpt} (step {step}, {tokens} tokens)")
    if acc.is_main_process and step == 0:
        log.path.unlink(missing_ok=True)
    log.truncate_after(step)
    guard = DivergenceGuard(acc, params)

    def checkpoint(at: int):
        """Save the state after `at` steps, unless it has diverged (then stop, naming the last good one)."""
        problem = guard.problem()
        if problem:
            raise NonFiniteLoss(f"training diverged by step {at}: {problem}; not saved - {last_good(run_dir)}")
        save_checkpoint(acc, run_dir, at, {"tokens": tokens}, keep=train.keep_checkpoints, scheduler=sched)

    if eval_fn is not None and step == 0:
        log.write(step=0, **eval_fn(0))

    speed = Throughput()
    on_cpu = acc.device.type == "cpu"
    if on_cpu:
        torch.set_num_threads(pick_threads(train.threads))
    threads = ThreadGuard(enabled=on_cpu and not train.threads)
    bar = tqdm(total=train.max_steps, initial=step, desc=desc, disable=not (train.progress and acc.is_main_process),
               dynamic_ncols=True)
    t0, last_loss, skipped, done_here = time.perf_counter(), float("nan"), 0, 0
    stopped_on_time = False
    module.train()
    try:
        while step < train.max_steps:
            losses, parts, bad, grad_norm = [], {}, False, None
            for micro in range(train.grad_accum):
                batch = move(data.batch(step, micro), acc.device)
                with acc.accumulate(module):
                    with acc.autocast():
                        loss, logs = step_fn(module, batch)
                    if not torch.isfinite(loss.detach()).all():
                        bad = True
                        if train.nan_policy != "skip":  # nothing is saved: this state may have diverged already
                            opt.zero_grad(set_to_none=True)
                            raise NonFiniteLoss(f"loss is {loss.item()} at step {step} micro-batch {micro}; "
                                                f"{last_good(run_dir)}")
                        continue
                    acc.backward(loss)
                    losses.append(float(loss.detach()))
                    for k, v in logs.items():
                        parts[k] = parts.get(k, 0.0) + float(v) / train.grad_accum
                    if acc.sync_gradients and not bad:
                        if train.max_grad_norm > 0:
                            norm = acc.clip_grad_norm_(params, train.max_grad_norm)  # DeepSpeed: its norm or None
                            grad_norm = float(norm) if norm is not None else None
                        opt.step()
                        sched.step()
                    if acc.sync_gradients or bad:
                        opt.zero_grad(set_to_none=True)
            if bad:
                skipped += 1
                opt.zero_grad(set_to_none=True)
                acc.print(f"warning: non-finite loss at step {step}: batch skipped ({skipped}/10)")
                if skipped > 10:
                    checkpoint(step)  # the skipped batches changed nothing: saved unless it diverged before
                    raise NonFiniteLoss(f"more than 10 non-finite losses (last at step {step}); the state before "
                                        f"them is saved in {run_dir}/checkpoints: check the data or lower train.lr, "
                                        f"then rerun with --resume")
            step_tokens = data.tokens_per_step(step)
            tokens += step_tokens
            step += 1
            done_here += 1
            last_loss = sum(losses) / max(len(losses), 1) if losses else float("nan")
            if acc.num_processes > 1:  # log the mean over ranks: the same number a 1-process run with
                # grad_accum x world micro-batches logs for the same data
                vals = acc.reduce(torch.tensor([last_loss, *parts.values()], device=acc.device), "mean")
                last_loss, parts = float(vals[0]), dict(zip(parts, map(float, vals[1:])))
            guard.note(last_loss, grad_norm)
            tps = speed.add(step_tokens)
            if step % max(train.log_every, 1) == 0 or step == train.max_steps:
                mem = {"peak_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 3)} \
                    if torch.cuda.is_available() else {}  # this (main) process's GPU
                log.write(step=step, loss=last_loss, lr=sched.get_last_lr()[0], grad_norm=grad_norm,
                          tokens=tokens, tok_per_s=round(tps, 1), **parts, **mem)
            if eval_fn is not None and eval_every and step % eval_every == 0 and step < train.max_steps:
                log.write(step=step, **eval_fn(step))
            bar.update(1)
            bar.set_postfix(loss=f"{last_loss:.4g}", tok_s=f"{tps:.0f}")
            threads.step_done()
            if train.save_every and step % train.save_every == 0 and step < train.max_steps:
                checkpoint(step)
            if stop_after is not None and done_here >= stop_after:
                break
            if train.max_minutes and time.perf_counter() - t0 > 60 * train.max_minutes:
                acc.print(f"{desc}: time budget of {train.max_minutes} min reached at step {step}")
                stopped_on_time = True
                break
    except KeyboardInterrupt:
        bar.close()
        checkpoint(step)
        raise UserError(f"interrupted at step {step}; checkpoint saved in {run_dir}/checkpoints - "
                        f"rerun the same command with --resume") from None
    bar.close()
    if torch.cuda.is_available():  # every rank's peak GPU memory (sharding shows here), one line
        peaks = acc.gather(torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device=acc.device))
        log.write(step=step, peak_mem_gb_per_rank=[round(float(x), 3) for x in peaks.cpu()],
                  world=acc.num_processes)
    if step >= train.max_steps or stop_after is not None or stopped_on_time:
        checkpoint(step)
    if eval_fn is not None and (step >= train.max_steps or stopped_on_time):
        log.write(step=step, **eval_fn(step))
    if acc.is_main_process:
        keys = tuple(k for k in ("loss", "kl", "ce", "aux") if any(k in r for r in log.read()))
        plot_losses(log.path, run_dir / "loss.png", keys=keys or ("loss",), title=f"{desc}: {run_dir.name}")
    return LoopResult(step=step, tokens=tokens, seconds=time.perf_counter() - t0, last_loss=last_loss,
                      run_dir=run_dir, stopped_on_time=stopped_on_time, max_steps=train.max_steps)

