"""GLA's forward built like the CCQ read: pieces, a scan over piece states, register-carried state.

Computes what `hybridize.ops.gla.reference.chunk_gla` computes for per-key-channel gates:
S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T, o_t = scale * S_t^T q_t, for q, k, g `[B, T, H, K]`, v `[B, T, H, V]`,
an initial / final state `[N, H, K, V]` and packed `cu_seqlens`. Written for SSE's speed target (issue 6): SSE
runs a GLA over 2T token-rows (shared partition + routed tokens), so it needs a GLA cheaper per token than fla's
`chunk_gla`; this forward runs at ~0.6x of chunk_gla per token, with fla's autotuning capped to one config
(H100, benchmarks/RESULTS.md).
`gla_fwd_triton` is the forward alone (no gradient); `gla_bwd.gla_triton` is the op with its backward. SSE's
varlen call uses it (`ops/sse/reference.py`, `_gla_in_pieces`); it is not registered with `dispatch`, so GLA layers
keep fla's chunk_gla.

Every sequence is cut into pieces (`triton_utils.make_pieces`, `piece_length.piece_len`). (1) `_piece_state_kernel`:
each piece's own state from zero, L = sum_t exp(G_end - G_t) k_t v_t^T (G the piece's inclusive cumulative log-decay,
per key channel), and its total log-decay, a GEMM walk over wide token tiles; (2) `_scan_kernel`: each piece's
starting state, S_start(j+1) = exp(G_end(j)) * S_start(j) + L(j) (rows scaled), from the initial state, and the
sequences' final states; (3) `_output_kernel`: every piece from its start, per tile of BT tokens and block of BV
value channels: o = (q * exp(Gc)) S + tril(A) v with A_ts = sum_d q_td k_sd exp(Gc_td - Gc_sd) (Gc the tile's
inclusive cumulative log-decay), then S = exp(Gc_end) * S + (k * exp(Gc_end - Gc))^T v. Under gradient
(`keep_scores`) the output pass also stores each tile's tril(A), rounded as for its product, for the backward's dv pass.

Numerics: fp32 accumulation; 16-bit inputs give 16-bit products (the carried state and the score tile are
rounded once for their product, as fla does). The in-tile scores factor exp(Gc_t - Gc_s) through a reference at
half the tile's total decay, so each factor is at most exp(|tile decay| / 2). The output pass therefore runs
16-token tiles and takes per-token log-decays below `G_MIN` = -8 as -8 (all passes alike): every factor stays
within exp(+-64). This departs from the exact op only for gates below exp(-8) = 3.4e-4 per token, where the
older state's share is under 3.4e-4 either way (fla's chunk_gla splits its tiles into sub-blocks instead).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from hybridize.ops.common.options import current_kernel_options
from hybridize.ops.common.piece_length import piece_len

from hybridize.ops.common.triton_utils import (autotuned, interp_tile, interpreter_shim, interpreting, make_pieces,
                                               seg_bounds, tile_block, tune_buckets)


@triton.jit
def _sources(rows, m_t, bos, order, wsc, L0, KS: tl.constexpr, GATHER: tl.constexpr, HAS_W: tl.constexpr,
             PACKED: tl.constexpr):
    """(the rows `[BT]` the tile reads, whether its piece reads the sparse tensors, the router scale of each row
    `[BT]` fp32). Without GATHER: the rows themselves, no scale. With it (SSE's layout read in place, `Gather`):
    a piece before row L0 reads the shared tensors' same rows; a later one the sparse tensors' rows of its pairs'
    tokens, order[r - L0] // KS, scaled by wsc[pair] where asked, or with PACKED (the sparse rows packed and
    scaled already) their row r - L0."""
    if GATHER and PACKED:
        sparse = bos >= L0
        src = tl.where(m_t & sparse, rows - L0, rows)
        w = tl.full(rows.shape, 1.0, tl.float32)
    elif GATHER:
        sparse = bos >= L0
        m_sp = m_t & sparse
        pair = tl.load(order + (rows - L0), mask=m_sp, other=0).to(tl.int64)
        src = tl.where(m_sp, pair // KS, rows)
        if HAS_W:
            w = tl.load(wsc + pair, mask=m_sp, other=1.0).to(tl.float32)
        else:
            w = tl.full(rows.shape, 1.0, tl.float32)
    else:
        sparse = bos < 0
        src = rows
        w = tl.full(rows.shape, 1.0, tl.float32)
    return src, sparse, w


@triton.jit
def _load(x, x_sp, src, sparse, i_h, o_c, m, C: tl.constexpr, H: tl.constexpr, GATHER: tl.constexpr,
          SELECT: tl.constexpr):
    """Rows `src` of x, or of x_sp for a sparse piece, channels o_c `[BT, BC]` (0 where not m). SELECT: one load
    from the chosen base pointer, which Triton software-pipelines (piece-state walk at 16k on the H100, gathered:
    0.455 ms, against 0.49 with the loads in a branch); otherwise the loads sit in a branch, not pipelined, which
    the output pass prefers (1.00 ms pipelined against 0.78; benchmarks/RESULTS.md)."""
    off = (src[:, None] * H + i_h) * C + o_c[None, :]
    if GATHER:
        if SELECT:
            out = tl.load(tl.where(sparse, x_sp, x) + off, mask=m, other=0.0)
        elif sparse:
            out = tl.load(x_sp + off, mask=m, other=0.0)
        else:
            out = tl.load(x + off, mask=m, other=0.0)
    else:
        out = tl.load(x + off, mask=m, other=0.0)
    return out


@triton.jit
def _scaled(x, w, SCALE: tl.constexpr):
    """x `[BT, C]` times the rows' router scale, rounded to x's dtype once as the row packer does (SCALE)."""
    if SCALE:
        return (x.to(tl.float32) * w[:, None]).to(x.dtype)
    else:
        return x


@triton.jit
def _piece_state_kernel(k, v, g, k_sp, v_sp, g_sp, order, wsc, L0, seg, l_out, d_out, H: tl.constexpr,
                        K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                        PREC: tl.constexpr, G_MIN: tl.constexpr, KS: tl.constexpr, GATHER: tl.constexpr,
                        SCALE_K: tl.constexpr, PACKED: tl.constexpr):
    # one program per ((key block, value block), piece, head)
    i_nh = tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    _, i_c, o_r, o_c, m_r, m_c = tile_block(tl.program_id(0), K, V, BR, BC)
    bos, L = seg_bounds(seg, i_n)
    o_t = tl.arange(0, BT)
    b_L = tl.zeros([BR, BC], dtype=tl.float32)
    b_G = tl.zeros([BR], dtype=tl.float32)
    for i_t in range(0, tl.cdiv(L, BT)):
        m_t = i_t * BT + o_t < L
        rows = bos + i_t * BT + o_t
        src, sparse, w = _sources(rows, m_t, bos, order, wsc, L0, KS, GATHER, SCALE_K, PACKED)
        m_tr = m_t[:, None] & m_r[None, :]
        b_k = _scaled(_load(k, k_sp, src, sparse, i_h, o_r, m_tr, K, H, GATHER, True), w, SCALE_K)
        b_g = tl.maximum(_load(g, g_sp, src, sparse, i_h, o_r, m_tr, K, H, GATHER, True).to(tl.float32), G_MIN)
        b_v = _load(v, v_sp, src, sparse, i_h, o_c, m_t[:, None] & m_c[None, :], V, H, GATHER, True)
        b_gc = tl.cumsum(b_g, 0)
        b_last = tl.sum(b_g, 0)
        b_kd = (b_k.to(tl.float32) * tl.exp(b_last[None, :] - b_gc)).to(b_v.dtype)   # exponents <= 0
        b_L = b_L * tl.exp(b_last)[:, None] + tl.dot(tl.trans(b_kd), b_v, input_precision=PREC)
        b_G += b_last
    tl.store(l_out + i_nh.to(tl.int64) * K * V + o_r[:, None] * V + o_c[None, :], b_L,
             mask=m_r[:, None] & m_c[None, :])
    if i_c == 0:
        tl.store(d_out + i_nh.to(tl.int64) * K + o_r, b_G, mask=m_r)


@triton.jit
def _scan_kernel(l_in, d_in, s0, starts, s_end, segs, f_starts, f_end, off, H: tl.constexpr, K: tl.constexpr,
                 V: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, HAS_H0: tl.constexpr, REVERSE: tl.constexpr):
    # per ((key block, value block), sequence, head): each piece's starting state and the sequence's final one.
    # REVERSE (the backward's state gradient, same recurrence run from the last piece): each piece's carried
    # gradient R from after it, the gradient of the sequence's initial state, and (BC covering all of V) each
    # piece's gates' gradient from after it, rowsum(S_end * R) with S_end the forward's state after the piece
    # (f_starts of the next piece, or f_end after the last)
    i_nh = tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    _, _, o_r, o_c, m_r, m_c = tile_block(tl.program_id(0), K, V, BR, BC)
    m_blk = m_r[:, None] & m_c[None, :]
    blk = o_r[:, None] * V + o_c[None, :]
    first = tl.load(segs + 2 * i_n).to(tl.int64)
    count = tl.load(segs + 2 * i_n + 1).to(tl.int64)
    b_S = tl.zeros([BR, BC], dtype=tl.float32)
    if HAS_H0:
        b_S += tl.load(s0 + i_nh.to(tl.int64) * K * V + blk, mask=m_blk, other=0.0)
    for i in range(0, count):
        if REVERSE:
            p = (first + count - 1 - i) * H + i_h
            if i == 0:
                b_E = tl.load(f_end + i_nh.to(tl.int64) * K * V + blk, mask=m_blk, other=0.0)
            else:
                b_E = tl.load(f_starts + (p + H) * K * V + blk, mask=m_blk, other=0.0)
            tl.store(off + p * K + o_r, tl.sum(b_E * b_S, 1), mask=m_r)
        else:
            p = (first + i) * H + i_h
        tl.store(starts + p * K * V + blk, b_S, mask=m_blk)
        b_d = tl.load(d_in + p * K + o_r, mask=m_r, other=0.0)
        b_S = b_S * tl.exp(b_d)[:, None] + tl.load(l_in + p * K * V + blk, mask=m_blk, other=0.0)
    tl.store(s_end + i_nh.to(tl.int64) * K * V + blk, b_S, mask=m_blk)


@triton.jit
def _out_inputs(q, k, v, g, q_sp, k_sp, v_sp, g_sp, order, wsc, L0, bos, rows, m_t, i_h, o_k, m_k, o_v, m_v, scale,
                H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, G_MIN: tl.constexpr, KS: tl.constexpr,
                GATHER: tl.constexpr, SCALE_Q: tl.constexpr, SCALE_K: tl.constexpr, PACKED: tl.constexpr):
    """The output pass's tile of rows `[BT]`: scale * q (fp32), k `[BT, BK]`, the floored gates' inclusive cumsum
    (fp32) and total `[BK]`, v `[BT, BV]` (loads in a branch, `_load`'s SELECT off). The backward's `_tile` loads the
    same q, k, g, but built on it (v loaded after the gates' sums) this pass compiles to different PTX for sm_90, not
    timed; this form is the one measured (benchmarks/RESULTS.md)."""
    src, sparse, w = _sources(rows, m_t, bos, order, wsc, L0, KS, GATHER, SCALE_Q or SCALE_K, PACKED)
    m_tk = m_t[:, None] & m_k[None, :]
    b_q = _scaled(_load(q, q_sp, src, sparse, i_h, o_k, m_tk, K, H, GATHER, False), w, SCALE_Q)
    b_k = _scaled(_load(k, k_sp, src, sparse, i_h, o_k, m_tk, K, H, GATHER, False), w, SCALE_K)
    b_g = tl.maximum(_load(g, g_sp, src, sparse, i_h, o_k, m_tk, K, H, GATHER, False).to(tl.float32), G_MIN)
    b_v = _load(v, v_sp, src, sparse, i_h, o_v, m_t[:, None] & m_v[None, :], V, H, GATHER, False)
    return b_q.to(tl.float32) * scale, b_k, tl.cumsum(b_g, 0), tl.sum(b_g, 0), b_v


@triton.jit
def _intra(b_qs, b_k, b_gc, b_last, tril, dt, PREC: tl.constexpr):
    """A `[BT, BT]` = tril(q k^T * exp(Gc_t - Gc_s)) within one 16-token tile, in dt, the factor split at half the
    tile's decay (each part within exp(+-64) under G_MIN)."""
    b_ref = 0.5 * b_last
    b_A = tl.dot((b_qs * tl.exp(b_gc - b_ref[None, :])).to(dt),
                 tl.trans((b_k.to(tl.float32) * tl.exp(b_ref[None, :] - b_gc)).to(dt)), input_precision=PREC)
    return tl.where(tril, b_A, 0.0).to(dt)


@triton.jit
def _output_kernel(q, k, v, g, q_sp, k_sp, v_sp, g_sp, order, wsc, L0, seg, starts, o, a_out, scale,
                   H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
                   BV: tl.constexpr, PREC: tl.constexpr, G_MIN: tl.constexpr, KS: tl.constexpr, GATHER: tl.constexpr,
                   SCALE_Q: tl.constexpr, SCALE_K: tl.constexpr, PACKED: tl.constexpr, KEEP_A: tl.constexpr, LEN,
                   ROWS):
    # one program per (value block, piece, head); LEN / ROWS: autotune key only. The tile's inputs and scores in
    # helpers (and the state rounded before the products) as written here: 255 registers a thread and no spill at
    # BV=128 with 4 warps, against 32 bytes spilled written inline (0.63 against 0.70 ms at 16k on SSE's layout, one
    # H200; benchmarks/RESULTS.md). KEEP_A: the first value block also stores each tile's scores A `[BT, BT]` (in
    # dt) at its rows, a_out `[rows, H, BT]`, for the backward's dv pass (`keep_scores`)
    tl.static_assert(BT == 16, "the kept scores are 16-token tiles (SCORE_TILE)")
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, L = seg_bounds(seg, i_n)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    tril = o_t[:, None] >= o_t[None, :]
    b_S = tl.load(starts + i_nh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :],
                  mask=m_k[:, None] & m_v[None, :], other=0.0)
    for i_t in range(0, tl.cdiv(L, BT)):
        m_t = i_t * BT + o_t < L
        rows = bos + i_t * BT + o_t
        b_qs, b_k, b_gc, b_last, b_v = _out_inputs(q, k, v, g, q_sp, k_sp, v_sp, g_sp, order, wsc, L0, bos, rows,
                                                   m_t, i_h, o_k, m_k, o_v, m_v, scale, H, K, V, G_MIN, KS, GATHER,
                                                   SCALE_Q, SCALE_K, PACKED)
        dt = b_v.dtype
        b_A = _intra(b_qs, b_k, b_gc, b_last, tril, dt, PREC)
        if KEEP_A:
            if i_v == 0:
                tl.store(a_out + (rows[:, None] * H + i_h) * BT + o_t[None, :], b_A, mask=m_t[:, None])
        b_Sd = b_S.to(dt)
        b_o = tl.dot((b_qs * tl.exp(b_gc)).to(dt), b_Sd, input_precision=PREC)
        b_o += tl.dot(b_A, b_v, input_precision=PREC)
        tl.store(o + (rows[:, None] * H + i_h) * V + o_v[None, :], b_o.to(o.dtype.element_ty),
                 mask=m_t[:, None] & m_v[None, :])
        b_kd = (b_k.to(tl.float32) * tl.exp(b_last[None, :] - b_gc)).to(dt)     # exponents <= 0
        b_S = b_S * tl.exp(b_last)[:, None] + tl.dot(tl.trans(b_kd), b_v, input_precision=PREC)


#: every token tile of the output pass and the backward's dq / dk / dv passes: 16 tokens (see G_MIN). The scores
#: the forward keeps for the backward's dv pass (`keep_scores`) are `[rows, H, 16]`
SCORE_TILE = 16

#: per-token log-decay floor: with 16-token tiles and the reference at half a tile's decay, every score factor
#: stays within exp(+-64) (fp32 normal, no flush to zero), so the factorisation is exact for all gates >= G_MIN;
#: below it the decay is taken as exp(-8) = 3.4e-4 per token (the older state's share is then under 3.4e-4
#: either way, below bf16's resolution)
G_MIN = -8.0


def tune_list(table: list) -> list:
    """The first n rows of an autotune table with the kernel option `gla_tune_top=<n>` (`HYBRIDIZE_GLA_TUNE_TOP`;
    1 for tests that only check numbers: fewer compiles), all of them by default."""
    top = current_kernel_options().gla_tune_top
    return table[:top] if top > 0 else table


def _out_configs():
    table = [(16, 32, 4, 2), (16, 64, 4, 2), (16, 128, 4, 2), (16, 64, 8, 2), (16, 128, 8, 2), (16, 32, 2, 2)]
    return [triton.Config({"BT": bt, "BV": bv}, num_warps=w, num_stages=st) for bt, bv, w, st in tune_list(table)]


def _state_configs():
    # the last: the fastest piece-state walk of a wider sweep on SSE's 16k layout, one H200 (0.456 against 0.466 ms)
    table = [(64, 64, 64, 4, 3), (128, 64, 64, 4, 3), (64, 128, 128, 8, 3), (128, 64, 64, 4, 2)]
    return [triton.Config({"BT": bt, "BR": br, "BC": bc}, num_warps=w, num_stages=st)
            for bt, br, bc, w, st in tune_list(table)]


def _pieces_for(q, B, T, cu, segment_len):
    """The piece table of a call (`segment_len`: None automatic on GPU / one piece per sequence in the
    interpreter, 0 one piece per sequence) and a bound on its longest piece, known on the host: the piece length, or
    T when a piece is a whole sequence (`[B, T]` rows, or documents packed into T tokens)."""
    if segment_len is None:
        # the option `gla_rows` (`HYBRIDIZE_GLA_ROWS`), default 512 (piece, head) rows: on SSE's 2T layout 1024-token
        # pieces at 16k, 2048 at 32k, 4096 at 64k. One H200, forward+backward (benchmarks/RESULTS.md): 16k 4.36-4.38
        # ms against 4.48-4.49 with 512-token pieces (1024 rows, the H100 sweep's pick on older kernels: 4.59 against
        # 4.64 ms there); 32k 9.60 against 9.64. From 8k down every setting from 512 up gives 512-token pieces.
        rows = current_kernel_options().gla_rows
        seg_len = None if interpreting() else piece_len(B, T, q.shape[2], T if cu is None else B * T, rows)
    else:
        seg_len = None if segment_len <= 0 else int(segment_len)
    return make_pieces(B, T, cu, None, None, seg_len, q.device), (seg_len or T)


def _precision(dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def scan_pieces(own, decay, s0, segs, H, K, V):
    """Piece sums `[G, H, K, V]` and total log-decays `[G, H, K]` -> (each piece's start `[G, H, K, V]`, each
    sequence's end `[N, H, K, V]`), fp32, from `s0` (fp32 or None)."""
    starts, s_end = torch.empty_like(own), own.new_empty(segs.shape[0], H, K, V)
    B_ = 16 if interpreting() else 32
    _launch_scan(own, decay, s0, segs, starts, s_end, (own, own, own), H, K, V, B_, B_, False)
    return starts, s_end


def reverse_scan(own, decay, dht, segs, f_starts, f_end, H, K, V):
    """The state gradient's scan from the last piece: each piece's own gradient sum `[G, H, K, V]` and total
    log-decay `[G, H, K]`, the final states' gradient `dht` (fp32 or None), and the forward's piece starts and final
    states -> (R `[G, H, K, V]` each piece's gradient from after it, the initial states' gradient `[N, H, K, V]`,
    `[G, H, K]` each piece's gates' gradient from after it, rowsum(S_end * R)), fp32."""
    rstarts, dh0 = torch.empty_like(own), own.new_empty(segs.shape[0], H, K, V)
    off = decay.new_empty(decay.shape)
    _launch_scan(own, decay, dht, segs, rstarts, dh0, (f_starts, f_end, off), H, K, V, 16,
                 max(16, triton.next_power_of_2(V)), True)
    return rstarts, dh0, off


def _launch_scan(own, decay, s0, segs, starts, s_end, ends, H, K, V, BR, BC, reverse):
    """`_scan_kernel` over [BR, BC] state blocks; `ends` (the forward's piece starts, final states, the gates'
    suffix out) read and written only with `reverse`, which needs BC >= V."""
    if interpreting():
        interpreter_shim()
    _scan_kernel[(triton.cdiv(K, BR) * triton.cdiv(V, BC), segs.shape[0] * H)](
        own, decay, own if s0 is None else s0, starts, s_end, segs, *ends, H=H, K=K, V=V, BR=BR, BC=BC,
        HAS_H0=s0 is not None, REVERSE=reverse, num_warps=4)


class Gather(NamedTuple):
    """SSE's varlen layout read where it is (`ops/sse/reference.py`) instead of packed by `triton/sse_route.pack_rows`.
    Row r < L0 of the call is row r of the tensors passed as q, k, v, g (the shared path); row L0 + j is row
    order[j] // K of the sparse tensors below, its q / k times scale[order[j]] where `scale_q` / `scale_k`. The
    rows of dropped (padding) pairs are read as they are: they sort into their own trailing segment, whose output
    and state the caller drops, so the zeros the packer writes there change nothing it keeps.
    `packed`: q, k, v, g are the sparse rows already packed and scaled (`[1, M, H, *]`, by `triton_route`'s packer):
    row L0 + j is their row j, only the shared path is read in place (`scale` is then unused)."""
    q: torch.Tensor              # [1, L, H, K] sparse path (and k, g); v [1, L, H, V]
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    order: torch.Tensor          # [M] int64: the sorted pairs
    scale: torch.Tensor | None   # [L * K] fp32: router probability of every pair
    K: int                       # slots per token
    L0: int                      # shared rows in front (0: no shared path)
    scale_q: bool
    scale_k: bool
    packed: bool = False


def _gather_args(q, k, v, g, gather):
    """The kernels' (sparse q, k, v, g, order, scale, L0) arguments and (KS, GATHER, SCALE_Q, SCALE_K) flags."""
    if gather is None:
        return (q, k, v, g, q, q, 0), dict(KS=1, GATHER=False, SCALE_Q=False, SCALE_K=False, PACKED=False)
    x = gather
    scaled = x.scale is not None and not x.packed
    w = x.scale if scaled else x.order
    return ((x.q, x.k, x.v, x.g, x.order, w, x.L0),
            dict(KS=x.K, GATHER=True, SCALE_Q=x.scale_q and scaled, SCALE_K=x.scale_k and scaled, PACKED=x.packed))


def forward_pieces(q, k, v, g, scale, s0, pc, chunk_size=None, gather: Gather | None = None,
                   keep_scores: bool = False):
    """The forward on contiguous inputs over the pieces `pc`: (o `[B, T, H, V]`, each piece's starting state
    `[G, H, K, V]`, each piece's total log-decay `[G, H, K]` (floored gates), each sequence's final state
    `[N, H, K, V]`, the scores or None), states fp32. `s0`: fp32 initial state or None. `gather`: read SSE's layout
    in place (then o is `[1, L0 + M, H, V]`). `keep_scores`: also the output pass's in-tile scores, A `[B * T, H,
    SCORE_TILE]` in v's dtype (row t: A[t, s] for the tokens s of its tile, as the pass rounded them for its product),
    which the backward's dv pass reads instead of computing them again."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if gather is not None:
        B, T = 1, gather.L0 + gather.order.numel()
    G = pc.seg.shape[0]
    f32 = dict(dtype=torch.float32, device=q.device)
    own, decay = torch.empty(G, H, K, V, **f32), torch.empty(G, H, K, **f32)
    o = torch.empty(B, T, H, V, dtype=v.dtype, device=q.device)
    prec = _precision(q.dtype)
    BK = max(16, triton.next_power_of_2(K))
    src, flags = _gather_args(q, k, v, g, gather)
    st_src, st_flags = src[1:], {n: flags[n] for n in ("KS", "GATHER", "SCALE_K", "PACKED")}
    if interpreting():
        interpreter_shim()
        BT = interp_tile(chunk_size)
        _piece_state_kernel[(triton.cdiv(K, 16) * triton.cdiv(V, 16), G * H)](
            k, v, g, *st_src, pc.seg, own, decay, H=H, K=K, V=V, BT=BT, BR=16, BC=16, PREC=prec, G_MIN=G_MIN,
            **st_flags)
    else:
        autotuned(_piece_state_kernel, _state_configs, ["K", "V", "PREC", *st_flags])[
            lambda m: (triton.cdiv(K, m["BR"]) * triton.cdiv(V, m["BC"]), G * H)](
            k, v, g, *st_src, pc.seg, own, decay, H=H, K=K, V=V, PREC=prec, G_MIN=G_MIN, **st_flags)
    starts, s_end = scan_pieces(own, decay, s0, pc.segs, H, K, V)
    bucket = tune_buckets(B * T, G * H)
    scores = torch.empty(B * T, H, SCORE_TILE, dtype=v.dtype, device=q.device) if keep_scores else None
    args = (q, k, v, g, *src, pc.seg, starts, o, o if scores is None else scores, scale)
    if interpreting():
        BV = min(16, triton.next_power_of_2(V))
        _output_kernel[(triton.cdiv(V, BV), G * H)](*args, H=H, K=K, V=V, BK=BK, BT=16, BV=BV, PREC=prec,
                                                    G_MIN=G_MIN, KEEP_A=keep_scores, **flags, **bucket)
    else:
        autotuned(_output_kernel, _out_configs, ["K", "V", "PREC", *flags, "KEEP_A", *bucket])[
            lambda m: (triton.cdiv(V, m["BV"]), G * H)](*args, H=H, K=K, V=V, BK=BK, PREC=prec, G_MIN=G_MIN,
                                                        KEEP_A=keep_scores, **flags, **bucket)
    return o, starts, decay, s_end, scores


def check_inputs(q, k, v, g, cu_seqlens):
    """One-line errors for what the pieces kernels do not take."""
    if g.shape != q.shape:
        raise ValueError(f"the pieces GLA takes per-key-channel gates {tuple(q.shape)}, got {tuple(g.shape)}")
    if k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"q, k `[B, T, H, K]` and v `[B, T, H, V]` must agree, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    # batch only: `varlen.check_cu_seqlens` also reads the packed total on the host (a sync on SSE's path, and
    # with `Gather` the rows are not q's)
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs a packed batch of 1, got batch {q.shape[0]}")


def gla_fwd_triton(q, k, v, g, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                   chunk_size=None, segment_len: int | None = None, gather: Gather | None = None):
    """(o `[B, T, H, V]` in v's dtype, final state `[N, H, K, V]` fp32 or None), no gradient. g: per-key-channel
    log-decay `[B, T, H, K]` (<= 0). `segment_len`: piece length (None: automatic on GPU, one piece per
    sequence in the interpreter; 0: one piece per sequence). `chunk_size`: the interpreter's tile (GPU tiles are
    autotuned). `gather`: SSE's packed layout read in place (`Gather`; q, k, v, g are then the shared path's
    tensors, `cu_seqlens` the layout's and o `[1, L0 + M, H, V]`). With gradients use `gla_bwd.gla_triton`."""
    ins = (q, k, v, g) + (() if gather is None else (gather.q, gather.k, gather.v, gather.g))
    if torch.is_grad_enabled() and any(t.requires_grad for t in ins):
        raise ValueError("gla_fwd_triton has no backward; call it under torch.no_grad() or use gla_triton")
    check_inputs(q, k, v, g, cu_seqlens)
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else float(scale)
    q, k, v, g = (t.contiguous() for t in (q, k, v, g))
    if gather is not None:
        check_inputs(gather.q, gather.k, gather.v, gather.g, cu_seqlens)
        if cu_seqlens is None or (gather.q.dtype, gather.v.dtype) != (q.dtype, v.dtype):
            raise ValueError("gla_fwd_triton(gather=...) needs cu_seqlens and the same dtypes on both paths")
        gather = gather._replace(**{n: getattr(gather, n).contiguous() for n in ("q", "k", "v", "g", "order")})
        B, T = 1, gather.L0 + gather.order.numel()
    cu = None if cu_seqlens is None else cu_seqlens.to(device=q.device, dtype=torch.long).contiguous()
    pc, _ = _pieces_for(q, B, T, cu, segment_len)
    s0 = None if initial_state is None else initial_state.to(dtype=torch.float32, device=q.device).contiguous()
    o, _, _, s_end, _ = forward_pieces(q, k, v, g, scale, s0, pc, chunk_size, gather)
    return o, (s_end if output_final_state else None)


__all__ = ["Gather", "gla_fwd_triton", "reverse_scan", "scan_pieces"]
