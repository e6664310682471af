"""Stage A, attention transfer: every converted layer learns to reproduce its teacher layer's attention
output, given the teacher's own inputs to that layer.

Per batch the teacher runs once under `no_grad`; forward hooks (with kwargs) on its `self_attn` modules
record each layer's inputs (hidden states, RoPE cos/sin, mask, position ids) and output. The student's
adapter at the same index is then called on exactly those inputs and the loss compares outputs:

    L = mean_i  loss(adapter_i(h_i^teacher), attn_i^teacher(h_i^teacher))      (loss: mse | nmse)

Layers never see each other's errors (no backward through the stack), as in LoLCATs' attention
transfer; departing from it, we match the attention block's OUTPUT (after o_proj), not attention weights
(a linear mixer has none), and we default to a normalised MSE so every layer weighs the same.
The teacher forward stops after the last layer that is needed (no MLP/lm_head work beyond it).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn
import torch.utils.checkpoint

from hybridize.errors import UserError
from hybridize.ops.common.options import with_run_kernel_options
from hybridize.modeling import packed_cu_seqlens
from .config import AlignConfig, save_config
from .data import build_data, build_heldout
from .loop import run_loop, teacher_dtype
from .loop import make_accelerator, save_final, save_final_model  # noqa: F401  (save_final: re-exported)
from .losses import LAYER_LOSSES
from .metrics import perplexity
from .models import converted_layers, decoder_layers, mixer_of, load_student, load_teacher, select_trainable, \
    check_run_teacher, teacher_source_of, trainable_summary


class _Stop(Exception):
    """Raised by the last hook: the rest of the teacher forward is not needed."""


class TeacherTap:
    """Records the inputs and output of chosen teacher attention modules during one forward."""

    def __init__(self, teacher: nn.Module, layers: list[int]):
        self.teacher = teacher
        self.layers = sorted(layers)
        self.records: dict[int, tuple[dict, torch.Tensor]] = {}
        self.wanted, self.stop_at = set(self.layers), self.layers[-1]
        attn = {i: decoder_layers(teacher)[i].self_attn for i in self.layers}
        self.handles = [m.register_forward_hook(self._hook(i), with_kwargs=True) for i, m in attn.items()]

    def _hook(self, i: int):
        def hook(module, args, kwargs, output):
            if i not in self.wanted:
                return None
            kw = dict(kwargs)
            if args:  # hidden_states given positionally
                kw["hidden_states"] = args[0]
            out = output[0] if isinstance(output, tuple) else output
            self.records[i] = (kw, out.detach())
            if i == self.stop_at:
                raise _Stop
        return hook

    @torch.no_grad()
    def run(self, batch: dict, layers: list[int] | None = None) -> dict[int, tuple[dict, torch.Tensor]]:
        """Teacher forward on `batch`; records of `layers` (default: all tapped layers)."""
        self.records = {}
        self.wanted = set(self.layers if layers is None else layers)
        self.stop_at = max(self.wanted)
        extra = mixer_inputs(batch)
        try:
            self.teacher(**batch, use_cache=False)
        except _Stop:
            pass
        missing = self.wanted - set(self.records)
        if missing:
            raise RuntimeError(f"teacher layers {sorted(missing)} did not run")
        for kw, _ in self.records.values():
            kw.update(extra)
        return self.records

    def close(self):
        for h in self.handles:
            h.remove()


def mixer_inputs(batch: dict) -> dict:
    """What a hybrid model computes once per forward for its mixer slots (see hybridize.modeling):
    the 2-D padding mask (only when some token is padding) and `cu_seqlens` of packed rows (only when
    there is no mask and `position_ids` restart)."""
    ids = batch["input_ids"]
    B, T = ids.shape
    am, pos = batch.get("attention_mask"), batch.get("position_ids")
    mask2d = am.bool() if isinstance(am, torch.Tensor) and am.dim() == 2 and not bool(am.bool().all()) else None
    cu = None
    if am is None and pos is not None and T > 1:
        cu = packed_cu_seqlens(pos, B)
    return {"mixer_attention_mask": mask2d, "mixer_cu_seqlens": cu}


def adapter_kwargs(kw: dict, is_mixer: bool = True) -> dict:
    """The teacher attention's call kwargs (plus `mixer_inputs`), as the student slot takes them.

    The slot has the teacher attention's signature and ignores the decoder's 4-D mask; packed-document
    boundaries come from `mixer_cu_seqlens` (or, for a plain adapter, from `position_ids`). No KV cache
    is passed."""
    out = {k: v for k, v in kw.items() if k not in ("past_key_values", "past_key_value", "use_cache")}
    if not is_mixer:  # a softmax module (e.g. the teacher's own, in tests) needs its 4-D mask
        return {k: v for k, v in out.items() if not k.startswith("mixer_")}
    m = out.get("attention_mask")
    if isinstance(m, torch.Tensor) and m.dim() == 4:
        out["attention_mask"] = None
    return out


class LayerAligner(nn.Module):
    """The adapters under training; `forward(records)` -> mean layer loss. This is the module accelerate
    prepares (DDP syncs exactly these parameters) and checkpoints (small: adapters only)."""

    def __init__(self, adapters: dict[int, nn.Module], loss: str = "nmse", balance_weight: float = 1.0,
                 checkpoint: bool = False):
        super().__init__()
        self.balance_weight = balance_weight
        # recompute each adapter in the backward: only its inputs are kept, so activation memory is one layer's
        # (the torch mixer path on CPU held ~3.6 MB per token across 25 SSE layers: 2048 tokens filled 24 GB)
        self.checkpoint = checkpoint
        if loss not in LAYER_LOSSES:
            raise UserError(f"align loss must be one of {sorted(LAYER_LOSSES)}, got {loss!r}")
        self.adapters = nn.ModuleDict({str(i): a for i, a in sorted(adapters.items())})
        self.loss_fn = LAYER_LOSSES[loss]

    def forward(self, records: dict[int, tuple[dict, torch.Tensor]]):
        """Mean loss over the layers present in `records` (all adapters, or the step's subset)."""
        losses, auxes = {}, []
        for key, adapter in self.adapters.items():
            if int(key) not in records:
                continue
            kw, target = records[int(key)]
            kw = adapter_kwargs(kw, mixer_of(adapter) is not None)
            if self.checkpoint and torch.is_grad_enabled():
                out = torch.utils.checkpoint.checkpoint(adapter, use_reentrant=False, **kw)
            else:
                out = adapter(**kw)
            out = out[0] if isinstance(out, tuple) else out
            losses[int(key)] = self.loss_fn(out, target)
            aux = getattr(adapter, "last_aux_loss", None)
            if aux is not None and self.balance_weight:
                # SSE's router balance loss: routers train in stage A, so they must stay balanced here too
                auxes.append(aux.float())
        total = torch.stack(list(losses.values())).mean()
        if auxes:
            aux_total = torch.stack(auxes).sum()
            losses["aux"] = aux_total
            total = total + self.balance_weight * aux_total
        return total, losses


def align(student: nn.Module, teacher: nn.Module, tokenizer, cfg: AlignConfig, resume: bool = False,
          stop_after: int | None = None):
    """Run stage A on in-memory models (the student is trained in place). Returns the LoopResult."""
    run_dir = Path(cfg.train.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    torch.manual_seed(cfg.train.seed)

    conv = converted_layers(student)
    layers = sorted(int(i) for i in cfg.layers) if cfg.layers else sorted(conv)
    if not layers:
        raise UserError("the student has no converted layers: nothing to align")
    select_trainable(student, cfg.params, layers)
    summary = trainable_summary(student)
    (run_dir / "trainable.json").write_text(json.dumps(summary, indent=1))
    print(f"align: layers {layers}; training {summary['trainable']:,} of {summary['total']:,} parameters "
          f"({cfg.params})")

    acc = make_accelerator(cfg.train)
    # the teacher runs outside accelerate's prepare (replicated on every rank, also under ZeRO-3): put both
    # models where the batches will be
    teacher.to(acc.device, dtype=teacher_dtype(acc, teacher)).eval().requires_grad_(False)
    student.to(acc.device)
    tap = TeacherTap(teacher, layers)
    aligner = LayerAligner({i: conv[i] for i in layers}, cfg.loss, cfg.balance_weight, cfg.gradient_checkpointing)
    data = _StepTagged(build_data(cfg.data, tokenizer, cfg.train.seed, cfg.train.grad_accum))

    def layers_at(step: int) -> list[int]:
        k = cfg.layers_per_step
        if not k or k >= len(layers):
            return layers
        start = (step * k) % len(layers)
        return [layers[(start + j) % len(layers)] for j in range(k)]

    def step_fn(module, batch):
        records = tap.run(batch, layers_at(batch.pop("_step", 0)))
        loss, per_layer = module(records)
        return loss, {(f"L{i}" if i != "aux" else "aux"): float(v.detach()) for i, v in per_layer.items()}

    heldout = build_heldout(cfg.data, tokenizer)
    eval_fn = None
    if heldout is not None:
        eval_fn = lambda step: {"ppl": perplexity(student, heldout, cfg.data.seq_len)}  # noqa: E731
    try:
        result = run_loop(cfg.train, aligner, step_fn, data, resume=resume, eval_fn=eval_fn, accelerator=acc,
                          eval_every=cfg.data.eval_every, desc="align", stop_after=stop_after)
    finally:
        tap.close()
    if result.finished:   # the last step, or the time budget (train.max_minutes): a checkpoint is there too
        save_final_model(acc, student, tokenizer, run_dir / "final")
    return result


class _StepTagged:
    """Wraps the data so each batch carries its optimizer step (the layer rotation depends on it)."""

    def __init__(self, data):
        self.data = data

    def __getattr__(self, name):
        return getattr(self.data, name)

    def __setattr__(self, name, value):
        if name == "data":
            object.__setattr__(self, name, value)
        else:
            setattr(self.data, name, value)

    def batch(self, step: int, micro: int) -> dict:
        return {**self.data.batch(step, micro), "_step": step}


@with_run_kernel_options   # cfg.kernel_options in force for the run
def run_align(cfg: AlignConfig, resume: bool = False):
    """CLI entry: load the student folder and its teacher, run stage A, write `<run_dir>/final`."""
    student, tok = load_student(cfg.student, cfg.train.dtype)
    src = cfg.teacher or teacher_source_of(student)
    if not src:
        raise UserError("no teacher: pass teacher=<source> (the student's config records none)")
    recorded = check_run_teacher(cfg.train.run_dir, src, resume)  # the run's teacher on --resume
    teacher, _ = load_teacher(src, cfg.train.dtype)
    cfg.teacher = recorded  # config.yaml records the teacher actually used (absolute), not ''
    return align(student, teacher, tok, cfg, resume=resume)
