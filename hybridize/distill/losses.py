"""Pure loss functions of the distillation stages (no model code, no state).

Token losses are means over the tokens that count, so a packed batch (documents in one row, positions
restarting at 0) and the same documents as right-padded rows give the same value:
- cross-entropy counts position t when token t+1 belongs to the same document (`next_token_mask`);
- KL counts every real token (its next-token distribution is defined by its own document's prefix).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _up(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 (bf16 logits are upcast; fp64 stays fp64 so tests can check to 1e-10)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def mse(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean squared error over real tokens; `student/teacher` `[B, T, D]`, `mask` `[B, T]` (1 = real)."""
    err = (_up(student) - _up(teacher)).pow(2).mean(-1)
    if mask is None:
        return err.mean()
    m = mask.to(err.dtype)
    return (err * m).sum() / m.sum().clamp(min=1)


def nmse(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor | None = None,
         eps: float = 1e-8) -> torch.Tensor:
    """MSE divided by the mean square of the teacher output: 1.0 means "as far as predicting zero",
    which makes layers with different output scales weigh the same in a sum over layers."""
    scale = mse(torch.zeros_like(teacher), teacher, mask).detach()
    return mse(student, teacher, mask) / (scale + eps)


LAYER_LOSSES = {"mse": mse, "nmse": nmse}


def next_token_mask(position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
                    shape: torch.Size) -> torch.Tensor:
    """`[B, T-1]` bool: logits at t predict token t+1, which must be real and in the same document
    (a packed document starts where its position id is 0)."""
    B, T = shape
    valid = torch.ones(B, T - 1, dtype=torch.bool)
    if position_ids is not None:
        valid = valid.to(position_ids.device) & (position_ids.expand(B, T)[:, 1:] != 0)
    if attention_mask is not None:
        m = attention_mask.bool()
        valid = valid.to(m.device) & m[:, 1:] & m[:, :-1]
    return valid


def token_mask(attention_mask: torch.Tensor | None, shape: torch.Size, device) -> torch.Tensor:
    """`[B, T]` bool of real tokens."""
    if attention_mask is None:
        return torch.ones(shape, dtype=torch.bool, device=device)
    return attention_mask.bool()


def causal_lm_ce(logits: torch.Tensor, input_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy averaged over `valid` `[B, T-1]` positions. logits `[B, T, V]`."""
    lg = _up(logits[:, :-1])
    tgt = input_ids[:, 1:].masked_fill(~valid, -100)
    n = valid.sum().clamp(min=1)
    return F.cross_entropy(lg.reshape(-1, lg.shape[-1]), tgt.reshape(-1), ignore_index=-100,
                           reduction="sum") / n


def kl_to_teacher(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor,
                  temperature: float = 1.0) -> torch.Tensor:
    """Forward KL(teacher || student) of the softened next-token distributions, mean over `mask`
    `[B, T]` tokens, times T^2 (so gradients keep their scale across temperatures, Hinton et al.)."""
    t = float(temperature)
    s = F.log_softmax(_up(student_logits) / t, dim=-1)
    p = F.log_softmax(_up(teacher_logits) / t, dim=-1)
    kl = (p.exp() * (p - s)).sum(-1)  # [B, T]
    m = mask.to(kl.dtype)
    return (kl * m).sum() / m.sum().clamp(min=1) * (t * t)


def perplexity_nll(logits: torch.Tensor, input_ids: torch.Tensor) -> tuple[float, int]:
    """(summed next-token NLL, number of predicted tokens) of one `[B, T]` window."""
    lg = _up(logits[:, :-1])
    nll = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), input_ids[:, 1:].reshape(-1), reduction="sum")
    return float(nll), input_ids[:, 1:].numel()
