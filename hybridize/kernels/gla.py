"""Gated linear attention op: S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T,  o_t = scale * S_t^T q_t.

Covers vanilla linear attention (`g=None`), scalar-per-head decay (`g` of shape `[B, T, H]`,
Mamba-2 / RetNet style) and GLA's per-key-channel decay (`g` of shape `[B, T, H, K]`); `g` is the
log of the decay (<= 0). Shapes: q, k `[B, T, H, K]`, v `[B, T, H, V]`, state `[N, H, K, V]`.

`gla_recurrent` is the per-token ground truth. `gla_chunk` is chunkwise-parallel: inside a chunk the
pairwise decay exp(G_i - G_j) (j <= i, G the in-chunk cumulative log-decay) is formed explicitly,
so every exponent is <= 0 and nothing overflows however strong the decay; across chunks the state
is carried by a short loop. Same math as fla's `chunk_gla`, laid out for CPU PyTorch.
"""
from __future__ import annotations

import torch

from .varlen import check_cu_seqlens, pack_to_padded, padded_to_pack


def acc_dtype(x: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: fp32, or fp64 when the caller asked for it (tests)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _expand_gate(g: torch.Tensor | None, k: torch.Tensor) -> torch.Tensor:
    if g is None:
        return torch.zeros_like(k, dtype=acc_dtype(k))
    g = g.to(acc_dtype(k))
    return g.unsqueeze(-1).expand_as(k) if g.dim() == 3 else g


def _run_varlen(fn, q, k, v, g, initial_state, output_final_state, cu_seqlens, **kw):
    """Route packed input through the padded-batch implementation `fn`."""
    if cu_seqlens is None:
        return fn(q, k, v, g, initial_state, output_final_state, **kw)
    check_cu_seqlens(q, cu_seqlens)
    pq, pk, pv = (pack_to_padded(t, cu_seqlens) for t in (q, k, v))
    pg = pack_to_padded(g, cu_seqlens)
    o, state = fn(pq, pk, pv, pg, initial_state, output_final_state, **kw)
    return padded_to_pack(o, cu_seqlens), state


def gla_recurrent(q, k, v, g=None, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    """Reference: one token at a time. Returns (o `[B, T, H, V]`, final state `[N, H, K, V]` or None)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _run_varlen(_gla_recurrent, q, k, v, g, initial_state, output_final_state, cu_seqlens, scale=scale)


def _gla_recurrent(q, k, v, g, initial_state, output_final_state, scale):
    B, T, H, K = q.shape
    V = v.shape[-1]
    acc = acc_dtype(q)
    qf, kf, vf = q.to(acc) * scale, k.to(acc), v.to(acc)
    gf = _expand_gate(g, k)
    S = q.new_zeros(B, H, K, V, dtype=acc) if initial_state is None else initial_state.to(acc).clone()
    o = torch.empty(B, T, H, V, dtype=acc, device=q.device)
    for t in range(T):
        S = S * gf[:, t].exp().unsqueeze(-1) + kf[:, t].unsqueeze(-1) * vf[:, t].unsqueeze(-2)
        o[:, t] = torch.einsum("bhk,bhkv->bhv", qf[:, t], S)
    return o.to(v.dtype), (S if output_final_state else None)


def gla_chunk(q, k, v, g=None, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
              chunk_size: int = 32):
    """Chunkwise-parallel form; equal to `gla_recurrent` up to float rounding."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _run_varlen(_gla_chunk, q, k, v, g, initial_state, output_final_state, cu_seqlens,
                       scale=scale, chunk_size=chunk_size)


class _SplitCumsum:
    """In-chunk cumulative log-decay G `[..., C, K]` that can form differences G_i - G_j accurately.

    With strong decays G reaches hundreds inside a chunk; G_i - G_j computed from two fp32 values
    of that size loses ~1e-5 relative accuracy in exp(G_i - G_j) even when the difference is small.
    So the cumsum is taken in fp64 and kept as hi + lo fp32 parts (lo carries the gradient, hi is
    detached): differences of the hi parts are exact to the difference's own rounding, and no
    `[C, C, K]`-sized fp64 tensor is ever formed. For fp64 input it is a plain fp64 cumsum."""

    def __init__(self, g: torch.Tensor):
        if g.dtype == torch.float64:
            self.value, self.hi, self.lo = g.cumsum(-2), None, None
            return
        G64 = g.double().cumsum(-2)
        self.hi = G64.detach().to(g.dtype)
        self.lo = (G64 - self.hi.double()).to(g.dtype)
        self.value = self.hi + self.lo

    def minus(self, di: int, dj: int) -> torch.Tensor:
        """G_i - G_j broadcast as `[..., C_i, C_j, K]` (i along dim `di`, j along `dj` after unsqueeze)."""
        if self.hi is None:
            return self.value.unsqueeze(di) - self.value.unsqueeze(dj)
        return (self.hi.unsqueeze(di) - self.hi.unsqueeze(dj)) + (self.lo.unsqueeze(di) - self.lo.unsqueeze(dj))

    def minus_last(self) -> torch.Tensor:
        """G_last - G_j `[..., C, K]` (decay from each position to the chunk end)."""
        if self.hi is None:
            return self.value[..., -1:, :] - self.value
        return (self.hi[..., -1:, :] - self.hi) + (self.lo[..., -1:, :] - self.lo)


def _gla_chunk(q, k, v, g, initial_state, output_final_state, scale, chunk_size):
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    n = (T + C - 1) // C
    pad = n * C - T
    acc = acc_dtype(q)
    gf = _expand_gate(g, k)

    def chunked(x):  # [B, T, H, D] -> [B, H, n, C, D], zero-padded at the end
        x = torch.nn.functional.pad(x.to(acc), (0, 0, 0, 0, 0, pad))
        return x.view(B, n, C, H, -1).permute(0, 3, 1, 2, 4)

    qc, kc, vc, gc = chunked(q) * scale, chunked(k), chunked(v), chunked(gf)
    G = _SplitCumsum(gc)                                # in-chunk cumulative log-decay
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    # pairwise decay exp(G_i - G_j) for j <= i, per key channel: [B, H, n, C, C, K]
    diff = G.minus(-2, -3).masked_fill(~causal[..., None], float("-inf"))
    A = torch.einsum("bhnik,bhnjk,bhnijk->bhnij", qc, kc, diff.exp())
    o = A @ vc                                          # intra-chunk part

    q_dec = qc * G.value.exp()                          # read of the carried state
    G_last = G.value[..., -1:, :]                       # [B, H, n, 1, K]
    k_dec = kc * G.minus_last().exp()                   # contribution to the chunk-end state
    S = q.new_zeros(B, H, K, V, dtype=acc) if initial_state is None else initial_state.to(acc)
    inter = []
    for i in range(n):
        inter.append(q_dec[:, :, i] @ S)
        S = S * G_last[:, :, i, 0].exp().unsqueeze(-1) + k_dec[:, :, i].transpose(-1, -2) @ vc[:, :, i]
    o = o + torch.stack(inter, dim=2)
    o = o.permute(0, 2, 3, 1, 4).reshape(B, n * C, H, V)[:, :T]
    return o.to(v.dtype), (S if output_final_state else None)
