"""The NaN guard of the runs the HF Trainer drives (`hybridize distill sft`: TRL's SFTTrainer; `hybridize grpo`:
TRL's GRPOTrainer): a non-finite loss, gradient or weight stops the run with one line (a `NonFiniteLoss`, so
the CLI prints it and exits 2) naming the step, the last good checkpoint and what to try, and no checkpoint
is ever written from such a state.

The ideas are the hand-written loop's (`hybridize.distill.loop`: `NonFiniteLoss`, `DivergenceGuard`, imported
here), placed at the Trainer's hooks:

- the loss, in `training_step` (a mixin override; the one public place that sees each micro-batch's loss:
  callbacks only see the logged loss, which the Trainer's `logging_nan_inf_filter` replaces by the running
  mean, so a NaN would never show). Checked after the backward and before the optimizer update, so the
  weights are still those of the last finished step. Under DeepSpeed the engine steps inside the backward:
  the update has happened, but nothing is saved from it;
- the gradients, before each optimizer step (callback `on_pre_optimizer_step`): a finite loss can still give
  inf/NaN gradients (an overflow in the backward), which clipping turns into NaN weights (not under fp16 mixed
  precision, whose grad scaler skips such steps by design);
- the weights, before every checkpoint (`on_step_end` when the Trainer is about to save), at the start (a model
  that is already broken) and at the end (before the caller writes `final/`): `DivergenceGuard.problem` - not
  finite, or grown 100x; for SFT also a loss 20x above its best 16-log mean (GRPO's loss sits near 0 and
  changes sign, so that test does not apply there: `watch_loss_spikes = False`).

The loss and gradient flags are reduced over processes, so every rank stops at the same step (one rank raising
while the others wait in the next collective would hang the run).
"""
from __future__ import annotations

import math
import os

import torch
from transformers import TrainerCallback

from .loop import DivergenceGuard, NonFiniteLoss


def _any_rank(accelerator, flag: bool) -> bool:
    """`flag` OR-ed over every process (one small all-reduce; free with one process)."""
    if accelerator is None or accelerator.num_processes <= 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=accelerator.device)
    return bool(accelerator.reduce(t, "sum").item() > 0)


class GuardedTrainerMixin:
    """Mix in before a `transformers.Trainer` subclass: `class T(GuardedTrainerMixin, SFTTrainer)`.

    Subclasses set `stage` (the message's prefix), `remedy` (what to try, in the stage's setting names),
    `watch_loss_spikes`, and may override `last_good_checkpoint` (default: the newest `checkpoint-N` in
    `args.output_dir`)."""

    stage = "train"
    remedy = "lower the learning rate or the gradient clipping norm, or check the data"
    watch_loss_spikes = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_callback(_GuardCallback(self))

    def last_good_checkpoint(self) -> str | None:
        from transformers.trainer_utils import get_last_checkpoint

        out = self.args.output_dir
        return get_last_checkpoint(out) if out and os.path.isdir(out) else None

    def stop_line(self, what: str) -> NonFiniteLoss:
        """The one line: what went wrong and where, the last good checkpoint, what to try."""
        ckpt = self.last_good_checkpoint()
        where = f"the last good checkpoint is {ckpt}" if ckpt else "no checkpoint was saved before it"
        return NonFiniteLoss(f"{self.stage}: {what}; nothing was saved from this state - {where}: {self.remedy}")

    def training_step(self, model, inputs, *args, **kwargs):
        loss = super().training_step(model, inputs, *args, **kwargs)
        value = loss.detach()
        if _any_rank(self.accelerator, not bool(torch.isfinite(value).all())):
            local = float(value.float().mean())
            shown = f"the loss is {local}" if not math.isfinite(local) else "the loss is not finite on another process"
            raise self.stop_line(f"{shown} at step {self.state.global_step + 1} (stopped before its update)")
        return loss


class _GuardCallback(TrainerCallback):
    """The gradient and weight checks of `GuardedTrainerMixin` (see the module docstring)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.guard: DivergenceGuard | None = None

    def _check(self, what: str) -> None:
        problem = self.guard.problem() if self.guard is not None else None
        if problem:
            raise self.trainer.stop_line(f"{what}: {problem}")

    def on_train_begin(self, args, state, control, **kwargs):
        params = [p for p in self.trainer.model.parameters() if p.requires_grad]
        self.guard = DivergenceGuard(self.trainer.accelerator, params) if params else None
        if self.guard is not None and not math.isfinite(self.guard.start):
            raise self.trainer.stop_line(f"some trainable weights are not finite at step {state.global_step}, "
                                         "before any update (a broken model or checkpoint)")

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.guard is None or getattr(self.trainer.accelerator, "scaler", None) is not None:
            return   # fp16's grad scaler skips a step with inf gradients itself (and lowers its scale)
        grads = [p.grad for p in self.guard.params if p.grad is not None]  # DeepSpeed: none here (it steps itself)
        bad = bool(grads) and not bool(torch.isfinite(torch.nn.utils.get_total_norm(grads)))
        if _any_rank(self.trainer.accelerator, bad):
            raise self.trainer.stop_line(f"the gradients are not finite at step {state.global_step + 1} with a "
                                         "finite loss (an overflow in the backward; stopped before its update)")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.guard is not None and self.trainer.watch_loss_spikes and logs and "loss" in logs:
            self.guard.note(float(logs["loss"]), None)

    def on_step_end(self, args, state, control, **kwargs):
        if control.should_save:
            self._check(f"training diverged by step {state.global_step}")

    def on_train_end(self, args, state, control, **kwargs):
        self._check(f"training diverged by step {state.global_step}")   # before the caller saves final/
