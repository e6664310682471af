"""Triton helpers shared by our kernels (CCQ read, pieces GLA, SSE plan, piece table).

- jit helpers: `seg_bounds` (a piece's first token and length from the `[G, 2]` table), `mdot` / `mdot_r`
  (fp32-register times 16-bit-input products: one 16-bit product, a bf16 hi/lo split or tf32/IEEE fp32),
  `tile_block` (row / column block of an R x C matrix cut into BR x BC blocks);
- launch helpers: `interpreting` (TRITON_INTERPRET=1), `interpreter_shim` (Triton 3.6's interpreter with
  NumPy >= 2.4), `interp_tile` (an interpreter run's token tile), `autotuned` (a kernel autotuned over a short
  curated list, once per kernel, cached on disk; `TUNED` holds them), `tune_buckets` (power-of-two buckets of
  tokens and rows, the key-only autotune arguments);
- pieces: every sequence of the flat token axis cut into pieces of `piece_length.piece_len` tokens so that B * H
  rows do not leave most SMs idle: `Pieces`, `make_pieces` (cached on CUDA for plain shapes), `build_pieces` (on
  the device, no host sync; the packed-documents case is one kernel, `piece_table`).

Imports triton at its top: loaded only by the Triton kernel modules (on CUDA or under the interpreter).
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from hybridize.ops.common.options import current_kernel_options


@triton.jit
def seg_bounds(seg, i_n):
    """(first token, length) of segment i_n from the int64 table `seg` `[G, 2]`."""
    return tl.load(seg + 2 * i_n).to(tl.int64), tl.load(seg + 2 * i_n + 1).to(tl.int64)


@triton.jit
def mdot(a, b, PROD: tl.constexpr, PREC: tl.constexpr):
    """a (fp32 registers) @ b (the 16-bit input dtype, exact). PROD 2: one 16-bit product (a rounded to b's
    dtype); PROD 1: a = a_hi + a_lo in bf16, two bf16 products (~16 mantissa bits of a); PROD 0: one product
    at PREC on fp32 tiles. fp32 accumulation in all three."""
    if PROD == 2:
        return tl.dot(a.to(b.dtype), b)
    elif PROD == 1:
        a_hi = a.to(tl.bfloat16)
        a_lo = (a - a_hi.to(tl.float32)).to(tl.bfloat16)
        return tl.dot(a_hi, b) + tl.dot(a_lo, b)
    else:
        return tl.dot(a, b.to(tl.float32), input_precision=PREC)


@triton.jit
def mdot_r(a, b, PROD: tl.constexpr, PREC: tl.constexpr):
    """a (16-bit input, exact) @ b (fp32 registers); see `mdot`."""
    if PROD == 2:
        return tl.dot(a, b.to(a.dtype))
    elif PROD == 1:
        b_hi = b.to(tl.bfloat16)
        b_lo = (b - b_hi.to(tl.float32)).to(tl.bfloat16)
        return tl.dot(a, b_hi) + tl.dot(a, b_lo)
    else:
        return tl.dot(a.to(tl.float32), b, input_precision=PREC)


@triton.jit
def tile_block(i_rc, R: tl.constexpr, C: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """(row block index, column block index, rows `[BR]`, columns `[BC]`, their masks) of block i_rc of an
    R x C matrix cut into BR x BC blocks, row-major."""
    NC: tl.constexpr = (C + BC - 1) // BC
    i_r, i_c = i_rc // NC, i_rc % NC
    o_r = i_r * BR + tl.arange(0, BR)
    o_c = i_c * BC + tl.arange(0, BC)
    return i_r, i_c, o_r, o_c, o_r < R, o_c < C


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def interpreter_shim() -> None:
    """Triton 3.6's interpreter turns a loop bound into an int with `int(array of shape (1,))`, which
    NumPy >= 2.4 refuses, so every `range(runtime value)` fails on CPU. Re-patch `__index__` to read
    the single element (interpreter only; compiled kernels are unaffected). Idempotent."""
    from triton.runtime import interpreter

    if getattr(interpreter, "_ccq_index_shim", False):
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    interpreter._ccq_index_shim = True


TUNED: dict = {}


def interp_tile(chunk_size) -> int:
    """The token tile of an interpreter run: `chunk_size` (default 16), a power of two >= 16."""
    interpreter_shim()
    BT = 16 if chunk_size is None else int(chunk_size)
    if BT < 16 or BT & (BT - 1):
        raise ValueError(f"chunk_size must be a power of two >= 16 for the Triton CCQ read, got {chunk_size}")
    return BT


def autotuned(kernel, configs, key):
    """`kernel` autotuned over `configs()`, built once per kernel. Every constexpr flag is part of `key`, so with
    and without mask / initial state tune separately. Marked `full_tune`: the global cap meant for fla's long
    lists (`autotune.py`, kernel option autotune_top) leaves these short, curated lists whole. The picks are cached
    on disk by Triton (`cache_results`, keyed by the kernel source, the GPU, the key and the config list), so a
    new length / rows bucket costs its tuning (seconds) once per machine, not once per process."""
    if kernel not in TUNED:
        TUNED[kernel] = triton.autotune(configs=configs(), key=key, cache_results=True)(kernel)
        TUNED[kernel].full_tune = True
    return TUNED[kernel]


def tune_buckets(tokens, rows) -> dict:
    """The key-only kernel arguments a pass autotunes on: power-of-two buckets of the token count and rows."""
    return dict(LEN=triton.next_power_of_2(max(int(tokens), 1)), ROWS=triton.next_power_of_2(max(int(rows), 1)))


class Pieces(NamedTuple):
    """Where every kernel program works: the flat token axis cut into pieces (see `make_pieces`)."""
    seg: torch.Tensor        # [G, 2] int64: first token, length (unused slots: length 0)
    n_before: torch.Tensor   # [G] fp32: real tokens counted before the piece (initial count included)
    n_after: torch.Tensor    # [G] fp32: ... and after it
    seq: torch.Tensor        # [G] int64: the sequence a piece belongs to
    segs: torch.Tensor       # [N, 2] int64: first piece, number of pieces, per sequence
    n_end: torch.Tensor      # [N] int64: count at the end of each sequence
    n_div: torch.Tensor      # [N] fp32: max(n_end, 1), what the mean key divides by


_PIECES: dict = {}


def make_pieces(B, T, cu, mask, n0, seg_len, device) -> Pieces:
    """Pieces over the flat token axis (`[B, T]` rows or `cu_seqlens` documents), built on the device
    without a host sync. Every sequence is cut into pieces of `seg_len` tokens (None: one piece each).
    n0 `[N]`: the initial counts (None: zeros). Without a mask, cu_seqlens or initial counts the table depends
    on the shape alone and is cached on CUDA (a dozen small launches per call otherwise)."""
    plain = cu is None and mask is None and n0 is None and device.type == "cuda"
    key = (B, T, seg_len, str(device)) if plain else None
    if key is not None and key in _PIECES:
        return _PIECES[key]
    out = build_pieces(B, T, cu, mask, n0, seg_len, device)
    if key is not None:
        if len(_PIECES) > 64:
            _PIECES.clear()
        _PIECES[key] = out
    return out


# ---- the piece table of packed documents (`cu_seqlens`, no mask) in one kernel -----------------------------
# `build_pieces`' PyTorch form takes about twenty small ops (searchsorted, gathers, clamps, stacks); on the
# H100 each costs 1-3 us of device time, which at 4k tokens is a tenth of SSE's whole forward
# (benchmarks/RESULTS.md). Here one program per document writes its own rows: its first piece is the sum of
# the earlier documents' piece counts (each program adds them up itself, O(N^2) over documents but in blocks
# of 1024), then its pieces. The last document also writes the table's unused slots, as the PyTorch form does
# (length 0, clamped to the row's end), so both give the same table (tests/ops/common/test_piece_table.py).

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
    (None: zeros), G = N + total // seg_len slots: `Pieces`' fields without a mask."""
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


def build_pieces(B, T, cu, mask, n0, seg_len, dev) -> Pieces:
    if cu is not None and mask is None and seg_len is not None and (dev.type == "cuda" or interpreting()):
        # one kernel instead of ~20 small ops
        return Pieces(*piece_table(cu, seg_len, B * T, n0))
    if n0 is None:
        n0 = torch.zeros(B if cu is None else len(cu) - 1, dtype=torch.long, device=dev)
    if cu is None:
        starts = torch.arange(B, device=dev) * T
        lens = torch.full((B,), T, device=dev, dtype=torch.long)
    else:
        starts, lens = cu[:-1], cu[1:] - cu[:-1]
    N, total = starts.numel(), B * T
    if mask is None:
        cm = torch.arange(total + 1, device=dev)
    else:
        cm = torch.cat([torch.zeros(1, device=dev, dtype=torch.long), mask.reshape(-1).long().cumsum(0)])
    n_end = n0 + cm[starts + lens] - cm[starts]
    n_div = n_end.clamp(min=1).float()
    if seg_len is None:
        ar = torch.arange(N, device=dev)
        return Pieces(torch.stack([starts, lens], 1).contiguous(), n0.float().contiguous(),
                      n_end.float().contiguous(), ar, torch.stack([ar, torch.ones_like(ar)], 1).contiguous(), n_end,
                      n_div)
    nseg = (lens + seg_len - 1) // seg_len
    ends = nseg.cumsum(0)
    G = N * triton.cdiv(T, seg_len) if cu is None else N + total // seg_len
    p = torch.arange(G, device=dev)
    seq = torch.searchsorted(ends, p, right=True).clamp(max=N - 1)
    local = p - (ends - nseg)[seq]
    bos = (starts[seq] + local * seg_len).clamp(max=total)
    ln = (lens[seq] - local * seg_len).clamp(0, seg_len)
    n_before = n0[seq] + cm[bos] - cm[starts[seq]]
    n_after = n_before + cm[bos + ln] - cm[bos]
    return Pieces(torch.stack([bos, ln], 1).contiguous(), n_before.float().contiguous(),
                  n_after.float().contiguous(), seq.contiguous(),
                  torch.stack([ends - nseg, nseg], 1).contiguous(), n_end, n_div)
