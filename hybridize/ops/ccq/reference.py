"""CCQ covariance read: Sigma_t q_t for every position (eq. 8-9, appendices B-C of
"Don't Read Everything: A Curvature-Conditioned Query for Linear Attention").

With unit-norm keys k_j, the running second moment and mean over the real tokens of a sequence are

    C_t = (1/t) sum_{j<=t} k_j k_j^T        mu_t = (1/t) sum_{j<=t} k_j        Sigma_t = C_t - mu_t mu_t^T

(token t itself included, no decay, t = number of real tokens so far), and the op returns
`Sigma_t q_t = C_t q_t - mu_t (mu_t^T q_t)`, shape `[B, T, H, K]` like q. The mixer forms
`q_clean = q - lambda_t * Sigma_t q_t`; nothing here touches the backbone.

- `naive_recurrent_ccq` is the ground truth, the paper's Algorithm 2: running-mean updates
  `C_t = C_{t-1} + (k k^T - C_{t-1}) / t`, `mu_t = mu_{t-1} + (k - mu_{t-1}) / t`.
- `chunk_ccq` is appendix B: `sum_j (k_j . q_t) k_j` is linear attention with values = keys and no
  decay (`chunk_gla(q, k, k)`), the key sum is a cumulative sum, and the 1/t and 1/t^2
  normalisations are applied after the products (eq. 21-22).

State (both forms): a tuple `(C [N, H, K, K], mu [N, H, K], t [N] int64)`, the normalised statistics
and the count, i.e. the paper's cache (C_t, mu_t) plus t. `mask` `[B, T]` bool marks real tokens:
padded tokens neither add to C/mu nor advance t, and their outputs are unspecified (zero where no
real token has been seen yet). `cu_seqlens` (packed, B == 1) restarts t, C, mu for every document.

Departure from the paper's Algorithm 1: its line 10 writes D = diag(1/t, ..., 1/(t+C)) with t the
count before the chunk, which would divide the first token by 0; we use the inclusive count of
Algorithm 2 / eq. 21 (position t divides by t, token t included), on which both algorithms agree.
"""
from __future__ import annotations

import torch

from hybridize.ops.gla.reference import acc_dtype, chunk_gla
from hybridize.ops.common.varlen import check_cu_seqlens, pack_to_padded, padded_to_pack

CCQStats = tuple  # (C [N, H, K, K], mu [N, H, K], t [N] int64)


def _check(q, k, mask):
    if q.shape != k.shape:
        raise ValueError(f"ccq needs q and k of the same shape [B, T, H, K] (repeat GQA keys first), "
                         f"got {tuple(q.shape)} and {tuple(k.shape)}")
    if mask is not None and mask.shape != q.shape[:2]:
        raise ValueError(f"mask must be [B, T] = {tuple(q.shape[:2])}, got {tuple(mask.shape)}")


def _start(q, initial_state):
    """Initial (C, mu, t) in the accumulation dtype; zeros when no state is given."""
    B, _, H, K = q.shape
    acc = acc_dtype(q)
    if initial_state is None:
        return (q.new_zeros(B, H, K, K, dtype=acc), q.new_zeros(B, H, K, dtype=acc),
                torch.zeros(B, dtype=torch.long, device=q.device))
    C, mu, t = initial_state
    if C.shape != (B, H, K, K) or mu.shape != (B, H, K) or t.shape != (B,):
        raise ValueError(f"initial_state must be (C [{B},{H},{K},{K}], mu [{B},{H},{K}], t [{B}]), got "
                         f"({tuple(C.shape)}, {tuple(mu.shape)}, {tuple(t.shape)})")
    return C.to(acc), mu.to(acc), t.to(device=q.device, dtype=torch.long)


def _run_varlen(fn, q, k, mask, initial_state, output_final_state, cu_seqlens, **kw):
    if cu_seqlens is None:
        return fn(q, k, mask, initial_state, output_final_state, **kw)
    check_cu_seqlens(q, cu_seqlens)
    real = torch.ones(q.shape[:2], dtype=torch.bool, device=q.device) if mask is None else mask.bool()
    pq, pk = pack_to_padded(q, cu_seqlens), pack_to_padded(k, cu_seqlens)
    pm = pack_to_padded(real, cu_seqlens, value=False)  # the right padding is not counted
    out, state = fn(pq, pk, pm, initial_state, output_final_state, **kw)
    return padded_to_pack(out, cu_seqlens), state


def naive_recurrent_ccq(q, k, mask=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    """Reference, one token at a time. q, k `[B, T, H, K]` -> (Sigma_t q_t `[B, T, H, K]`, stats or None)."""
    _check(q, k, mask)
    return _run_varlen(_ccq_recurrent, q, k, mask, initial_state, output_final_state, cu_seqlens)


def _ccq_recurrent(q, k, mask, initial_state, output_final_state):
    B, T, H, K = q.shape
    acc = acc_dtype(q)
    C, mu, t = _start(q, initial_state)
    C, mu = C.clone(), mu.clone()
    m = torch.ones(B, T, dtype=acc, device=q.device) if mask is None else mask.to(acc)
    qf, kf = q.to(acc), k.to(acc)
    out = []
    for i in range(T):
        t = t + m[:, i].long()
        # step 1/t on real tokens, 0 on padding (which then leaves C, mu untouched)
        w = (m[:, i] / t.clamp(min=1).to(acc)).view(B, 1, 1)
        ki = kf[:, i]
        C = C + w.unsqueeze(-1) * (ki.unsqueeze(-1) * ki.unsqueeze(-2) - C)
        mu = mu + w * (ki - mu)
        qi = qf[:, i]
        # C^T q, the linear-attention read convention (C is symmetric; this only fixes which
        # layout an initial state's gradient takes, the same as in the chunked form)
        cq = torch.einsum("bhlk,bhl->bhk", C, qi)
        out.append(cq - mu * (mu * qi).sum(-1, keepdim=True))
    o = torch.stack(out, dim=1) if T else qf.new_zeros(B, 0, H, K)
    return o.to(q.dtype), ((C, mu, t) if output_final_state else None)


def chunk_ccq(q, k, mask=None, initial_state=None, output_final_state=False, cu_seqlens=None,
              chunk_size: int = 32):
    """Chunkwise form (appendix B); equal to `naive_recurrent_ccq` up to float rounding. Same arguments."""
    _check(q, k, mask)
    return _run_varlen(_ccq_chunk, q, k, mask, initial_state, output_final_state, cu_seqlens,
                       chunk_size=chunk_size)


def _ccq_chunk(q, k, mask, initial_state, output_final_state, chunk_size):
    B, T, H, K = q.shape
    acc = acc_dtype(q)
    C0, mu0, t0 = _start(q, initial_state)
    m = torch.ones(B, T, dtype=acc, device=q.device) if mask is None else mask.to(acc)
    qf = q.to(acc)
    kf = k.to(acc) * m[:, :, None, None]              # padded keys add nothing to the sums
    t0f = t0.to(acc)
    # un-normalised sums carried into the sequence: t0 * C0 and t0 * mu0
    S0 = C0 * t0f.view(B, 1, 1, 1)
    M0 = mu0 * t0f.view(B, 1, 1)
    # sum_{j<=t} (k_j . q_t) k_j: linear attention with values = keys (eq. 21)
    Sq, S_end = chunk_gla(qf, kf, kf, None, scale=1.0, initial_state=S0, output_final_state=True,
                          chunk_size=chunk_size)
    M = M0.unsqueeze(1) + kf.cumsum(1)                 # running key sum [B, T, H, K]
    t = t0.unsqueeze(1) + m.long().cumsum(1)           # inclusive count [B, T]
    inv = 1.0 / t.clamp(min=1).to(acc).view(B, T, 1, 1)
    o = Sq * inv - M * (M * qf).sum(-1, keepdim=True) * inv.square()   # eq. 21 minus eq. 22
    if not output_final_state:
        return o.to(q.dtype), None
    t_end = t[:, -1] if T else t0
    inv_end = 1.0 / t_end.clamp(min=1).to(acc)
    M_end = M[:, -1] if T else M0
    return o.to(q.dtype), (S_end * inv_end.view(B, 1, 1, 1), M_end * inv_end.view(B, 1, 1), t_end)
