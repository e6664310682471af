"""`x @ W^T (+ b)` for a decode step's few rows (M <= 16): a weight-streaming GEMM, bf16/fp16.

Why: a decode step of the fast rollout loop multiplies 8 rows by every weight matrix of the model, so
it is bound by reading the weights once. cuBLAS picks tile shapes made for large M there: in the
compiled Qwen3-1.7B-shaped 5:1 hybrid step (B=8, H100) its GEMMs took 2.06 ms for ~3.4 GB of weights,
about half of HBM bandwidth, with split-K and a separate reduce kernel on the tall-K matrices.
Here each program owns `BN` output columns (weight rows), streams its `[BN, K]` weight panel through
`BK`-wide tiles, and multiplies them with the whole `[M, BK]` input tile (padded to 16 rows, the
smallest tensor-core operand), so the weight is read exactly once and nothing else is. No split-K:
`BN` as small as 16 gives every SM its own panel already for N >= 2048.

fp32 accumulation (as cuBLAS), output and bias in x's dtype. Configs are autotuned per (N, K) on the
first call (seconds; Triton caches the winner on disk); `benchmarks/decode_gemm.py` compares it with
`F.linear` per shape. Only 16-bit inputs: fp32 would run tf32 dots, which F.linear does not.

    decode_linear(x, weight, bias=None) -> `[..., N]`
        x `[..., K]` with at most 16 rows in all, weight `[N, K]` (row-major), bias `[N]` or None

Registered as the custom op `hybridize::decode_linear`, so `torch.compile` keeps it as one opaque call
(no graph break) and CUDA graphs capture the launch. The caller (`hybridize.kernels.decode_linear`)
decides when it applies and falls back to `F.linear` otherwise.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: F.linear is used
    triton = None

#: rows one call may have (the MMA operand height the kernel pads to)
MAX_ROWS = 16


def _configs():
    # a small grid: (BN, BK, warps, stages); BN 16/32 for the narrow-N, tall-K matrices (enough programs
    # without split-K), 64/128 for the wide ones (lm_head, MLP up), deep pipelines to keep HBM busy
    out = []
    for bn, bk, warps, stages in [(16, 256, 4, 4), (16, 512, 4, 3), (16, 512, 4, 5), (32, 256, 4, 4),
                                  (32, 512, 4, 3), (32, 256, 4, 6), (64, 128, 4, 4), (64, 256, 4, 4),
                                  (64, 256, 8, 3), (128, 128, 4, 4), (128, 128, 8, 4), (128, 64, 4, 6)]:
        out.append(triton.Config({"BN": bn, "BK": bk}, num_warps=warps, num_stages=stages))
    return out


if triton is not None:
    @triton.jit
    def _decode_linear_kernel(x, w, b, out, M, N, stride_xm, stride_wn, stride_om, K: tl.constexpr,
                              HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                              UPCAST: tl.constexpr = False):
        # UPCAST: fp32 dots, for the interpreter, whose bf16 dot is wrong (numpy has no bf16).
        # K is a compile-time constant: a static loop (the interpreter takes no tensor bounds in range())
        # and no K mask when BK divides it
        offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
        offs_m = tl.arange(0, BM)
        offs_k = tl.arange(0, BK)
        m_n = offs_n < N
        m_m = offs_m < M
        p_w = w + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]     # [BN, BK]
        p_x = x + offs_m[None, :].to(tl.int64) * stride_xm + offs_k[:, None]     # [BK, BM] (x^T tile)
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        for k0 in range(0, K, BK):
            if K % BK == 0:
                b_w = tl.load(p_w, mask=m_n[:, None], other=0.0)
                b_x = tl.load(p_x, mask=m_m[None, :], other=0.0)
            else:
                m_k = (k0 + offs_k) < K
                b_w = tl.load(p_w, mask=m_n[:, None] & m_k[None, :], other=0.0)
                b_x = tl.load(p_x, mask=m_k[:, None] & m_m[None, :], other=0.0)
            if UPCAST:
                acc = tl.dot(b_w.to(tl.float32), b_x.to(tl.float32), acc)
            else:
                acc = tl.dot(b_w, b_x, acc)
            p_w += BK
            p_x += BK
        if HAS_BIAS:
            acc += tl.load(b + offs_n, mask=m_n, other=0.0).to(tl.float32)[:, None]
        p_o = out + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
        tl.store(p_o, acc.to(out.dtype.element_ty), mask=m_n[:, None] & m_m[None, :])

    _decode_linear_tuned = triton.autotune(configs=_configs(), key=["N", "K", "HAS_BIAS"],
                                           cache_results=True)(_decode_linear_kernel)


def _launch(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
            config: dict | None = None) -> None:
    M, K = x2.shape
    N = weight.shape[0]
    args = (x2, weight, bias if bias is not None else weight, out, M, N, x2.stride(0), weight.stride(0),
            out.stride(0), K)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if config is not None or interpret:
        cfg = dict(config or {"BN": 16, "BK": 32})
        warps = cfg.pop("num_warps", 4)
        stages = cfg.pop("num_stages", 2)
        grid = (triton.cdiv(N, cfg["BN"]),)
        _decode_linear_kernel[grid](*args, HAS_BIAS=bias is not None, BM=MAX_ROWS, UPCAST=interpret,
                                    num_warps=warps, num_stages=stages, **cfg)
        return
    grid = lambda meta: (triton.cdiv(N, meta["BN"]),)  # noqa: E731
    _decode_linear_tuned[grid](*args, HAS_BIAS=bias is not None, BM=MAX_ROWS)


def check_args(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """One-line errors for what the kernel cannot take (the dispatcher avoids all of these)."""
    rows = x.numel() // max(x.shape[-1], 1)
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"decode_linear: x [..., K] and weight [N, K] do not fit: {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")
    if rows > MAX_ROWS:
        raise ValueError(f"decode_linear takes at most {MAX_ROWS} rows, got {rows}; use F.linear")
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype:
        raise ValueError(f"decode_linear takes bf16/fp16 x and weight of one dtype, got {x.dtype}, {weight.dtype}")
    if weight.stride(1) != 1:
        raise ValueError("decode_linear needs a row-major weight (stride 1 along K)")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(f"decode_linear: bias must be [N={weight.shape[0]}] in {x.dtype}, got "
                         f"{tuple(bias.shape)} {bias.dtype}")


def decode_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         config: dict | None = None) -> torch.Tensor:
    """The kernel on x `[..., K]` (<= 16 rows): `[..., N]` in x's dtype. `config` fixes
    {BN, BK, num_warps, num_stages} instead of autotuning (benchmarks and the interpreter)."""
    check_args(x, weight, bias)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _launch(x2, weight, bias, out, config)
    return out.view(*x.shape[:-1], weight.shape[0])


if triton is not None:
    @torch.library.custom_op("hybridize::decode_linear", mutates_args=())
    def decode_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return decode_linear_triton(x, weight, bias)

    @decode_linear_op.register_fake
    def _(x, weight, bias):
        return x.new_empty(*x.shape[:-1], weight.shape[0])
