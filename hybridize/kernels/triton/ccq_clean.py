"""CCQ query cleaning on the GPU: the normalisation of k as one fused pass, and the gate's Triton pieces.

- `unit_rows`: kbar = k / max(||k||, 1e-12), one pass forward and one backward
  (dk = (dkbar - kbar (kbar . dkbar)) / ||k||; dkbar / 1e-12 on rows below the clamp, as F.normalize);
- the gate, lambda = sigmoid(w_h . qbar + b_h) and q - lambda * Sigma q, is applied by the read: the
  Triton read (`ccq_read.py`) does it in its output pass and its backward's dq / dk passes with `_lam`
  and `_gate_params` from here, so q, Sigma q and the gradients make no extra trip through memory.
All arithmetic is fp32 in registers, one rounding to the output dtype. fp64 inputs go to the PyTorch form.
History (16k tokens, H = 16, K = 128, H100): a dozen PyTorch elementwise kernels each way cost ~0.7 ms
forward and ~3 ms backward per layer; two fused passes around the read ~0.13 / ~0.3 ms; inside the read
the gate costs a few row sums per tile.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

EPS = 1e-12  # F.normalize's clamp


@triton.jit
def _unit(b_x, EPS: tl.constexpr):
    """(x / max(||x||, EPS), the clamped norm `[BR]`) per row of a `[BR, BK]` fp32 tile (F.normalize)."""
    d = tl.maximum(tl.sqrt(tl.sum(b_x * b_x, 1)), EPS)
    return b_x / d[:, None], d


@triton.jit
def _unit_grad(b_y, d, b_dy, EPS: tl.constexpr):
    """dx from dy through y = `_unit`(x) (y, d its outputs); below the clamp (d == EPS) the denominator is
    the constant EPS, so no gradient goes through the norm."""
    proj = tl.where(d > EPS, tl.sum(b_y * b_dy, 1), 0.0)
    return (b_dy - b_y * proj[:, None]) / d[:, None]


@triton.jit
def _unit_rows_fwd(x, y, R, K: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, EPS: tl.constexpr):
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)
    o_k = tl.arange(0, BK)
    m = (o_r[:, None] < R) & (o_k[None, :] < K)
    p = o_r[:, None].to(tl.int64) * K + o_k[None, :]
    b_y, _ = _unit(tl.load(x + p, mask=m, other=0.0).to(tl.float32), EPS)
    tl.store(y + p, b_y.to(y.dtype.element_ty), mask=m)


@triton.jit
def _unit_rows_bwd(x, dy, dx, R, K: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, EPS: tl.constexpr):
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)
    o_k = tl.arange(0, BK)
    m = (o_r[:, None] < R) & (o_k[None, :] < K)
    p = o_r[:, None].to(tl.int64) * K + o_k[None, :]
    b_y, d = _unit(tl.load(x + p, mask=m, other=0.0).to(tl.float32), EPS)
    b_dy = tl.load(dy + p, mask=m, other=0.0).to(tl.float32)
    tl.store(dx + p, _unit_grad(b_y, d, b_dy, EPS).to(dx.dtype.element_ty), mask=m)


@triton.jit
def _gate_params(w, b, i_h, o_k, m_k, K: tl.constexpr, FIXED: tl.constexpr):
    """Head i_h's weight row and bias in fp32 (zeros, unread, with a fixed lambda)."""
    if FIXED:
        return tl.zeros(o_k.shape, dtype=tl.float32), 0.0
    else:
        return tl.load(w + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32), tl.load(b + i_h).to(tl.float32)


@triton.jit
def _lam(b_q, b_w, bias_h, FIXED: tl.constexpr, LAM, EPS: tl.constexpr):
    """(lambda, ||q|| clamped, qbar . w) per row of a `[BT, BK]` fp32 tile of whole query rows of one head
    (b_w: its weight row, bias_h: its bias); qbar itself is never formed."""
    d = tl.maximum(tl.sqrt(tl.sum(b_q * b_q, 1)), EPS)
    if FIXED:
        qw = tl.zeros_like(d)
        lam = qw + LAM
    else:
        qw = tl.sum(b_q * b_w[None, :], 1) / d
        lam = tl.sigmoid(qw + bias_h)
    return lam, d, qw


def _tiles(K):
    BK = max(16, triton.next_power_of_2(K))
    BR = max(1, min(64, 4096 // BK))
    return BK, BR


class _UnitRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()
        K = x.shape[-1]
        R = x.numel() // K
        BK, BR = _tiles(K)
        y = torch.empty_like(x)
        _unit_rows_fwd[(triton.cdiv(R, BR),)](x, y, R, K=K, BK=BK, BR=BR, EPS=EPS, num_warps=4)
        ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        K = x.shape[-1]
        R = x.numel() // K
        BK, BR = _tiles(K)
        dx = torch.empty_like(x)
        _unit_rows_bwd[(triton.cdiv(R, BR),)](x, dy.contiguous(), dx, R, K=K, BK=BK, BR=BR, EPS=EPS, num_warps=4)
        return dx


def ccq_clean_fused(q, k, weight, bias, fixed_lambda, read):
    """`ccq_clean_chunk` with kbar from the fused pass; `read` applies the gate (in its own kernels when it
    is the Triton read)."""
    from hybridize.kernels import ccq_clean as ref

    ref.check_gate(q, weight, bias, fixed_lambda)
    if q.dtype == torch.float64 or q.numel() == 0:
        return ref.ccq_clean_chunk(q, k, weight, bias, fixed_lambda, read)
    return read(q, _UnitRows.apply(k), gate=(weight, bias, fixed_lambda))


__all__ = ["ccq_clean_fused"]
