"""GLA's backward in the pieces layout of `triton_fwd.py`, and `gla_triton`: the op with both directions.

For S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T and o_t = scale * S_t^T q_t (per-key-channel gates), with do the
output's gradient and dS_t the gradient of the state S_t (from every later read, plus the final state's):

    dS_{t-1} = diag(exp(g_t)) dS_t + scale q_{t-1} do_{t-1}^T
    dq_t = scale S_t do_t           dk_t = dS_t v_t           dv_t = dS_t^T k_t
    dg_t = sum_{t' >= t} (q_t' * dq_t' - k_t' * dk_t')  +  rowsum(S_final * dS_final)

Pieces (`triton_utils.make_pieces`), as the forward: (1) `_dq_kernel`, forward in time from the forward's piece
starts (kept): dq, q * dq (fp32, for dg; see "Precision of dg"), the anchored states, and each piece's own state
gradient from its tokens alone, D = sum_t exp(G_t) scale q_t do_t^T (G inclusive from the piece's start); (2) the
forward's scan run from the last piece (`triton_fwd.reverse_scan`): R(j), the state gradient each piece receives
from after its end, the initial state's gradient, and the suffix of dg past each piece, rowsum(S_end(j) * R(j))
(that equals dL/dg at the next piece's first token, see below; S_end(j) is the forward's next piece start or final
state), so dg needs no scan of its own; (3) `_dk_kernel`, backward in time from R(j): dk, and dg as the in-tile
suffix sum of q * dq - k * dk (a product with the 16 x 16 triangle: dk 0.93 against 1.18 ms with a cumsum at 16k on
SSE's layout, one H200) plus the carried suffix, reset to its exact value at every anchor; (4) `_dv_kernel`,
backward in time from R(j): dv, with each tile's scores A as the forward's output pass kept them
(`forward_pieces(keep_scores=True)`, `[rows, H, 16]` in v's dtype, 16 MB at 16k tokens on SSE's layout) instead of
computing them again: on one H200 at 16k dv took 0.53 against 0.71 ms and the output pass 0.67 against 0.63 for the
store, forward+backward -2.8% (benchmarks/RESULTS.md). D was a GEMM walk of its own over wide tiles before the dq
pass took it (it reads the same q, g and do). (One pass for dk and dv, a program per (piece, head) carrying the
whole K x V gradient, measured slower on the H100 at 16k on SSE's layout with 256 or more rows: 2.31-2.49 ms against
2.01-2.19 for the two, benchmarks/RESULTS.md; their key / value blocks give more programs.)

Precision of dg: its suffix runs over a piece and its terms cancel (scaling a key channel of q by a and of k by 1/a
leaves the output unchanged, so a sequence's terms sum to zero without an initial state), so rounding in the 16-bit
products adds up over the sum. Two things keep it short of that (a CPU model of the passes' roundings,
`benchmarks/ops/gla_dg_rounding.py`, found them and reproduces the GPU's figures): (a) consistent terms: each pass
forms its part of dG = q dq - k dk from the operands as the other pass rounded them for the partner product (the dq
pass's q dq through the state with q as the dk pass's state-gradient update rounds it, its in-tile part with q as
the dk pass's in-tile product rounds it, and the dk pass's k dk likewise), so each token pair's two terms cancel in
the sums as they do exactly; (b) anchors: every `gla_dg_anchor` tokens into a piece (kernel option, default 512) the
dq pass stores its state in bf16 (`anchors`, `[ceil(rows / 512), H, K, V]`, a quarter of q's size at K = V = 128)
and the dk pass sets the suffix to rowsum(S * dS) there, as the reverse scan does at a piece's end, so no sum runs
longer than 512 tokens (a call whose pieces are all at most 512 tokens runs without them). Against a float64
reference on bf16 inputs with mild gates (`benchmarks/ops/gla_grad_error.py`, one H200) dg's error is 8.8e-3 at 4k
tokens with 512- or 2048-token pieces and at 16k tokens, where it was 1.5e-2 / 2.9e-2 at 4k without (a) and (b),
growing with the piece; fla's chunk_gla's is 1.6e-3 (it restarts every 64-token chunk from its stored states); dq,
dk and dv are within 1.5x of fla's. The cost at 16k on SSE's layout, forward+backward: +0.3% for (a), +1.1% more for
(b) and 32 MiB (4.047-4.059 against 4.009-4.013 ms alternating, 3.993-4.005 with neither; 256-token anchors: 6.5e-3
for 4.062 ms and 64 MiB; benchmarks/RESULTS.md). What is left is the state reads' rounding (bf16 products with the
fp32 state): split reads (`gla_products="split"`) would take it to ~2.4e-3 in the model, for ~13% more time.

Why rowsum(S_end * R) is the suffix: dL/dg_t = rowsum(exp(g_t) S_{t-1} * dS_t), and for the first token t of the
next piece exp(g_t) dS_t is R(j) (the gradient from later tokens only) and S_{t-1} is S_end(j).

SSE's varlen layout can be read in place here too (`backward_pieces(gather=...)`, `triton_fwd.Gather`): the passes
read the shared and sparse tensors where they are and each sparse row's output gradient from its token's row
(`ops/sse/triton_gathered_gla.py`), or with `Gather.packed` the shared path where it is and the sparse rows (and
their output gradient, `do_sparse`) packed; their gradients come in the packed layout. The dq and dk passes load
from a pointer chosen per piece (`_load`'s SELECT, software-pipelined): with the loads in a branch they took
0.19-0.23 ms more each at 16k on one H200 (benchmarks/RESULTS.md); dv keeps the branch.

Tiles, like the forward's output pass: 16 tokens, scores factored through a reference at half the tile's decay,
per-token log-decays floored at `gla_fwd.G_MIN` = -8 (the floored gates get no gradient, as a clamp's). fp32
accumulation; 16-bit products, the carried fp32 state rounded once per product, as fla does.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from hybridize.errors import UserError
from hybridize.ops.common.fla_adapter import needs_grad
from hybridize.ops.common.options import current_kernel_options

from hybridize.ops.common.triton_utils import (autotuned, interpreter_shim, interpreting, mdot_r, seg_bounds,
                                               tune_buckets)
from hybridize.ops.gla.triton_fwd import (G_MIN, SCORE_TILE, Gather, _gather_args, _load, _pieces_for, _precision,
                                          _scaled, _sources, check_inputs, forward_pieces, reverse_scan, tune_list)


@triton.jit
def _tile(q, k, g, q_sp, k_sp, g_sp, src, sparse, w, m_t, i_h, o_k, m_k, H: tl.constexpr, K: tl.constexpr,
          G_MIN: tl.constexpr, GATHER: tl.constexpr, SCALE_Q: tl.constexpr, SCALE_K: tl.constexpr,
          SELECT: tl.constexpr):
    """q, k `[BT, BK]` (input dtype; with GATHER read from SSE's layout in place and scaled as the row packer
    scales them, `triton_fwd._sources`), the floored gates' inclusive cumsum over the tile (fp32), the tile's
    total log-decay `[BK]`, and whether each gate is above the floor (its gradient passes). SELECT: `_load`'s."""
    m_tk = m_t[:, None] & m_k[None, :]
    b_q = _scaled(_load(q, q_sp, src, sparse, i_h, o_k, m_tk, K, H, GATHER, SELECT), w, SCALE_Q)
    b_k = _scaled(_load(k, k_sp, src, sparse, i_h, o_k, m_tk, K, H, GATHER, SELECT), w, SCALE_K)
    b_graw = _load(g, g_sp, src, sparse, i_h, o_k, m_tk, K, H, GATHER, SELECT).to(tl.float32)
    b_g = tl.maximum(b_graw, G_MIN)
    return b_q, b_k, tl.cumsum(b_g, 0), tl.sum(b_g, 0), b_graw >= G_MIN


@triton.jit
def _rows_tile(q, k, v, g, do, q_sp, k_sp, v_sp, g_sp, do_sp, order, wsc, L0, bos, rows, m_t, i_h, o_k, m_k, o_v,
               m_v, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, G_MIN: tl.constexpr, KS: tl.constexpr,
               GATHER: tl.constexpr, SCALE_Q: tl.constexpr, SCALE_K: tl.constexpr, PACKED: tl.constexpr):
    """The dq and dk passes' tile: `_tile`'s five values, then v and the output's gradient `[BT, BV]`, every load
    from a pointer chosen per piece (`_load`'s SELECT: software-pipelined, which these two passes need)."""
    src, sparse, w = _sources(rows, m_t, bos, order, wsc, L0, KS, GATHER, SCALE_Q or SCALE_K, PACKED)
    b_q, b_k, b_gc, b_last, b_pass = _tile(q, k, g, q_sp, k_sp, g_sp, src, sparse, w, m_t, i_h, o_k, m_k, H, K,
                                           G_MIN, GATHER, SCALE_Q, SCALE_K, True)
    m_tv = m_t[:, None] & m_v[None, :]
    b_v = _load(v, v_sp, src, sparse, i_h, o_v, m_tv, V, H, GATHER, True)
    b_do = _load(do, do_sp, src, sparse, i_h, o_v, m_tv, V, H, GATHER, True)
    return b_q, b_k, b_gc, b_last, b_pass, b_v, b_do


@triton.jit
def _anchor_rows(anchors, row, ANCHOR: tl.constexpr, i_h, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    """Where the anchored state before flat row `row` lives in `anchors` `[ceil(rows / ANCHOR), H, K, V]`: slot
    row // ANCHOR. Anchors sit ANCHOR tokens apart inside a piece and a piece's first anchor ANCHOR tokens after its
    start, so no two share a slot."""
    return anchors + ((row // ANCHOR).to(tl.int64) * H + i_h) * K * V


@triton.jit
def _dq_kernel(q, k, v, g, do, q_sp, k_sp, v_sp, g_sp, do_sp, order, wsc, L0, seg, starts, dq, dgq, d_own, anchors,
               scale, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
               BV: tl.constexpr, PREC: tl.constexpr, G_MIN: tl.constexpr, PROD: tl.constexpr,
               KS: tl.constexpr, GATHER: tl.constexpr, SCALE_Q: tl.constexpr, SCALE_K: tl.constexpr,
               PACKED: tl.constexpr, ANCHOR: tl.constexpr, LEN, ROWS):
    # one program per (key block, piece, head), forward in time carrying the state's rows S[BK, V] and the rows of
    # the piece's own state gradient D[BK, V] = sum_t exp(G_t) scale q_t do_t^T (G inclusive from the piece's
    # start: exponents <= 0, no rescaling as the walk goes on); every ANCHOR tokens into the piece (0: never) the
    # state before the tile goes to `anchors` (`_anchor_rows`) for the dk pass; LEN / ROWS: autotune key only
    i_k, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, L = seg_bounds(seg, i_n)
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    tril = o_t[:, None] >= o_t[None, :]
    o_kv = o_k[:, None] * V + o_v[None, :]
    blk = i_nh.to(tl.int64) * K * V + o_kv
    m_blk = m_k[:, None] & m_v[None, :]
    b_S = tl.load(starts + blk, mask=m_blk, other=0.0)
    b_D = tl.zeros([BK, BV], dtype=tl.float32)
    b_G = tl.zeros([BK], dtype=tl.float32)
    for i_t in range(0, tl.cdiv(L, BT)):
        m_t = i_t * BT + o_t < L
        rows = bos + i_t * BT + o_t
        if ANCHOR > 0:
            if (i_t > 0) & (i_t % (ANCHOR // BT) == 0):
                tl.store(_anchor_rows(anchors, bos + i_t * BT, ANCHOR, i_h, H, K, V) + o_kv,
                         b_S.to(anchors.dtype.element_ty), mask=m_blk)
        b_q, b_k, b_gc, b_last, _, b_v, b_do = _rows_tile(
            q, k, v, g, do, q_sp, k_sp, v_sp, g_sp, do_sp, order, wsc, L0, bos, rows, m_t, i_h, o_k, m_k, o_v, m_v,
            H, K, V, G_MIN, KS, GATHER, SCALE_Q, SCALE_K, PACKED)
        dt = b_v.dtype
        b_ref = 0.5 * b_last
        # the state is read and updated first, the products and stores of the tile after it: 250 registers, not
        # 255, at the picked BK=32 (0.975 against 0.992 ms at 16k on SSE's layout, one H200; benchmarks/RESULTS.md)
        b_ps = mdot_r(b_do, tl.trans(b_S), PROD, PREC)          # through the state
        b_kd = (b_k.to(tl.float32) * tl.exp(b_last[None, :] - b_gc)).to(dt)
        b_S = b_S * tl.exp(b_last)[:, None] + tl.dot(tl.trans(b_kd), b_v, input_precision=PREC)
        b_B = tl.where(tril, tl.dot(b_do, tl.trans(b_v), input_precision=PREC), 0.0)
        b_pi = tl.dot(b_B.to(dt), (b_k.to(tl.float32) * tl.exp(b_ref[None, :] - b_gc)).to(dt),
                      input_precision=PREC)                      # in the tile
        b_qs = b_q.to(tl.float32) * scale
        b_dq = (b_ps * tl.exp(b_gc) + b_pi * tl.exp(b_gc - b_ref[None, :])) * scale
        # q dq for dg, each part with q rounded as the dk pass rounds it for that part's partner product (`_dk_kernel`:
        # its state gradient's update, its in-tile product), so each token pair's two terms cancel in dg's sums
        b_dgq = ((b_qs * tl.exp(b_gc)).to(dt).to(tl.float32) * b_ps
                 + (b_qs * tl.exp(b_gc - b_ref[None, :])).to(dt).to(tl.float32) * b_pi)
        b_qd = (b_qs * tl.exp(b_G[None, :] + b_gc)).to(dt)
        b_D += tl.dot(tl.trans(b_qd), b_do, input_precision=PREC)
        b_G += b_last
        pk = (rows[:, None] * H + i_h) * K + o_k[None, :]
        m_tk = m_t[:, None] & m_k[None, :]
        tl.store(dq + pk, b_dq.to(dq.dtype.element_ty), mask=m_tk)
        tl.store(dgq + pk, b_dgq, mask=m_tk)
    tl.store(d_own + blk, b_D, mask=m_blk)


@triton.jit
def _dk_kernel(q, k, v, g, do, q_sp, k_sp, v_sp, g_sp, do_sp, order, wsc, L0, seg, rstarts, dgq, off, anchors, dk, dg,
               scale, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
               BV: tl.constexpr, PREC: tl.constexpr, G_MIN: tl.constexpr, PROD: tl.constexpr,
               KS: tl.constexpr, GATHER: tl.constexpr, SCALE_Q: tl.constexpr, SCALE_K: tl.constexpr,
               PACKED: tl.constexpr, ANCHOR: tl.constexpr, LEN, ROWS):
    # one program per (key block, piece, head), backward in time carrying the state gradient's rows dS[BK, V]
    # and the gates' gradient suffix [BK]; at an anchor (every ANCHOR tokens into the piece) the suffix is set to
    # its exact value rowsum(S * dS), S the dq pass's anchored state, as the reverse scan sets it at a piece's end
    i_k, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, L = seg_bounds(seg, i_n)
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    triu = o_t[:, None] <= o_t[None, :]      # [s, t]: key s is read by query t >= s
    o_kv = o_k[:, None] * V + o_v[None, :]
    m_blk = m_k[:, None] & m_v[None, :]
    b_dS = tl.load(rstarts + i_nh.to(tl.int64) * K * V + o_kv, mask=m_blk, other=0.0)
    b_c = tl.load(off + i_nh.to(tl.int64) * K + o_k, mask=m_k, other=0.0)
    NT = tl.cdiv(L, BT)
    for i in range(0, NT):
        i_t = NT - 1 - i
        if ANCHOR > 0:
            if (i_t + 1 < NT) & ((i_t + 1) % (ANCHOR // BT) == 0):
                b_Sa = tl.load(_anchor_rows(anchors, bos + (i_t + 1) * BT, ANCHOR, i_h, H, K, V) + o_kv,
                               mask=m_blk, other=0.0)
                b_c = tl.sum(b_Sa.to(tl.float32) * b_dS, 1)
        m_t = i_t * BT + o_t < L
        rows = bos + i_t * BT + o_t
        b_q, b_k, b_gc, b_last, b_pass, b_v, b_do = _rows_tile(
            q, k, v, g, do, q_sp, k_sp, v_sp, g_sp, do_sp, order, wsc, L0, bos, rows, m_t, i_h, o_k, m_k, o_v, m_v,
            H, K, V, G_MIN, KS, GATHER, SCALE_Q, SCALE_K, PACKED)
        dt = b_v.dtype
        b_ref = 0.5 * b_last
        b_qs = b_q.to(tl.float32) * scale
        b_Bt = tl.where(triu, tl.dot(b_v, tl.trans(b_do), input_precision=PREC), 0.0)
        b_pi = tl.dot(b_Bt.to(dt), (b_qs * tl.exp(b_gc - b_ref[None, :])).to(dt),
                      input_precision=PREC)                       # in the tile
        # rounded here, not at the update: q in fp32 dies earlier (the picked BK=32, 2-warp config spills 16 bytes,
        # not 24; 1.19 against 1.21 ms at 16k on SSE's layout, one H200; benchmarks/RESULTS.md)
        b_qd = (b_qs * tl.exp(b_gc)).to(dt)
        b_ps = mdot_r(b_v, tl.trans(b_dS), PROD, PREC)           # through the state
        b_dk = b_pi * tl.exp(b_ref[None, :] - b_gc) + b_ps * tl.exp(b_last[None, :] - b_gc)
        pk = (rows[:, None] * H + i_h) * K + o_k[None, :]
        m_tk = m_t[:, None] & m_k[None, :]
        tl.store(dk + pk, b_dk.to(dk.dtype.element_ty), mask=m_tk)
        # k dk for dg, each part with k rounded as the dq pass rounds it for that part's partner product (its state
        # update, its in-tile product): the counterpart of the dq pass's `dgq`
        b_kf = b_k.to(tl.float32)
        b_dG = (tl.load(dgq + pk, mask=m_tk, other=0.0)
                - (b_kf * tl.exp(b_last[None, :] - b_gc)).to(dt).to(tl.float32) * b_ps
                - (b_kf * tl.exp(b_ref[None, :] - b_gc)).to(dt).to(tl.float32) * b_pi)
        # the in-tile suffix sum as a product with the triangle (3xTF32: fp32's precision), not tl.cumsum: it stays in
        # the product's register layout, where cumsum took dG to a blocked layout and back (12 -> 8 layout
        # conversions; dk 0.93 against 1.18 ms at 16k on SSE's layout, one H200; benchmarks/RESULTS.md)
        b_suf = tl.dot(triu.to(tl.float32), b_dG, input_precision="tf32x3")
        b_tot = tl.sum(b_dG, 0)
        b_dg = b_c[None, :] + b_suf
        tl.store(dg + pk, tl.where(b_pass, b_dg, 0.0).to(dg.dtype.element_ty), mask=m_tk)
        b_c += b_tot
        b_dS = b_dS * tl.exp(b_last)[:, None] + tl.dot(tl.trans(b_qd), b_do, input_precision=PREC)


@triton.jit
def _dv_kernel(q, k, g, do, q_sp, k_sp, g_sp, do_sp, order, wsc, L0, seg, rstarts, a_in, dv, scale, H: tl.constexpr,
               K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               PREC: tl.constexpr, G_MIN: tl.constexpr, PROD: tl.constexpr,
               KS: tl.constexpr, GATHER: tl.constexpr, SCALE_Q: tl.constexpr, SCALE_K: tl.constexpr,
               PACKED: tl.constexpr, LEN, ROWS):
    # one program per (value block, piece, head), backward in time carrying the state gradient's columns dS[K, BV];
    # the tiles' scores A as the forward's output pass kept them (a_in `[rows, H, BT]`), read transposed
    tl.static_assert(BT == 16, "the kept scores are 16-token tiles (triton_fwd.SCORE_TILE)")
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, L = seg_bounds(seg, i_n)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    b_dS = tl.load(rstarts + i_nh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :],
                   mask=m_k[:, None] & m_v[None, :], other=0.0)
    NT = tl.cdiv(L, BT)
    for i in range(0, NT):
        i_t = NT - 1 - i
        m_t = i_t * BT + o_t < L
        rows = bos + i_t * BT + o_t
        src, sparse, w = _sources(rows, m_t, bos, order, wsc, L0, KS, GATHER, SCALE_Q or SCALE_K, PACKED)
        b_q, b_k, b_gc, b_last, _ = _tile(q, k, g, q_sp, k_sp, g_sp, src, sparse, w, m_t, i_h, o_k, m_k, H, K,
                                          G_MIN, GATHER, SCALE_Q, SCALE_K, False)
        pv = (rows[:, None] * H + i_h) * V + o_v[None, :]
        b_do = _load(do, do_sp, src, sparse, i_h, o_v, m_t[:, None] & m_v[None, :], V, H, GATHER, False)
        dt = b_do.dtype
        b_qs = b_q.to(tl.float32) * scale
        b_At = tl.load(a_in + (rows[None, :] * H + i_h) * BT + o_t[:, None], mask=m_t[None, :], other=0.0)
        b_dv = tl.dot(b_At, b_do, input_precision=PREC)
        b_dv += mdot_r((b_k.to(tl.float32) * tl.exp(b_last[None, :] - b_gc)).to(dt), b_dS, PROD, PREC)
        tl.store(dv + pv, b_dv.to(dv.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])
        b_qd = (b_qs * tl.exp(b_gc)).to(dt)
        b_dS = b_dS * tl.exp(b_last)[:, None] + tl.dot(tl.trans(b_qd), b_do, input_precision=PREC)


#: the dq and dk passes' (BT, BK, num_warps, num_stages): key-channel blocks with the whole value width carried. The
#: last two: the fastest of a wider sweep (stages 1-3) for both passes on SSE's 16k layout, one H200 (dk 1.15 against
#: 1.27 ms, dq 0.76 against 0.82 for the best before; benchmarks/RESULTS.md)
ROW_TILES = [(16, 32, 4, 2), (16, 64, 4, 2), (16, 64, 8, 2), (16, 32, 2, 2), (16, 128, 8, 2), (16, 32, 2, 3),
             (16, 64, 4, 3)]


def _key_block_configs(table):
    return [triton.Config({"BT": bt, "BK": bk}, num_warps=w, num_stages=st) for bt, bk, w, st in tune_list(table)]


def _row_configs():
    # the dk pass
    return _key_block_configs(ROW_TILES)


def _dq_configs():
    # the dq pass carries two [BK, V] fp32 blocks (the state and the piece's own state gradient): narrower key blocks
    # too; the last was the one picked on SSE's 16k layout, one H200 (benchmarks/RESULTS.md)
    return _key_block_configs(ROW_TILES + [(16, 16, 2, 2), (16, 16, 4, 2), (16, 32, 4, 3)])


def _col_configs():
    # the dv pass: value-channel blocks with the whole key width carried
    table = [(16, 32, 4, 2), (16, 64, 4, 2), (16, 128, 4, 2), (16, 64, 8, 2), (16, 128, 8, 2), (16, 32, 2, 2)]
    return [triton.Config({"BT": bt, "BV": bv}, num_warps=w, num_stages=st) for bt, bv, w, st in tune_list(table)]


def backward_pieces(q, k, v, g, do, dht, starts, s_fin, decay, scores, pc, scale, prod: int | None = None,
                    gather: Gather | None = None, do_sparse: torch.Tensor | None = None, anchor: int | None = None):
    """(dq, dk, dv, dg in the inputs' dtypes, dh0 `[N, H, K, V]` fp32) from the output's gradient `do` and the
    final state's `dht` (fp32 or None), with the forward's piece starts, final states `s_fin` `[N, H, K, V]`, total
    log-decays and in-tile scores (`forward_pieces(keep_scores=True)`). `prod`: the products setting the forward read
    (`_products`; None: read it now). `gather`: the forward read SSE's layout in place (`triton_fwd.Gather`; q, k, v,
    g the shared path's tensors): the passes read it in place too, `do` is the combined output's gradient
    `[1, L, H, V]` (a sparse row reads its token's), and the gradients come in the packed layout `[1, L0 + M, ...]`,
    the rows the packer would have built. With `gather.packed` the sparse rows' output gradient comes packed too,
    `do_sparse` `[1, M, H, V]`. `anchor`: the kernel option `gla_dg_anchor` the forward read (`_dg_anchor`; None: read
    it now)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if gather is not None:
        B, T = 1, gather.L0 + gather.order.numel()
    if scores is None or scores.shape != (B * T, H, SCORE_TILE) or scores.dtype != v.dtype:
        raise ValueError("backward_pieces needs the forward's scores: forward_pieces(..., keep_scores=True)")
    G = pc.seg.shape[0]
    f32 = dict(dtype=torch.float32, device=q.device)
    prec = _precision(q.dtype)
    BKF, BVF = max(16, triton.next_power_of_2(K)), max(16, triton.next_power_of_2(V))
    src, flags = _gather_args(q, k, v, g, gather)     # (q_sp, k_sp, v_sp, g_sp, order, wsc, L0), constexprs
    if gather is not None and gather.packed:
        if do_sparse is None:
            raise ValueError("backward_pieces: a packed Gather needs the sparse rows' output gradient (do_sparse)")
        do_sp = do_sparse.contiguous()
    else:
        do_sp = do
    q_sp, k_sp, v_sp, g_sp, order, wsc, L0 = src
    dq, dk, dg = (torch.empty(B, T, H, K, dtype=t.dtype, device=q.device) for t in (q, k, g))
    dv = torch.empty(B, T, H, V, dtype=v.dtype, device=q.device)
    dgq, own = torch.empty(B, T, H, K, **f32), torch.empty(G, H, K, V, **f32)
    prod = _products(q.dtype) if prod is None else prod
    anchor = _dg_anchor() if anchor is None else anchor
    # the dq pass's anchored states for dg (`_anchor_rows`), in the inputs' dtype (a bf16 state, as fla keeps its
    # chunk states): B * T * H * K * V / anchor elements, a quarter of q's size at K = V = 128 and anchor 512
    anchors = torch.empty(triton.cdiv(B * T, anchor) if anchor else 1, H, K, V, dtype=q.dtype, device=q.device)
    common = dict(H=H, K=K, V=V, PREC=prec, G_MIN=G_MIN, PROD=prod, **flags, **tune_buckets(B * T, G * H))
    rows_only = dict(ANCHOR=anchor)       # the dq and dk passes' own constexprs
    rows = (q, k, v, g, do, q_sp, k_sp, v_sp, g_sp, do_sp, order, wsc, L0, pc.seg)
    v_rows = (q, k, g, do, q_sp, k_sp, g_sp, do_sp, order, wsc, L0, pc.seg)
    interp = interpreting()
    key = ["K", "V", "PREC", "PROD", *flags, "LEN", "ROWS"]
    row_key = key + list(rows_only)     # a setting of their own compiles and tunes apart
    by_rows = lambda m: (triton.cdiv(K, m["BK"]), G * H)  # noqa: E731
    # (1) dq and every piece's own state gradient, (2) the reverse scan, (3) dk and dg, (4) dv
    if interp:
        interpreter_shim()
        _dq_kernel[(triton.cdiv(K, 16), G * H)](*rows, starts, dq, dgq, own, anchors, scale, BT=16, BK=16,
                                                BV=BVF, **common, **rows_only)
    else:
        autotuned(_dq_kernel, _dq_configs, row_key)[by_rows](*rows, starts, dq, dgq, own, anchors, scale, BV=BVF,
                                                             **common, **rows_only)
    rstarts, dh0, off = reverse_scan(own, decay, dht, pc.segs, starts, s_fin, H, K, V)
    if interp:
        grid = (triton.cdiv(K, 16), G * H)
        _dk_kernel[grid](*rows, rstarts, dgq, off, anchors, dk, dg, scale, BT=16, BK=16, BV=BVF, **common,
                         **rows_only)
        _dv_kernel[(triton.cdiv(V, 16), G * H)](*v_rows, rstarts, scores, dv, scale, BT=16, BK=BKF, BV=16,
                                                **common)
        return dq, dk, dv, dg, dh0
    autotuned(_dk_kernel, _row_configs, row_key)[by_rows](*rows, rstarts, dgq, off, anchors, dk, dg, scale, BV=BVF,
                                                         **common, **rows_only)
    autotuned(_dv_kernel, _col_configs, key)[lambda m: (triton.cdiv(V, m["BV"]), G * H)](
        *v_rows, rstarts, scores, dv, scale, BK=BKF, **common)
    return dq, dk, dv, dg, dh0


def _products(dtype) -> int:
    """`triton_utils.mdot_r`'s PROD for the products with a carried fp32 state (gradient): fp32 inputs 0 (IEEE);
    bf16 2, one bf16 product (the state rounded once, as fla does), or with the kernel option
    `gla_products="split"` (`HYBRIDIZE_GLA_PRODUCTS=split`) 1, two bf16 products of a hi/lo split (~16 mantissa
    bits of the state); fp16 0 (tf32 tiles)."""
    mode = current_kernel_options().gla_products   # checked there
    if dtype != torch.bfloat16:
        return 0
    return 1 if mode == "split" else 2


def _dg_anchor(longest: int | None = None) -> int:
    """The kernel option `gla_dg_anchor` (`HYBRIDIZE_GLA_DG_ANCHOR`): tokens between the dk pass's exact resets of
    the gates' gradient suffix (`_dk_kernel`), a multiple of the 16-token tile; 0: none. With `longest`, a bound on
    the call's longest piece (`_pieces_for`), 0 too when no piece is longer than n: an anchor falls only inside
    a piece, so the passes then run without the anchors' stores, resets and memory (the same numbers)."""
    n = current_kernel_options().gla_dg_anchor
    if n % 16:
        raise UserError(f"kernel option gla_dg_anchor (HYBRIDIZE_GLA_DG_ANCHOR) must be a multiple of 16 tokens or 0, "
                        f"got {n}")
    return 0 if longest is not None and longest <= n else n


class _GLAFn(torch.autograd.Function):
    """(q, k, v, g, s0 fp32 or None) -> (o, final state fp32) over the pieces `pc`; the forward keeps its piece
    starts and decays for the backward's dq pass and reverse scan."""

    @staticmethod
    def forward(ctx, q, k, v, g, s0, pc, scale, chunk_size, keep_scores, longest):
        o, starts, decay, s_end, scores = forward_pieces(q, k, v, g, scale, s0, pc, chunk_size,
                                                         keep_scores=keep_scores)
        ctx.save_for_backward(q, k, v, g, starts, s_end, decay, scores)
        ctx.pc, ctx.scale, ctx.has_h0 = pc, scale, s0 is not None
        ctx.prod = _products(q.dtype)   # the forward's options, also for a backward run outside their block
        ctx.anchor = _dg_anchor(longest)
        ctx.set_materialize_grads(False)
        return o, s_end

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, starts, s_end, decay, scores = ctx.saved_tensors
        do = torch.zeros_like(v) if do is None else do.contiguous()
        dht = None if dht is None else dht.float().contiguous()
        dq, dk, dv, dg, dh0 = backward_pieces(q, k, v, g, do, dht, starts, s_end, decay, scores, ctx.pc, ctx.scale,
                                              ctx.prod, anchor=ctx.anchor)
        return dq, dk, dv, dg, (dh0 if ctx.has_h0 else None), None, None, None, None, None


def gla_triton(q, k, v, g, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
               chunk_size=None, segment_len: int | None = None):
    """GLA with per-key-channel gates, forward and backward in pieces: q, k, g `[B, T, H, K]` (g the log-decay,
    <= 0), v `[B, T, H, V]`, initial state `[N, H, K, V]`, packed `cu_seqlens` -> (o `[B, T, H, V]` in v's dtype,
    final state `[N, H, K, V]` fp32 or None). Gradients reach q, k, v, g and the initial state. Per-token
    log-decays below -8 are taken as -8 (module docstring of `triton_fwd.py`). `segment_len` / `chunk_size`: as
    `gla_fwd_triton`. Under TRITON_INTERPRET=1 16-bit inputs run in fp32 (the interpreter's 16-bit dot is
    wrong)."""
    check_inputs(q, k, v, g, cu_seqlens)
    _products(q.dtype)   # a bad gla_products option fails here, not in the backward
    if interpreting() and q.dtype != torch.float32:
        o, st = gla_triton(q.float(), k.float(), v.float(), g.float(), scale, initial_state, output_final_state,
                           cu_seqlens, chunk_size, segment_len)
        return o.to(v.dtype), st
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else float(scale)
    q, k, v, g = (t.contiguous() for t in (q, k, v, g))
    cu = None if cu_seqlens is None else cu_seqlens.to(device=q.device, dtype=torch.long).contiguous()
    pc, longest = _pieces_for(q, B, T, cu, segment_len)
    s0 = None if initial_state is None else initial_state.to(dtype=torch.float32, device=q.device).contiguous()
    # the in-tile scores the dv pass reads are kept only when a backward can follow (a forward alone stores nothing)
    o, s_end = _GLAFn.apply(q, k, v, g, s0, pc, scale, chunk_size, needs_grad(q, k, v, g, s0), longest)
    return o, (s_end if output_final_state else None)


__all__ = ["gla_triton"]
