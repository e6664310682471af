"""SSE's varlen plan (`ops.sse.reference.varlen_plan`) as three Triton kernels: a stable counting sort of the pairs.

The PyTorch plan sorts the M = L * K (token, slot) pairs by key = sequence * N + partition with a device radix
sort, then finds the segments with `searchsorted`: about twenty launches, 1-3 us each on the H100, plus the sort
(0.03-0.05 ms at 4k-16k tokens; benchmarks/RESULTS.md). The keys are small and the tokens are already
in sequence order, so a counting sort over the N partitions does it:

    P[p, i]  = kept pairs before pair p with partition i (an exclusive prefix count over all pairs),
    rank(p)  = P[p, part(p)] - P[first pair of seq(p), part(p)]     (stable: time order kept),
    start(s, i) = sum_j P[first pair of s, j] + sum_{j < i} (P[first pair of s + 1, j] - P[first pair of s, j]),

and a dropped (padding) pair goes after every kept one, in pair order. Kernels: (1) `_count_kernel` per chunk of
pairs, its kept pairs per partition; (2) `_bounds_kernel` per sequence boundary, P at the boundary's pair (the
chunks before it, summed by the program itself, plus the part of its chunk before it); (3) `_place_kernel` per
chunk, every pair's sorted position (`order`, `inv`), and in its first program the segment offsets `seg_cu` and
the op call's offsets with the shared documents in front. Same results as the PyTorch plan, exactly
(`tests/ops/sse/test_sse_plan.py`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridize.ops.common.triton_utils import interpreter_shim, interpreting


@triton.jit
def _pairs(idx, keep, p0, M, BLOCK: tl.constexpr, NP: tl.constexpr, HAS_KEEP: tl.constexpr):
    """Pairs p0 .. p0 + BLOCK: (ids `[BLOCK]`, in range, partition, kept, one-hot of kept pairs `[BLOCK, NP]`)."""
    o = p0 + tl.arange(0, BLOCK)
    m = o < M
    part = tl.load(idx + o, mask=m, other=0).to(tl.int32)
    ok = m
    if HAS_KEEP:
        ok = ok & (tl.load(keep + o, mask=m, other=0) != 0)
    hot = ((part[:, None] == tl.arange(0, NP)[None, :]) & ok[:, None]).to(tl.int32)
    return o, m, part, ok, hot


@triton.jit
def _chunks_before(counts, c, NP: tl.constexpr, CB: tl.constexpr):
    """Kept pairs per partition in chunks 0 .. c - 1 `[NP]`."""
    acc = tl.zeros([NP], dtype=tl.int32)
    o_n = tl.arange(0, NP)
    for c0 in range(0, c, CB):
        rows = c0 + tl.arange(0, CB)
        blk = tl.load(counts + rows[:, None] * NP + o_n[None, :], mask=(rows < c)[:, None], other=0)
        acc += tl.sum(blk, 0)
    return acc


@triton.jit
def _count_kernel(idx, keep, counts, M, BLOCK: tl.constexpr, NP: tl.constexpr, HAS_KEEP: tl.constexpr):
    c = tl.program_id(0)
    _, _, _, _, hot = _pairs(idx, keep, c.to(tl.int64) * BLOCK, M, BLOCK, NP, HAS_KEEP)
    tl.store(counts + c * NP + tl.arange(0, NP), tl.sum(hot, 0))


@triton.jit
def _bounds_kernel(idx, keep, cu, counts, pb, M, K, BLOCK: tl.constexpr, NP: tl.constexpr, CB: tl.constexpr,
                   HAS_KEEP: tl.constexpr):
    # one program per sequence boundary s = 0 .. S: P at pair K * cu[s]
    s = tl.program_id(0)
    b = tl.load(cu + s) * K
    c = b // BLOCK
    o, _, _, _, hot = _pairs(idx, keep, c * BLOCK, M, BLOCK, NP, HAS_KEEP)
    acc = _chunks_before(counts, c, NP, CB) + tl.sum(tl.where((o < b)[:, None], hot, 0), 0)
    tl.store(pb + s * NP + tl.arange(0, NP), acc)


@triton.jit
def _place_kernel(idx, keep, cu, counts, pb, order, inv, seg_cu, layout_cu, M, K, S, N, L0,
                  BLOCK: tl.constexpr, NP: tl.constexpr, CB: tl.constexpr, LOG: tl.constexpr, BG: tl.constexpr,
                  HAS_KEEP: tl.constexpr, SHARED: tl.constexpr):
    c = tl.program_id(0)
    o_n = tl.arange(0, NP)
    o, m, part, ok, hot = _pairs(idx, keep, c.to(tl.int64) * BLOCK, M, BLOCK, NP, HAS_KEEP)
    P = _chunks_before(counts, c, NP, CB)[None, :] + tl.cumsum(hot, 0) - hot      # [BLOCK, NP]
    mine = part[:, None] == o_n[None, :]
    t = o // K
    lo = tl.zeros([BLOCK], dtype=tl.int64)                # seq(p): how many of cu[1:] are <= t
    hi = tl.zeros([BLOCK], dtype=tl.int64) + S
    for _ in tl.static_range(LOG):
        live = lo < hi
        mid = (lo + hi) // 2
        go = t >= tl.load(cu + mid + 1, mask=m & live, other=0)
        lo = tl.where(live & go, mid + 1, lo)
        hi = tl.where(live & (go == 0), mid, hi)
    seq = tl.minimum(lo, S - 1)
    here = tl.load(pb + seq[:, None] * NP + o_n[None, :], mask=m[:, None], other=0)
    nxt = tl.load(pb + (seq + 1)[:, None] * NP + o_n[None, :], mask=m[:, None], other=0)
    start = tl.sum(here, 1) + tl.sum(tl.where(o_n[None, :] < part[:, None], nxt - here, 0), 1)
    rank = tl.sum(tl.where(mine, P - here, 0), 1)
    kept_all = tl.sum(tl.load(pb + S * NP + o_n), 0)
    pos = tl.where(ok, start + rank, kept_all + o - tl.sum(P, 1)).to(tl.int64)
    tl.store(order + pos, o, mask=m)
    tl.store(inv + o, pos, mask=m)
    if c == 0:
        G = S * N
        for g0 in range(0, G + 2, BG):                     # seg_cu[g], g = s * N + i; [G] all kept; [G + 1] M
            g = g0 + tl.arange(0, BG)
            s, i = g // N, g % N
            m_g = g <= G
            h = tl.load(pb + s[:, None] * NP + o_n[None, :], mask=m_g[:, None], other=0)
            h2 = tl.load(pb + (s + 1)[:, None] * NP + o_n[None, :], mask=(m_g & (g < G))[:, None], other=0)
            val = tl.sum(h, 1) + tl.sum(tl.where(o_n[None, :] < i[:, None], h2 - h, 0), 1)
            val = tl.where(g == G + 1, M, val).to(tl.int64)
            tl.store(seg_cu + g, val, mask=g < G + 2)
            if SHARED:                                     # [cu, seg_cu[1:] + L0]
                tl.store(layout_cu + S + g, val + L0, mask=(g >= 1) & (g < G + 2))
        if SHARED:
            for s0 in range(0, S + 1, BG):
                r = s0 + tl.arange(0, BG)
                tl.store(layout_cu + r, tl.load(cu + r, mask=r <= S, other=0), mask=r <= S)


#: partitions the counting sort takes (its one-hot tile is [BLOCK, N]); more fall back to the PyTorch sort
MAX_PARTITIONS = 128


def plan_triton(index: torch.Tensor, keep: torch.Tensor | None, cu: torch.Tensor, n: int, shared_len: int | None):
    """index `[L, K]` int64 partitions of the pairs (token-major), keep `[L * K]` bool or None (all kept),
    cu `[S + 1]` int64, n partitions -> (order `[M]`, inv `[M]`, seg_cu `[S * n + 2]`, layout_cu): as
    `ops.sse.reference.varlen_plan`; layout_cu is seg_cu, or with `shared_len` (the shared path's L rows in front)
    `[cu, seg_cu[1:] + L]`."""
    L, K = index.shape
    M, S = L * K, cu.numel() - 1
    NP = max(2, triton.next_power_of_2(n))
    BLOCK = max(64, 4096 // NP)
    C = triton.cdiv(M, BLOCK)
    dev = index.device
    idx = index.reshape(-1).contiguous()
    kp = idx if keep is None else keep.reshape(-1).contiguous().view(torch.int8)
    counts = torch.empty(max(C, 1), NP, dtype=torch.int32, device=dev)
    pb = torch.empty(S + 1, NP, dtype=torch.int32, device=dev)
    order, inv = torch.empty(M, dtype=torch.long, device=dev), torch.empty(M, dtype=torch.long, device=dev)
    seg_cu = torch.empty(S * n + 2, dtype=torch.long, device=dev)
    layout_cu = seg_cu if shared_len is None else torch.empty(S + S * n + 2, dtype=torch.long, device=dev)
    if interpreting():
        interpreter_shim()
    flags = dict(BLOCK=BLOCK, NP=NP, HAS_KEEP=keep is not None, num_warps=4)
    if C:
        _count_kernel[(C,)](idx, kp, counts, M, **flags)
    _bounds_kernel[(S + 1,)](idx, kp, cu, counts, pb, M, K, CB=32, **flags)
    _place_kernel[(max(C, 1),)](idx, kp, cu, counts, pb, order, inv, seg_cu, layout_cu, M, K, S, n,
                                0 if shared_len is None else shared_len, CB=32, LOG=max(1, S.bit_length()) + 1,
                                BG=128, SHARED=shared_len is not None, **flags)
    return order, inv, seg_cu, layout_cu


__all__ = ["MAX_PARTITIONS", "plan_triton"]
