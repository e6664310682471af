"""Generalised (gated) delta rule with a separate erase direction p: DeltaNet, Gated DeltaNet, Q-Delta.

Per head, state S `[K, V]`, per token:

    S'  = exp(g_t) S_{t-1}                    (scalar log-decay g_t <= 0; g=None means no decay)
    u_t = v_t - S'^T p_t                      (prediction error read along the erase direction p)
    S_t = S' + beta_t k_t u_t^T               (written along the key k)
    o_t = scale * S_t^T q_t

i.e. S_t = exp(g_t) (I - beta_t k_t p_t^T) S_{t-1} + beta_t k_t v_t^T. `p = None` means p = k, which is
DeltaNet (g=None) / Gated DeltaNet. Q-Delta ("Q-Delta: Beyond Key-Value Associative State Evolution") is
p = x = k + lambda q: the paper writes S_t = alpha_t S_{t-1}(I - beta_t x_t k_t^T) + beta_t v_t k_t^T with
S `[V, K]`; this module holds the transpose. (fla-core calls this family Comba / DPLR.)

Q-Delta stability (the Q-Delta paper, Lemma 3.1): the erase map (I - beta k p^T) has eigenvalue 1 - beta_t a_t
along k with a_t = k_t . p_t; the hybrid error contracts when beta_t a_t in (0, 2). With q, k
L2-normalised, beta in (0, 1) and lambda in [0, 1], a_t = 1 + lambda cos(q_t, k_t) in [1 - lambda,
1 + lambda], so beta_t a_t lies in [0, 2) always (0 only at lambda = 1 and q = -k). The op does not
enforce it (it is exact for any inputs); `contraction_factor` computes beta_t a_t for monitoring.

Shapes: q, k, p `[B, T, H, K]`, v `[B, T, H, V]`, beta `[B, T, H]`, g `[B, T, H]` or None, lam `[H]` or None
(instead of p: Q-Delta's p = k + lam q, formed by the op so the GPU path can fuse it into one pass),
initial/final state `[N, H, K, V]`, packed input: B == 1 with `cu_seqlens` `[N+1]`.

`naive_recurrent_delta` is the per-token ground truth. `chunk_delta` is the chunkwise WY / UT-transform
form, derived here for p != k. Inside one chunk with start state S0, let G_t = sum_{s<=t} g_s
(in-chunk cumulative log-decay) and gamma_t = exp(G_t). Unrolling the recurrence gives

    S_t = gamma_t S0 + sum_{s<=t} exp(G_t - G_s) k_s w_s^T,        w_s := beta_s u_s.

Substituting S_{t-1} into u_t = v_t - exp(g_t) S_{t-1}^T p_t:

    w_t + sum_{s<t} beta_t exp(G_t - G_s) (p_t . k_s) w_s = beta_t v_t - beta_t gamma_t S0^T p_t,

so with the strictly lower-triangular A_ts = beta_t exp(G_t - G_s) (p_t . k_s)  (s < t) and the UT
transform T = (I + A)^{-1} (a unit lower-triangular solve):

    W = U - Wd S0,   U = T diag(beta) V,   Wd = T diag(beta * gamma) P.

p enters only the erase side (A and Wd); k the write side. Then, per chunk,

    O   = scale * [ diag(gamma) Q S0 + (M o exp(G_t - G_s) o Q K^T) W ]     (M: s <= t)
    S_C = gamma_C S0 + (K o exp(G_C - G))^T W.

With p = k this is the WY form of DeltaNet / Gated DeltaNet. Every exponent is G_t - G_s with
s <= t (or G_t itself), hence <= 0: no overflow however strong the decay. U and Wd are computed for
all chunks at once; only W, O and the carried state need the short loop over chunks. Computed in fp32
(fp64 when the inputs are fp64), returned in v's dtype; gradients come from autograd.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridize.ops.gla.reference import acc_dtype
from hybridize.ops.common.varlen import check_cu_seqlens, pack_to_padded, padded_to_pack


def contraction_factor(k: torch.Tensor, beta: torch.Tensor, p: torch.Tensor | None = None) -> torch.Tensor:
    """beta_t * (k_t . p_t) `[B, T, H]`: Q-Delta's one-step contraction holds where it lies in (0, 2)."""
    p = k if p is None else p
    return beta.float() * (k.float() * p.float()).sum(-1)


def _check(q, k, v, beta, g, p, initial_state):
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k {tuple(k.shape)} must match q {tuple(q.shape)}; repeat GQA heads before the op")
    if v.shape[:3] != (B, T, H):
        raise ValueError(f"v {tuple(v.shape)} must be [B, T, H, V] with B, T, H of q {tuple(q.shape)}")
    if beta.shape != (B, T, H):
        raise ValueError(f"beta must be [B, T, H] = {(B, T, H)}, got {tuple(beta.shape)}")
    if g is not None and g.shape != (B, T, H):
        raise ValueError(f"g must be a scalar log-decay per head [B, T, H] = {(B, T, H)}, got {tuple(g.shape)}")
    if p is not None and p.shape != k.shape:
        raise ValueError(f"p must have k's shape {tuple(k.shape)}, got {tuple(p.shape)}")
    if initial_state is not None and initial_state.shape[1:] != (H, K, v.shape[-1]):
        raise ValueError(f"initial_state must be [N, H, K, V] = [N, {H}, {K}, {v.shape[-1]}], "
                         f"got {tuple(initial_state.shape)}")


def check_erase(q: torch.Tensor, p, lam) -> None:
    """The erase direction comes as p or as lam (p = k + lam q, lam `[H]`), never both."""
    if lam is None:
        return
    if p is not None:
        raise ValueError("give the erase direction as p or as lam (p = k + lam q), not both")
    if lam.shape != (q.shape[2],):
        raise ValueError(f"lam must hold one value per head [H] = [{q.shape[2]}], got {tuple(lam.shape)}")


def query_erase(q: torch.Tensor, k: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """Q-Delta's erase direction p = k + lam q `[B, T, H, K]` for lam `[H]` (in q's dtype)."""
    check_erase(q, None, lam)
    return k + lam.to(k.dtype)[:, None] * q


def _run(fn, q, k, v, beta, g, p, scale, initial_state, output_final_state, cu_seqlens, lam=None, **kw):
    """Shared front end: checks, defaults, and packed input routed through the padded batch form."""
    check_erase(q, p, lam)
    if lam is not None:
        p = query_erase(q, k, lam)
    _check(q, k, v, beta, g, p, initial_state)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if cu_seqlens is None:
        return fn(q, k, v, beta, g, p, scale, initial_state, output_final_state, **kw)
    check_cu_seqlens(q, cu_seqlens)
    if initial_state is not None and initial_state.shape[0] != len(cu_seqlens) - 1:
        raise ValueError(f"initial_state has {initial_state.shape[0]} rows but cu_seqlens holds "
                         f"{len(cu_seqlens) - 1} sequences; give one state per sequence")
    # right padding with beta = 0, k = 0, g = 0 leaves each sequence's state untouched
    pq, pk, pv, pb, pg, pp = (pack_to_padded(t, cu_seqlens) for t in (q, k, v, beta, g, p))
    o, state = fn(pq, pk, pv, pb, pg, pp, scale, initial_state, output_final_state, **kw)
    return padded_to_pack(o, cu_seqlens), state


def naive_recurrent_delta(q, k, v, beta, g=None, p=None, scale=None, initial_state=None, output_final_state=False,
                          cu_seqlens=None, lam=None):
    """Reference: one token at a time. Returns (o `[B, T, H, V]`, final state `[N, H, K, V]` or None)."""
    return _run(_delta_recurrent, q, k, v, beta, g, p, scale, initial_state, output_final_state, cu_seqlens,
                lam=lam)


def _delta_recurrent(q, k, v, beta, g, p, scale, initial_state, output_final_state):
    B, T, H, K = q.shape
    V = v.shape[-1]
    acc = acc_dtype(q)
    qf, kf, vf, bf = q.to(acc) * scale, k.to(acc), v.to(acc), beta.to(acc)
    pf = kf if p is None else p.to(acc)
    S = q.new_zeros(B, H, K, V, dtype=acc) if initial_state is None else initial_state.to(acc).clone()
    o = torch.empty(B, T, H, V, dtype=acc, device=q.device)
    for t in range(T):
        if g is not None:
            S = S * g[:, t].to(acc).exp()[..., None, None]
        u = vf[:, t] - torch.einsum("bhk,bhkv->bhv", pf[:, t], S)
        S = S + (bf[:, t, :, None] * kf[:, t]).unsqueeze(-1) * u.unsqueeze(-2)
        o[:, t] = torch.einsum("bhk,bhkv->bhv", qf[:, t], S)
    return o.to(v.dtype), (S if output_final_state else None)


def chunk_delta(q, k, v, beta, g=None, p=None, scale=None, initial_state=None, output_final_state=False,
                cu_seqlens=None, chunk_size: int = 32, lam=None):
    """Chunkwise WY / UT-transform form (module docstring); equal to `naive_recurrent_delta` up to rounding."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return _run(_delta_chunk, q, k, v, beta, g, p, scale, initial_state, output_final_state, cu_seqlens,
                lam=lam, chunk_size=chunk_size)


def _delta_chunk(q, k, v, beta, g, p, scale, initial_state, output_final_state, chunk_size):
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    n = (T + C - 1) // C
    pad = n * C - T
    acc = acc_dtype(q)

    def chunked(x):  # [B, T, H, ...] -> [B, H, n, C, ...], zero-padded at the end (beta = 0: no-op)
        x = x.to(acc)
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
        return x.view(B, n, C, H, *x.shape[3:]).transpose(1, 3).transpose(2, 3)

    qc, kc, vc, bc = chunked(q) * scale, chunked(k), chunked(v), chunked(beta)   # bc [B, H, n, C]
    pc = kc if p is None else chunked(p)
    G = chunked(g).cumsum(-1) if g is not None else torch.zeros_like(bc)        # [B, H, n, C]

    ones = torch.ones(C, C, dtype=torch.bool, device=q.device)
    incl, strict = ones.tril(), ones.tril(-1)
    diff = G.unsqueeze(-1) - G.unsqueeze(-2)                                      # G_t - G_s
    # mask before exp: above the diagonal G_t - G_s >= 0 could overflow
    dec_incl = diff.masked_fill(~incl, float("-inf")).exp()
    dec_strict = diff.masked_fill(~strict, float("-inf")).exp()

    A = bc.unsqueeze(-1) * dec_strict * (pc @ kc.transpose(-1, -2))              # [B, H, n, C, C]
    eye = torch.eye(C, dtype=acc, device=q.device)
    rhs = torch.cat([bc.unsqueeze(-1) * vc, (bc * G.exp()).unsqueeze(-1) * pc], dim=-1)
    sol = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    U, Wd = sol[..., :V], sol[..., V:]                                            # [.., C, V], [.., C, K]

    Aqk = dec_incl * (qc @ kc.transpose(-1, -2))                                  # [B, H, n, C, C]
    q_dec = qc * G.exp().unsqueeze(-1)                                            # reads S0
    G_last = G[..., -1:]                                                          # [B, H, n, 1]
    k_dec = kc * (G_last - G).exp().unsqueeze(-1)                                 # writes to chunk end

    S = q.new_zeros(B, H, K, V, dtype=acc) if initial_state is None else initial_state.to(acc)
    out = []
    for i in range(n):
        W = U[:, :, i] - Wd[:, :, i] @ S
        out.append(q_dec[:, :, i] @ S + Aqk[:, :, i] @ W)
        S = S * G_last[:, :, i].exp().unsqueeze(-1) + k_dec[:, :, i].transpose(-1, -2) @ W
    o = torch.stack(out, dim=2)                                                   # [B, H, n, C, V]
    o = o.permute(0, 2, 3, 1, 4).reshape(B, n * C, H, V)[:, :T]
    return o.to(v.dtype), (S if output_final_state else None)
