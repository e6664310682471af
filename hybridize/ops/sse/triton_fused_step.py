"""SSE on GLA, one decode token in one Triton kernel: from the fused projections' outputs to the summed
output of the shared and the selected partition ("Scaling Linear Attention with Sparse State Expansion").

`SSE.fused_inputs` + `ops.sse.reference.naive_recurrent_sse` take a decode token through about a dozen small
kernels per layer (q/k add, norms, RoPE, feature maps, gates, router softmax and max, two decode-kernel calls,
the sum); at batch 1 they cost more than the state update itself (an H100 profile of the 1.7B shape:
about 17.5 us per SSE layer against 4.6 us for a softmax layer's front end; benchmarks/RESULTS.md). Here one
program per (value block, row, query head) does all of it in registers:

    router:  p = softmax(y[router]), i = argmax p, w = max p         (top-1, recomputed by every program)
    path:    x = y[q or k head] (+ u[LoRA delta] on the sparse path)
             x = RMSNorm(x) * weight   (optional), then RoPE (optional, full rotary), then the feature map
    gates:   g = logsigmoid(u[gate]) / normalizer       (per key channel, fp32)
    shared:  S = exp(g_sh) S + k_sh v^T,                 o  = scale S^T q_sh
    sparse:  S_i = exp(g_sp) S_i + (w k_sp) v^T,         o += scale S_i^T (w q_sp)     (emulk / emulq)

and writes o `[B, 1, H, D]` in the inputs' dtype. With `layout.out_norm_eps` set it also finishes the head as the
mixer's `finish` does before o_proj (the output RMSNorm over the head's D values, gain `out_weight`, and the silu
output gate from y's gate columns): two kernels fewer per layer in the decode step's chain. A head's value columns are
split over `D / BV` programs, so each writes its fp32 block to a scratch row through L2 (atomics) and bumps a per-head
counter; the program that brings the counter to `D / BV` reads the whole row, finishes it and sets the counter back to
zero (`head_counters`: one buffer per device, zero between steps, so no memset launch). With `paths=2`
(`fused_step.step_paths`: 128-wide heads at batch 1) the shared and the selected partition's updates run in programs
of their own, so their two state round trips overlap; each writes its own set of partial rows and the head's last
program adds them. o_proj stays with the caller.
With `layout.low_col` set (kernel option `sse_step_lowrank`) the step also applies the low-rank up-projections, which
the stage-2 matmul otherwise runs as a kernel of its own: each program multiplies y's low-rank columns by the rows of
the LoRA and gate up-projection weights its head needs (`StepUps`: `[D, r]` panels, read from L2 by the head's other
programs), in fp32. One GEMM launch fewer per layer, and the up-projections' zero blocks are not read.
States are updated in place; partitions nobody selected are never touched. The math is that of the
separate kernels, in fp32 from the loaded 16-bit projections on (the separate path rounds q/k to 16 bits
between its kernels), so in fp32 the two agree to rounding and in bf16 to the inputs' rounding.

Contract (`fused_step.StepLayout` names the columns; `fused_step.sse_gla_step_reference` is the same step in
PyTorch): y `[B, 1, n1]` the stage-1 projections of x (q heads, k heads,
v heads, ..., router logits at `router_col`); u `[B, 1, n2]` the low-rank up-projections: the sparse q|k
LoRA delta at `delta_col`, the shared and the sparse gate pre-activations at `gate_col` (the stage-2 matmul's
output, or y itself when they are merged into stage 1: kernel option `sse_merged_lowrank`,
`SSE._merged_weights`); shared state `[B, H, D, D]`, sparse `[B, P, H, D, D]`, fp32 contiguous; norm weight
`[H + Hk, D]` (q rows, then k rows); cos / sin `[B, 1, D]`. Departures from the separate path: top-1
routing only, no padding mask, full rotary only, head dim a power of two, value width = key width: the
caller (`SSE.fused_step_ok`) keeps the separate kernels otherwise. No host sync, no data-dependent shape:
the step can be captured in a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hybridize.ops.common.pdl import pdl_args
from hybridize.ops.sse.fused_step import StepLayout, StepUps, block_v, step_paths, step_warps
from hybridize.ops.sse.qk_front import MAPS   # feature-map codes (constexpr in the kernels)


@triton.jit
def _feature(x, MAP: tl.constexpr, AXIS: tl.constexpr):
    """The feature map along the head dim `AXIS` of x (a `[D]` row: 0; `[rows, D]`: 1); also `triton_qk_front`'s."""
    if MAP == 1:
        x = x / (1.0 + tl.exp(-x))                     # silu
    if MAP == 2:
        x = tl.exp(x - tl.max(x, AXIS, keep_dims=True))   # softmax over the head dim
        x = x / tl.sum(x, AXIS, keep_dims=True)
    return x


@triton.jit
def _qk(y_row, delta, delta_p, w_row, c, s, eps, d, partner, sign, ADD: tl.constexpr, NORM: tl.constexpr,
        ROPE: tl.constexpr, MAP: tl.constexpr, D: tl.constexpr):
    """One q or k head row `[D]` fp32: (+ LoRA delta: `delta` at d, `delta_p` at the RoPE partner), RMSNorm, RoPE,
    feature map."""
    x, xp = _pair(y_row, d, partner, ROPE)             # rotate_half's partner channel, through the same norm
    if ADD:
        x += delta
        xp += delta_p
    if NORM:
        r = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
        x = x * r * tl.load(w_row + d).to(tl.float32)
        if ROPE:
            xp = xp * r * tl.load(w_row + partner).to(tl.float32)
    if ROPE:
        x = x * c + sign * xp * s
    return _feature(x, MAP, 0)


@triton.jit
def _pair(row, d, partner, ROPE: tl.constexpr):
    """fp32 `[D]` values of the row at d and, with ROPE, at the rotate-half partner (without: the same values)."""
    x = tl.load(row + d).to(tl.float32)
    xp = x
    if ROPE:
        xp = tl.load(row + partner).to(tl.float32)
    return x, xp


@triton.jit
def _low(y_row, R: tl.constexpr, RP: tl.constexpr):
    """R low-rank inputs at y_row, fp32 `[RP]` (zero past R)."""
    r = tl.arange(0, RP)
    return tl.load(y_row + r, mask=r < R, other=0.0).to(tl.float32)


@triton.jit
def _up(w, a, rows, R: tl.constexpr, RP: tl.constexpr):
    """Rows `rows` of a low-rank up-projection `w` `[*, R]` applied to a `[RP]`: fp32 `[len(rows)]`."""
    r = tl.arange(0, RP)
    b_w = tl.load(w + rows[:, None] * R + r[None, :], mask=r[None, :] < R, other=0.0).to(tl.float32)
    return tl.sum(b_w * a[None, :], 1)


@triton.jit
def _up_pair(w, a, row0, d, partner, ROPE: tl.constexpr, R: tl.constexpr, RP: tl.constexpr):
    """`_pair` of a head's rows (from `row0`) of the low-rank up-projection `w` applied to a."""
    x = _up(w, a, row0 + d, R, RP)
    xp = x
    if ROPE:
        xp = _up(w, a, row0 + partner, R, RP)
    return x, xp


@triton.jit
def _logsigmoid(z):
    return tl.minimum(z, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(z)))


@triton.jit
def _update(state, q, k, v, g, d, ov, scale, D: tl.constexpr):
    """S = exp(g) S + k v^T on the `[D, BV]` block at `state` (in place); returns scale S^T q `[BV]`."""
    p = state + d[:, None] * D + ov[None, :]
    b_s = tl.load(p)
    b_s = b_s * tl.exp(g)[:, None] + k[:, None] * v[None, :]
    tl.store(p, b_s)
    return tl.sum(b_s * q[:, None], 0) * scale


@triton.jit
def _sse_gla_step_kernel(y, u, wn, cos, sin, st_sh, st_sp, o, sy, su, spe, u_delta, v_col, r_col, g_col,
                         eps, inv_gn, scale, H, NREP, P, onw, o_eps, og_col, part_o, count,
                         w_uq, w_uk, w_ugs, w_ugp, b_ugs, b_ugp, low_col,
                         D: tl.constexpr, BV: tl.constexpr, BN: tl.constexpr, NORM: tl.constexpr,
                         ROPE: tl.constexpr, QMAP: tl.constexpr, KMAP: tl.constexpr, VMAP: tl.constexpr,
                         EMULQ: tl.constexpr, EMULK: tl.constexpr, FINISH: tl.constexpr, GATE: tl.constexpr,
                         NB: tl.constexpr, UP: tl.constexpr, RQ: tl.constexpr, RQP: tl.constexpr,
                         RG: tl.constexpr, RGP: tl.constexpr, GBIAS: tl.constexpr, PATHS: tl.constexpr,
                         PDL: tl.constexpr):
    if PDL:   # launched before the previous kernel finished (ops/common/pdl.py): wait for its outputs
        tl.extra.cuda.gdc_wait()
    # PATHS = 2: the shared and the selected partition's updates in programs of their own (i_p 0 / 1)
    i_v, i_p = tl.program_id(0) // PATHS, tl.program_id(0) % PATHS
    i_b, i_h = tl.program_id(1).to(tl.int64), tl.program_id(2)
    i_kh = i_h // NREP
    d = tl.arange(0, D)
    ov = i_v * BV + tl.arange(0, BV)
    partner = (d + D // 2) % D
    sign = tl.where(d < D // 2, -1.0, 1.0)
    y_row, u_row = y + i_b * sy, u + i_b * su
    c = tl.zeros([D], dtype=tl.float32)
    s = tl.zeros([D], dtype=tl.float32)
    if ROPE:
        c = tl.load(cos + i_b * spe + d).to(tl.float32)
        s = tl.load(sin + i_b * spe + d).to(tl.float32)
    # router: top-1 of the softmax (every program of the row computes the same choice)
    n = tl.arange(0, BN)
    lg = tl.load(y_row + r_col + n, mask=n < P, other=-float("inf")).to(tl.float32)
    e = tl.exp(lg - tl.max(lg, 0))
    prob = e / tl.sum(e, 0)
    w = tl.max(prob, 0)
    part = tl.argmax(prob, 0).to(tl.int64)

    v = _feature(tl.load(y_row + v_col + i_kh * D + ov).to(tl.float32), VMAP, 0)
    q_col, k_col = i_h * D, (H + i_kh) * D
    wq_row, wk_row = wn + i_h * D, wn + (H + i_kh) * D
    if PATHS == 2:
        if i_p == 0:
            o_sum = _shared_out(y_row, u_row, wq_row, wk_row, q_col, k_col, c, s, v, st_sh + (i_b * H + i_h) * D * D,
                                w_ugs, b_ugs, low_col, g_col, eps, inv_gn, scale, i_h, d, ov, partner, sign, NORM,
                                ROPE, QMAP, KMAP, UP, RQ, RG, RGP, GBIAS, D)
        else:
            o_sum = _sparse_out(y_row, u_row, wq_row, wk_row, q_col, k_col, c, s, v, w,
                                st_sp + ((i_b * P + part) * H + i_h) * D * D, w_uq, w_uk, w_ugp, b_ugp, low_col,
                                u_delta, g_col, eps, inv_gn, scale, H, i_h, i_kh, d, ov, partner, sign, NORM, ROPE,
                                QMAP, KMAP, EMULQ, EMULK, UP, RQ, RQP, RG, RGP, GBIAS, D)
    else:
        o_sum = _both_out(y_row, u_row, wq_row, wk_row, q_col, k_col, c, s, v, w, st_sh + (i_b * H + i_h) * D * D,
                          st_sp + ((i_b * P + part) * H + i_h) * D * D, w_uq, w_uk, w_ugs, w_ugp, b_ugs, b_ugp,
                          low_col, u_delta, g_col, eps, inv_gn, scale, H, i_h, i_kh, d, ov, partner, sign, NORM, ROPE,
                          QMAP, KMAP, EMULQ, EMULK, UP, RQ, RQP, RG, RGP, GBIAS, D)
    row = i_b * H + i_h
    if not FINISH:
        tl.store(o + row * D + ov, o_sum.to(o.dtype.element_ty))
    elif NB * PATHS == 1:   # the program holds the whole head
        _finish(o_sum, o + row * D, y_row + og_col + i_h * D, onw, o_eps, d, GATE, D)
    else:           # the head's last program to finish normalises it: partial rows through L2, a counter per head
        # (the fp32 rows travel as int32 bits: atomics, so they are read where they were written, in L2); with
        # PATHS = 2 the selected partition's programs write a second set of rows after the first
        rows_all = tl.num_programs(1) * H
        tl.atomic_xchg(part_o + (i_p * rows_all + row) * D + ov, o_sum.to(tl.int32, bitcast=True), sem="release")
        tl.debug_barrier()                       # every thread's row written before the count goes up
        if tl.atomic_add(count + row, 1, sem="acq_rel") == NB * PATHS - 1:
            zero = tl.zeros([D], dtype=tl.int32)
            full = tl.atomic_add(part_o + row * D + d, zero, sem="acquire").to(tl.float32, bitcast=True)
            if PATHS == 2:
                full += tl.atomic_add(part_o + (rows_all + row) * D + d, zero, sem="acquire").to(tl.float32,
                                                                                                  bitcast=True)
            _finish(full, o + row * D, y_row + og_col + i_h * D, onw, o_eps, d, GATE, D)
            tl.atomic_xchg(count + row, 0)       # ready for the next step (and the next graph replay)


@triton.jit
def _shared_out(y_row, u_row, wq_row, wk_row, q_col, k_col, c, s, v, state, w_ugs, b_ugs, low_col, g_col, eps, inv_gn,
                scale, i_h, d, ov, partner, sign, NORM: tl.constexpr, ROPE: tl.constexpr, QMAP: tl.constexpr,
                KMAP: tl.constexpr, UP: tl.constexpr, RQ: tl.constexpr, RG: tl.constexpr, RGP: tl.constexpr,
                GBIAS: tl.constexpr, D: tl.constexpr):
    """The shared partition's update and output `[BV]` alone (PATHS = 2)."""
    if UP:
        z_sh = _up(w_ugs, _low(y_row + low_col + 2 * RQ, RG, RGP), i_h * D + d, RG, RGP)
        if GBIAS:
            z_sh += tl.load(b_ugs + i_h * D + d).to(tl.float32)
    else:
        z_sh = tl.load(u_row + g_col + i_h * D + d).to(tl.float32)
    q = _qk(y_row + q_col, c, c, wq_row, c, s, eps, d, partner, sign, False, NORM, ROPE, QMAP, D)
    k = _qk(y_row + k_col, c, c, wk_row, c, s, eps, d, partner, sign, False, NORM, ROPE, KMAP, D)
    return _update(state, q, k, v, _logsigmoid(z_sh) * inv_gn, d, ov, scale, D)


@triton.jit
def _sparse_out(y_row, u_row, wq_row, wk_row, q_col, k_col, c, s, v, w, state, w_uq, w_uk, w_ugp, b_ugp, low_col,
                u_delta, g_col, eps, inv_gn, scale, H, i_h, i_kh, d, ov, partner, sign, NORM: tl.constexpr,
                ROPE: tl.constexpr, QMAP: tl.constexpr, KMAP: tl.constexpr, EMULQ: tl.constexpr, EMULK: tl.constexpr,
                UP: tl.constexpr, RQ: tl.constexpr, RQP: tl.constexpr, RG: tl.constexpr, RGP: tl.constexpr,
                GBIAS: tl.constexpr, D: tl.constexpr):
    """The selected partition's update and output `[BV]` alone (PATHS = 2)."""
    if UP:
        dq, dq_p = _up_pair(w_uq, _low(y_row + low_col, RQ, RQP), i_h * D, d, partner, ROPE, RQ, RQP)
        dk, dk_p = _up_pair(w_uk, _low(y_row + low_col + RQ, RQ, RQP), i_kh * D, d, partner, ROPE, RQ, RQP)
        z_sp = _up(w_ugp, _low(y_row + low_col + 2 * RQ + RG, RG, RGP), i_h * D + d, RG, RGP)
        if GBIAS:
            z_sp += tl.load(b_ugp + i_h * D + d).to(tl.float32)
    else:
        dq, dq_p = _pair(u_row + u_delta + q_col, d, partner, ROPE)
        dk, dk_p = _pair(u_row + u_delta + k_col, d, partner, ROPE)
        z_sp = tl.load(u_row + g_col + (H + i_h) * D + d).to(tl.float32)
    q = _qk(y_row + q_col, dq, dq_p, wq_row, c, s, eps, d, partner, sign, True, NORM, ROPE, QMAP, D)
    k = _qk(y_row + k_col, dk, dk_p, wk_row, c, s, eps, d, partner, sign, True, NORM, ROPE, KMAP, D)
    if EMULQ:
        q = q * w
    if EMULK:
        k = k * w
    return _update(state, q, k, v, _logsigmoid(z_sp) * inv_gn, d, ov, scale, D)


@triton.jit
def _both_out(y_row, u_row, wq_row, wk_row, q_col, k_col, c, s, v, w, st_sh, st_sp, w_uq, w_uk, w_ugs, w_ugp, b_ugs,
              b_ugp, low_col, u_delta, g_col, eps, inv_gn, scale, H, i_h, i_kh, d, ov, partner, sign,
              NORM: tl.constexpr, ROPE: tl.constexpr, QMAP: tl.constexpr, KMAP: tl.constexpr, EMULQ: tl.constexpr,
              EMULK: tl.constexpr, UP: tl.constexpr, RQ: tl.constexpr, RQP: tl.constexpr, RG: tl.constexpr,
              RGP: tl.constexpr, GBIAS: tl.constexpr, D: tl.constexpr):
    """Both partitions' updates in one program, the shared first (PATHS = 1), their outputs summed `[BV]`. Not
    `_shared_out` + `_sparse_out`: with UP the selected partition's up-projections are read before the shared update
    here, the order this path was timed and register-checked in (`benchmarks/ops/kernel_resources.py`)."""
    # the sparse path's q|k LoRA deltas (at d and at the RoPE partner) and both paths' gate pre-activations: from y's
    # low-rank columns and the up-projection weights, in fp32 (UP), or from u
    if UP:
        dq, dq_p = _up_pair(w_uq, _low(y_row + low_col, RQ, RQP), i_h * D, d, partner, ROPE, RQ, RQP)
        dk, dk_p = _up_pair(w_uk, _low(y_row + low_col + RQ, RQ, RQP), i_kh * D, d, partner, ROPE, RQ, RQP)
        z_sh = _up(w_ugs, _low(y_row + low_col + 2 * RQ, RG, RGP), i_h * D + d, RG, RGP)
        z_sp = _up(w_ugp, _low(y_row + low_col + 2 * RQ + RG, RG, RGP), i_h * D + d, RG, RGP)
        if GBIAS:
            z_sh += tl.load(b_ugs + i_h * D + d).to(tl.float32)
            z_sp += tl.load(b_ugp + i_h * D + d).to(tl.float32)
    else:   # from u: the shared gate now, the rest after the shared update (see below)
        z_sh = tl.load(u_row + g_col + i_h * D + d).to(tl.float32)
    # shared partition: the base projections (no delta: `c` stands in for it)
    q = _qk(y_row + q_col, c, c, wq_row, c, s, eps, d, partner, sign, False, NORM, ROPE, QMAP, D)
    k = _qk(y_row + k_col, c, c, wk_row, c, s, eps, d, partner, sign, False, NORM, ROPE, KMAP, D)
    g = _logsigmoid(z_sh) * inv_gn
    o_sum = _update(st_sh, q, k, v, g, d, ov, scale, D)
    # the selected partition: base + LoRA, scaled by the router probability. Without UP each delta and the gate are
    # loaded from u where they are used, after the shared update: loaded before it, they stay live across it, and at
    # SmolLM2-135M's shape (a whole 64-wide head per program) the kernel took 167 registers a thread instead of 128
    # (sm_90, `python -m benchmarks.ops.kernel_resources`)
    if not UP:
        dq, dq_p = _pair(u_row + u_delta + q_col, d, partner, ROPE)
    q = _qk(y_row + q_col, dq, dq_p, wq_row, c, s, eps, d, partner, sign, True, NORM, ROPE, QMAP, D)
    if not UP:
        dk, dk_p = _pair(u_row + u_delta + k_col, d, partner, ROPE)
    k = _qk(y_row + k_col, dk, dk_p, wk_row, c, s, eps, d, partner, sign, True, NORM, ROPE, KMAP, D)
    if EMULQ:
        q = q * w
    if EMULK:
        k = k * w
    if not UP:
        z_sp = tl.load(u_row + g_col + (H + i_h) * D + d).to(tl.float32)
    g = _logsigmoid(z_sp) * inv_gn
    o_sum += _update(st_sp, q, k, v, g, d, ov, scale, D)
    return o_sum


@triton.jit
def _finish(x, o_row, gate_row, onw, eps, d, GATE: tl.constexpr, D: tl.constexpr):
    """The mixer's output norm (RMSNorm over the head, gain `onw`) and silu output gate on one head's summed
    output x `[D]` fp32, stored at o_row in o's dtype."""
    x = x * tl.rsqrt(tl.sum(x * x, 0) / D + eps) * tl.load(onw + d).to(tl.float32)
    if GATE:
        z = tl.load(gate_row + d).to(tl.float32)
        x = x * (z / (1.0 + tl.exp(-z)))
    tl.store(o_row + d, x.to(o_row.dtype.element_ty))


_COUNTS: dict = {}


def head_counters(n: int, device) -> torch.Tensor:
    """Zeroed int32 counters, at least `n`, one per (row, head), that the finishing step leaves at zero again; kept
    per device across calls and layers (the layers' steps run one after another on one stream), so a step needs no
    memset of its own."""
    have = _COUNTS.get(device)
    if have is None or have.numel() < n:
        have = _COUNTS[device] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return have


@dataclass(frozen=True)
class StepLaunch:
    """One launch of the step kernel as data: its grid, its runtime arguments in order, its keyword arguments (the
    constexprs and Triton's launch option `launch_pdl`) and the output it writes. `sse_gla_step` launches it;
    `benchmarks/ops/kernel_resources.py` compiles it offline for a target GPU to read its registers and spills."""

    grid: tuple
    args: tuple
    kwargs: dict
    out: torch.Tensor


def step_launch(y: torch.Tensor, u: torch.Tensor, shared: torch.Tensor, sparse: torch.Tensor, layout: StepLayout,
                norm_weight: torch.Tensor | None = None, cos: torch.Tensor | None = None,
                sin: torch.Tensor | None = None, scale: float | None = None, bv: int | None = None,
                out_weight: torch.Tensor | None = None, ups: StepUps | None = None,
                warps: int | None = None, paths: int | None = None) -> StepLaunch:
    """`sse_gla_step`'s checks and kernel arguments (the output `o` allocated), without launching. `bv` and `warps`
    (value columns and warps per program) default to `block_v`'s and `step_warps`' choices."""
    L = layout
    B, H, D = y.shape[0], L.heads, L.head_dim
    if y.shape[1] != 1 or u.shape[:2] != (B, 1):
        raise ValueError(f"sse_gla_step takes one token per row: y {tuple(y.shape)}, u {tuple(u.shape)}")
    if D & (D - 1) or H % L.kv_heads:
        raise ValueError(f"sse_gla_step needs a power-of-two head dim and whole query groups, got D={D}, "
                         f"H={H}, Hk={L.kv_heads}")
    for name, t, shape in (("shared", shared, (B, H, D, D)), ("sparse", sparse, (B, L.partitions, H, D, D))):
        if t.dtype != torch.float32 or not t.is_contiguous() or tuple(t.shape) != shape:
            raise ValueError(f"sse_gla_step updates the {name} state in place: give a contiguous fp32 tensor "
                             f"{shape}, got {t.dtype} {tuple(t.shape)}")
    if y.stride(-1) != 1 or u.stride(-1) != 1:
        raise ValueError("sse_gla_step needs y and u with unit column stride")
    rope = cos is not None
    if rope:
        if cos.shape[-1] != D or sin.shape != cos.shape:
            raise ValueError(f"sse_gla_step applies full rotary only: cos/sin [B, 1, {D}], got {tuple(cos.shape)}")
        cos, sin = cos.expand(B, 1, D).contiguous(), sin.expand(B, 1, D).contiguous()
    norm = L.norm_eps is not None
    if norm and (norm_weight is None or tuple(norm_weight.shape) != (H + L.kv_heads, D)):
        raise ValueError(f"sse_gla_step's q/k norm needs a weight [H + Hk, D] = {(H + L.kv_heads, D)}")
    finish = L.out_norm_eps is not None
    if finish and (out_weight is None or tuple(out_weight.shape) != (D,)):
        raise ValueError(f"sse_gla_step's output norm needs a gain [D] = [{D}]")
    up = L.low_col is not None
    if up:
        _check_ups(ups, L, y)
    o = torch.empty(B, 1, H, D, dtype=y.dtype, device=y.device)
    bv = block_v(B, H, D, finish) if bv is None else bv
    nb = triton.cdiv(D, bv)
    paths = (step_paths(B, D) if finish else 1) if paths is None else paths
    if paths not in (1, 2) or (paths == 2 and not finish):
        raise ValueError(f"sse_gla_step runs the two partitions in programs of their own (paths=2) only when it "
                         f"finishes the heads (layout.out_norm_eps); got paths={paths}")
    dummy = y   # never read: constexpr branches skip absent inputs
    split = finish and nb * paths > 1   # a head over several programs: its last one finishes it
    part_o = (torch.empty(paths * B * H * D, dtype=torch.int32, device=y.device) if split
              else dummy)   # fp32 bits
    count = head_counters(B * H, y.device) if split else dummy
    args = (y, u, norm_weight if norm else dummy, cos if rope else dummy, sin if rope else dummy, shared, sparse, o,
            y.stride(0), u.stride(0), cos.stride(0) if rope else 0, L.delta_col, L.v_col, L.router_col,
            L.gate_col, float(L.norm_eps or 0.0), 1.0 / L.gate_normalizer, D ** -0.5 if scale is None else scale,
            H, H // L.kv_heads, L.partitions, out_weight if finish else dummy, float(L.out_norm_eps or 0.0),
            L.out_gate_col or 0, part_o, count,
            *((ups.q, ups.k, ups.gate_shared, ups.gate_sparse) if up else (dummy,) * 4),
            ups.bias_shared if up and ups.bias_shared is not None else dummy,
            ups.bias_sparse if up and ups.bias_sparse is not None else dummy, L.low_col or 0)
    kwargs = dict(D=D, BV=bv, BN=triton.next_power_of_2(L.partitions), NORM=norm, ROPE=rope, QMAP=MAPS[L.q_map],
                  KMAP=MAPS[L.k_map], VMAP=MAPS[L.v_map], EMULQ=L.emulq, EMULK=L.emulk, FINISH=finish,
                  GATE=L.out_gate_col is not None, NB=nb, UP=up, RQ=L.lora_rank,
                  RQP=triton.next_power_of_2(max(L.lora_rank, 1)), RG=L.gate_rank,
                  RGP=triton.next_power_of_2(max(L.gate_rank, 1)), GBIAS=up and ups.bias_shared is not None,
                  PATHS=paths, num_warps=step_warps(B, D) if warps is None else warps, **pdl_args(y.device))
    return StepLaunch(grid=(nb * paths, B, H), args=args, kwargs=kwargs, out=o)


@torch.compiler.disable   # opaque to torch.compile, as the other decode kernels: it writes the states in place
def sse_gla_step(y: torch.Tensor, u: torch.Tensor, shared: torch.Tensor, sparse: torch.Tensor, layout: StepLayout,
                 norm_weight: torch.Tensor | None = None, cos: torch.Tensor | None = None,
                 sin: torch.Tensor | None = None, scale: float | None = None, bv: int | None = None,
                 out_weight: torch.Tensor | None = None, ups: StepUps | None = None,
                 warps: int | None = None, paths: int | None = None) -> torch.Tensor:
    """One decode token: update `shared` and the selected partition of `sparse` in place; o `[B, 1, H, D]`, with the
    output norm (gain `out_weight` `[D]`) and gate applied when `layout.out_norm_eps` is set, and the low-rank
    up-projections `ups` applied in the kernel when `layout.low_col` is set (u is then not read)."""
    launch = step_launch(y, u, shared, sparse, layout, norm_weight, cos, sin, scale, bv, out_weight, ups, warps, paths)
    _sse_gla_step_kernel[launch.grid](*launch.args, **launch.kwargs)
    return launch.out


def _check_ups(ups: StepUps | None, L: StepLayout, y: torch.Tensor) -> None:
    """One-line errors for up-projection weights the kernel cannot read as `[rows, rank]` row-major."""
    if ups is None:
        raise ValueError("sse_gla_step: a layout with low_col needs the up-projection weights (ups=StepUps(...))")
    H, Hk, D = L.heads, L.kv_heads, L.head_dim
    want = (("q", ups.q, (H * D, L.lora_rank)), ("k", ups.k, (Hk * D, L.lora_rank)),
            ("gate_shared", ups.gate_shared, (H * D, L.gate_rank)), ("gate_sparse", ups.gate_sparse, (H * D, L.gate_rank)))
    for name, t, shape in want:
        if tuple(t.shape) != shape or not t.is_contiguous() or t.device != y.device:
            raise ValueError(f"sse_gla_step: ups.{name} must be a contiguous {shape} tensor on {y.device}, got "
                             f"{tuple(t.shape)} on {t.device}")
    if (ups.bias_shared is None) != (ups.bias_sparse is None):
        raise ValueError("sse_gla_step: give both gate biases or neither")
