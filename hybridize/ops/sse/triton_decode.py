"""Partition-sparse SSE decode step ("Scaling Linear Attention with Sparse State Expansion"): reads and writes only the
selected partition states.

The PyTorch path of `ops.sse.reference.naive_recurrent_sse` gathers the K selected partitions of every row into
a new tensor, runs the recurrent op and scatters them back: three full copies of the selected states
per token. Here
one Triton program per (row, slot, head, value block) loads its partition's `[K, BV]` state block
from the full state tensor, updates it in registers and writes it back in place; partitions nobody
selected are never touched (bit-identical), and no gather/scatter copies exist.

Per slot (state S `[K, V]`, fp32 math):
- gla backbone  (beta None):  S = exp(g) * S + k v^T                     (g `[K]` or scalar)
- delta backbone (beta given): S' = exp(g) S;  u = v - S'^T p;  S = S' + beta k u^T   (p = k if None)
then o = scale * S^T q. A slot whose partition index is negative is skipped (o = 0, nothing written):
use it for unselected slots and padding. Shapes: state `[B, P, H, K, V]` fp32 (updated in place),
index `[B, S]` integer partition ids, q, k, p `[B, S, H, K]`, v `[B, S, H, V]`, g `[B, S, H]` or
`[B, S, H, K]` or None, beta `[B, S, H]` or None; every per-token input may instead have slot dim 1
(one token's inputs broadcast to its S slots, as SSE's sparse path needs). wq, wk `[B, S]` or None:
per-slot factors on q and k (SSE's router probability, emulq / emulk); with p None the erase
direction is the scaled k. Returns o `[B, S, H, V]` fp32 per slot; the caller sums the slots (and
the shared partition, which is just another call with P = 1 and index 0). Two slots of one row
must not select the same partition (top-K indices are distinct). No host sync, no data-dependent
shape: the step can be captured in a CUDA graph (`ops.sse.reference.naive_recurrent_sse` is the caller).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sse_decode_kernel(state, index, q, k, p, v, g, beta, wq, wk, o, scale,
                       S, P, H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       GATE: tl.constexpr, DELTA: tl.constexpr, HAS_P: tl.constexpr, BCAST: tl.constexpr,
                       HAS_WQ: tl.constexpr, HAS_WK: tl.constexpr):
    # GATE: 0 none, 1 scalar per head, 2 per key channel; BCAST: inputs have one slot for all S slots
    i_v, i_bs, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b = i_bs // S
    part = tl.load(index + i_bs).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    row = i_bs.to(tl.int64) * H + i_h                     # (b, slot, h) row of the per-slot output
    if BCAST:
        row_in = i_b.to(tl.int64) * H + i_h               # (b, h) row of slot-broadcast inputs
    else:
        row_in = row
    if part >= 0:
        base = ((i_b.to(tl.int64) * P + part) * H + i_h) * K * V
        p_s = state + base + o_k[:, None] * V + o_v[None, :]
        m_s = m_k[:, None] & m_v[None, :]
        b_s = tl.load(p_s, mask=m_s, other=0.0)
        b_q = tl.load(q + row_in * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + row_in * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + row_in * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        if HAS_WQ:
            b_q = b_q * tl.load(wq + i_bs).to(tl.float32)
        if HAS_WK:
            b_k = b_k * tl.load(wk + i_bs).to(tl.float32)
        if GATE == 1:
            b_s = b_s * tl.exp(tl.load(g + row_in).to(tl.float32))
        if GATE == 2:
            b_g = tl.load(g + row_in * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_s = b_s * tl.exp(b_g)[:, None]
        if DELTA:
            if HAS_P:
                b_p = tl.load(p + row_in * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            else:
                b_p = b_k                                 # erase along the (router-scaled) key
            b_beta = tl.load(beta + row_in).to(tl.float32)
            b_u = b_v - tl.sum(b_s * b_p[:, None], axis=0)
            b_s = b_s + (b_beta * b_k)[:, None] * b_u[None, :]
        else:
            b_s = b_s + b_k[:, None] * b_v[None, :]
        tl.store(p_s, b_s, mask=m_s)
        b_o = tl.sum(b_s * b_q[:, None], axis=0) * scale
    else:
        b_o = tl.zeros([BV], dtype=tl.float32)
    tl.store(o + row * V + o_v, b_o, mask=m_v)


@torch.compiler.disable   # opaque to torch.compile: dynamo re-types its Python scalars (fp32 -> fp64)
def sse_decode_step(state, index, q, k, v, g=None, beta=None, p=None, scale=None, wq=None, wk=None):
    """One decode token for every row: update the selected partitions of `state` in place; see module doc."""
    B, P, H, K, V = state.shape
    S = index.shape[1]
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError("sse_decode_step updates the state in place: give a contiguous fp32 state tensor")
    Si = q.shape[1]
    if (Si not in (1, S) or q.shape != (B, Si, H, K) or k.shape != q.shape or v.shape != (B, Si, H, V)
            or (p is not None and p.shape != q.shape)):
        raise ValueError(f"expected q, k, p [B, S or 1, H, K] = {(B, S, H, K)} and v [B, S or 1, H, V], got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    for name, w in (("wq", wq), ("wk", wk)):
        if w is not None and tuple(w.shape) != (B, S):
            raise ValueError(f"{name} must be [B, S] = {(B, S)}, got {tuple(w.shape)}")
    gate = 0 if g is None else (1 if g.dim() == 3 else 2)
    delta = beta is not None
    scale = K ** -0.5 if scale is None else scale
    c = lambda t: t.contiguous()  # noqa: E731
    q, k, v = c(q), c(k), c(v)
    g = c(g) if g is not None else q
    pp = c(p) if (delta and p is not None) else k
    bt = c(beta) if delta else q
    wq_ = c(wq.float()) if wq is not None else q
    wk_ = c(wk.float()) if wk is not None else q
    o = torch.empty(B, S, H, V, dtype=torch.float32, device=q.device)
    BK = triton.next_power_of_2(K)
    BV = min(triton.next_power_of_2(V), max(16, 8192 // BK))
    grid = (triton.cdiv(V, BV), B * S, H)
    _sse_decode_kernel[grid](state, c(index.to(torch.int64)), q, k, pp, v, g, bt, wq_, wk_, o, scale,
                             S, P, H, K=K, V=V, BK=BK, BV=BV, GATE=gate, DELTA=delta,
                             HAS_P=delta and p is not None, BCAST=(Si == 1 and S > 1),
                             HAS_WQ=wq is not None, HAS_WK=wk is not None)
    return o


def sse_decode_step_reference(state, index, q, k, v, g=None, beta=None, p=None, scale=None, wq=None, wk=None):
    """PyTorch loop with the same contract (tests and the GPU check compare against it)."""
    B, P, H, K, V = state.shape
    scale = K ** -0.5 if scale is None else scale
    o = torch.zeros(B, index.shape[1], H, V, dtype=torch.float32, device=q.device)
    at = lambda x, b, s: x[b, s if x.shape[1] > 1 else 0]  # noqa: E731 - slot-broadcast inputs
    for b in range(B):
        for s in range(index.shape[1]):
            part = int(index[b, s])
            if part < 0:
                continue
            St = state[b, part]                                         # [H, K, V]
            if g is not None:
                dec = at(g, b, s).float().exp()
                St = St * (dec[:, None, None] if dec.dim() == 1 else dec[:, :, None])
            qf, kf, vf = at(q, b, s).float(), at(k, b, s).float(), at(v, b, s).float()
            if wq is not None:
                qf = qf * wq[b, s].float()
            if wk is not None:
                kf = kf * wk[b, s].float()
            if beta is not None:
                pf = kf if p is None else at(p, b, s).float()
                u = vf - torch.einsum("hkv,hk->hv", St, pf)
                St = St + (at(beta, b, s).float()[:, None] * kf)[:, :, None] * u[:, None, :]
            else:
                St = St + kf[:, :, None] * vf[:, None, :]
            state[b, part] = St
            o[b, s] = torch.einsum("hkv,hk->hv", St, qf) * scale
    return o
