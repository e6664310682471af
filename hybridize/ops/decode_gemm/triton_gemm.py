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
(`triton.testing.do_bench` flushes it, as a decode step meets its weights) and keeps the fastest,
cuBLAS included (`choices()` shows what was picked and the timings). That costs a few seconds per shape
once per process, in the eager warm-up steps before a CUDA graph is captured; while a graph is being
captured an untimed shape runs cuBLAS. fp32 accumulation (as cuBLAS); output and bias in x's dtype.
Only 16-bit inputs: fp32 would run tf32 dots, which F.linear does not.

The input tile can be made from x in the loads (`Prologue`): a gated MLP's `silu(gate) * up` from x = [gate | up],
or SSE's output `rms_norm(x per head) * silu(gate)` (K tiles one head wide). In a decode step that elementwise op was a kernel of its own
between two GEMMs; each such launch costs about as much as a small GEMM's bytes (the step is a chain of ~390
kernels at the SmolLM2-135M shape, benchmarks/RESULTS.md). The prologue rounds where PyTorch's ops do.

    decode_linear_triton(x, weight, bias=None, config=None, pro=PLAIN) -> `[..., N]`
        x `[..., K]` (`[..., 2K]` for pro "gated") with at most 16 rows in all, weight `[N, K]` (row-major), bias
        `[N]` or None; config {BN, BK, SPLIT, num_warps, num_stages} runs that config (benchmarks, tests), "cublas"
        PyTorch

Registered as the custom ops `hybridize::decode_linear`, `decode_linear_gated` and `decode_linear_head_norm`, so
`torch.compile` keeps each as one opaque call (no graph break) and CUDA graphs capture the launch. The caller (`hybridize.ops.decode_gemm.route`)
decides when it applies and falls back to `F.linear` otherwise.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

from hybridize.ops.common.pdl import pdl_launch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: F.linear is used
    triton = None

#: rows one call may have (the MMA operand height the kernel pads to)
MAX_ROWS = 16

#: candidate configs (BN, BK, SPLIT, num_warps, num_stages): narrow BN and split-K give tall-K / narrow-N
#: matrices enough programs; wide BN the wide ones (lm_head); deep pipelines keep HBM busy
CONFIGS = [dict(BN=bn, BK=bk, SPLIT=sp, num_warps=w, num_stages=st) for bn, bk, sp, w, st in [
    (16, 256, 1, 4, 4), (16, 512, 1, 4, 3), (16, 512, 1, 2, 4), (32, 256, 1, 4, 4), (32, 128, 1, 4, 5),
    (64, 128, 1, 4, 4), (64, 256, 1, 8, 3), (128, 128, 1, 8, 4), (128, 64, 1, 4, 5),
    (16, 256, 2, 4, 4), (16, 256, 4, 4, 4), (16, 256, 2, 2, 4), (32, 256, 2, 4, 4), (32, 256, 4, 4, 4),
    (64, 128, 2, 4, 4), (64, 128, 4, 4, 4), (32, 128, 8, 4, 4)]]

_CHOICE: dict[tuple, dict | str] = {}      # (N, K, M, dtype, bias, prologue kind, head dim) -> config or "cublas"
_TIMINGS: dict[tuple, dict[str, float]] = {}


if triton is not None:
    @triton.jit
    def _gated(x, g):
        # x * silu(g) with PyTorch's roundings in 16 bits: silu in fp32 rounded to the input dtype, then the product
        # in fp32 rounded again (`x * F.silu(g)`)
        gf = g.to(tl.float32)
        a = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
        return (x.to(tl.float32) * a.to(tl.float32)).to(g.dtype)

    @triton.jit
    def _head_normed(x, nw, eps, HD: tl.constexpr):
        # the x^T tile [HD, BM], one head of each row, RMS-normed over its HD channels and scaled by the gain nw
        # [HD], in fp32, rounded once to x's dtype (F.rms_norm); a plain reduction along the tile's first axis
        xf = x.to(tl.float32)
        r = tl.rsqrt(tl.sum(xf * xf, 0) / HD + eps)                             # [BM]
        return (xf * r[None, :] * nw[:, None]).to(x.dtype)

    @triton.jit
    def _decode_linear_kernel(x, w, b, out, g, nw, M, N, stride_xm, stride_wn, stride_om, stride_gm, eps,
                              K: tl.constexpr, HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                              BK: tl.constexpr, SPLIT: tl.constexpr, INPUT: tl.constexpr, HD: tl.constexpr,
                              UPCAST: tl.constexpr, PDL: tl.constexpr):
        # UPCAST: fp32 dots, for the interpreter, whose bf16 dot is wrong (numpy has no bf16).
        # K is a compile-time constant: static loop bounds (the interpreter takes no tensor bounds in
        # range()) and no K mask when the slice is a multiple of BK.
        # SPLIT > 1: out is the fp32 partial buffer [SPLIT, M, N]; slice s writes out[s]
        # INPUT, how the input tile is made from x (the elementwise kernel before the GEMM, folded into its loads):
        #   0: x itself; 1 (a gated MLP's down projection): x is [gate | up] [M, 2K], the input silu(gate) * up;
        #   2 (SSE's output): RMSNorm over each head's HD channels with gain nw [HD], times silu(g), g [M, K] with
        #   row stride stride_gm (BK = HD: a tile is one head)
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
                m_x = m_m[None, :]
            else:
                m_k = (i_s * KS + k0 + tl.arange(0, BK)) < K
                b_w = tl.load(p_w, mask=m_n[:, None] & m_k[None, :], other=0.0)
                m_x = m_k[:, None] & m_m[None, :]
            b_x = tl.load(p_x, mask=m_x, other=0.0)
            if INPUT == 1:
                b_x = _gated(tl.load(p_x + K, mask=m_x, other=0.0), b_x)
            if INPUT == 2:
                k_abs = i_s * KS + k0 + tl.arange(0, BK)
                b_n = tl.load(nw + tl.arange(0, BK)).to(tl.float32)
                b_g = tl.load(g + offs_m[None, :].to(tl.int64) * stride_gm + k_abs[:, None], mask=m_x, other=0.0)
                b_x = _gated(_head_normed(b_x, b_n, eps, HD), b_g)
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


class Prologue(NamedTuple):
    """How the GEMM's input is made from x in its loads (the elementwise kernel before it, folded in).

    kind "plain": x itself. "gated" (a gated MLP's down projection): x is [gate | up] `[M, 2K]`, the input
    `F.silu(gate) * up`. "head_norm" (SSE's output): `rms_norm(x per head of head_dim channels, norm_weight) *
    F.silu(gate)`, gate `[M, K]` (any row stride), norm_weight `[head_dim]`; PyTorch's roundings in 16 bits."""

    kind: str = "plain"
    gate: torch.Tensor | None = None
    norm_weight: torch.Tensor | None = None
    eps: float = 0.0

    @property
    def head_dim(self) -> int:
        return self.norm_weight.shape[0] if self.kind == "head_norm" else 0

    def key(self) -> tuple:
        return (self.kind, self.head_dim)

    def configs(self) -> list[dict]:
        """The candidate configs: `CONFIGS`, for head_norm with the K tile one head wide (the norm is then a plain
        reduction along the tile, no reshape)."""
        if self.kind != "head_norm":
            return CONFIGS
        return [dict(t) for t in dict.fromkeys(tuple({**c, "BK": self.head_dim}.items()) for c in CONFIGS)]


PLAIN = Prologue()
_KIND = {"plain": 0, "gated": 1, "head_norm": 2}


def _launch(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
            cfg: dict, pdl: bool = False, pro: Prologue = PLAIN) -> None:
    M = x2.shape[0]
    N, K = weight.shape
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    cfg = dict(cfg)
    warps, stages, split = cfg.pop("num_warps", 4), cfg.pop("num_stages", 2), cfg.pop("SPLIT", 1)
    b = bias if bias is not None else weight
    g = pro.gate if pro.gate is not None else x2              # never read unless head_norm
    nw = pro.norm_weight if pro.norm_weight is not None else x2
    dst = out if split == 1 else torch.empty(split, M, N, dtype=torch.float32, device=x2.device)
    grid = (triton.cdiv(N, cfg["BN"]), split)
    _decode_linear_kernel[grid](x2, weight, b, dst, g, nw, M, N, x2.stride(0), weight.stride(0), out.stride(0),
                                g.stride(0), float(pro.eps), K, HAS_BIAS=bias is not None, BM=MAX_ROWS,
                                SPLIT=split, INPUT=_KIND[pro.kind], HD=max(pro.head_dim, 1), UPCAST=interpret,
                                PDL=pdl, num_warps=warps, num_stages=stages, launch_pdl=pdl, **cfg)
    if split > 1:
        block = 1024
        _split_sum_kernel[(triton.cdiv(N, block), M)](dst, b, out, M, N, out.stride(0), HAS_BIAS=bias is not None,
                                                      SPLIT=split, BLOCK=block, PDL=pdl, launch_pdl=pdl)


def _name(cfg) -> str:
    if cfg == "cublas":
        return "cublas"
    return "BN{BN}_BK{BK}_S{SPLIT}_w{num_warps}_s{num_stages}".format(**cfg)


def _cublas(x2, weight, bias, pro: Prologue = PLAIN):
    """The same product through PyTorch: the prologue's elementwise ops, then F.linear."""
    if pro.kind == "gated":
        gate, up = x2.chunk(2, dim=-1)
        x2 = F.silu(gate) * up
    elif pro.kind == "head_norm":
        M, K = x2.shape
        D = pro.head_dim
        normed = F.rms_norm(x2.view(M, K // D, D), (D,), pro.norm_weight, pro.eps).view(M, K)
        x2 = normed * F.silu(pro.gate)
    return F.linear(x2, weight, bias)


def _choose(x2, weight, bias, key, pro: Prologue = PLAIN) -> dict | str:
    """Time cuBLAS and every config on these tensors with a cold L2; remember and return the fastest."""
    from triton.testing import do_bench

    out = torch.empty(x2.shape[0], weight.shape[0], dtype=x2.dtype, device=x2.device)
    try:   # do_bench flushes L2 with a 256 MB buffer: on a nearly full GPU, keep cuBLAS rather than fail a rollout
        times = {"cublas": do_bench(lambda: _cublas(x2, weight, bias, pro), warmup=5, rep=20, return_mode="median")}
    except torch.cuda.OutOfMemoryError:
        times = {}
    best, best_t = "cublas", times.get("cublas", 0.0)
    for cfg in pro.configs() if times else []:
        try:
            t = do_bench(lambda: _launch(x2, weight, bias, out, cfg, pro=pro), warmup=5, rep=20,
                         return_mode="median")
        except Exception:  # a config this GPU cannot run (shared memory), or out of memory: skip it
            continue
        times[_name(cfg)] = t
        if t < best_t:
            best, best_t = cfg, t
    _CHOICE[key] = best
    _TIMINGS[key] = times
    return best


def _picked(x2, weight, bias, pro: Prologue = PLAIN) -> dict | str:
    """The kept choice for this shape, timed now if there is none; never timed inside a CUDA graph
    capture (an untimed shape runs cuBLAS there, and is timed at its next call outside one)."""
    key = (*weight.shape, x2.shape[0], x2.dtype, bias is not None, *pro.key())
    config = _CHOICE.get(key)
    if config is None:
        config = "cublas" if torch.cuda.is_current_stream_capturing() else _choose(x2, weight, bias, key, pro)
    return config


def choices() -> dict[str, dict]:
    """What was picked per shape so far: {"NxK m=rows dtype[ bias][ kind]": {"choice": name, "us": {...}}}."""
    shown = {}
    for key, c in _CHOICE.items():
        n, k, m, dt, hb, kind, hd = key
        label = f"{n}x{k} m={m} {str(dt).replace('torch.', '')}{' bias' if hb else ''}"
        label += "" if kind == "plain" else f" {kind}" + (f"{hd}" if hd else "")
        shown[label] = {"choice": _name(c), "us": {name: 1e3 * t for name, t in _TIMINGS.get(key, {}).items()}}
    return shown


def unsupported(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                pro: Prologue = PLAIN) -> str | None:
    """Why the kernel cannot take these tensors (a one-line message), or None when it can."""
    gated = pro.kind == "gated"
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1] * (2 if gated else 1):
        want = "[gate | up] [..., 2K]" if gated else "[..., K]"
        return f"decode_linear: x {want} and weight [N, K] do not fit: {tuple(x.shape)}, {tuple(weight.shape)}"
    rows = x.numel() // max(x.shape[-1], 1)
    if rows > MAX_ROWS:
        return f"decode_linear takes at most {MAX_ROWS} rows, got {rows}; use F.linear"
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype:
        return f"decode_linear takes bf16/fp16 x and weight of one dtype, got {x.dtype}, {weight.dtype}"
    if weight.stride(1) != 1:
        return "decode_linear needs a row-major weight (stride 1 along K)"
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype):
        return f"decode_linear: bias must be [N={weight.shape[0]}] in {x.dtype}, got {tuple(bias.shape)} {bias.dtype}"
    if pro.kind == "head_norm":
        D, g, nw = pro.head_dim, pro.gate, pro.norm_weight
        if D < 16 or D & (D - 1) or x.shape[-1] % D:
            return (f"decode_linear's head norm needs a power-of-two head dim >= 16 (a K tile) dividing K, got {D}, "
                    f"K={x.shape[-1]}")
        if g is None or g.shape != x.shape or g.dtype != x.dtype or g.stride(-1) != 1:
            return f"decode_linear's head norm needs a gate like x {tuple(x.shape)} {x.dtype} with unit column stride"
        if nw.dim() != 1 or nw.dtype != x.dtype or not nw.is_contiguous():
            return f"decode_linear's head norm needs a contiguous norm weight [{D}] in {x.dtype}"
    return None


def check_args(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pro: Prologue = PLAIN) -> None:
    """One-line errors for what the kernel cannot take (the dispatcher avoids all of these)."""
    reason = unsupported(x, weight, bias, pro)
    if reason is not None:
        raise ValueError(reason)


def decode_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         config: dict | str | None = None, pro: Prologue = PLAIN) -> torch.Tensor:
    """x `[..., K]` (<= 16 rows) -> `[..., N]` in x's dtype, by the config picked for this shape (timed on
    the first call, see the module docstring), or by `config` when given ("cublas": PyTorch). `pro`: the input
    made from x in the kernel's loads (`Prologue`; x is `[..., 2K]` for "gated")."""
    check_args(x, weight, bias, pro)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if pro.gate is not None:
        pro = pro._replace(gate=pro.gate.reshape(x2.shape))
    M, N = x2.shape[0], weight.shape[0]
    if config is None:   # CPU tensors (the interpreter): no timing, one small config
        config = _picked(x2, weight, bias, pro) if x.is_cuda else dict(BN=16, BK=pro.head_dim or 32, SPLIT=1)
    if pro.kind == "head_norm" and config != "cublas" and config["BK"] != pro.head_dim:
        raise ValueError(f"decode_linear's head norm takes K tiles one head wide: BK={config['BK']}, head dim "
                         f"{pro.head_dim}")
    if config == "cublas":
        return _cublas(x2, weight, bias, pro).view(*x.shape[:-1], N)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M:
        _launch(x2, weight, bias, out, config, pdl=pdl_launch(x.device), pro=pro)
    return out.view(*x.shape[:-1], N)


if triton is not None:
    @torch.library.custom_op("hybridize::decode_linear", mutates_args=())
    def decode_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return decode_linear_triton(x, weight, bias)

    @decode_linear_op.register_fake
    def _(x, weight, bias):
        return x.new_empty(*x.shape[:-1], weight.shape[0])

    @torch.library.custom_op("hybridize::decode_linear_gated", mutates_args=())
    def decode_linear_gated_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return decode_linear_triton(x, weight, bias, pro=Prologue("gated"))

    @decode_linear_gated_op.register_fake
    def _(x, weight, bias):
        return x.new_empty(*x.shape[:-1], weight.shape[0])

    @torch.library.custom_op("hybridize::decode_linear_head_norm", mutates_args=())
    def decode_linear_head_norm_op(x: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                                   weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return decode_linear_triton(x, weight, bias, pro=Prologue("head_norm", gate, norm_weight, eps))

    @decode_linear_head_norm_op.register_fake
    def _(x, gate, norm_weight, eps, weight, bias):
        return x.new_empty(*x.shape[:-1], weight.shape[0])
