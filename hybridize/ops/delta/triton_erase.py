"""Q-Delta's erase direction for fla's Comba kernels in one pass: p = exp(g) (k + lambda q).

Why: formed with PyTorch ops (lambda q, + k, x exp(g)) the erase direction costs three passes over
`[B, T, H, K]` tensors before the Comba forward, which kept Q-Delta's forward at 1.22x Gated DeltaNet's
at T >= 16k (benchmarks/RESULTS.md). This kernel reads q and k once and writes p once, in fp32 registers.
The backward is one pass too (dq, dk and per-row partial sums for dg and dlam; dlam's sum over rows in
PyTorch): as PyTorch elementwise ops in fp32 it cost Q-Delta's fwd+bwd ~8% at 64k.

    comba_erase(q, k, lam, g) -> p `[B, T, H, K]` in q's dtype
        q, k `[B, T, H, K]`; lam `[H]` (lambda per head); g `[B, T, H]` log-decay or None (no exp(g) factor)

`comba_erase_reference` is the same in PyTorch (the CPU path and the tests' reference).
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: only the reference is used
    triton = None


def comba_erase_reference(q, k, lam, g=None):
    """exp(g) (k + lam q) computed in fp32, returned in q's dtype."""
    x = k.float() + lam.float()[:, None] * q.float()
    if g is not None:
        x = x * g.float().exp()[..., None]
    return x.to(q.dtype)


if triton is not None:
    @triton.jit
    def _row_block(q, k, lam, n_rows, H, K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        """This program's rows of the flattened `[B*T*H, K]` q and k (fp32), their lambda, and the indexing."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_K)
        rmask = rows < n_rows
        mask = rmask[:, None] & (cols[None, :] < K)
        offs = rows[:, None] * K + cols[None, :]
        b_q = tl.load(q + offs, mask=mask, other=0.0).to(tl.float32)
        b_k = tl.load(k + offs, mask=mask, other=0.0).to(tl.float32)
        b_l = tl.load(lam + rows % H, mask=rmask, other=0.0).to(tl.float32)
        return rows, rmask, mask, offs, b_q, b_k, b_l

    @triton.jit
    def _erase_kernel(q, k, lam, g, p, n_rows, H, K: tl.constexpr, HAS_G: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        rows, rmask, mask, offs, b_q, b_k, b_l = _row_block(q, k, lam, n_rows, H, K, BLOCK_R, BLOCK_K)
        b_x = b_k + b_l[:, None] * b_q
        if HAS_G:
            b_g = tl.load(g + rows, mask=rmask, other=0.0).to(tl.float32)
            b_x = b_x * tl.exp(b_g)[:, None]
        tl.store(p + offs, b_x.to(p.dtype.element_ty), mask=mask)

    @triton.jit
    def _erase_bwd_kernel(dp, q, k, lam, g, dq, dk, dg_row, dl_row, n_rows, H, K: tl.constexpr,
                          HAS_G: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        rows, rmask, mask, offs, b_q, b_k, b_l = _row_block(q, k, lam, n_rows, H, K, BLOCK_R, BLOCK_K)
        b_dp = tl.load(dp + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_G:
            b_s = tl.exp(tl.load(g + rows, mask=rmask, other=0.0).to(tl.float32))
            b_dk = b_dp * b_s[:, None]
            tl.store(dg_row + rows, tl.sum(b_dk * (b_k + b_l[:, None] * b_q), axis=1), mask=rmask)
        else:
            b_dk = b_dp
        tl.store(dk + offs, b_dk.to(dk.dtype.element_ty), mask=mask)
        tl.store(dq + offs, (b_dk * b_l[:, None]).to(dq.dtype.element_ty), mask=mask)
        tl.store(dl_row + rows, tl.sum(b_dk * b_q, axis=1), mask=rmask)


def _blocks(K: int) -> tuple[int, int]:
    block_k = triton.next_power_of_2(K)
    return max(1, 2048 // block_k), block_k


@torch.compiler.disable   # opaque to torch.compile (a Triton launcher)
def _erase_bwd_triton(dp, q, k, lam, g):
    B, T, H, K = q.shape
    n = B * T * H
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    dg_row = torch.empty(n, device=q.device, dtype=torch.float32)
    dl_row = torch.empty(n, device=q.device, dtype=torch.float32)
    gf = g.float().contiguous() if g is not None else dl_row
    block_r, block_k = _blocks(K)
    _erase_bwd_kernel[(triton.cdiv(n, block_r),)](dp.contiguous(), q.contiguous(), k.contiguous(),
                                                  lam.float().contiguous(), gf, dq, dk, dg_row, dl_row, n, H, K=K,
                                                  HAS_G=g is not None, BLOCK_R=block_r, BLOCK_K=block_k,
                                                  num_warps=4)
    dlam = dl_row.view(B * T, H).sum(0)
    dg = dg_row.view(B, T, H) if g is not None else None
    return dq, dk, dlam, dg


@torch.compiler.disable   # opaque to torch.compile (a Triton launcher)
def _erase_triton(q, k, lam, g):
    B, T, H, K = q.shape
    q, k = q.contiguous(), k.contiguous()
    lam = lam.float().contiguous()
    gf = g.float().contiguous() if g is not None else lam   # any pointer when HAS_G is off
    p = torch.empty_like(q)
    n = B * T * H
    block_r, block_k = _blocks(K)
    _erase_kernel[(triton.cdiv(n, block_r),)](q, k, lam, gf, p, n, H, K=K, HAS_G=g is not None,
                                               BLOCK_R=block_r, BLOCK_K=block_k, num_warps=4)
    return p


def _use_triton(q) -> bool:
    return triton is not None and (q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


class _CombaErase(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, lam, g):
        ctx.save_for_backward(q, k, lam, g)
        return _erase_triton(q, k, lam, g) if _use_triton(q) else comba_erase_reference(q, k, lam, g)

    @staticmethod
    def backward(ctx, dp):
        q, k, lam, g = ctx.saved_tensors
        if _use_triton(q):
            dq, dk, dlam, dg = _erase_bwd_triton(dp, q, k, lam, g)
            return dq, dk, dlam.to(lam.dtype), (dg.to(g.dtype) if g is not None else None)
        dp = dp.float()
        s = g.float().exp()[..., None] if g is not None else None
        dk = dp * s if s is not None else dp                       # dp/dk = exp(g)
        dq = dk * lam.float()[:, None]                              # dp/dq = exp(g) lam
        dlam = (dk * q.float()).sum(dim=(0, 1, 3))                  # [H]
        dg = None
        if g is not None and ctx.needs_input_grad[3]:
            dg = (dk * (k.float() + lam.float()[:, None] * q.float())).sum(-1).to(g.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dlam.to(lam.dtype), dg


def comba_erase(q: torch.Tensor, k: torch.Tensor, lam: torch.Tensor, g: torch.Tensor | None = None) -> torch.Tensor:
    """p = exp(g) (k + lam q) `[B, T, H, K]` in q's dtype, differentiable in q, k, lam and g."""
    B, T, H, K = q.shape
    if k.shape != q.shape or lam.shape != (H,) or (g is not None and g.shape != (B, T, H)):
        raise ValueError(f"comba_erase: q, k [B, T, H, K], lam [H], g [B, T, H]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, lam {tuple(lam.shape)}, g {None if g is None else tuple(g.shape)}")
    return _CombaErase.apply(q, k, lam, g)
