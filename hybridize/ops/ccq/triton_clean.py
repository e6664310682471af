"""CCQ query cleaning on the GPU: the PyTorch glue around the covariance read as two fused passes.

Computes what `hybridize.ops.ccq.clean.chunk_ccq_clean` computes (same arguments):
- `unit_rows`: kbar = k / max(||k||, 1e-12), one pass forward and one backward
  (dk = (dkbar - kbar (kbar . dkbar)) / ||k||; dkbar / 1e-12 on rows below the clamp, as F.normalize);
- the read itself is the caller's (`read(q, kbar)`, the Triton covariance read on CUDA);
- `clean_query`: per row (token, head) qbar, lambda = sigmoid(w_h . qbar + b_h) and q - lambda * Sigma q in
  one pass; the backward recomputes qbar and lambda and gives dq, d(Sigma q) and per-block partial sums of
  dw, db (summed afterwards: deterministic, no atomics).
In chunk mode without gradient (inference) the gate and update run inside the Triton read's output pass instead
(`ccq_clean_fused_chunk`, `ops/ccq/triton_read.py`'s `clean=`): no gate pass at all.
All arithmetic is fp32 in registers, one rounding to the output dtype (the PyTorch form rounds after
every op in 16-bit). fp64 inputs go to the PyTorch form. Before: F.normalize twice, an fp32 copy of qbar,
an einsum, sigmoid, a product and a difference, each a full pass over `[B, T, H, K]` forward and more
backward (16k tokens, H = 16, K = 128 on an H100: ~0.7 ms forward and ~3 ms backward per layer).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridize.ops.ccq import clean as ref

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
def _gate(b_q, b_w, bias_h, FIXED: tl.constexpr, LAM, EPS: tl.constexpr):
    """(qbar, ||q|| clamped, lambda) for a tile of rows of one head (b_w: its weight row, bias_h: its bias)."""
    b_qbar, d = _unit(b_q, EPS)
    if FIXED:
        lam = tl.zeros_like(d) + LAM
    else:
        lam = tl.sigmoid(tl.sum(b_qbar * b_w[None, :], 1) + bias_h)
    return b_qbar, d, lam


@triton.jit
def _clean_fwd(q, s, w, b, out, BT, LAM, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr,
               FIXED: tl.constexpr, EPS: tl.constexpr):
    # one program per (block of BR tokens, head): rows (token, head) of [B*T, H, K]
    i_r, i_h = tl.program_id(0), tl.program_id(1)
    o_r = i_r * BR + tl.arange(0, BR)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    m = (o_r[:, None] < BT) & m_k[None, :]
    p = (o_r[:, None].to(tl.int64) * H + i_h) * K + o_k[None, :]
    b_q = tl.load(q + p, mask=m, other=0.0).to(tl.float32)
    b_s = tl.load(s + p, mask=m, other=0.0).to(tl.float32)
    b_w, bias_h = _gate_params(w, b, i_h, o_k, m_k, K, FIXED)
    _, _, lam = _gate(b_q, b_w, bias_h, FIXED, LAM, EPS)
    tl.store(out + p, (b_q - lam[:, None] * b_s).to(out.dtype.element_ty), mask=m)


@triton.jit
def _clean_bwd(q, s, w, b, dout, dq, ds, dw_part, db_part, BT, LAM, H: tl.constexpr, K: tl.constexpr,
               BK: tl.constexpr, BR: tl.constexpr, FIXED: tl.constexpr, EPS: tl.constexpr):
    i_r, i_h = tl.program_id(0), tl.program_id(1)
    o_r = i_r * BR + tl.arange(0, BR)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    m_r = o_r < BT
    m = m_r[:, None] & m_k[None, :]
    p = (o_r[:, None].to(tl.int64) * H + i_h) * K + o_k[None, :]
    b_q = tl.load(q + p, mask=m, other=0.0).to(tl.float32)
    b_s = tl.load(s + p, mask=m, other=0.0).to(tl.float32)
    b_do = tl.load(dout + p, mask=m, other=0.0).to(tl.float32)
    b_w, bias_h = _gate_params(w, b, i_h, o_k, m_k, K, FIXED)
    b_qbar, d, lam = _gate(b_q, b_w, bias_h, FIXED, LAM, EPS)
    tl.store(ds + p, (-lam[:, None] * b_do).to(ds.dtype.element_ty), mask=m)
    b_dq = b_do
    if not FIXED:
        # lambda's gradient through the sigmoid to w, b and (via qbar = q / max(||q||, EPS)) to q
        dlogit = -tl.sum(b_do * b_s, 1) * lam * (1.0 - lam)
        dlogit = tl.where(m_r, dlogit, 0.0)
        b_dq += _unit_grad(b_qbar, d, dlogit[:, None] * b_w[None, :], EPS)
        pp = (i_r * H + i_h).to(tl.int64)
        tl.store(dw_part + pp * K + o_k, tl.sum(dlogit[:, None] * b_qbar, 0), mask=m_k)
        tl.store(db_part + pp, tl.sum(dlogit, 0))
    tl.store(dq + p, b_dq.to(dq.dtype.element_ty), mask=m)


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


def _gate_pointers(q, weight, bias, fixed):
    """Weight and bias as kernel arguments; with a fixed lambda the kernels read neither (q stands in)."""
    return (q, q) if fixed else (weight.contiguous(), bias.contiguous())


class _CleanQuery(torch.autograd.Function):
    """(q, Sigma q, weight, bias, fixed lambda) -> q - lambda(qbar) Sigma q, all `[B, T, H, K]`."""

    @staticmethod
    def forward(ctx, q, s, weight, bias, fixed_lambda):
        q, s = q.contiguous(), s.contiguous()
        B, T, H, K = q.shape
        BK, BR = _tiles(K)
        fixed = fixed_lambda is not None
        w, b = _gate_pointers(q, weight, bias, fixed)
        out = torch.empty_like(q)
        grid = (triton.cdiv(B * T, BR), H)
        _clean_fwd[grid](q, s, w, b, out, B * T, float(fixed_lambda or 0.0), H=H, K=K, BK=BK, BR=BR, FIXED=fixed,
                         EPS=EPS, num_warps=4)
        ctx.save_for_backward(q, s, weight if not fixed else None, bias if not fixed else None)
        ctx.fixed_lambda = fixed_lambda
        return out

    @staticmethod
    def backward(ctx, dout):
        q, s, weight, bias = ctx.saved_tensors
        B, T, H, K = q.shape
        BK, BR = _tiles(K)
        fixed = ctx.fixed_lambda is not None
        nb = triton.cdiv(B * T, BR)
        dq, ds = torch.empty_like(q), torch.empty_like(s)
        f32 = dict(device=q.device, dtype=torch.float32)
        dw_part = torch.empty(nb, H, K, **f32) if not fixed else dq
        db_part = torch.empty(nb, H, **f32) if not fixed else dq
        w, b = _gate_pointers(q, weight, bias, fixed)
        _clean_bwd[(nb, H)](q, s, w, b, dout.contiguous(), dq, ds, dw_part, db_part, B * T,
                            float(ctx.fixed_lambda or 0.0), H=H, K=K, BK=BK, BR=BR, FIXED=fixed, EPS=EPS, num_warps=4)
        if fixed:
            return dq, ds, None, None, None
        return dq, ds, dw_part.sum(0).to(weight.dtype), db_part.sum(0).to(bias.dtype), None


def ccq_clean_fused(q, k, weight, bias, fixed_lambda, read, unit_keys: bool = False, read_cleans: bool = False):
    """`chunk_ccq_clean` with the normalisation of k and the gate + update of q as fused Triton passes
    (`unit_keys`: k is used as it is, no normalisation pass either way). `read_cleans`: `read` takes
    `clean=(weight, bias, fixed lambda)` and then returns the cleaned query itself (the Triton read's epilogue,
    `ops/ccq/triton_read.py`); used when nothing needs a gradient, saving the gate pass (inference)."""
    ref.check_gate(q, weight, bias, fixed_lambda)
    if q.dtype == torch.float64 or q.numel() == 0:
        return ref.chunk_ccq_clean(q, k, weight, bias, fixed_lambda, read, unit_keys)
    k_unit = k if unit_keys else _UnitRows.apply(k)
    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, weight, bias))
    if read_cleans and not grads:
        return read(q, k_unit, clean=(weight, bias, fixed_lambda))
    sigma_q, stats = read(q, k_unit)
    return _CleanQuery.apply(q, sigma_q, weight, bias, fixed_lambda), stats


def ccq_clean_fused_chunk(*args, **kwargs):
    """`ccq_clean_fused` for chunk mode, whose read (`triton_read.ccq_triton` on CUDA) can clean in its epilogue."""
    return ccq_clean_fused(*args, read_cleans=True, **kwargs)


__all__ = ["ccq_clean_fused", "ccq_clean_fused_chunk"]
