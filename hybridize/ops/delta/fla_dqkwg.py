"""PyTorch replacement for fla-core's gated `chunk_bwd_dqkwg` (the kernel fla issue #640 is about).

fla-core 0.6.0 raises in `fla.ops.common.chunk_o.chunk_bwd_dqkwg` whenever a gate `g` is given on a
Hopper GPU with Triton >= 3.4 and < 3.7.1, because that Triton miscompiles the kernel. The kernel is
chunk-local (no recurrence), so this module computes the same quantities with batched matmuls in fp32
over all chunks at once; everything else in fla's backward (the state recurrences, the WY backward)
stays fla's. `patched(module)` swaps it in for one call of fla's backward only: fla's own public ops
keep their guard.

Per chunk c (chunk-start state h `[K, V]`, its gradient dh, in-chunk cumulative log2-decay b `[C]`,
last valid position l, e = 2^b; all products masked to valid positions, causal s <= t):

    dq  = scale * e_t * (do h^T)_t + sum_{s<=t} ds_ts k_s       ds_ts = scale * 2^(b_t - b_s) do_t . v_s
    dk  = 2^(b_l - b_s) (v dh^T)_s + sum_{t>=s} ds_ts q_t
    dw  = -(dv h^T)
    dg  = rowsum(dq * q) - rowsum(dk * k), plus 2^(b_l) sum(h * dh) + sum(dk_inter * k) at position l,

the gradient with respect to the natural-log in-chunk cumulative decay (fla reverses the cumsum next).
Shapes: q, k, w `[B, T, H, K]`, v (= v_new), do, dv `[B, T, H, V]`, g `[B, T, H]` fp32,
h, dh `[B * NT or total chunks, H, K, V]`; packed input (B == 1) via cu_seqlens / chunk_indices.
"""
from __future__ import annotations

import contextlib

import torch


def chunk_token_index(T: int, B: int, chunk_size: int, cu_seqlens, device):
    """(index `[NC, C]` into the flattened B*T tokens, valid `[NC, C]` bool), chunks sequence-major
    (fla's order: chunk i of sequence n is global chunk number n * NT + i, or the chunk_indices order)."""
    if cu_seqlens is None:
        cu = torch.arange(B + 1, device=device, dtype=torch.long) * T
    else:
        cu = cu_seqlens.to(device=device, dtype=torch.long)
    lens = cu[1:] - cu[:-1]
    nchunks = (lens + chunk_size - 1) // chunk_size
    seq = torch.repeat_interleave(torch.arange(len(lens), device=device), nchunks)
    first = torch.cumsum(nchunks, 0) - nchunks
    within = torch.arange(int(nchunks.sum()), device=device) - first[seq]
    start = cu[seq] + within * chunk_size
    index = start[:, None] + torch.arange(chunk_size, device=device)
    valid = index < cu[seq + 1][:, None]
    return index.clamp(max=max(int(cu[-1]) - 1, 0)), valid


def chunk_bwd_dqkwg_torch(q, k, v, do, h, dh, w=None, g=None, g_gamma=None, dv=None, scale=None,
                          state_v_first=False, cu_seqlens=None, chunk_size=64, chunk_indices=None):
    """Same signature and results as fla's `chunk_bwd_dqkwg` (H == HV, K-major state, g or no gate)."""
    if g_gamma is not None or state_v_first:
        raise NotImplementedError("chunk_bwd_dqkwg_torch supports g (or none) and the [K, V] state layout only")
    B, T, H, K = k.shape
    if v.shape[2] != H:
        raise NotImplementedError("chunk_bwd_dqkwg_torch does not support grouped value heads")
    scale = K ** -0.5 if scale is None else scale
    C = chunk_size
    index, valid = chunk_token_index(T, B, C, cu_seqlens, q.device)            # [NC, C]
    NC = index.shape[0]
    m = valid.float()[..., None, None]                                          # [NC, C, 1, 1]

    def gather(x):  # [B, T, H, D] -> [NC, C, H, D] fp32, zero where invalid
        return x.reshape(B * T, *x.shape[2:]).float()[index] * m

    qc, kc, vc, doc = gather(q), gather(k), gather(v), gather(do)
    hc = h.reshape(NC, H, K, -1).float()
    dhc = dh.reshape(NC, H, K, -1).float()
    dq = torch.einsum("cihv,chkv->cihk", doc, hc)
    dk = torch.einsum("cihv,chkv->cihk", vc, dhc)
    ds = torch.einsum("cihv,cjhv->chij", doc, vc)                              # [NC, H, C, C]
    dw = None
    if w is not None:
        dw = -torch.einsum("cihv,chkv->cihk", gather(dv), hc)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    keep = causal & valid[:, :, None] & valid[:, None, :]                      # [NC, C, C]
    dg = None
    if g is not None:
        b = g.reshape(B * T, H).float()[index] * valid.float()[..., None]      # [NC, C, H]
        last = valid.sum(1) - 1                                                 # [NC]
        b_last = b.gather(1, last.view(NC, 1, 1).expand(NC, 1, H))             # [NC, 1, H]
        dg_last = (hc * dhc).sum((-1, -2)) * torch.exp2(b_last[:, 0])          # [NC, H]
        dq = dq * (torch.exp2(b) * scale)[..., None]
        dk = dk * (torch.exp2(b_last - b) * valid.float()[..., None])[..., None]
        dg_last = dg_last + (dk * kc).sum((1, 3))
        diff = (b.transpose(1, 2)[:, :, :, None] - b.transpose(1, 2)[:, :, None, :])  # [NC, H, C, C]
        diff = diff.masked_fill(~keep[:, None], float("-inf"))
        ds = ds * torch.exp2(diff) * scale
    else:
        ds = ds.masked_fill(~keep[:, None], 0.0)
        dq = dq * scale
        ds = ds * scale
    dq = dq + torch.einsum("chij,cjhk->cihk", ds, kc)
    dk = dk + torch.einsum("chij,cihk->cjhk", ds, qc)
    if g is not None:
        dgc = (dq * qc).sum(-1) - (dk * kc).sum(-1)                            # [NC, C, H]
        at_last = torch.arange(C, device=q.device)[None, :] == last[:, None]   # [NC, C]
        dgc = dgc + at_last.float()[..., None] * dg_last[:, None, :]
        dg = _scatter(dgc, index, valid, B * T).view(B, T, H)
    dq = _scatter(dq, index, valid, B * T).view(B, T, H, K).to(q.dtype)
    dk = _scatter(dk, index, valid, B * T).view(B, T, H, K).to(k.dtype)
    if dw is not None:
        dw = _scatter(dw, index, valid, B * T).view(B, T, H, K).to(w.dtype)
    return dq, dk, dw, dg


def _scatter(x, index, valid, n):
    """[NC, C, ...] chunk rows back to [n, ...] token rows (each token appears once among valid rows)."""
    out = x.new_zeros(n, *x.shape[2:])
    out[index[valid]] = x[valid]
    return out


@contextlib.contextmanager
def patched(module):
    """Within the block, `module.chunk_bwd_dqkwg` (an fla module that imported it) is ours."""
    saved = module.chunk_bwd_dqkwg
    module.chunk_bwd_dqkwg = chunk_bwd_dqkwg_torch
    try:
        yield
    finally:
        module.chunk_bwd_dqkwg = saved
