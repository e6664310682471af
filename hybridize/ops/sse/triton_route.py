"""Fused row movement of SSE's varlen layout as Triton kernels (appendix 11, Algorithm 2 of "Scaling Linear
Attention with Sparse State Expansion").

`ops.sse.reference.sse_varlen` reorders the (token, slot) pairs of a packed row by (sequence, partition)
(`ops.sse.reference.varlen_plan`: `order` [M] sorted pair ids, pair p = t * K + s; `inv` [L * K] the sorted
position of every pair; `keep` [L * K] False for padding pairs, which sort into one trailing trash
segment). Two row movements surround the single varlen op call, and both are gathers (no atomics):

- `pack_rows`: out `[1, L0 + M, *C]` = the shared path's rows (L0 = L, or 0 without shared path)
  followed by the sparse rows in sorted order, each multiplied by its pair's router probability
  (`scale`, for emulq / emulk) and zeroed for dropped pairs:
      out[L0 + j] = keep[p] ? x_sp[p // K] * scale[p] : 0,   p = order[j].
  Its backward is a per-token gather-sum over the K slots (plus the scale gradient as row dots).
- `combine_rows`: o `[1, L, *C]` = o_all[t] (shared) + sum_s keep[p] * o_all[L0 + inv[p]], p = t * K + s.
  Its backward is `pack_rows` of the output gradient without scale.

This replaces, per tensor, the PyTorch chain gather copy -> multiply -> `torch.cat` with the shared
path (three full passes, plus an `index_put` with atomics in the backward), and the `index_add`
scatter of the output. Math in fp32, results in the input dtype (the PyTorch reference
`ops.sse.reference.pack_rows_torch` / `combine_rows_torch` does the same, so fp32 results agree exactly
up to summation order). Only CUDA (or the Triton interpreter) tensors; fp64 stays on PyTorch.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl


@triton.jit
def _pack_kernel(x_sh, x_sp, scale, keep, order, out, L0, C: tl.constexpr, K: tl.constexpr,
                 BC: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_KEEP: tl.constexpr):
    """out[r] = x_sh[r] (r < L0), else the scaled sparse row of pair order[r - L0]."""
    r, i_c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    if r < L0:
        # (a distinct name per branch: Triton unifies a variable's type across if/else)
        shared_row = tl.load(x_sh + r * C + o_c, mask=m_c, other=0.0)
        tl.store(out + r * C + o_c, shared_row.to(out.dtype.element_ty), mask=m_c)
    else:
        pair = tl.load(order + (r - L0)).to(tl.int64)
        tok = pair // K
        b = tl.load(x_sp + tok * C + o_c, mask=m_c, other=0.0).to(tl.float32)
        if HAS_SCALE:
            b = b * tl.load(scale + pair).to(tl.float32)
        if HAS_KEEP:
            kp = tl.load(keep + pair)
            b = tl.where(kp != 0, b, 0.0)
        tl.store(out + r * C + o_c, b.to(out.dtype.element_ty), mask=m_c)


@triton.jit
def _gather_sum_kernel(src, base, scale, keep, inv, y, out, dots, L0, C: tl.constexpr, K: tl.constexpr,
                       KP: tl.constexpr, BC: tl.constexpr, HAS_BASE: tl.constexpr, HAS_SCALE: tl.constexpr,
                       HAS_KEEP: tl.constexpr, HAS_DOTS: tl.constexpr):
    """out[t] = base[t] + sum_s keep * scale * src[L0 + inv[t*K+s]];  dots[t*K+s] = keep * <src row, y[t]>."""
    t = tl.program_id(0).to(tl.int64)
    o_s = tl.arange(0, KP)
    m_s = o_s < K
    pair = t * K + o_s
    rows = L0 + tl.load(inv + pair, mask=m_s, other=0).to(tl.int64)             # [KP]
    w = m_s.to(tl.float32)
    if HAS_KEEP:
        w = tl.where(tl.load(keep + pair, mask=m_s, other=0) != 0, w, 0.0)
    if HAS_SCALE:
        sw = w * tl.load(scale + pair, mask=m_s, other=0.0).to(tl.float32)
    else:
        sw = w
    acc_dot = tl.zeros([KP], dtype=tl.float32)
    for c0 in range(0, C, BC):
        o_c = c0 + tl.arange(0, BC)
        m_c = o_c < C
        blk = tl.load(src + rows[:, None] * C + o_c[None, :], mask=m_s[:, None] & m_c[None, :],
                      other=0.0).to(tl.float32)                                    # [KP, BC]
        blk = tl.where(w[:, None] != 0, blk, 0.0)                                  # dropped pairs: exactly 0
        b = tl.sum(blk * sw[:, None], axis=0)
        if HAS_BASE:
            b += tl.load(base + t * C + o_c, mask=m_c, other=0.0).to(tl.float32)
        tl.store(out + t * C + o_c, b.to(out.dtype.element_ty), mask=m_c)
        if HAS_DOTS:
            yy = tl.load(y + t * C + o_c, mask=m_c, other=0.0).to(tl.float32)
            acc_dot += tl.sum(blk * yy[None, :], axis=1)
    if HAS_DOTS:
        tl.store(dots + pair, acc_dot, mask=m_s)


class MoveConfig(NamedTuple):
    """One mover launch: `block` columns of a row a program moves at a time (a power of two), `warps` a program."""
    block: int
    warps: int


def move_config(C: int, itemsize: int) -> MoveConfig:
    """The launch for rows of C elements of `itemsize` bytes: 4 KB of a row a program at a time, 4 warps. On one H200
    at SSE's 16k-token layout this was 0.5-7% faster per 16-bit mover than 1024 columns, and within 0.7% of the
    fastest of 1-8 rows a program x 512-2048 columns x 4 / 8 warps for every mover (`benchmarks/ops/sse_route.py`;
    benchmarks/RESULTS.md, "the row movers move 4 KB of a row a program")."""
    return MoveConfig(block=max(16, min(triton.next_power_of_2(C), 4096 // itemsize)), warps=4)


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0] * x.shape[1], -1).contiguous()


def _pack(x_sh, x_sp, scale, keep, order, K, cfg: MoveConfig | None = None):
    """Raw launch; x_sh `[1, L, *C]` | None, x_sp `[1, L, *C]` -> `[1, L0 + M, *C]`. `cfg`: the launch (default
    `move_config`)."""
    L0 = 0 if x_sh is None else x_sh.shape[1]
    M = order.numel()
    C = math.prod(x_sp.shape[2:])
    out = x_sp.new_empty(1, L0 + M, *x_sp.shape[2:])
    if L0 + M == 0:
        return out
    sp = _flat(x_sp)
    sh = _flat(x_sh) if x_sh is not None else sp
    cfg = cfg or move_config(C, x_sp.element_size())
    _pack_kernel[(L0 + M, triton.cdiv(C, cfg.block))](
        sh, sp, scale if scale is not None else sp, keep if keep is not None else sp, order, out, L0, C, K,
        BC=cfg.block, HAS_SCALE=scale is not None, HAS_KEEP=keep is not None, num_warps=cfg.warps)
    return out


def _gather_sum(src, L, base, scale, keep, inv, K, L0, y=None, cfg: MoveConfig | None = None):
    """Raw launch; src `[1, L0 + M, *C]` -> (out `[1, L, *C]`, dots `[L * K]` fp32 | None). `cfg`: the launch
    (default `move_config`)."""
    C = math.prod(src.shape[2:])
    out = src.new_empty(1, L, *src.shape[2:])
    dots = torch.empty(L * K, dtype=torch.float32, device=src.device) if y is not None else None
    if L == 0:
        return out, dots
    s = _flat(src)
    cfg = cfg or move_config(C, src.element_size())
    dummy = s
    _gather_sum_kernel[(L,)](
        s, _flat(base) if base is not None else dummy, scale if scale is not None else dummy,
        keep if keep is not None else dummy, inv, _flat(y) if y is not None else dummy, out,
        dots if dots is not None else dummy, L0, C, K,
        KP=triton.next_power_of_2(K), BC=cfg.block, HAS_BASE=base is not None, HAS_SCALE=scale is not None,
        HAS_KEEP=keep is not None, HAS_DOTS=y is not None, num_warps=cfg.warps)
    return out, dots


def _combine(o_all, keep, inv, K, L, shared):
    """Raw `combine_rows`: o `[1, L, *C]` = o_all[t] (with the shared path) + the kept sparse rows of token t."""
    L0 = L if shared else 0
    return _gather_sum(o_all, L, o_all[:, :L] if shared else None, None, keep, inv, K, L0)[0]


def _unpack_grad(d_out, L, shared, scale, keep, inv, K, x_sp=None, same=False):
    """The packer's backward on `d_out` `[1, L0 + M, *C]`: (the shared rows' gradient, None without a shared path or
    when `same` (one tensor on both paths: then summed into the sparse one), the sparse tensor's `[1, L, *C]`, the
    row dots with `x_sp` that are the scale's gradient, or None)."""
    L0 = L if shared else 0
    if same and shared:
        d_sp, dots = _gather_sum(d_out, L, d_out[:, :L0], scale, keep, inv, K, L0, y=x_sp)
        return None, d_sp, dots
    d_sp, dots = _gather_sum(d_out, L, None, scale, keep, inv, K, L0, y=x_sp)
    return (d_out[:, :L0] if shared else None), d_sp, dots


class _PackRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_sh, x_sp, scale, keep, order, inv, K):
        ctx.K, ctx.has_sh = K, x_sh is not None
        ctx.sh_dtype = None if x_sh is None else x_sh.dtype
        # one tensor on both paths (SSE's v): its gradient is summed in the gather-sum, no separate add
        ctx.same = x_sh is x_sp
        ctx.save_for_backward(x_sp if (scale is not None and scale.requires_grad) else None, scale, keep, inv)
        return _pack(x_sh, x_sp, scale, keep, order, K)

    @staticmethod
    def backward(ctx, d_out):
        x_sp, scale, keep, inv = ctx.saved_tensors
        d_sh, d_sp, dots = _unpack_grad(d_out.contiguous(), inv.numel() // ctx.K, ctx.has_sh, scale, keep, inv, ctx.K,
                                        x_sp, ctx.same)
        d_sh = None if d_sh is None else d_sh.to(ctx.sh_dtype)
        d_scale = None if dots is None else dots.to(scale.dtype)
        return d_sh, d_sp, d_scale, None, None, None, None


class _CombineRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o_all, keep, order, inv, K, L, shared):
        ctx.K, ctx.shared = K, shared
        ctx.save_for_backward(keep, order, inv)
        return _combine(o_all, keep, inv, K, L, shared)

    @staticmethod
    def backward(ctx, d_o):
        keep, order, inv = ctx.saved_tensors
        d_o = d_o.contiguous()
        return _pack(d_o if ctx.shared else None, d_o, None, keep, order, ctx.K), None, None, None, None, None, None


def pack_rows(x_sh, x_sp, order, inv, K: int, scale=None, keep=None):
    """See module doc. x_sh `[1, L, *C]` | None, x_sp `[1, L, *C]` (same dtype), order `[M]`, inv `[L*K]`
    int64, scale `[L*K]` fp32 | None (differentiable), keep `[L*K]` bool | None -> `[1, L0 + M, *C]`."""
    if x_sh is not None and x_sh.dtype != x_sp.dtype:
        x_sh = x_sh.to(x_sp.dtype)
    keep = None if keep is None else keep.to(torch.int8)
    return _PackRows.apply(x_sh, x_sp, scale, keep, order, inv, K)


def combine_rows(o_all, order, inv, K: int, L: int, shared: bool, keep=None):
    """See module doc. o_all `[1, L0 + M, *C]` -> o `[1, L, *C]` (o_all's dtype, fp32 sums)."""
    keep = None if keep is None else keep.to(torch.int8)
    return _CombineRows.apply(o_all, keep, order, inv, K, L, shared)
