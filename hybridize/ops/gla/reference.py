"""Gated linear attention op: S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T,  o_t = scale * S_t^T q_t.

Covers vanilla linear attention (`g=None`), scalar-per-head decay (`g` of shape `[B, T, H]`,
Mamba-2 / RetNet style) and GLA's per-key-channel decay (`g` of shape `[B, T, H, K]`); `g` is the
log of the decay (<= 0). Shapes: q, k `[B, T, H, K]`, v `[B, T, H, V]`, state `[N, H, K, V]`.

`naive_recurrent_gla` is the per-token ground truth. `chunk_gla` is chunkwise-parallel: inside a chunk the
pairwise decay exp(G_i - G_j) (j <= i, G the in-chunk cumulative log-decay) is formed explicitly,
so every exponent is <= 0 and nothing overflows however strong the decay; across chunks the state
is carried by a short loop. Same math as fla's `chunk_gla`, laid out for CPU PyTorch.
"""
from __future__ import annotations

import torch

from hybridize.ops.common.varlen import check_cu_seqlens, pack_to_padded, padded_to_pack


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


def naive_recurrent_gla(q, k, v, g=None, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
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


def chunk_gla(q, k, v, g=None, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
              chunk_size: int = 32):
    """Chunkwise-parallel form; equal to `naive_recurrent_gla` up to float rounding."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _run_varlen(_gla_chunk, q, k, v, g, initial_state, output_final_state, cu_seqlens,
                       scale=scale, chunk_size=chunk_size)


def _split_cumsum(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In-chunk cumulative log-decay G = hi + lo `[..., C, K]`; hi is detached, lo carries the gradient.

    With strong decays G reaches hundreds inside a chunk, and G_i - G_j formed from two fp32 values
    of that size loses ~1e-5 relative accuracy in exp(G_i - G_j) even when the difference is small.
    So the cumsum is taken in fp64 and split: hi (fp32) holds it to fp32 rounding, lo (fp32, |lo| <=
    ulp(hi)) the rest. exp(G_i - G_j) = exp(hi_i - hi_j) * exp(lo_i) * exp(-lo_j): the big `[C, C, K]`
    factor is one fp32 difference of detached tensors (no fp64, nothing saved for its backward) and
    the lo factors fold into q and k. Because every use of G takes hi + lo together, d/dlo = d/dG,
    so routing the gradient through lo alone is exact. For fp64 input, hi = G detached, lo = G - hi."""
    G = g.double().cumsum(-2) if g.dtype != torch.float64 else g.cumsum(-2)
    hi = G.detach().to(g.dtype)
    lo = (G - hi.to(G.dtype)).to(g.dtype)
    return hi, lo


#: largest in-chunk total log-decay for which the factorised scores are used (e^40 is far from fp32 overflow)
FACTORISED_MAX_SPAN = 40.0


def _intra_chunk_scores(qc, kc, hi, lo, causal):
    """A_ij = sum_d q_id k_jd exp(G_id - G_jd) for j <= i, `[B, H, n, C, C]`.

    Fast path: exp(G_i - G_j) = exp(G_i - G_0) * exp(G_0 - G_j) folds into q and k and A is one matmul;
    both factors are bounded by exp(span), span = G_0 - G_last, so it is taken for every chunk whose span is
    <= FACTORISED_MAX_SPAN (the usual case: gates near 1). The other chunks, and only those, get the pairwise
    decay tensor `[M, C, C, K]` (`_pairwise_scores`): formed for every chunk whenever one needed it,
    it would hold ~11 MB of autograd state per token (the 135M demo student training on the CPU)."""
    span = (hi[..., :1, :] - hi[..., -1:, :]).amax(-1).squeeze(-1)   # [B, H, n]
    strong = span > FACTORISED_MAX_SPAN
    rel = (hi - hi[..., :1, :]) + (lo - lo[..., :1, :])               # G_i - G_0 <= 0
    any_strong = bool(strong.any())
    if any_strong:   # those chunks' factors could overflow: zeroed here, their scores come from the pairwise form
        rel = rel.masked_fill(strong[..., None, None], 0.0)
    A = ((qc * rel.exp()) @ (kc * (-rel).exp()).transpose(-1, -2)).masked_fill(~causal, 0.0)
    if not any_strong:
        return A
    idx = strong.nonzero(as_tuple=True)
    return A.index_put(idx, _pairwise_scores(qc[idx], kc[idx], hi[idx], lo[idx], causal))


def _pairwise_scores(qc, kc, hi, lo, causal):
    """A `[M, C, C]` of M chunks `[M, C, K]` from the explicit pairwise decays, j > i masked before exp so every
    exponent is <= 0."""
    diff = (hi.unsqueeze(-2) - hi.unsqueeze(-3)).masked_fill(~causal[..., None], float("-inf"))
    return torch.einsum("mik,mjk,mijk->mij", qc * lo.exp(), kc * (-lo).exp(), diff.exp())


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
    hi, lo = _split_cumsum(gc)                          # in-chunk cumulative log-decay G = hi + lo
    G = hi + lo
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    A = _intra_chunk_scores(qc, kc, hi, lo, causal)
    o = A @ vc                                          # intra-chunk part

    q_dec = qc * G.exp()                                # read of the carried state
    G_last = G[..., -1:, :]                             # [B, H, n, 1, K]
    k_dec = kc * ((hi[..., -1:, :] - hi) + (lo[..., -1:, :] - lo)).exp()   # to the chunk-end state
    S = q.new_zeros(B, H, K, V, dtype=acc) if initial_state is None else initial_state.to(acc)
    inter = []
    for i in range(n):
        inter.append(q_dec[:, :, i] @ S)
        S = S * G_last[:, :, i, 0].exp().unsqueeze(-1) + k_dec[:, :, i].transpose(-1, -2) @ vc[:, :, i]
    o = o + torch.stack(inter, dim=2)
    o = o.permute(0, 2, 3, 1, 4).reshape(B, n * C, H, V)[:, :T]
    return o.to(v.dtype), (S if output_final_state else None)
