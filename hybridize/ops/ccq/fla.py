"""CCQ's GPU wrappers: our fused Triton read and cleaning (`triton_read.py`, `triton_clean.py`) and `chunk_ccq`,
the read through fla-core's `chunk_gla` (values = keys; kept as the comparison path). Registered with dispatch
by `hybridize.ops.gpu` (GPU paths: `ops/common/fla_adapter.py`).
"""
from __future__ import annotations

import torch

from hybridize.ops.common.fla_adapter import fallback, fla, long_cu, unsupported
from hybridize.ops.gla.fla import gate_for_keys


def cumsum_time(x, block: int = 128):
    """`x.cumsum(1)` for x `[B, T, ...]`, as a two-level scan (within blocks of `block` steps, then over
    block totals). PyTorch scans a non-innermost dim sequentially per column: with T = 64k and
    H * K = 2048 columns that took ~30 ms on an H100 (first device run); this takes T / block + block
    sequential steps instead of T."""
    B, T = x.shape[:2]
    n = -(-T // block)
    if n <= 1:
        return x.cumsum(1)
    pad = n * block - T
    xp = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, pad)) if pad else x
    inner = xp.reshape(B, n, block, *x.shape[2:]).cumsum(2)
    totals = inner[:, :, -1]
    offsets = totals.cumsum(1) - totals                                     # exclusive scan over blocks
    return (inner + offsets.unsqueeze(2)).reshape(B, n * block, *x.shape[2:])[:, :T]


def chunk_ccq(q, k, mask=None, initial_state=None, output_final_state=False, cu_seqlens=None, chunk_size=None):
    """Sigma_t q_t = C_t q_t - mu_t (mu_t . q_t); C_t q_t is linear attention with values = keys."""
    if (unsupported(q, k) or (mask is not None and cu_seqlens is not None)
            or (cu_seqlens is not None and bool((cu_seqlens[1:] == cu_seqlens[:-1]).any()))):
        return fallback("ccq", "chunk", q, k, mask=mask, initial_state=initial_state,
                         output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    B, T, H, K = q.shape
    cu = long_cu(cu_seqlens)
    nseq = B if cu is None else len(cu) - 1
    m = torch.ones(B, T, device=q.device) if mask is None else mask.float()
    kf = k.float() * m[:, :, None, None]
    if initial_state is None:
        S0, M0 = None, q.new_zeros(nseq, H, K, dtype=torch.float32)
        t0 = torch.zeros(nseq, dtype=torch.long, device=q.device)
    else:
        C0, mu0, t0 = initial_state
        t0 = t0.to(device=q.device, dtype=torch.long)
        S0 = C0.float() * t0.float().view(-1, 1, 1, 1)
        M0 = mu0.float() * t0.float().view(-1, 1, 1)
    kb = k if mask is None else kf.to(q.dtype)
    Sq, S_end = fla().chunk_gla(q.contiguous(), kb.contiguous(), kb.contiguous(), gate_for_keys(None, q),
                                scale=1.0, initial_state=S0, output_final_state=True, cu_seqlens=cu)
    Sq = Sq.float()
    if cu is None:
        M = M0.unsqueeze(1) + cumsum_time(kf)                               # [B, T, H, K]
        t = t0.unsqueeze(1) + m.long().cumsum(1)                            # [B, T]
    else:  # restart the running sums at every document start
        seq = torch.repeat_interleave(torch.arange(nseq, device=q.device), cu[1:] - cu[:-1])
        csum = cumsum_time(kf)[0]                                           # [T, H, K]
        before = torch.cat([csum.new_zeros(1, H, K), csum])[cu[:-1]]        # [N, H, K] sum before start
        M = (csum - before[seq] + M0[seq]).unsqueeze(0)
        pos = torch.arange(T, device=q.device) - cu[:-1][seq] + 1
        t = (pos + t0[seq]).unsqueeze(0)
    inv = 1.0 / t.clamp(min=1).float().view(B, T, 1, 1)
    o = Sq * inv - M * (M * q.float()).sum(-1, keepdim=True) * inv.square()
    if not output_final_state:
        return o.to(q.dtype), None
    if cu is None:
        t_end, M_end = t[:, -1], M[:, -1]
    else:
        last = cu[1:] - 1
        t_end, M_end = t[0, last], M[0, last]
    inv_end = 1.0 / t_end.clamp(min=1).float()
    return o.to(q.dtype), (S_end * inv_end.view(-1, 1, 1, 1), M_end * inv_end.view(-1, 1, 1), t_end)


def ccq_fused(*args, **kwargs):
    from hybridize.ops.ccq.triton_read import ccq_triton  # imports triton on the first CUDA call only
    return ccq_triton(*args, **kwargs)


def ccq_clean_fused(*args, **kwargs):
    from hybridize.ops.ccq.triton_clean import ccq_clean_fused as fused  # imports triton on the first CUDA call only
    return fused(*args, **kwargs)


def ccq_clean_fused_chunk(*args, **kwargs):
    from hybridize.ops.ccq.triton_clean import ccq_clean_fused_chunk as fused  # the chunk read cleans in its epilogue
    return fused(*args, **kwargs)
