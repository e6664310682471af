"""The piece table of packed documents (`triton_utils.make_pieces` with `cu_seqlens` and no mask) as one Triton kernel.

`triton_utils.build_pieces` cuts every document of a packed row into pieces of `seg_len` tokens with about twenty
small PyTorch ops (searchsorted, gathers, clamps, stacks). On the H100 each costs 1-3 us of device time, which
at 4k tokens is a tenth of SSE's whole forward (benchmarks/RESULTS.md, session 12). Here one program per
document writes its own rows: its first piece is the sum of the earlier documents' piece counts (each program
adds them up itself, O(N^2) over documents but in blocks of 1024), then its pieces. The last document also
writes the table's unused slots, as the PyTorch form does (length 0, clamped to the row's end), so both give
the same table, which `tests/ops/common/test_piece_table.py` checks.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridize.ops.common.triton_utils import interpreter_shim, interpreting


@triton.jit
def _table_kernel(cu, n0, seg, n_before, n_after, seq, segs, n_end, n_div, N, G, total, SEG,
                  BLOCK: tl.constexpr, HAS_N0: tl.constexpr):
    # one program per document i
    i = tl.program_id(0).to(tl.int64)
    first = tl.zeros([], dtype=tl.int64)
    for j0 in range(0, i, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        m_j = j < i
        a = tl.load(cu + j, mask=m_j, other=0)
        b = tl.load(cu + j + 1, mask=m_j, other=0)
        first += tl.sum((b - a + SEG - 1) // SEG, 0)
    start = tl.load(cu + i)
    ln = tl.load(cu + i + 1) - start
    nseg = (ln + SEG - 1) // SEG
    c0 = tl.zeros([], dtype=tl.int64)
    if HAS_N0:
        c0 += tl.load(n0 + i)
    tl.store(segs + 2 * i, first)
    tl.store(segs + 2 * i + 1, nseg)
    tl.store(n_end + i, c0 + ln)
    tl.store(n_div + i, tl.maximum(c0 + ln, 1).to(tl.float32))
    count = tl.where(i == N - 1, G - first, nseg)     # the last document also fills the unused slots
    for l0 in range(0, count, BLOCK):
        loc = l0 + tl.arange(0, BLOCK)
        m_l = loc < count
        bos = tl.minimum(start + loc * SEG, total)
        length = tl.minimum(tl.maximum(ln - loc * SEG, 0), SEG)
        before = c0 + bos - start
        p = first + loc
        tl.store(seg + 2 * p, bos, mask=m_l)
        tl.store(seg + 2 * p + 1, length, mask=m_l)
        tl.store(n_before + p, before.to(tl.float32), mask=m_l)
        tl.store(n_after + p, (before + length).to(tl.float32), mask=m_l)
        tl.store(seq + p, tl.zeros_like(p) + i, mask=m_l)


def piece_table(cu: torch.Tensor, seg_len: int, total: int, n0: torch.Tensor | None):
    """(seg `[G, 2]`, n_before `[G]`, n_after `[G]`, seq `[G]`, segs `[N, 2]`, n_end `[N]`, n_div `[N]`) for
    documents `cu` `[N + 1]` int64 over a row of `total` tokens, pieces of `seg_len`, initial counts n0 `[N]`
    (None: zeros), G = N + total // seg_len slots: `triton_utils.Pieces`' fields without a mask."""
    N = cu.numel() - 1
    G = N + total // seg_len
    dev = cu.device
    i64 = dict(dtype=torch.long, device=dev)
    seg, seq, segs, n_end = (torch.empty(G, 2, **i64), torch.empty(G, **i64), torch.empty(N, 2, **i64),
                             torch.empty(N, **i64))
    f32 = dict(dtype=torch.float32, device=dev)
    n_before, n_after, n_div = torch.empty(G, **f32), torch.empty(G, **f32), torch.empty(N, **f32)
    if interpreting():
        interpreter_shim()
    _table_kernel[(N,)](cu, cu if n0 is None else n0, seg, n_before, n_after, seq, segs, n_end, n_div, N, G, total,
                        seg_len, BLOCK=1024, HAS_N0=n0 is not None, num_warps=4)
    return seg, n_before, n_after, seq, segs, n_end, n_div


__all__ = ["piece_table"]
