"""CCQ covariance read as one fused Triton chunked pass, forward and backward (appendix B of
"Don't Read Everything: A Curvature-Conditioned Query for Linear Attention").

Computes what `hybridize.ops.ccq.reference.chunk_ccq` computes, `Sigma_t q_t = C_t q_t - mu_t (mu_t . q_t)`
for q, k `[B, T, H, K]`, with the same arguments (mask `[B, T]`, initial / final state `(C, mu, t)`,
packed `cu_seqlens`), but instead of a second full linear-attention call plus an fp32 elementwise
epilogue it keeps the un-normalised sums in registers and walks the sequence once:

    S = t0 C0 + sum_{j<=t} m_j k_j k_j^T  (K x K)     M = t0 mu0 + sum_{j<=t} m_j k_j     n_t = t0 + sum m_j
    o_t = S_t^T q_t / n_t - M_t (M_t . q_t) / n_t^2                    (n_t clamped to >= 1)

Per chunk of BT tokens and per block of BV output channels (one program per (channel block, piece,
head)): the inter-chunk part `q S_prev`, the intra-chunk part `tril(q k^T) k`, the mean part from the
carried M plus the chunk's own keys (M_t . q_t = q M_prev + rowsum(tril(q k^T)); the in-chunk key sums
ride on the intra-chunk product, `tril(A / n - w) k` with w = (M_t . q_t) / n^2, so no tile needs a cumsum
over its rows), then the state update `S += k^T k_v`, `M += sum k`. The 1/n and 1/n^2 normalisations happen
in registers.

Parallelism: with B * H = 16 rows one program per (sequence, head) leaves most of an H100 idle and
runs T / BT dependent steps. Both directions therefore cut every sequence into pieces of `segment_len`
tokens (automatic on GPU: 512-4096 tokens, see `piece_len`). Forward: (1) `_piece_sums_kernel` sums
each piece's keys (a plain GEMM walk over wide token tiles), (2) `_ccq_scan_kernel` turns the piece sums into
each piece's starting sums (plus the initial state; it also writes the end state), (3) every piece runs
the fused pass above from its start. Pieces are built on the device from `cu_seqlens` (no host sync): a
table of (first token, length) with unused slots of length 0; without mask / varlen / initial state the
table depends on the shape only and is cached.

Backward (no chunk states stored; written about zero here, the kernels use u, U and S_c, see "Centre"):
with g_i = do_i / n_i, a'_i = g_i . M_i, r_i = q_i . M_i
- `dq` pass, forward in time, carrying rows of S: `dq = g S_prev^T + tril(g k^T) k - (a' / n) M`; it
  also writes a', r per token and, with an initial state and no pieces, dS0 = sum_i q_i g_i^T. Per piece, from the
  forward's piece starting sums (kept for the backward: G x H x K x K fp32, 16 MB at 16k tokens);
- `dk` pass, backward in time, carrying E = sum_{i later} (q_i g_i^T + g_i q_i^T) and the key-sum
  gradient: `dk = k E^T + tril(g k^T)^T q + tril(q k^T)^T g + revcumsum(dM)`, dM_i = -(r_i g_i + a'_i q_i) / n_i,
  times the mask; dM0 is the carried sum at the start. Per piece: `_piece_grad_sums_kernel` (a GEMM walk
  like the forward's piece sums) gives each piece's D = sum q_i g_i^T and dM sum (with an initial state,
  dS0 is the sum of the D), the scan kernel (REVERSE, SYM) turns D + D^T and dM into suffix starts (plus
  the final state's gradient), then every piece runs from its own start.
The torch wrapper turns (C0, mu0, t0) into (t0 C0, t0 mu0) and the end sums back into (C, mu, t) with
differentiable torch ops, so gradients reach the initial state (and flow from the final state).

Centre: Sigma_t is the same for keys shifted by any vector c, so the output, dq and dk passes carry their
sums about c = each sequence's mean key (`_mean_key`; with pieces from the scan's end sums, without from
`_key_sums`, one small pass; initial statistics included; c gets no gradient and needs none) and use
u = k - c, rounded once to the input dtype, in place of k: U = M - n c, S_c = S - c M^T - M c^T + n c c^T,
converted in registers where a pass starts (and back where it stores the end); the piece sums and the
scan stay about zero. The backward turns the gradients about c into gradients of the sums about zero
(`dM = dU - (dS + dS^T) c`). About zero, C_t q and mu_t mu_t^T q nearly cancel when the keys share a
direction (CCQ's unit keys usually do), so a 16-bit rounding of the carried sums is amplified in their
difference (3.7e-2 max relative error measured at 16k with one bf16 product); about the mean the carried
sums are of the size of the result, and one bf16 product is as accurate as the hi/lo pair was about zero.

Inference (`clean=`, no gradient): the output pass also applies CCQ's query cleaning (`ops/ccq/clean.py`):
lambda from the query tile it holds, q - lambda Sigma q written from the fp32 read, so the separate gate pass
over q and Sigma q does not run. Training keeps that pass (its backward needs Sigma q).

Numerics: sums and scores accumulate in fp32. Products of two inputs (q u^T, u^T u, do u^T) run on 16-bit
tiles. Products with a carried fp32 operand (the state S, the score
tile, g = do / n, E) run, for bf16 inputs, as one bf16 product (the default), or with
kernel option `ccq_products="split"` (`HYBRIDIZE_CCQ_PRODUCTS=split`) as two bf16 products of a hi/lo split
(forward and dq pass; tf32 in the dk pass), or `"tf32"` on fp32 tiles in tf32; fp16 inputs use tf32 (a
carried sum rounded to fp16 could overflow), fp32 inputs IEEE fp32. fp64 and empty inputs go to the PyTorch op; under
TRITON_INTERPRET=1 16-bit inputs run in fp32 (the interpreter's 16-bit `tl.dot` is wrong). On CUDA the
tile sizes (BT, BV) and warps are autotuned over a short list, once per power-of-two bucket of the token count
and of the rows, and `chunk_size` is ignored; under TRITON_INTERPRET=1 `chunk_size` (default 16) is used.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridize.ops.ccq import clean as ref_clean
from hybridize.ops.ccq import reference as ref
from hybridize.ops.common.options import current_kernel_options
from hybridize.ops.common.piece_length import piece_len
from hybridize.ops.common.triton_utils import (autotuned, interp_tile, interpreter_shim, interpreting,
                                               make_pieces, mdot, mdot_r, seg_bounds, tile_block,
                                               tune_buckets)
from hybridize.ops.common.varlen import check_cu_seqlens

# ---- kernels ---------------------------------------------------------------------------------------


@triton.jit
def _keep(msk, rows, m_t, HAS_MASK: tl.constexpr):
    """1.0 for the tile's real tokens, 0.0 for padding and rows past the piece `[BT]`."""
    if HAS_MASK:
        return tl.load(msk + rows, mask=m_t, other=0).to(tl.float32)
    else:
        return m_t.to(tl.float32)


@triton.jit
def _counted(b_m, o_t, HAS_MASK: tl.constexpr):
    """Real tokens of the tile up to and including each row `[BT]` (rows past the piece: don't care; their
    tiles are zero). Without a mask that is the row number + 1, no scan over the tile."""
    if HAS_MASK:
        return tl.cumsum(b_m, 0)
    else:
        return (o_t + 1).to(tl.float32)


@triton.jit
def _centred(b_k, b_c, b_m):
    """Keys minus the sequence's centre `[BT, BK]`, zero on padding and past the piece, in the input dtype."""
    return tl.where(b_m[:, None] > 0, b_k.to(tl.float32) - b_c[None, :], 0.0).to(b_k.dtype)


@triton.jit
def _centre(cen, sid, i_n, i_h, o, m, H: tl.constexpr, K: tl.constexpr):
    """Channels `o` of the centre of the sequence piece i_n belongs to (fp32)."""
    base = (tl.load(sid + i_n).to(tl.int64) * H + i_h) * K
    return tl.load(cen + base + o, mask=m, other=0.0)


@triton.jit
def _shift(x, X, y, Y, n):
    """x Y^T + X y^T - n x y^T: what moving the centre from 0 to c takes off S = sum k k^T, with (x, X) the
    row block's (c, M) and (y, Y) the column block's (c, M) over n keys (U = M - n c, S_c = S - this)."""
    return x[:, None] * Y[None, :] + X[:, None] * y[None, :] - n * x[:, None] * y[None, :]


@triton.jit
def _key_sum_kernel(k, msk, out, seg, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
                    HAS_MASK: tl.constexpr):
    # one program per (piece, head): the sum of the piece's real keys, fp32 `[BK]`
    i_nh = tl.program_id(0)
    i_n, i_h = i_nh // H, i_nh % H
    bos, L = seg_bounds(seg, i_n)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    acc = tl.zeros([BT, BK], dtype=tl.float32)
    for i_t in range(0, tl.cdiv(L, BT)):
        m_t = i_t * BT + o_t < L
        rows = bos + i_t * BT + o_t
        b_k = tl.load(k + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=m_t[:, None] & (o_k[None, :] < K),
                      other=0.0).to(tl.float32)
        acc += b_k * _keep(msk, rows, m_t, HAS_MASK)[:, None]
    tl.store(out + i_nh.to(tl.int64) * K + o_k, tl.sum(acc, 0), mask=o_k < K)


@triton.jit
def _piece_sums_kernel(k, msk, s_out, m_out, seg, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                       BR: tl.constexpr, BC: tl.constexpr, HAS_MASK: tl.constexpr, PREC: tl.constexpr):
    # one program per ((row block, column block), piece, head): S[rows, cols] = sum k[:, rows]^T k[:, cols]
    # over the piece's real keys (about zero, fp32), and M[cols] from the first row block. A plain GEMM
    # walk with wide token tiles: no scores, no output, so none of the output pass's register limits
    i_nh = tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    i_r, _, o_r, o_c, m_r, m_c = tile_block(tl.program_id(0), K, K, BR, BC)
    bos, L = seg_bounds(seg, i_n)
    o_t = tl.arange(0, BT)
    b_S = tl.zeros([BR, BC], dtype=tl.float32)
    b_M = tl.zeros([BC], dtype=tl.float32)
    for i_t in range(0, tl.cdiv(L, BT)):
        m_t = i_t * BT + o_t < L
        rows = bos + i_t * BT + o_t
        p = (rows[:, None] * H + i_h) * K
        b_kr = tl.load(k + p + o_r[None, :], mask=m_t[:, None] & m_r[None, :], other=0.0)
        b_kc = tl.load(k + p + o_c[None, :], mask=m_t[:, None] & m_c[None, :], other=0.0)
        if HAS_MASK:  # padding keys are not counted (one operand zeroed is enough for the product)
            b_kc = tl.where(_keep(msk, rows, m_t, HAS_MASK)[:, None] > 0, b_kc, 0.0).to(b_kr.dtype)
        b_S += tl.dot(tl.trans(b_kr), b_kc, input_precision=PREC)
        b_M += tl.sum(b_kc.to(tl.float32), 0)
    base = i_nh.to(tl.int64) * K
    tl.store(s_out + base * K + o_r[:, None] * K + o_c[None, :], b_S, mask=m_r[:, None] & m_c[None, :])
    if i_r == 0:
        tl.store(m_out + base + o_c, b_M, mask=m_c)


@triton.jit
def _piece_grad_sums_kernel(q, do, msk, a_buf, r_buf, n0, d_out, dm_out, seg, H: tl.constexpr, K: tl.constexpr,
                            BT: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, HAS_MASK: tl.constexpr,
                            PROD: tl.constexpr, PREC: tl.constexpr):
    # the backward's counterpart of `_piece_sums_kernel`: per piece D[rows, cols] = sum_i q_i[rows] g_i[cols]
    # (g = do / n; the dk pass's E is D + D^T, the scan adds the transpose) and, from the first row block,
    # the key-sum gradient's sum dM[cols] = -sum_i (r_i / n_i) g_i + (a'_i / n_i) q_i
    i_nh = tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    i_r, _, o_r, o_c, m_r, m_c = tile_block(tl.program_id(0), K, K, BR, BC)
    bos, L = seg_bounds(seg, i_n)
    o_t = tl.arange(0, BT)
    b_D = tl.zeros([BR, BC], dtype=tl.float32)
    b_dM = tl.zeros([BC], dtype=tl.float32)
    b_n = tl.load(n0 + i_n)
    for i_t in range(0, tl.cdiv(L, BT)):
        m_t = i_t * BT + o_t < L
        rows = bos + i_t * BT + o_t
        p = (rows[:, None] * H + i_h) * K
        b_m = _keep(msk, rows, m_t, HAS_MASK)
        inv = 1.0 / tl.maximum(b_n + _counted(b_m, o_t, HAS_MASK), 1.0)
        b_qr16 = tl.load(q + p + o_r[None, :], mask=m_t[:, None] & m_r[None, :], other=0.0)
        b_g = tl.load(do + p + o_c[None, :], mask=m_t[:, None] & m_c[None, :], other=0.0).to(tl.float32)
        b_g = b_g * inv[:, None]
        b_D += mdot_r(tl.trans(b_qr16), b_g, PROD, PREC)
        if i_r == 0:
            b_qc = tl.load(q + p + o_c[None, :], mask=m_t[:, None] & m_c[None, :], other=0.0).to(tl.float32)
            b_a = tl.load(a_buf + rows * H + i_h, mask=m_t, other=0.0)
            b_rr = tl.load(r_buf + rows * H + i_h, mask=m_t, other=0.0)
            b_dM -= tl.sum((b_rr * inv)[:, None] * b_g + (b_a * inv)[:, None] * b_qc, 0)
        b_n += tl.sum(b_m, 0)
    base = i_nh.to(tl.int64) * K
    tl.store(d_out + base * K + o_r[:, None] * K + o_c[None, :], b_D, mask=m_r[:, None] & m_c[None, :])
    if i_r == 0:
        tl.store(dm_out + base + o_c, b_dM, mask=m_c)


@triton.jit
def _ccq_fwd_kernel(q, k, msk, s0, m0, n0, o, s_end, m_end, seg, cen, sid, cw, cb, LAM,
                    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                    HAS_MASK: tl.constexpr, HAS_H0: tl.constexpr, STORE_END: tl.constexpr,
                    PROD: tl.constexpr, PREC: tl.constexpr, CLEAN: tl.constexpr, LEN, ROWS):
    # one program per (channel block, segment, head). CLEAN (no gradient: inference): 0 writes Sigma q; 1 writes
    # q - lambda Sigma q with lambda = sigmoid(w_h . q / max(||q||, 1e-12) + b_h) (`ops/ccq/triton_clean.py`'s
    # gate, on the fp32 read before any rounding); 2 the same with the fixed lambda LAM
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, L = seg_bounds(seg, i_n)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < K
    tril = o_t[:, None] >= o_t[None, :]
    hbase = i_nh.to(tl.int64) * K
    # carried state: S[:, v-block] (un-normalised second moment), M (full, for M . q), M[v-block], count;
    # about the sequence's centre c, see the module docstring
    b_S = tl.zeros([BK, BV], dtype=tl.float32)
    b_M = tl.zeros([BK], dtype=tl.float32)
    b_Mv = tl.zeros([BV], dtype=tl.float32)
    if HAS_H0:
        b_S += tl.load(s0 + hbase * K + o_k[:, None] * K + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_M += tl.load(m0 + hbase + o_k, mask=m_k, other=0.0)
        b_Mv += tl.load(m0 + hbase + o_v, mask=m_v, other=0.0)
    b_n = tl.load(n0 + i_n)
    b_c = _centre(cen, sid, i_n, i_h, o_k, m_k, H, K)
    b_cv = _centre(cen, sid, i_n, i_h, o_v, m_v, H, K)
    b_S -= _shift(b_c, b_M, b_cv, b_Mv, b_n)
    b_M -= b_n * b_c
    b_Mv -= b_n * b_cv
    if CLEAN == 1:
        b_cw = tl.load(cw + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_cb = tl.load(cb + i_h).to(tl.float32)
    for i_t in range(0, tl.cdiv(L, BT)):
        m_t = i_t * BT + o_t < L
        rows = bos + i_t * BT + o_t
        p = (rows[:, None] * H + i_h) * K
        # key / query tiles stay in the input dtype for the products whose operands are both inputs
        # (q u^T, u^T u): fp32 accumulation, native 16-bit tensor-core rate
        b_m = _keep(msk, rows, m_t, HAS_MASK)
        b_k16 = _centred(tl.load(k + p + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0), b_c, b_m)
        b_kv16 = _centred(tl.load(k + p + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0), b_cv, b_m)
        b_kv = b_kv16.to(tl.float32)
        b_q16 = tl.load(q + p + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_q = b_q16.to(tl.float32)
        inv = 1.0 / tl.maximum(b_n + _counted(b_m, o_t, HAS_MASK), 1.0)
        b_A = tl.where(tril, tl.dot(b_q16, tl.trans(b_k16), input_precision=PREC), 0.0)
        b_r = tl.sum(b_q * b_M[None, :], 1) + tl.sum(b_A, 1)                 # U_t . q_t
        # the mean part U_t (U_t . q) / n^2 with U_t = U_prev + sum_{j<=t} u_j: its in-chunk sum rides on
        # the score tile's product (A / n - w on j <= t) instead of a cumsum over the tile's rows
        b_w = b_r * inv * inv
        b_A = tl.where(tril, b_A * inv[:, None] - b_w[:, None], 0.0)
        b_o = mdot_r(b_q16, b_S, PROD, PREC) * inv[:, None] + mdot(b_A, b_kv16, PROD, PREC)
        b_o = b_o - b_w[:, None] * b_Mv[None, :]
        if CLEAN == 1:
            lam = tl.sigmoid(tl.sum(b_q * b_cw[None, :], 1) / tl.maximum(tl.sqrt(tl.sum(b_q * b_q, 1)), 1e-12) + b_cb)
            b_o = tl.load(q + p + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0).to(tl.float32) \
                - lam[:, None] * b_o
        elif CLEAN == 2:
            b_o = tl.load(q + p + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0).to(tl.float32) - LAM * b_o
        tl.store(o + p + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])
        b_S += tl.dot(tl.trans(b_k16), b_kv16, input_precision=PREC)
        b_M += tl.sum(b_k16.to(tl.float32), 0)
        b_Mv += tl.sum(b_kv, 0)
        b_n += tl.sum(b_m, 0)
    if STORE_END:  # back about zero
        b_M += b_n * b_c
        b_Mv += b_n * b_cv
        b_S += _shift(b_c, b_M, b_cv, b_Mv, b_n)
        tl.store(s_end + hbase * K + o_k[:, None] * K + o_v[None, :], b_S, mask=m_k[:, None] & m_v[None, :])
        if i_v == 0:
            tl.store(m_end + hbase + o_k, b_M, mask=m_k)


@triton.jit
def _ccq_scan_kernel(sums, msums, s0, m0, starts, mstarts, s_end, m_end, segs,
                     H: tl.constexpr, K: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                     HAS_H0: tl.constexpr, REVERSE: tl.constexpr, SYM: tl.constexpr):
    # per ((row block, column block), sequence, head): starting sums of each of the sequence's segments
    # (exclusive prefix over its segments, plus the initial state) and the sequence's end sums, in fp32
    # sequence order; the key sum M rides with the first row block. REVERSE walks the segments last to first
    # (exclusive suffix sums, for the backward's reversed pass); SYM sums each segment's block plus its
    # transpose (the backward's D + D^T). Small blocks: the walk over segments is a chain of dependent
    # loads, so the more programs the better
    i_nh = tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    i_r, _, o_r, o_c, m_r, m_c = tile_block(tl.program_id(0), K, K, BR, BC)
    first = tl.load(segs + 2 * i_n).to(tl.int64)
    count = tl.load(segs + 2 * i_n + 1).to(tl.int64)
    blk = o_r[:, None] * K + o_c[None, :]
    m_blk = m_r[:, None] & m_c[None, :]
    b_S = tl.zeros([BR, BC], dtype=tl.float32)
    b_M = tl.zeros([BC], dtype=tl.float32)
    if HAS_H0:
        b_S += tl.load(s0 + i_nh.to(tl.int64) * K * K + blk, mask=m_blk, other=0.0)
        b_M += tl.load(m0 + i_nh.to(tl.int64) * K + o_c, mask=m_c, other=0.0)
    for i in range(0, count):
        if REVERSE:
            g = (first + count - 1 - i) * H + i_h
        else:
            g = (first + i) * H + i_h
        b_x = tl.load(sums + g * K * K + blk, mask=m_blk, other=0.0)
        if SYM:
            b_x += tl.load(sums + g * K * K + o_c[None, :] * K + o_r[:, None], mask=m_blk, other=0.0)
        tl.store(starts + g * K * K + blk, b_S, mask=m_blk)
        b_S += b_x
        if i_r == 0:
            b_y = tl.load(msums + g * K + o_c, mask=m_c, other=0.0)
            tl.store(mstarts + g * K + o_c, b_M, mask=m_c)
            b_M += b_y
    tl.store(s_end + i_nh.to(tl.int64) * K * K + blk, b_S, mask=m_blk)
    if i_r == 0:
        tl.store(m_end + i_nh.to(tl.int64) * K + o_c, b_M, mask=m_c)


@triton.jit
def _ccq_bwd_dq_kernel(q, k, msk, do, s0, m0, n0, dq, a_buf, r_buf, ds0, seg, cen, sid,
                       H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                       HAS_MASK: tl.constexpr, HAS_H0: tl.constexpr, STORE_DS0: tl.constexpr,
                       PROD: tl.constexpr, PREC: tl.constexpr, LEN, ROWS):
    # this program owns channels l in the block: it carries rows S[l, :] (about the centre, like the
    # forward) and writes dq[:, l]
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, L = seg_bounds(seg, i_n)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < K
    tril = o_t[:, None] >= o_t[None, :]
    hbase = i_nh.to(tl.int64) * K
    b_c, b_cv = _centre(cen, sid, i_n, i_h, o_k, m_k, H, K), _centre(cen, sid, i_n, i_h, o_v, m_v, H, K)
    b_S = tl.zeros([BV, BK], dtype=tl.float32)
    b_D = tl.zeros([BV, BK], dtype=tl.float32)     # rows of dS0 = sum_i q_i g_i^T
    b_M = tl.zeros([BK], dtype=tl.float32)
    b_Mv = tl.zeros([BV], dtype=tl.float32)
    if HAS_H0:
        b_S += tl.load(s0 + hbase * K + o_v[:, None] * K + o_k[None, :], mask=m_v[:, None] & m_k[None, :], other=0.0)
        b_M += tl.load(m0 + hbase + o_k, mask=m_k, other=0.0)
        b_Mv += tl.load(m0 + hbase + o_v, mask=m_v, other=0.0)
    b_n = tl.load(n0 + i_n)
    b_S -= _shift(b_cv, b_Mv, b_c, b_M, b_n)    # rows: the v-block
    b_M -= b_n * b_c
    b_Mv -= b_n * b_cv
    for i_t in range(0, tl.cdiv(L, BT)):
        m_t = i_t * BT + o_t < L
        rows = bos + i_t * BT + o_t
        p = (rows[:, None] * H + i_h) * K
        mf, mv = m_t[:, None] & m_k[None, :], m_t[:, None] & m_v[None, :]
        b_m = _keep(msk, rows, m_t, HAS_MASK)
        b_q16 = tl.load(q + p + o_k[None, :], mask=mf, other=0.0)
        b_k16 = tl.load(k + p + o_k[None, :], mask=mf, other=0.0)
        b_kv16 = tl.load(k + p + o_v[None, :], mask=mv, other=0.0)
        b_do16 = tl.load(do + p + o_k[None, :], mask=mf, other=0.0)
        b_k16 = _centred(b_k16, b_c, b_m)
        b_kv16 = _centred(b_kv16, b_cv, b_m)
        b_q, b_kv = b_q16.to(tl.float32), b_kv16.to(tl.float32)
        inv = 1.0 / tl.maximum(b_n + _counted(b_m, o_t, HAS_MASK), 1.0)
        b_g = b_do16.to(tl.float32) * inv[:, None]
        # products of two 16-bit tiles (u rounded once); g = do / n scales rows afterwards
        b_Ag = tl.where(tril, tl.dot(b_do16, tl.trans(b_k16), input_precision=PREC) * inv[:, None], 0.0)
        b_Aq = tl.where(tril, tl.dot(b_q16, tl.trans(b_k16), input_precision=PREC), 0.0)
        b_a = tl.sum(b_g * b_M[None, :], 1) + tl.sum(b_Ag, 1)                # g_t . U_t
        b_r = tl.sum(b_q * b_M[None, :], 1) + tl.sum(b_Aq, 1)                # q_t . U_t
        # the mean part U_t (a' / n) folded into the score product, as in the forward
        b_w = b_a * inv
        b_Ag = tl.where(tril, b_Ag - b_w[:, None], 0.0)
        b_dq = mdot_r(b_do16, tl.trans(b_S), PROD, PREC) * inv[:, None] + mdot(b_Ag, b_kv16, PROD, PREC)
        b_dq = b_dq - b_w[:, None] * b_Mv[None, :]
        tl.store(dq + p + o_v[None, :], b_dq.to(dq.dtype.element_ty), mask=mv)
        if i_v == 0:
            tl.store(a_buf + rows * H + i_h, b_a, mask=m_t)
            tl.store(r_buf + rows * H + i_h, b_r, mask=m_t)
        if STORE_DS0:
            b_qv = tl.load(q + p + o_v[None, :], mask=mv, other=0.0).to(tl.float32)
            b_D += tl.dot(tl.trans(b_qv), b_g, input_precision=PREC)
        b_S += tl.dot(tl.trans(b_kv16), b_k16, input_precision=PREC)
        b_M += tl.sum(b_k16.to(tl.float32), 0)
        b_Mv += tl.sum(b_kv, 0)
        b_n += tl.sum(b_m, 0)
    if STORE_DS0:
        tl.store(ds0 + hbase * K + o_v[:, None] * K + o_k[None, :], b_D, mask=m_v[:, None] & m_k[None, :])


@triton.jit
def _ccq_bwd_dk_kernel(q, k, msk, do, a_buf, r_buf, n_end, e0, dm_end, dk, dm0, seg, cen, sid,
                       H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                       HAS_MASK: tl.constexpr, HAS_DEND: tl.constexpr, PROD: tl.constexpr, PREC: tl.constexpr,
                       LEN, ROWS):
    # reversed pass; this program owns key channels l in the block and carries rows E[l, :]
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, L = seg_bounds(seg, i_n)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < K
    tril = o_t[:, None] >= o_t[None, :]
    hbase = i_nh.to(tl.int64) * K
    e_blk = hbase * K + o_v[:, None] * K + o_k[None, :]
    b_c = _centre(cen, sid, i_n, i_h, o_k, m_k, H, K)
    b_E = tl.zeros([BV, BK], dtype=tl.float32)
    b_dM = tl.zeros([BV], dtype=tl.float32)
    if HAS_DEND:
        b_E += tl.load(e0 + e_blk, mask=m_v[:, None] & m_k[None, :], other=0.0)
        b_dM += tl.load(dm_end + hbase + o_v, mask=m_v, other=0.0)
    b_n = tl.load(n_end + i_n)
    NT = tl.cdiv(L, BT)
    for i_rev in range(0, NT):
        i_t = NT - 1 - i_rev
        m_t = i_t * BT + o_t < L
        rows = bos + i_t * BT + o_t
        p = (rows[:, None] * H + i_h) * K
        mf, mv = m_t[:, None] & m_k[None, :], m_t[:, None] & m_v[None, :]
        b_q16 = tl.load(q + p + o_k[None, :], mask=mf, other=0.0)
        b_do16 = tl.load(do + p + o_k[None, :], mask=mf, other=0.0)
        b_qv16 = tl.load(q + p + o_v[None, :], mask=mv, other=0.0)
        b_dov16 = tl.load(do + p + o_v[None, :], mask=mv, other=0.0)
        b_qv, b_dov = b_qv16.to(tl.float32), b_dov16.to(tl.float32)
        b_a = tl.load(a_buf + rows * H + i_h, mask=m_t, other=0.0)
        b_r = tl.load(r_buf + rows * H + i_h, mask=m_t, other=0.0)
        b_m = _keep(msk, rows, m_t, HAS_MASK)
        b_prev = b_n - tl.sum(b_m, 0)
        inv = 1.0 / tl.maximum(b_prev + _counted(b_m, o_t, HAS_MASK), 1.0)
        b_g = b_do16.to(tl.float32) * inv[:, None]
        b_gv = b_dov * inv[:, None]
        # gradient of the key sum M_i (v-block); its sum over the chunk goes to the carry, its in-chunk suffix
        # sums (i >= j) into dk through the score products below
        b_dMi = -(b_r * inv)[:, None] * b_gv - (b_a * inv)[:, None] * b_qv
        b_tot = tl.sum(b_dMi, 0)
        b_k16 = _centred(tl.load(k + p + o_k[None, :], mask=mf, other=0.0), b_c, b_m)
        # g_i . u_j and q_i . u_j: products of two 16-bit tiles, rows scaled after; the in-chunk suffix sum
        # of dM_i (i >= j) rides on them: dM_i's q part on B1^T q, its g part on B2^T do (no cumsum over rows)
        b_B1 = tl.dot(b_do16, tl.trans(b_k16), input_precision=PREC) * inv[:, None] - (b_a * inv)[:, None]
        b_B2 = (tl.dot(b_q16, tl.trans(b_k16), input_precision=PREC) - (b_r * inv)[:, None]) * inv[:, None]
        b_dk = mdot(tl.trans(tl.where(tril, b_B1, 0.0)), b_qv16, PROD, PREC)
        b_dk += mdot(tl.trans(tl.where(tril, b_B2, 0.0)), b_dov16, PROD, PREC)   # B2^T g
        b_dk += mdot_r(b_k16, tl.trans(b_E), PROD, PREC)
        b_dk += b_dM[None, :]
        if HAS_MASK:
            b_dk = b_dk * b_m[:, None]
        tl.store(dk + p + o_v[None, :], b_dk.to(dk.dtype.element_ty), mask=mv)
        b_E += mdot_r(tl.trans(b_qv16), b_g, PROD, PREC)
        b_E += mdot(tl.trans(b_gv), b_q16, PROD, PREC)
        b_dM += b_tot
        b_n = b_prev
    tl.store(dm0 + hbase + o_v, b_dM, mask=m_v)


# ---- launch configuration --------------------------------------------------------------------------


def _configs():
    # ptxas (sm_90a, K = 128, bf16 -> tf32 tiles): BT=16 compiles without spills, BT=32 spills ~0.2-1 KB,
    # BT=64 spills 1-4 KB per thread at 4 warps (and (64, 32, 4 warps) made an illegal memory access in the
    # forward on the H100 once the keys were centred, so it is out); the 8-warp rows hold wider channel
    # blocks (fewer programs recomputing q k^T); (64, 64, 8) and (32, 64, 4) are the dk passes' picks in a wider
    # H100 sweep (16k: 0.85 -> 0.75 ms); (64, 128, 8) was fastest at 16k in an earlier sweep and 2x slow at 32k,
    # which the key's length and row buckets (`_launch`) allow. Autotuning picks the fastest of these on the device
    # (the global cap, kernel option autotune_top, meant for fla's long lists, does not apply here; the option
    # ccq_tune_top=<n> (HYBRIDIZE_CCQ_TUNE_TOP=<n>) keeps the first n, e.g. 1 for tests that only check numbers)
    table = [(16, 32, 4, 2), (32, 32, 4, 2), (16, 64, 4, 2), (32, 16, 4, 2), (32, 32, 8, 2), (32, 64, 8, 2),
             (64, 64, 8, 2), (32, 64, 4, 2), (16, 32, 2, 2), (64, 128, 8, 2)]
    top = current_kernel_options().ccq_tune_top
    return [triton.Config({"BT": bt, "BV": bv}, num_warps=w, num_stages=st)
            for bt, bv, w, st in (table[:top] if top > 0 else table)]


def _launch(kernel, rows, K, chunk_size, args, meta, tokens):
    """Run `kernel` over (channel blocks, rows = segments * heads): fixed tiles in the interpreter,
    autotuned (BT, BV, warps, stages) on GPU, once per power-of-two bucket of the token count and of the rows
    (`LEN`, `ROWS`: key-only arguments, unused by the kernels). The best tile differs with both: (64, 128,
    8 warps) was fastest at 16k and 2x slow at 32k, and with one channel block it leaves half of the SMs idle
    when a forward alone has half the rows (4k: 64 programs)."""
    BK = max(16, triton.next_power_of_2(K))
    bucket = tune_buckets(tokens, rows)
    if interpreting():
        BV = min(BK, 16)
        kernel[(triton.cdiv(K, BV), rows)](*args, K=K, BK=BK, BT=interp_tile(chunk_size), BV=BV, **bucket, **meta)
        return
    autotuned(kernel, _configs, ["K", "BK", *bucket, *meta])[lambda m: (triton.cdiv(K, m["BV"]), rows)](
        *args, K=K, BK=BK, **bucket, **meta)


def _sums_configs():
    # (BT, BR, BC, warps, stages): a GEMM's tiles, wide along the tokens. H100 sweep of six configs at 4k, 16k
    # and 32k: the key sums were fastest with the first at every length, the gradient sums with the
    # first or the second; the third is within 6-12% of the best for both. The autotune key has no length in it,
    # so the list keeps only configs that are good at every length
    table = [(128, 64, 64, 4, 3), (64, 128, 128, 8, 3), (128, 128, 64, 8, 3)]
    top = current_kernel_options().ccq_tune_top
    return [triton.Config({"BT": bt, "BR": br, "BC": bc}, num_warps=w, num_stages=st)
            for bt, br, bc, w, st in (table[:top] if top > 0 else table)]


def _launch_sums(kernel, rows, K, chunk_size, args, meta):
    """Run a piece-sums kernel over ((row block, column block), rows = pieces * heads): 16 x 16 blocks in the
    interpreter (several of each), autotuned tiles on GPU (`_sums_configs`)."""
    if interpreting():
        kernel[(triton.cdiv(K, 16) ** 2, rows)](*args, K=K, BT=interp_tile(chunk_size), BR=16, BC=16, **meta)
        return
    autotuned(kernel, _sums_configs, ["K", *meta])[
        lambda m: (triton.cdiv(K, m["BR"]) * triton.cdiv(K, m["BC"]), rows)](*args, K=K, **meta)


def _piece_sums(k, mask, pc, S_out, M_out, H, K, chunk_size, prec):
    """Each piece's key sums about zero, S `[G, H, K, K]` and M `[G, H, K]` fp32, into S_out / M_out."""
    _launch_sums(_piece_sums_kernel, pc.seg.shape[0] * H, K, chunk_size,
                 (k, M_out if mask is None else mask, S_out, M_out, pc.seg),
                 dict(H=H, HAS_MASK=mask is not None, PREC=prec))


def _piece_grad_sums(q, do, mask, a_buf, r_buf, pc, D_out, dM_out, H, K, chunk_size, prod, prec):
    """Each piece's D = sum_i q_i g_i^T `[G, H, K, K]` and key-sum gradient `[G, H, K]` (fp32), for the dk pass's
    suffix starts (E = D + D^T)."""
    _launch_sums(_piece_grad_sums_kernel, pc.seg.shape[0] * H, K, chunk_size,
                 (q, do, dM_out if mask is None else mask, a_buf, r_buf, pc.n_before, D_out, dM_out, pc.seg),
                 dict(H=H, HAS_MASK=mask is not None, PROD=prod, PREC=prec))


def _scan(sums, msums, S0, M0, S_end, M_end, segs, H, K, reverse=False, sym=False):
    """Per-segment sums -> per-segment starting sums (exclusive prefix, or suffix with `reverse`, plus S0 /
    M0 when given; `sym`: each segment's K x K sum plus its transpose), returned as (starts, mstarts) in new
    buffers (in place, the forward's walk measured 4-5x slower on the H100: 125 against 27 us at 32k);
    writes the sequences' totals to S_end / M_end."""
    N = segs.shape[0]
    B = 16 if interpreting() else 32
    if interpreting():
        interpreter_shim()
    dummy = msums
    starts, mstarts = torch.empty_like(sums), torch.empty_like(msums)
    _ccq_scan_kernel[(triton.cdiv(K, B) ** 2, N * H)](
        sums, msums, dummy if S0 is None else S0, dummy if M0 is None else M0, starts, mstarts, S_end, M_end, segs,
        H=H, K=K, BR=B, BC=B, HAS_H0=S0 is not None, REVERSE=reverse, SYM=sym, num_warps=4)
    return starts, mstarts


#: bf16 product settings (kernel option `ccq_products`, `HYBRIDIZE_CCQ_PRODUCTS`): (PROD of the forward and dq
#: passes, PROD of the dk pass)
PRODUCT_MODES = {"single": (2, 2), "split": (1, 0), "tf32": (0, 0)}


def _products(dtype) -> tuple[int, int, str]:
    """(PROD forward / dq, PROD dk, PREC) for the input dtype. bf16: kernel option `ccq_products` (default
    `single`: one bf16 product, accurate because the sums are carried about the keys' mean; `split`: the
    hi/lo pair in the forward and dq passes, tf32 in the dk pass; `tf32`). fp16 keeps tf32 tiles (a carried
    sum rounded to fp16 could overflow), fp32 IEEE."""
    if dtype == torch.float32:
        return 0, 0, "ieee"
    if dtype != torch.bfloat16:
        return 0, 0, "tf32"
    mode = current_kernel_options().ccq_products   # checked there (`HYBRIDIZE_CCQ_PRODUCTS`)
    return (*PRODUCT_MODES[mode], "tf32")


def _clean_mode(clean) -> int:
    """The forward kernel's CLEAN flag for `clean` = None or (weight, bias, fixed lambda)."""
    return 0 if clean is None else (2 if clean[2] is not None else 1)


def _clean_args(clean, dummy) -> tuple:
    """(weight, bias, fixed lambda) as the forward kernel's arguments (`dummy` where unread)."""
    if clean is None:
        return dummy, dummy, 0.0
    w, b, fixed = clean
    if fixed is not None:
        return dummy, dummy, float(fixed)
    return w.contiguous(), b.contiguous(), 0.0


def _mean_key(M, n_div):
    """The centre the passes carry their sums about: each sequence's mean key `[N, H, K]` from its key sum
    M `[N, H, K]` (initial statistics included) and max(count, 1) `[N]` fp32 (`Pieces.n_div`)."""
    return M / n_div.view(-1, 1, 1)


def _key_sums(k, mask, pc, M0, H, K):
    """Each sequence's key sum, initial statistics included, `[N, H, K]` fp32 (no gradient), for the pass
    without pieces (with pieces the forward has it from the scan)."""
    G, N = pc.seg.shape[0], pc.segs.shape[0]
    sums = torch.empty(G, H, K, dtype=torch.float32, device=k.device)
    if interpreting():
        interpreter_shim()
    _key_sum_kernel[(G * H,)](k, sums if mask is None else mask, sums, pc.seg, H=H, K=K,
                              BK=max(16, triton.next_power_of_2(K)), BT=16 if interpreting() else 64,
                              HAS_MASK=mask is not None, num_warps=4)
    total = torch.zeros(N, H, K, dtype=torch.float32, device=k.device).index_add_(0, pc.seq, sums)
    if M0 is not None:
        total += M0.detach()
    return total


# ---- autograd --------------------------------------------------------------------------------------

class _CCQReadFn(torch.autograd.Function):
    """(q, k, mask, S0 = t0 C0, M0 = t0 mu0, pieces) -> (o, S_end, M_end, n_end) with un-normalised sums
    about zero (n_end: the real-token count at each sequence's end, not differentiable). The centre is
    internal: the kernels move the starting sums to it and the end sums back, and the backward turns the
    gradients of the sums about the centre into gradients of these.

    With `seg_len` both directions run per piece: the forward's piece starting sums (prefix over pieces)
    are kept for the backward's dq pass; the dk pass first sums each piece's E and key-sum gradient, takes
    suffix sums over pieces, then runs every piece from its own start."""

    @staticmethod
    def forward(ctx, q, k, mask, S0, M0, pc, chunk_size, seg_len, prods, clean=None):
        B, T, H, K = q.shape
        prod, _, prec = prods   # the dk pass's setting is the backward's
        o = torch.empty_like(q)
        N, G = pc.segs.shape[0], pc.seg.shape[0]
        S_end = q.new_empty(N, H, K, K, dtype=torch.float32)
        M_end = q.new_empty(N, H, K, dtype=torch.float32)
        dummy = M_end
        m_arg = dummy if mask is None else mask
        common = dict(HAS_MASK=mask is not None, PROD=prod, PREC=prec, CLEAN=_clean_mode(clean))
        gate = _clean_args(clean, dummy)
        starts = mstarts = None
        if seg_len is None:  # one pass per sequence, straight from the initial state
            cen = _mean_key(_key_sums(k, mask, pc, M0, H, K), pc.n_div)
            where = (pc.seg, cen, pc.seq, *gate, H)
            _launch(_ccq_fwd_kernel, G * H, K, chunk_size,
                    (q, k, m_arg, dummy if S0 is None else S0, dummy if M0 is None else M0, pc.n_before, o,
                     S_end, M_end, *where),
                    dict(HAS_H0=S0 is not None, STORE_END=True, **common), B * T)
        else:  # key sums per piece, prefix over pieces, then all pieces in parallel
            sums = q.new_empty(G, H, K, K, dtype=torch.float32)
            msums = q.new_empty(G, H, K, dtype=torch.float32)
            _piece_sums(k, mask, pc, sums, msums, H, K, chunk_size, prec)
            starts, mstarts = _scan(sums, msums, S0, M0, S_end, M_end, pc.segs, H, K)
            cen = _mean_key(M_end, pc.n_div)
            where = (pc.seg, cen, pc.seq, *gate, H)
            _launch(_ccq_fwd_kernel, G * H, K, chunk_size,
                    (q, k, m_arg, starts, mstarts, pc.n_before, o, dummy, dummy, *where),
                    dict(HAS_H0=True, STORE_END=False, **common), B * T)
        ctx.save_for_backward(q, k, mask, S0, M0, starts, mstarts, cen)
        ctx.pieces = pc   # index tables only (no autograd): the backward walks the same pieces
        ctx.chunk_size, ctx.seg_len, ctx.prods = chunk_size, seg_len, prods
        ctx.set_materialize_grads(False)  # unused end sums give None, not zero tensors
        return o, S_end, M_end

    @staticmethod
    def backward(ctx, do, dS_end, dM_end):
        q, k, mask, S0, M0, starts, mstarts, cen = ctx.saved_tensors
        B, T, H, K = q.shape
        prod, prod_dk, prec = ctx.prods
        split = ctx.seg_len is not None
        pc = ctx.pieces
        N, G = pc.segs.shape[0], pc.seg.shape[0]
        do = torch.zeros_like(q) if do is None else do.contiguous()   # None: only the final state was used
        f32 = dict(dtype=torch.float32, device=q.device)
        dq, dk = torch.empty_like(q), torch.empty_like(k)
        a_buf, r_buf = torch.empty(B, T, H, **f32), torch.empty(B, T, H, **f32)
        store_ds0 = S0 is not None and not split   # with pieces dS0 is the sum of the pieces' D (below)
        ds0 = torch.empty(G, H, K, K, **f32) if store_ds0 else None
        dm0 = torch.empty(G, H, K, **f32)
        dummy = dm0
        m_arg = dummy if mask is None else mask
        where = (pc.seg, cen, pc.seq, H)
        s_start = starts if split else S0
        m_start = mstarts if split else M0
        _launch(_ccq_bwd_dq_kernel, G * H, K, ctx.chunk_size,
                (q, k, m_arg, do, dummy if s_start is None else s_start, dummy if m_start is None else m_start,
                 pc.n_before, dq, a_buf, r_buf, dummy if ds0 is None else ds0, *where),
                dict(HAS_MASK=mask is not None, HAS_H0=s_start is not None, STORE_DS0=store_ds0, PROD=prod,
                     PREC=prec), B * T)
        has_end = dS_end is not None or dM_end is not None
        e_end = dm_end = None
        if has_end:
            dS_end = torch.zeros(N, H, K, K, **f32) if dS_end is None else dS_end.float()
            dm_end = torch.zeros(N, H, K, **f32) if dM_end is None else dM_end.float().contiguous()
            e_end = (dS_end + dS_end.transpose(-1, -2)).contiguous()
            # the passes carry U = M - n c and S_c = S - c M^T - M c^T + n c c^T: dU_end = dM_end + (dS + dS^T) c
            dm_end = (dm_end + (e_end @ cen.unsqueeze(-1)).squeeze(-1)).contiguous()
        # the hi/lo pair measured slower than tf32 tiles in this pass (five products with a carried operand:
        # 1.09 vs 1.00 ms at 16k on the H100), so `split` runs it in tf32
        dk_flags = dict(HAS_MASK=mask is not None, PROD=prod_dk, PREC=prec)
        if split:  # each piece's D = sum q g^T and key-sum gradient, then suffix sums of D + D^T (+ the end's)
            d_piece = torch.empty(G, H, K, K, **f32)
            dm_piece = torch.empty(G, H, K, **f32)
            _piece_grad_sums(q, do, mask, a_buf, r_buf, pc, d_piece, dm_piece, H, K, ctx.chunk_size, prod_dk, prec)
            e_start, dm_start = _scan(d_piece, dm_piece, e_end, dm_end, torch.empty(N, H, K, K, **f32),
                                      torch.empty(N, H, K, **f32), pc.segs, H, K, reverse=True, sym=True)
            if S0 is not None:
                ds0 = d_piece
        else:
            e_start, dm_start = e_end, dm_end
        _launch(_ccq_bwd_dk_kernel, G * H, K, ctx.chunk_size,
                (q, k, m_arg, do, a_buf, r_buf, pc.n_after, dummy if e_start is None else e_start,
                 dummy if dm_start is None else dm_start, dk, dm0, *where),
                dict(HAS_DEND=e_start is not None, **dk_flags), B * T)
        dS0 = dM0 = None
        if S0 is not None:
            if split:  # per-piece partial sums -> per sequence; dM0 is the first piece's carried sum
                ds0 = torch.zeros(N, H, K, K, **f32).index_add_(0, pc.seq, ds0)
                first, count = pc.segs[:, 0].clamp(max=G - 1), pc.segs[:, 1]
                empty = (count == 0).view(N, 1, 1)
                dm0 = torch.where(empty, dm_end if has_end else torch.zeros_like(dm0[:N]), dm0[first])
            dS0 = ds0 + dS_end if has_end else ds0
            dM0 = dm0 - ((dS0 + dS0.transpose(-1, -2)) @ cen.unsqueeze(-1)).squeeze(-1)   # back from U0, S0_c
        return dq, dk, None, dS0, dM0, None, None, None, None, None


# ---- the op ----------------------------------------------------------------------------------------

def _clean_torch(q, sigma_q, clean):
    """q - lambda Sigma q in PyTorch (`ops.ccq.clean`), for the inputs the fused epilogue does not take."""
    lam = ref_clean.gate(ref_clean.unit_rows(q), *clean)
    return (q.to(lam.dtype) - lam.unsqueeze(-1) * sigma_q.to(lam.dtype)).to(q.dtype)


def ccq_triton(q, k, mask=None, initial_state=None, output_final_state=False, cu_seqlens=None, chunk_size=None,
               segment_len: int | None = None, clean=None):
    """Sigma_t q_t with the signature of `ops.ccq.reference.chunk_ccq`: q, k `[B, T, H, K]` -> (o `[B, T, H, K]`
    in q's dtype, `(C [N, H, K, K], mu [N, H, K], t [N])` fp32 / int64 or None).

    `chunk_size` is used by the interpreter only (GPU tiles are autotuned). `segment_len` splits every
    sequence into pieces of that many tokens in both directions (None: automatic on GPU, off in the
    interpreter; 0: off). `clean` = (weight `[H, K]`, bias `[H]`, fixed lambda): o is CCQ's cleaned query
    q - lambda Sigma q instead (`ops.ccq.clean`'s gate), computed in the output pass's epilogue: one pass
    over q and Sigma q less. Without gradient only (inference); training runs the cleaning as its own op."""
    ref._check(q, k, mask)
    if clean is not None:
        ref_clean.check_gate(q, *clean)
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, *clean[:2])):
            raise ValueError("ccq_triton(clean=...) has no backward; call it without gradient (torch.no_grad()), "
                             "or run the read and `ccq_clean` separately")
    if q.dtype == torch.float64 or q.shape[1] == 0 or q.dtype != k.dtype:
        o, fs = ref.chunk_ccq(q, k, mask=mask, initial_state=initial_state, output_final_state=output_final_state,
                              cu_seqlens=cu_seqlens, **({} if chunk_size is None else {"chunk_size": chunk_size}))
        return (o if clean is None else _clean_torch(q, o, clean)), fs
    if interpreting() and q.dtype != torch.float32:  # the CPU interpreter's 16-bit tl.dot is wrong
        o, fs = ccq_triton(q.float(), k.float(), mask, initial_state, output_final_state, cu_seqlens, chunk_size,
                           segment_len, clean)
        return o.to(q.dtype), fs
    prods = _products(q.dtype)
    B, T, H, K = q.shape
    q, k = q.contiguous(), k.contiguous()
    cu = None
    if cu_seqlens is not None:
        check_cu_seqlens(q, cu_seqlens)
        cu = cu_seqlens.to(device=q.device, dtype=torch.long).contiguous()
    N = B if cu is None else len(cu) - 1
    m = None if mask is None else mask.to(device=q.device, dtype=torch.int8).contiguous()
    if initial_state is None:
        S0 = M0 = n0 = None
    else:
        C0, mu0, n0 = initial_state
        if C0.shape != (N, H, K, K) or mu0.shape != (N, H, K) or n0.shape != (N,):
            raise ValueError(f"initial_state must be (C [{N},{H},{K},{K}], mu [{N},{H},{K}], t [{N}]), got "
                             f"({tuple(C0.shape)}, {tuple(mu0.shape)}, {tuple(n0.shape)})")
        n0 = n0.to(device=q.device, dtype=torch.long).contiguous()
        tf = n0.float()
        S0 = (C0.float() * tf.view(N, 1, 1, 1)).contiguous()
        M0 = (mu0.float() * tf.view(N, 1, 1)).contiguous()
    if segment_len is None:
        seg_len = None if interpreting() else piece_len(B, T, H, T if cu is None else B * T)
    else:
        seg_len = None if segment_len <= 0 else int(segment_len)
    pc = make_pieces(B, T, cu, m, n0, seg_len, q.device)
    o, S_end, M_end = _CCQReadFn.apply(q, k, m, S0, M0, pc, chunk_size, seg_len, prods, clean)
    if not output_final_state:
        return o, None
    n_end = pc.n_end.clone()  # the caller's: not the cached table's tensor
    inv = 1.0 / n_end.clamp(min=1).float()
    return o, (S_end * inv.view(N, 1, 1, 1), M_end * inv.view(N, 1, 1), n_end)


__all__ = ["ccq_triton"]
