"""Q-Delta's erase direction for fla's Comba kernels in one pass: p = exp(g) (k + lambda q).

Why: formed with PyTorch ops (lambda q, + k, x exp(g)) the erase direction costs three passes over
`[B, T, H, K]` tensors before the Comba forward, which kept Q-Delta's forward at 1.22x Gated DeltaNet's
at T >= 16k (benchmarks/RESULTS.md). This kernel reads q and k once and writes p once, in fp32 registers.
The backward is plain PyTorch (elementwise, fp32), next to Comba's own much larger backward.

    comba_erase(q, k, lam, g) -> p `[B, T, H, K]` in q's dtype
        q, k `[B, T, H, K]`; lam `[H]` (lambda per head); g `[B, T, H]` log-decay or None (no exp(g) factor)

`comba_erase_reference` is the same in PyTorch (the CPU path and the tests' reference).
"""
from __future__ import annotations

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
    def _erase_kernel(q, k, lam, g, p, n_rows, H, K: tl.constexpr, HAS_G: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_K)
        rmask = rows < n_rows
        mask = rmask[:, None] & (cols[None, :] < K)
        offs = rows[:, None] * K + cols[None, :]
        b_q = tl.load(q + offs, mask=mask, other=0.0).to(tl.float32)
        b_k = tl.load(k + offs, mask=mask, other=0.0).to(tl.float32)
        b_l = tl.load(lam + rows % H, mask=rmask, other=0.0).to(tl.float32)
        b_x = b_k + b_l[:, None] * b_q
        if HAS_G:
            b_g = tl.load(g + rows, mask=rmask, other=0.0).to(tl.float32)
            b_x = b_x * tl.exp(b_g)[:, None]
        tl.store(p + offs, b_x.to(p.dtype.element_ty), mask=mask)


@torch.compiler.disable   # opaque to torch.compile (a Triton launcher)
def _erase_triton(q, k, lam, g):
    B, T, H, K = q.shape
    q, k = q.contiguous(), k.contiguous()
    lam = lam.float().contiguous()
    gf = g.float().contiguous() if g is not None else lam   # any pointer when HAS_G is off
    p = torch.empty_like(q)
    n = B * T * H
    block_k = triton.next_power_of_2(K)
    block_r = max(1, 2048 // block_k)
    _erase_kernel[(triton.cdiv(n, block_r),)](q, k, lam, gf, p, n, H, K=K, HAS_G=g is not None,
                                               BLOCK_R=block_r, BLOCK_K=block_k, num_warps=4)
    return p


def _use_triton(q) -> bool:
    import os
    return triton is not None and (q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


class _CombaErase(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, lam, g):
        ctx.save_for_backward(q, k, lam, g)
        return _erase_triton(q, k, lam, g) if _use_triton(q) else comba_erase_reference(q, k, lam, g)

    @staticmethod
    def backward(ctx, dp):
        q, k, lam, g = ctx.saved_tensors
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
