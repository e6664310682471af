"""SSE's no-gradient q/k front end (`qk_front.qk_front_torch`) in one Triton kernel: read the fused
projections' q|k columns (and the sparse path's LoRA delta) once, write both paths' feature-mapped q and k once.

One program takes BM rows of the flattened (token, head) pairs of one path: add the delta (sparse path),
RMS-norm with the head's gain, RoPE with the token's cos/sin (rotate_half's partner channel loaded beside
each channel), the q or k feature map; in fp32 from the loaded 16-bit values, one rounding at the store (the
PyTorch chain rounds after every op, so in bf16 the two agree to the inputs' rounding, in fp32 to rounding).
No host sync, no data-dependent shape: capturable in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridize.ops.sse.qk_front import MAPS
from hybridize.ops.sse.triton_fused_step import _feature


@triton.jit
def _qk_front_kernel(qk, delta, wn, cos, sin, q_out, k_out, M, T, s_qk, s_d, s_cb, s_ct, eps,
                     H: tl.constexpr, R: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
                     NORM: tl.constexpr, ROPE: tl.constexpr, QMAP: tl.constexpr, KMAP: tl.constexpr):
    i_m, path = tl.program_id(0), tl.program_id(1)
    rows = i_m.to(tl.int64) * BM + tl.arange(0, BM)            # (token, head) pairs, head fastest
    live = rows < M * R
    tok, head = rows // R, rows % R
    d = tl.arange(0, D)
    partner = (d + D // 2) % D
    m2 = live[:, None]
    src = tok[:, None] * s_qk + head[:, None] * D
    x = tl.load(qk + src + d[None, :], mask=m2, other=0.0).to(tl.float32)
    add = m2 & (path == 1)                                     # the shared path reads no delta
    dsrc = tok[:, None] * s_d + head[:, None] * D
    x += tl.load(delta + dsrc + d[None, :], mask=add, other=0.0).to(tl.float32)
    if ROPE:
        xp = tl.load(qk + src + partner[None, :], mask=m2, other=0.0).to(tl.float32)
        xp += tl.load(delta + dsrc + partner[None, :], mask=add, other=0.0).to(tl.float32)
    if NORM:
        r = tl.rsqrt(tl.sum(x * x, 1) / D + eps)[:, None]
        x = x * r * tl.load(wn + head[:, None] * D + d[None, :], mask=m2, other=0.0).to(tl.float32)
        if ROPE:
            xp = xp * r * tl.load(wn + head[:, None] * D + partner[None, :], mask=m2, other=0.0).to(tl.float32)
    if ROPE:
        pe = (tok // T)[:, None] * s_cb + (tok % T)[:, None] * s_ct + d[None, :]
        c = tl.load(cos + pe, mask=m2, other=0.0).to(tl.float32)
        s = tl.load(sin + pe, mask=m2, other=0.0).to(tl.float32)
        sign = tl.where(d < D // 2, -1.0, 1.0)[None, :]
        x = x * c + sign * xp * s
    is_q = head < H
    x = tl.where(is_q[:, None], _feature(x, QMAP, 1), _feature(x, KMAP, 1))
    base = path * M + tok
    qdst = (base * H + head)[:, None] * D + d[None, :]
    kdst = (base * (R - H) + head - H)[:, None] * D + d[None, :]
    tl.store(q_out + qdst, x.to(q_out.dtype.element_ty), mask=m2 & is_q[:, None])
    tl.store(k_out + kdst, x.to(k_out.dtype.element_ty), mask=m2 & (head >= H)[:, None])


@torch.compiler.disable
def qk_front_triton(qk: torch.Tensor, delta: torch.Tensor, heads: int, head_dim: int, maps: tuple[str, str],
                    norm: tuple[torch.Tensor, float] | None = None,
                    rope: tuple[torch.Tensor, torch.Tensor] | None = None, block_rows: int = 16):
    """`qk_front.qk_front_torch`'s contract in one kernel: qk, delta `[B, T, (H + Hk) D]` with unit column stride
    and one token stride (column views of the fused projections are fine) -> q `[2, B, T, H, D]`,
    k `[2, B, T, Hk, D]`, contiguous. Full rotary only (cos/sin `[B or 1, T, D]`); power-of-two D."""
    B, T, n = qk.shape
    D = head_dim
    R = n // D
    if D & (D - 1) or R * D != n or delta.shape != qk.shape or not 0 < heads < R:
        raise ValueError(f"qk_front_triton: D={D} must be a power of two dividing {n} into q and k heads")
    M = B * T
    s_qk = qk.stride(1) if T > 1 else qk.stride(0)
    s_d = delta.stride(1) if T > 1 else delta.stride(0)
    q = torch.empty(2, B, T, heads, D, dtype=qk.dtype, device=qk.device)
    k = torch.empty(2, B, T, R - heads, D, dtype=qk.dtype, device=qk.device)
    weight, eps = norm if norm is not None else (qk, 0.0)      # qk: never read (constexpr branch)
    if norm is not None and tuple(weight.shape) != (R, D):
        raise ValueError(f"qk_front_triton: the norm weight must be [H + Hk, D] = {(R, D)}, got {tuple(weight.shape)}")
    cos, sin = rope if rope is not None else (qk, qk)
    if rope is not None:
        if cos.shape[-1] != D or cos.shape != sin.shape or cos.shape[-2] != T or cos.shape[0] not in (1, B):
            raise ValueError(f"qk_front_triton: cos/sin must be [B or 1, {T}, {D}], got {tuple(cos.shape)}")
        cos, sin = cos.contiguous(), sin.contiguous()
    s_cb = cos.stride(0) if rope is not None and cos.shape[0] > 1 else 0
    s_ct = cos.stride(-2) if rope is not None else 0
    grid = (triton.cdiv(M * R, block_rows), 2)
    _qk_front_kernel[grid](qk, delta, weight, cos, sin, q, k, M, T, s_qk, s_d, s_cb, s_ct, float(eps),
                           H=heads, R=R, D=D, BM=block_rows, NORM=norm is not None, ROPE=rope is not None,
                           QMAP=MAPS[maps[0]], KMAP=MAPS[maps[1]], num_warps=4)
    return q, k
