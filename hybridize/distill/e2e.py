"""Stage B, end-to-end distillation / long-context continual training.

    L = kl_weight * T^2 * KL(p_teacher^T || p_student^T) + ce_weight * CE(next token) + balance_weight * aux
        + hidden_weight * mean over the student's softmax layers l of ||h_s[l] - h_t[l]||^2 / ||h_t[l]||^2
        + attn_weight * mean over those layers of KL(A_t || A_s) on sampled query rows (`attention_transfer.py`)

on packed variable-length rows: each micro-batch is one row `[1, R*L]` of whole or cut documents whose
`position_ids` restart at 0, with `attention_mask=None` and no cache. HF (transformers 5.x) then builds
a block-diagonal causal mask for eager/sdpa softmax layers (`find_packed_sequence_indices`), and the
hybrid adapters split the row at the same restarts (`cu_seqlens`), so no attention or recurrent state
crosses a document boundary; tests check packed == unpacked losses. The row length follows
`data.seq_len_schedule` (growing context); tokens per micro-batch stay `data.batch_tokens`.

`h[l]` `[B, T, hidden]` is the hidden state entering layer l (`output_hidden_states`). The hidden term is not in
the SSE recipe: it targets what a kept softmax layer computes its queries and keys from, which the converted
layers below it change (`hybridize eval needle-attention`: on the demo student the kept layers' retrieving
heads put 5-8% of their attention on the needle where the teacher's put 70%). Off by default, as is the attention
term, which asks for those layers' attention maps themselves (`attn_queries` rows per micro-batch).

`aux` is the model's auxiliary loss (`outputs.aux_loss`, SSE's partition-balance loss, already scaled
by its alpha inside the model). Which parameters train is explicit (`params`) and written to
`<run_dir>/trainable.json`. `params=lora` wraps the student with peft LoRA (merged at the end).
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
import torch.nn as nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from hybridize.errors import UserError
from hybridize.ops.common.options import with_run_kernel_options

from .attention_transfer import attention_kl, probe_attention, record, sample_queries
from .config import E2EConfig, save_config
from .data import build_data, build_heldout
from .losses import causal_lm_ce, kl_to_teacher, next_token_mask, token_mask
from .loop import make_accelerator, run_loop, save_final_model, teacher_dtype, zero_stage
from .metrics import perplexity
from .models import (apply_lora, check_run_teacher, load_student, load_teacher, lr_scales_outside_mixers,
                     select_trainable, teacher_source_of, trainable_summary)


def fp32_packed_sdpa(model: nn.Module, batch: dict):
    """SDPA backends for one forward: on CUDA in float32 (no autocast) with a packed row, everything but
    the memory-efficient kernel, which rejects the block-diagonal mask transformers builds for packed
    rows ("(*bias): last dimension must be contiguous", torch 2.11, H100); elsewhere no change."""
    ids = batch["input_ids"]
    packed = batch.get("attention_mask") is None and batch.get("position_ids") is not None
    fp32 = next(model.parameters()).dtype == torch.float32 and not torch.is_autocast_enabled("cuda")
    if ids.is_cuda and packed and fp32:
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH])
    return contextlib.nullcontext()


def softmax_layer_indices(model: nn.Module) -> list[int]:
    """The layers a hybrid keeps as softmax attention (`HybridConfig.softmax_layers`); [] for a model without a
    plan."""
    return list(getattr(getattr(model, "config", None), "softmax_layers", None) or [])


def hidden_error(h_s: tuple, h_t: tuple, layers: list[int], mask: torch.Tensor | None) -> torch.Tensor:
    """Mean over `layers` of ||h_s[l] - h_t[l]||^2 / ||h_t[l]||^2 over the counted tokens (`mask` `[B, T]`)."""
    errs = []
    for i in layers:
        d, t = (h_s[i] - h_t[i]).float(), h_t[i].float()
        w = None if mask is None else mask.to(d.dtype)[..., None]
        num = (d.square() if w is None else d.square() * w).sum()
        den = (t.square() if w is None else t.square() * w).sum().clamp_min(1e-12)
        errs.append(num / den)
    return torch.stack(errs).mean()


def e2e_loss(student: nn.Module, teacher: nn.Module | None, batch: dict, kl_weight: float = 1.0,
             ce_weight: float = 0.1, temperature: float = 1.0, balance_weight: float = 1.0,
             hidden_weight: float = 0.0, hidden_layers: list[int] | None = None, attn_weight: float = 0.0,
             attn_queries: int = 128, attn_rows: str = "all"):
    """(loss, {kl, ce, aux, hidden, attn}) of one batch: packed (`position_ids` restarting, no mask) or padded
    (`attention_mask`); both give the same value for the same documents. `hidden_layers`: the student's softmax
    layers, whose input hidden states the hidden term compares and whose attention the attention term compares
    (both models then run under `attention_transfer.probe_attention`)."""
    ids = batch["input_ids"]
    hidden = bool(hidden_weight and teacher is not None and hidden_layers)
    attn = bool(attn_weight and teacher is not None and hidden_layers)
    layers = hidden_layers if attn else []
    with fp32_packed_sdpa(student, batch), record(layers) as s_rec:
        out = student(**batch, use_cache=False, **({"output_hidden_states": True} if hidden else {}))
    logits = out.logits
    mask = token_mask(batch.get("attention_mask"), ids.shape, ids.device)
    parts, loss = {}, logits.new_zeros((), dtype=torch.float32)
    t_out = None
    if (kl_weight or hidden or attn) and teacher is not None:
        with torch.no_grad(), fp32_packed_sdpa(teacher, batch), record(layers) as t_rec:
            t_out = teacher(**batch, use_cache=False, **({"output_hidden_states": True} if hidden else {}))
    if kl_weight and t_out is not None:
        kl = kl_to_teacher(logits, t_out.logits, mask, temperature)
        loss = loss + kl_weight * kl
        parts["kl"] = kl.detach()
    if hidden:
        err = hidden_error(out.hidden_states, t_out.hidden_states, hidden_layers, batch.get("attention_mask"))
        loss = loss + hidden_weight * err
        parts["hidden"] = err.detach()
    if attn:
        rows, keys = sample_queries(batch.get("position_ids"), batch.get("attention_mask"), ids.shape, attn_queries,
                                    input_ids=ids if attn_rows == "repeats" else None, device=ids.device)
        akl = attention_kl(s_rec, t_rec, layers, rows, keys)
        loss = loss + attn_weight * akl
        parts["attn"] = akl.detach()
    if ce_weight:
        valid = next_token_mask(batch.get("position_ids"), batch.get("attention_mask"), ids.shape)
        ce = causal_lm_ce(logits, ids, valid.to(ids.device))
        loss = loss + ce_weight * ce
        parts["ce"] = ce.detach()
    aux = getattr(out, "aux_loss", None)
    if aux is not None and balance_weight:
        loss = loss + balance_weight * aux.float()
        parts["aux"] = aux.detach()
    return loss, parts


def e2e(student: nn.Module, teacher: nn.Module | None, tokenizer, cfg: E2EConfig, resume: bool = False,
        stop_after: int | None = None):
    """Run stage B on in-memory models; returns (LoopResult, trained model)."""
    run_dir = Path(cfg.train.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    torch.manual_seed(cfg.train.seed)
    if cfg.kl_weight and teacher is None:
        raise UserError("kl_weight > 0 needs a teacher (or set kl_weight=0 for CE-only training)")
    hidden_layers = softmax_layer_indices(student)
    if cfg.hidden_weight and (teacher is None or not hidden_layers):
        raise UserError("hidden_weight > 0 needs a teacher and a student that keeps softmax layers (its inputs are "
                        "what the term compares); set hidden_weight=0")
    if cfg.attn_weight and (teacher is None or not hidden_layers):
        raise UserError("attn_weight > 0 needs a teacher and a student that keeps softmax layers (their attention "
                        "is what the term compares); set attn_weight=0")
    if cfg.attn_rows not in ("all", "repeats"):
        raise UserError(f"attn_rows={cfg.attn_rows!r}: use all (any position) or repeats (positions whose token "
                        "occurred earlier in the document)")
    if not (cfg.kl_weight or cfg.ce_weight):
        raise UserError("kl_weight and ce_weight are both 0: nothing to learn from")

    if cfg.params == "lora":
        student = apply_lora(student, cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.target_modules)
    select_trainable(student, cfg.params)
    summary = trainable_summary(student)
    (run_dir / "trainable.json").write_text(json.dumps(summary, indent=1))
    lr_scales = lr_scales_outside_mixers(student, cfg.pretrained_lr_scale)
    print(f"e2e: training {summary['trainable']:,} of {summary['total']:,} parameters ({cfg.params}); "
          f"kl {cfg.kl_weight} ce {cfg.ce_weight} T {cfg.temperature}"
          + (f" hidden {cfg.hidden_weight} at layers {hidden_layers}" if cfg.hidden_weight else "")
          + (f" attn {cfg.attn_weight} ({cfg.attn_queries} {cfg.attn_rows} queries) at layers {hidden_layers}"
             if cfg.attn_weight else "")
          + (f"; lr x{cfg.pretrained_lr_scale} outside the mixers" if lr_scales else ""))
    if cfg.gradient_checkpointing:
        student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    acc = make_accelerator(cfg.train)
    if cfg.params == "lora" and zero_stage(acc) == 3:
        raise UserError("params=lora is not supported under ZeRO-3 (merging LoRA needs whole weights): use "
                        "recipes/accelerate/zero2.yaml (LoRA's optimizer state is small) or params=all")
    student.to(acc.device)
    if teacher is not None:  # runs outside accelerate's prepare (replicated on every rank, also under ZeRO-3)
        teacher.to(acc.device, dtype=teacher_dtype(acc, teacher)).eval().requires_grad_(False)

    data = build_data(cfg.data, tokenizer, cfg.train.seed, cfg.train.grad_accum)

    def step_fn(module, batch):
        loss, parts = e2e_loss(module, teacher, batch, cfg.kl_weight, cfg.ce_weight, cfg.temperature,
                               cfg.balance_weight, cfg.hidden_weight, hidden_layers, cfg.attn_weight, cfg.attn_queries,
                               cfg.attn_rows)
        return loss, {k: float(v) for k, v in parts.items()}

    heldout = build_heldout(cfg.data, tokenizer)
    eval_fn = None
    if heldout is not None:
        eval_fn = lambda step: {"ppl": perplexity(student, heldout, cfg.data.seq_len)}  # noqa: E731
    # the attention term reads the kept layers' queries and keys through a registered attention implementation,
    # in force for the loop only: the final model is saved with the one it was loaded with
    probe = probe_attention(student, teacher) if cfg.attn_weight else contextlib.nullcontext()
    with probe:
        result = run_loop(cfg.train, student, step_fn, data, resume=resume, eval_fn=eval_fn, accelerator=acc,
                          eval_every=cfg.data.eval_every, desc="e2e", stop_after=stop_after,
                          lr_scales=lr_scales)
    if cfg.params == "lora" and hasattr(student, "merge_and_unload"):
        student = student.merge_and_unload()
    if result.finished:   # the last step, or the time budget (train.max_minutes): a checkpoint is there too
        save_final_model(acc, student, tokenizer, run_dir / "final")
    return result, student


@with_run_kernel_options   # cfg.kernel_options in force for the run
def run_e2e(cfg: E2EConfig, resume: bool = False):
    student, tok = load_student(cfg.student, cfg.train.dtype)
    teacher = None
    if cfg.teacher != "none" and cfg.kl_weight:
        src = cfg.teacher or teacher_source_of(student)
        if not src:
            raise UserError("no teacher: pass teacher=<source>, or teacher=none kl_weight=0 for CE only")
        recorded = check_run_teacher(cfg.train.run_dir, src, resume)  # the run's teacher on --resume
        teacher, _ = load_teacher(src, cfg.train.dtype)
        cfg.teacher = recorded  # config.yaml records the teacher actually used (absolute), not ''
    return e2e(student, teacher, tok, cfg, resume=resume)[0]
