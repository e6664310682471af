"""SSE's q/k front end without gradient: the shared and the sparse path's q/k heads from the fused projections,
with the sparse path's LoRA delta added, RMS-normed, rotated (RoPE) and feature-mapped, in one pass
("Scaling Linear Attention with Sparse State Expansion": the sparse path's q/k are the shared path's plus a
low-rank delta; the norms, rotary and maps are the teacher's and SSE's).

    x_p = qk + (p == sparse) delta              qk, delta `[M, (H + Hk) D]` (M = B T tokens, column views)
    x_p = RMSNorm(x_p) * weight                 weight `[H + Hk, D]`: q rows, then k rows (optional)
    x_p = x_p cos + rotate_half(x_p) sin        cos / sin `[B or 1, T, D]`, full rotary (optional)
    q_p = q_map(x_p[:H]),  k_p = k_map(x_p[H:])

`qk_front_torch` is the reference, the separate PyTorch ops (each rounding to the inputs' dtype); on CUDA
`triton_qk_front.qk_front_triton` does it in one kernel in fp32 from the loaded 16-bit values, rounding once,
as the one-kernel decode step does. The PyTorch chain is about a dozen passes over `[2, B, T, H + Hk, D]`: at the
1.7B shape, 8k x 8, it made the fused front end 18.9 ms per SSE layer against 9.1 ms with the kernel (H100 / H200;
benchmarks/RESULTS.md, "Prefill: SSE's q/k front end in one kernel").
"""
from __future__ import annotations

import torch

from hybridize.mixers.base import apply_rope

#: feature-map codes (constexpr in the kernel)
MAPS = {"identity": 0, "silu": 1, "softmax": 2}


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`RMSNorm.forward` with a weight that may vary per row (`[..., rows, D]` against `[rows, D]`): as torch's
    rms_norm computes it, in fp32 with the gain multiplied before the one rounding."""
    dtype = x.dtype
    x = x.to(torch.promote_types(dtype, torch.float32))
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight).to(dtype)


def feature_map(x: torch.Tensor, name: str) -> torch.Tensor:
    """SSE's q/k/v feature maps: silu | softmax (over the head dim) | identity."""
    if name == "silu":
        return torch.nn.functional.silu(x)
    if name == "softmax":  # over the head dim; torch's softmax accumulates 16-bit inputs in fp32 and rounds once,
        return torch.softmax(x, dim=-1).to(x.dtype)   # so one pass gives the fp32 softmax's rounding (autocast: fp32)
    return x


def qk_front_torch(qk: torch.Tensor, delta: torch.Tensor, heads: int, head_dim: int, maps: tuple[str, str],
                   norm: tuple[torch.Tensor, float] | None = None,
                   rope: tuple[torch.Tensor, torch.Tensor] | None = None):
    """qk, delta `[B, T, (H + Hk) D]` -> (q `[2, B, T, H, D]`, k `[2, B, T, Hk, D]`), path 0 the shared, 1 the
    sparse; `norm` (weight `[H + Hk, D]`, eps) and `rope` (cos, sin `[B, T, R]`, R <= D) optional."""
    B, T, n = qk.shape
    both = torch.empty(2, B, T, n, dtype=qk.dtype, device=qk.device)
    both[0].copy_(qk)
    torch.add(qk, delta, out=both[1])
    both = both.view(2, B, T, n // head_dim, head_dim)
    if norm is not None:
        both = rms_norm_rows(both, *norm)
    if rope is not None:
        both = apply_rope(both, *rope)
    return feature_map(both[..., :heads, :], maps[0]), feature_map(both[..., heads:, :], maps[1])


def qk_front_fits(qk: torch.Tensor, delta: torch.Tensor, head_dim: int, maps: tuple[str, str], rope) -> bool:
    """The one-kernel form applies: a power-of-two head dim, known maps, full rotary with cos/sin `[B or 1, T, D]`,
    and qk / delta with unit column stride and token rows as one stride."""
    if head_dim & (head_dim - 1) or any(m not in MAPS for m in maps):
        return False
    B, T, _ = qk.shape
    if rope is not None:
        cos = rope[0]
        if cos.dim() != 3 or cos.shape[-1] != head_dim or cos.shape[1] != T or cos.shape[0] not in (1, B):
            return False   # partial rotary, or a layout the kernel does not index: the PyTorch chain
    return all(t.stride(-1) == 1 and (B == 1 or T == 1 or t.stride(0) == T * t.stride(1)) for t in (qk, delta))


def qk_front(qk: torch.Tensor, delta: torch.Tensor, heads: int, head_dim: int, maps: tuple[str, str],
             norm: tuple[torch.Tensor, float] | None = None, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
             kernel: bool = False):
    """`qk_front_torch`'s contract; `kernel=True` (the caller checked that our Triton kernels apply) takes the
    one-kernel form where it fits, and never inside torch.compile (Inductor fuses the PyTorch chain itself)."""
    if kernel and not torch.compiler.is_compiling() and qk_front_fits(qk, delta, head_dim, maps, rope):
        from hybridize.ops.sse.triton_qk_front import qk_front_triton
        return qk_front_triton(qk, delta, heads, head_dim, maps, norm, rope)
    return qk_front_torch(qk, delta, heads, head_dim, maps, norm, rope)
