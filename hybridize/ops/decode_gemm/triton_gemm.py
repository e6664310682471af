"""`x @ W^T (+ b)` for a decode step's few rows (M <= 16): a weight-streaming GEMM, bf16/fp16, and the
per-shape choice between it and cuBLAS.

Why: a decode step of the fast rollout loop multiplies 8 rows by every weight matrix of the model, so
it is bound by reading the weights once. cuBLAS picks tile shapes made for large M there: in the
compiled Qwen3-1.7B-shaped 5:1 hybrid step (B=8, H100) its GEMMs took 2.06 ms for ~3.9 GB of weights,
about 55% of HBM bandwidth, with split-K and a separate reduce kernel on the tall-K matrices.
Here each program owns `BN` output columns (weight rows) and one of `SPLIT` slices of K, streams its
weight panel through `BK`-wide tiles and multiplies them with the `[M, BK]` input tile (padded to 16
rows, the smallest tensor-core operand), so the weight is read exactly once. With `SPLIT` > 1 the
slices write fp32 partial sums and a second small kernel adds them (+ bias) into the output.

Which is faster depends on the shape and the GPU, so `decode_linear_triton` does not guess: on the
first call for a (N, K, rows, dtype, bias) it times cuBLAS and each config of `CONFIGS` with a cold L2
(flushed, as a decode step meets its weights) and keeps the fastest, cuBLAS included (`choices()` shows what was
picked and the timings). The times are GPU times, the host's launch cost kept out
(`hybridize.ops.common.gpu_timer.time_cold`), as the step runs from a CUDA graph. That costs about 1-3 s in all for
the 1.7B step's six shapes (H200), once per process, in the eager warm-up steps before a CUDA graph is captured; while
a graph is being captured an untimed shape runs cuBLAS. Two processes of one code can still pick differently where the
best configs are within a percent or two; `pin_choices(choices())` makes another process run the same picks, untimed
(`benchmarks/generation/compile_auto.py --gemm-choices`). fp32 accumulation (as cuBLAS); output and bias in x's dtype.
Only 16-bit inputs: fp32 would run tf32 dots, which F.linear does not.

    decode_linear_triton(x, weight, bias=None, config=None) -> `[..., N]`
        x `[..., K]` with at most 16 rows in all, weight `[N, K]` (row-major), bias `[N]` or None;
        config {BN, BK, SPLIT, num_warps, num_stages} runs that config (benchmarks, tests), "cublas" F.linear

Registered as the custom op `hybridize::decode_linear`, so `torch.compile` keeps it as one opaque call
(no graph break) and CUDA graphs capture the launch. The caller (`hybridize.ops.decode_gemm.route`)
decides when it applies and falls back to `F.linear` otherwise.
"""
from __future__ import annotations

import os
import re

import torch
import torch.nn.functional as F

from hybridize.ops.common.gpu_timer import time_cold
from hybridize.ops.common.pdl import pdl_launch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: F.linear is used
    triton = None

#: rows one call may have (the MMA operand height the kernel pads to)
MAX_ROWS = 16

#: candidate configs (BN, BK, SPLIT, num_warps, num_stages): narrow BN and split-K give tall-K / narrow-N
#: matrices enough programs; wide BN the wide ones (lm_head); deep pipelines keep HBM busy. The last three (a
#: 1024-wide K tile, six stages) took the H200's best at 8 rows from the others by ~5% for the 1.7B shape's down
#: projection, SSE stage 1 and q / k / v stack (benchmarks/ops/decode_gemm_variants.py)
CONFIGS = [dict(BN=bn, BK=bk, SPLIT=sp, num_warps=w, num_stages=st) for bn, bk, sp, w, st in [
    (16, 256, 1, 4, 4), (16, 512, 1, 4, 3), (16, 512, 1, 2, 4), (32, 256, 1, 4, 4), (32, 128, 1, 4, 5),
    (64, 128, 1, 4, 4), (64, 256, 1, 8, 3), (128, 128, 1, 8, 4), (128, 64, 1, 4, 5),
    (16, 256, 2, 4, 4), (16, 256, 4, 4, 4), (16, 256, 2, 2, 4), (32, 256, 2, 4, 4), (32, 256, 4, 4, 4),
    (64, 128, 2, 4, 4), (64, 128, 4, 4, 4), (32, 128, 8, 4, 4),
    (16, 1024, 1, 4, 3), (64, 128, 1, 4, 6), (64, 256, 1, 4, 4)]]

_CHOICE: dict[tuple, dict | str] = {}      # (N, K, M, dtype, bias) -> config or "cublas"
_TIMINGS: dict[tuple, dict[str, float]] = {}


if triton is not None:
    @triton.jit
    def _decode_linear_kernel(x, w, b, out, M, N, stride_xm, stride_wn, stride_om, K: tl.constexpr,
                              HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                              SPLIT: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr):
        # UPCAST: fp32 dots, for the interpreter, whose bf16 dot is wrong (numpy has no bf16).
        # K is a compile-time constant: static loop bounds (the interpreter takes no tensor bounds in
        # range()) and no K mask when the slice is a multiple of BK.
        # SPLIT > 1: out is the fp32 partial buffer [SPLIT, M, N]; slice s writes out[s]
        # PDL: launched before the previous kernel has finished (`ops/common/pdl.py`): wait for it before
        # reading x; let the next kernel launch once the weights are read.
        KS: tl.constexpr = ((K + SPLIT * BK - 1) // (SPLIT * BK)) * BK      # K per slice, whole tiles
        i_s = tl.program_id(1)
        offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
        offs_m = tl.arange(0, BM)
        offs_k = i_s * KS + tl.arange(0, BK)
        m_n = offs_n < N
        m_m = offs_m < M
        p_w = w + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]     # [BN, BK]
        p_x = x + offs_m[None, :].to(tl.int64) * stride_xm + offs_k[:, None]     # [BK, BM] (x^T tile)
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        if PDL:
            tl.extra.cuda.gdc_wait()
        for k0 in range(0, KS, BK):
            if K % (SPLIT * BK) == 0:
                b_w = tl.load(p_w, mask=m_n[:, None], other=0.0)
                b_x = tl.load(p_x, mask=m_m[None, :], other=0.0)
            else:
                m_k = (i_s * KS + k0 + tl.arange(0, BK)) < K
                b_w = tl.load(p_w, mask=m_n[:, None] & m_k[None, :], other=0.0)
                b_x = tl.load(p_x, mask=m_k[:, None] & m_m[None, :], other=0.0)
            if UPCAST:
                acc = tl.dot(b_w.to(tl.float32), b_x.to(tl.float32), acc)
            else:
                acc = tl.dot(b_w, b_x, acc)
            p_w += BK
            p_x += BK
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        if SPLIT == 1:
            if HAS_BIAS:
                acc += tl.load(b + offs_n, mask=m_n, other=0.0).to(tl.float32)[:, None]
            p_o = out + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
            tl.store(p_o, acc.to(out.dtype.element_ty), mask=m_n[:, None] & m_m[None, :])
        else:
            p_o = out + (i_s * M + offs_m[None, :]).to(tl.int64) * N + offs_n[:, None]
            tl.store(p_o, acc, mask=m_n[:, None] & m_m[None, :])

    @triton.jit
    def _split_sum_kernel(part, b, out, M, N, stride_om, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                          BLOCK: tl.constexpr, PDL: tl.constexpr):
        # out[m, n] = sum_s part[s, m, n] (+ b[n]), one program per BLOCK outputs of one row
        if PDL:
            tl.extra.cuda.gdc_wait()
        m = tl.program_id(1)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            acc += tl.load(part + (s * M + m).to(tl.int64) * N + offs, mask=mask, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out + m.to(tl.int64) * stride_om + offs, acc.to(out.dtype.element_ty), mask=mask)


def _launch(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
            cfg: dict, pdl: bool = False) -> None:
    M, K = x2.shape
    N = weight.shape[0]
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    cfg = dict(cfg)
    warps, stages, split = cfg.pop("num_warps", 4), cfg.pop("num_stages", 2), cfg.pop("SPLIT", 1)
    b = bias if bias is not None else weight
    dst = out if split == 1 else torch.empty(split, M, N, dtype=torch.float32, device=x2.device)
    grid = (triton.cdiv(N, cfg["BN"]), split)
    _decode_linear_kernel[grid](x2, weight, b, dst, M, N, x2.stride(0), weight.stride(0), out.stride(0), K,
                                HAS_BIAS=bias is not None, BM=MAX_ROWS, SPLIT=split, UPCAST=interpret, PDL=pdl,
                                num_warps=warps, num_stages=stages, launch_pdl=pdl, **cfg)
    if split > 1:
        block = 1024
        _split_sum_kernel[(triton.cdiv(N, block), M)](dst, b, out, M, N, out.stride(0), HAS_BIAS=bias is not None,
                                                      SPLIT=split, BLOCK=block, PDL=pdl, launch_pdl=pdl)


def _name(cfg) -> str:
    if cfg == "cublas":
        return "cublas"
    return "BN{BN}_BK{BK}_S{SPLIT}_w{num_warps}_s{num_stages}".format(**cfg)


def _choose(x2, weight, bias, key) -> dict | str:
    """Time cuBLAS and every config on these tensors with a cold L2 (GPU time); remember and return the fastest."""
    out = torch.empty(x2.shape[0], weight.shape[0], dtype=x2.dtype, device=x2.device)
    try:   # the L2 flush takes a 256 MB buffer: on a nearly full GPU, keep cuBLAS rather than fail a rollout
        times = {"cublas": time_cold(lambda: F.linear(x2, weight, bias), x2.device)}
    except torch.cuda.OutOfMemoryError:
        times = {}
    best, best_t = "cublas", times.get("cublas", 0.0)
    for cfg in CONFIGS if times else []:
        try:
            t = time_cold(lambda: _launch(x2, weight, bias, out, cfg), x2.device)
        except Exception:  # a config this GPU cannot run (shared memory), or out of memory: skip it
            continue
        times[_name(cfg)] = t
        if t < best_t:
            best, best_t = cfg, t
    _CHOICE[key] = best
    _TIMINGS[key] = times
    return best


def _picked(x2, weight, bias) -> dict | str:
    """The kept choice for this shape, timed now if there is none; never timed inside a CUDA graph
    capture (an untimed shape runs cuBLAS there, and is timed at its next call outside one)."""
    key = (weight.shape[0], x2.shape[1], x2.shape[0], x2.dtype, bias is not None)
    config = _CHOICE.get(key)
    if config is None:
        config = "cublas" if torch.cuda.is_current_stream_capturing() else _choose(x2, weight, bias, key)
    return config


def choices() -> dict[str, dict]:
    """What was picked per shape so far: {"NxK m=rows dtype bias": {"choice": name, "us": {...}}}."""
    return {f"{n}x{k} m={m} {str(dt).replace('torch.', '')}{' bias' if hb else ''}":
            {"choice": _name(c), "us": {name: 1e3 * t for name, t in _TIMINGS.get((n, k, m, dt, hb), {}).items()}}
            for (n, k, m, dt, hb), c in _CHOICE.items()}


def _parse_name(name: str) -> dict | str:
    """`_name`'s inverse: "cublas", or "BN64_BK128_S1_w4_s4" -> {BN, BK, SPLIT, num_warps, num_stages}."""
    if name == "cublas":
        return name
    m = re.fullmatch(r"BN(\d+)_BK(\d+)_S(\d+)_w(\d+)_s(\d+)", name)
    if m is None:
        raise ValueError(f"not a decode GEMM config name: {name!r} (expected cublas or BN<n>_BK<k>_S<s>_w<w>_s<s>)")
    bn, bk, split, warps, stages = map(int, m.groups())
    return dict(BN=bn, BK=bk, SPLIT=split, num_warps=warps, num_stages=stages)


def pin_choices(shown: dict[str, dict]) -> int:
    """Make the picks of `shown` (a `choices()` dict, e.g. from another process's JSON) this process's, untimed: the
    shapes it names are not timed again. For A/B runs that must not differ in their picks. Returns how many."""
    for label, entry in shown.items():
        m = re.fullmatch(r"(\d+)x(\d+) m=(\d+) (\w+)( bias)?", label)
        if m is None or not hasattr(torch, m.group(4)):
            raise ValueError(f"not a decode GEMM choice label: {label!r} (expected like '2048x6144 m=8 bfloat16')")
        n, k, rows = int(m.group(1)), int(m.group(2)), int(m.group(3))
        key = (n, k, rows, getattr(torch, m.group(4)), m.group(5) is not None)
        _CHOICE[key] = _parse_name(entry["choice"])
        _TIMINGS[key] = {}
    return len(shown)


def unsupported(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """Why the kernel cannot take these tensors (a one-line message), or None when it can."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        return f"decode_linear: x [..., K] and weight [N, K] do not fit: {tuple(x.shape)}, {tuple(weight.shape)}"
    rows = x.numel() // max(x.shape[-1], 1)
    if rows > MAX_ROWS:
        return f"decode_linear takes at most {MAX_ROWS} rows, got {rows}; use F.linear"
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype:
        return f"decode_linear takes bf16/fp16 x and weight of one dtype, got {x.dtype}, {weight.dtype}"
    if weight.stride(1) != 1:
        return "decode_linear needs a row-major weight (stride 1 along K)"
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype):
        return f"decode_linear: bias must be [N={weight.shape[0]}] in {x.dtype}, got {tuple(bias.shape)} {bias.dtype}"
    return None


def check_args(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """One-line errors for what the kernel cannot take (the dispatcher avoids all of these)."""
    reason = unsupported(x, weight, bias)
    if reason is not None:
        raise ValueError(reason)


def decode_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         config: dict | str | None = None) -> torch.Tensor:
    """x `[..., K]` (<= 16 rows) -> `[..., N]` in x's dtype, by the config picked for this shape (timed on
    the first call, see the module docstring), or by `config` when given ("cublas": F.linear)."""
    check_args(x, weight, bias)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M, N = x2.shape[0], weight.shape[0]
    if config is None:   # CPU tensors (the interpreter): no timing, one small config
        config = _picked(x2, weight, bias) if x.is_cuda else dict(BN=16, BK=32, SPLIT=1)
    if config == "cublas":
        return F.linear(x, weight, bias)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M:
        _launch(x2, weight, bias, out, config, pdl=pdl_launch(x.device))
    return out.view(*x.shape[:-1], N)


if triton is not None:
    @torch.library.custom_op("hybridize::decode_linear", mutates_args=())
    def decode_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return decode_linear_triton(x, weight, bias)

    @decode_linear_op.register_fake
    def _(x, weight, bias):
        return x.new_empty(*x.shape[:-1], weight.shape[0])
