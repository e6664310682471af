"""Attention-map transfer on the kept softmax layers: stage B's `attn_weight` term.

    attn = mean over kept layers l, heads h, sampled query rows q of  KL(A_t[l, h, q, :] || A_s[l, h, q, :])

`A[l, h, q, :]` is layer l's softmax attention of query row q over the keys it may see (causal, inside its own
document of a packed row, not on padding). Why: a hybrid that keeps a teacher's softmax layers can still lose
retrieval, because the converted layers below them change the hidden states those layers read their queries and
keys from (`hybridize eval needle-attention`: on the demo student the kept layers' retrieving heads put 5-8% of
their attention on the needle where the teacher's put 70%); matching the hidden states entering those layers
(`hidden_weight`) did not bring S-NIAH-2/3 back on the GPU variants (RESULTS.md, recovery (vii)). This term asks
for the attention pattern itself. It follows the attention-transfer idea of "LoLCATs: On Low-Rank Linearizing of
Large Language Models" and the matrix-orientation stage of "Transformers to SSMs: Distilling Quadratic Knowledge to
Subquadratic Models" (MOHAWK), departing from both: it matches the layers that stay softmax attention, not the
converted ones, and only on `queries` sampled rows per micro-batch (a `[B, H, Q, T]` map instead of `[B, H, T, T]`):
any position, or (`attn_rows=repeats`) positions whose token occurred earlier in the document, where a copy can be.

How the queries and keys are read: both models run with the attention implementation `ATTENTION` registered in
transformers' `AttentionInterface` (and its mask function in `AttentionMaskInterface`). It computes the output
with transformers' SDPA function and, while a `record` block is open, keeps the post-rotary queries and keys of
the named layers. Between `record` blocks (e.g. a gradient-checkpoint recompute) it is plain SDPA. Assumes
full causal attention in the kept layers (no sliding window).
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .models import attention_implementation

ATTENTION = "hybridize_attention_probe"


@dataclass
class Recording:
    """The post-rotary queries `[B, H, T, D]` and keys `[B, Hkv, T, D]` and the scale of each recorded layer."""
    layers: frozenset
    queries: dict = field(default_factory=dict)
    keys: dict = field(default_factory=dict)
    scaling: dict = field(default_factory=dict)


_ACTIVE: contextvars.ContextVar[Recording | None] = contextvars.ContextVar("hybridize_attention_recording",
                                                                           default=None)


def _probe_forward(module: nn.Module, query, key, value, attention_mask, dropout: float = 0.0,
                   scaling: float | None = None, **kwargs):
    rec = _ACTIVE.get()
    if rec is not None and getattr(module, "layer_idx", None) in rec.layers:
        i = module.layer_idx
        rec.queries[i], rec.keys[i] = query, key
        rec.scaling[i] = scaling if scaling is not None else query.shape[-1] ** -0.5
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


AttentionInterface.register(ATTENTION, _probe_forward)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def probe_attention(*models: nn.Module):
    """The models run `ATTENTION` (SDPA plus recording) inside the block, their own implementation after it."""
    return attention_implementation(ATTENTION, *models)


@contextlib.contextmanager
def record(layers: list[int]):
    """Keep the queries and keys of `layers` of every forward inside the block (a `Recording`)."""
    rec = Recording(frozenset(layers))
    token = _ACTIVE.set(rec)
    try:
        yield rec
    finally:
        _ACTIVE.reset(token)


def repeats(input_ids: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
    """`[B, T]` bool: the token at this position already occurred earlier in its document. There a model can copy
    what followed it then (an induction step), which is where retrieving heads act."""
    B, T = input_ids.shape
    key = doc * (int(input_ids.max()) + 1) + input_ids                     # one id per (document, token)
    order = torch.argsort(key * T + torch.arange(T, device=key.device), dim=-1)   # by key, then position
    sk = key.gather(1, order)
    seen = torch.zeros_like(sk, dtype=torch.bool)
    seen[:, 1:] = sk[:, 1:] == sk[:, :-1]
    return torch.zeros_like(seen).scatter_(1, order, seen)


def sample_queries(position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, shape: tuple,
                   n: int, min_keys: int = 16, input_ids: torch.Tensor | None = None,
                   device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows `[B, Q]`, keys `[B, Q, T]` bool): Q query positions per row drawn uniformly among the positions that
    see at least `min_keys` keys, and the keys each may attend to (causal, its own document of a packed row whose
    `position_ids` restart at 0, not padding). With `input_ids` only positions whose token occurred earlier in
    the document (`repeats`) are drawn, where a row has any. A row with fewer candidates repeats them. `device`:
    where the rows go (the batch's; default: that of the first tensor given, else the CPU)."""
    B, T = shape
    if device is None:
        device = next((t.device for t in (position_ids, attention_mask, input_ids) if t is not None),
                      torch.device("cpu"))
    pos = position_ids.expand(B, T) if position_ids is not None else torch.arange(T, device=device).expand(B, T)
    valid = torch.ones(B, T, dtype=torch.bool, device=device) if attention_mask is None else attention_mask.bool()
    if attention_mask is not None and position_ids is None:   # padded rows: count only real tokens
        pos = valid.long().cumsum(-1) - 1
    doc = (pos == 0).long().cumsum(-1)                         # [B, T] document index (restarts at position 0)
    seen = pos + 1                                             # keys a query sees inside its document
    cand = valid & (seen >= min(min_keys, int(seen.max())))
    rep = repeats(input_ids, doc) & cand if input_ids is not None else None
    rows = []
    for b in range(B):
        idx = (rep[b] if rep is not None and rep[b].any() else cand[b]).nonzero().squeeze(-1)
        if idx.numel() == 0:
            idx = valid[b].nonzero().squeeze(-1)
        rows.append(idx[torch.randint(idx.numel(), (n,), device=device)] if idx.numel() > n
                    else idx.repeat((n + idx.numel() - 1) // idx.numel())[:n])
    q = torch.stack(rows)                                      # [B, Q]
    k = torch.arange(T, device=device)
    same_doc = doc.gather(1, q)[:, :, None] == doc[:, None, :]
    keys = (k[None, None, :] <= q[:, :, None]) & same_doc & valid[:, None, :]
    return q, keys


def attention_logprobs(rec: Recording, layer: int, rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """log A `[B, H, Q, T]` (fp32) of layer `layer` at the query `rows` `[B, Q]`, masked keys at -inf."""
    q, k = rec.queries[layer], rec.keys[layer]                  # [B, H, T, D], [B, Hkv, T, D]
    B, H, _, D = q.shape
    q = q.gather(2, rows[:, None, :, None].expand(B, H, rows.shape[1], D))
    k = k.repeat_interleave(H // k.shape[1], dim=1)
    logits = (q.float() @ k.float().transpose(-1, -2)) * rec.scaling[layer]
    return logits.masked_fill(~keys[:, None], float("-inf")).log_softmax(-1)


def attention_kl(student_rec: Recording, teacher_rec: Recording, layers: list[int], rows: torch.Tensor,
                 keys: torch.Tensor) -> torch.Tensor:
    """Mean over `layers`, heads and rows of KL(teacher's attention || student's), in nats."""
    missing = [i for i in layers if i not in student_rec.queries or i not in teacher_rec.queries]
    if missing:
        raise RuntimeError(f"no queries recorded for layers {missing}: run both models inside probe_attention()")
    kls = []
    for i in layers:
        lt = attention_logprobs(teacher_rec, i, rows, keys)
        ls = attention_logprobs(student_rec, i, rows, keys)
        pt = lt.exp()
        kls.append(torch.where(keys[:, None], pt * (lt - ls), 0.0).sum(-1).mean())
    return torch.stack(kls).mean()
