"""Thin adapter: registers fla-core 0.6.0 GPU kernels (and our fixes) with `dispatch.register_gpu`.

`activate()` registers one wrapper per (op, mode) below; it imports nothing heavy. Each wrapper
imports fla-core on its first call (so `import hybridize` on a CPU machine never imports triton or
fla), maps our argument conventions onto fla's, and hands any case fla does not cover back to the
PyTorch op (`dispatch.torch_impl`) instead of guessing.

| op / mode          | GPU path                                                                      |
| ------------------ | ----------------------------------------------------------------------------- |
| gla / chunk        | `chunk_gla` (scalar or absent gate broadcast to the key channels)             |
| gla / recurrent    | `fused_recurrent_gla`                                                         |
| delta / chunk      | g, p None, 16-bit: `chunk_delta_rule`; p None: GDN = fla's gated delta rule  |
|                    | forward + fla's backward with our PyTorch `chunk_bwd_dqkwg`; p given: Comba,  |
|                    | same scheme, with p_fla = exp(g) * p; lam given (Q-Delta, p = k + lam q):     |
|                    | p_fla = exp(g) (k + lam q) in one Triton pass (`ops/delta/triton_erase.py`)   |
| delta / recurrent  | `fused_recurrent_gated_delta_rule` / `fused_recurrent_comba` (forward only:   |
|                    | with gradients required the chunk path above is used)                        |
| log_linear / chunk | `chunk_log_linear_attn` (on fp32 copies) when no state in/out, no clamped level|
| ccq / chunk        | our fused Triton read (`ops/ccq/triton_read.py`: C_t q, mu_t mu_t^T q, one    |
|                    | chunked pass fwd + Triton bwd); `ccq_chunk` here (a `chunk_gla` call with     |
|                    | values = keys, cumsum for mu, t) is kept as the comparison path               |
| ccq_clean / both   | `ops/ccq/triton_clean.py`: CCQ's normalisation of k, gate and                 |
|                    | q - lambda Sigma q as two fused passes around the read (forward and backward) |

Conventions mapped here:
- fla's Comba reads its erase direction against the *undecayed* state: u = v - S_{t-1}^T p_fla, then
  S = exp(g) S + beta k u^T. Our delta op reads the decayed state S' = exp(g) S_{t-1}, so
  p_fla = exp(g_t) p_t (fla-core `comba/chunk.py`, `fused_recurrent.py`; the paper's p = alpha x).
- fla wants fp32 states and returns o in q's dtype; we return o in v's dtype and fp32 states.
- fp64 inputs, empty sequences and GQA-shaped inputs go to the PyTorch ops.
- fla's `chunk_size` is fixed (64); a `chunk_size` argument is accepted and ignored on GPU.

Training path for Gated DeltaNet / CCQ-GDN / Q-Delta (fla issue #640): fla 0.6.0 raises in the gated
`chunk_bwd_dqkwg` on Hopper with Triton 3.4-3.7.0. `hybridize.ops.delta.fla_dqkwg` replaces exactly
that chunk-local kernel by batched fp32 PyTorch inside our own autograd Functions; the rest of the
backward is fla's. `benchmarks/ops/gpu_check.py` verifies every gradient against the fp32 reference.
(Scalar-gate GLA avoids the same kernel by using `chunk_gla` with the gate broadcast over keys.)

Switches (kernel options, `hybridize.ops.common.options`; environment variable in brackets): `kernels=auto|torch|gpu`
[`HYBRIDIZE_KERNELS`] (dispatch), `autotune_top=n` [`HYBRIDIZE_AUTOTUNE_TOP`] caps autotuning
(`hybridize.ops.common.autotune`), `fla_dqkwg="fla"` [`HYBRIDIZE_FLA_DQKWG=fla`] uses fla's own kernel (for
Triton >= 3.7.1 or non-Hopper GPUs, where fla's guard does not fire; read at the forward, kept for the backward).
"""
from __future__ import annotations

import importlib
import importlib.util
from types import SimpleNamespace

import torch

from hybridize.ops.common import dispatch
from hybridize.ops.common.options import current_kernel_options

_ACTIVE = False
_FLA: SimpleNamespace | None = None


def available() -> bool:
    """CUDA present and fla-core + triton importable (checked without importing them)."""
    return (torch.cuda.is_available() and importlib.util.find_spec("fla") is not None
            and importlib.util.find_spec("triton") is not None)


def activate(force: bool = False) -> bool:
    """Register the GPU wrappers with dispatch (idempotent). Returns whether they are registered."""
    global _ACTIVE
    if _ACTIVE:
        return True
    if not (force or available()):
        return False
    for (op, mode), fn in WRAPPERS.items():
        dispatch.register_gpu(op, mode, fn)
    _ACTIVE = True
    return True


_CAP = 0   # the autotune cap applied (kernel option autotune_top; 0: Triton's autotuner untouched)


def _apply_cap() -> None:
    global _CAP
    from hybridize.ops.common.autotune import limit_from_options
    _CAP = limit_from_options()


def fla() -> SimpleNamespace:
    """fla-core entry points, imported on first use (tests replace `_FLA` with fakes)."""
    global _FLA
    if _FLA is not None and current_kernel_options().autotune_top != _CAP:
        _apply_cap()
    if _FLA is None:
        _apply_cap()
        gla = importlib.import_module("fla.ops.gla")
        gdr = importlib.import_module("fla.ops.gated_delta_rule")
        gdr_chunk = importlib.import_module("fla.ops.gated_delta_rule.chunk")
        dr = importlib.import_module("fla.ops.delta_rule")
        comba = importlib.import_module("fla.ops.comba")
        comba_chunk = importlib.import_module("fla.ops.comba.chunk")
        index = importlib.import_module("fla.ops.utils.index")
        llin = importlib.import_module("fla.ops.log_linear_attn")
        _FLA = SimpleNamespace(
            chunk_gla=gla.chunk_gla, fused_recurrent_gla=gla.fused_recurrent_gla,
            chunk_delta_rule=dr.chunk_delta_rule,
            fused_recurrent_gated_delta_rule=gdr.fused_recurrent_gated_delta_rule,
            fused_recurrent_comba=comba.fused_recurrent_comba,
            gdn_fwd=gdr_chunk.chunk_gated_delta_rule_fwd, gdn_bwd=gdr_chunk.chunk_gated_delta_rule_bwd,
            gdn_module=gdr_chunk,
            comba_fwd=comba_chunk.chunk_comba_fwd, comba_bwd=comba_chunk.chunk_comba_bwd,
            comba_module=comba_chunk,
            prepare_chunk_indices=index.prepare_chunk_indices,
            chunk_log_linear_attn=llin.chunk_log_linear_attn,
        )
    return _FLA


# ---- shared helpers ----------------------------------------------------------------------------

def _fallback(op: str, mode: str, *args, **kwargs):
    return dispatch.torch_impl(op, mode)(*args, **kwargs)


def _unsupported(*tensors) -> bool:
    """Cases the PyTorch ops handle and fla does not: fp64, empty time axis."""
    ts = [t for t in tensors if isinstance(t, torch.Tensor)]
    return any(t.dtype == torch.float64 for t in ts) or ts[0].shape[1] == 0


def _state(s):
    return None if s is None else s.float().contiguous()


def _cu(cu_seqlens):
    return None if cu_seqlens is None else cu_seqlens.to(torch.long)


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def _gate_for_keys(g, k):
    """Our gla gate (None, scalar `[B, T, H]` or vector `[B, T, H, K]`) as fla's `[B, T, H, K]` fp32."""
    if g is None:
        return k.new_zeros(k.shape, dtype=torch.float32)
    g = g.float()
    return g.unsqueeze(-1).expand_as(k).contiguous() if g.dim() == 3 else g.contiguous()


# ---- gla ---------------------------------------------------------------------------------------

def gla_chunk(q, k, v, g=None, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
              chunk_size=None):
    if _unsupported(q, k, v, g, initial_state):
        return _fallback("gla", "chunk", q, k, v, g, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    o, st = fla().chunk_gla(q.contiguous(), k.contiguous(), v.contiguous(), _gate_for_keys(g, k),
                            scale=scale, initial_state=_state(initial_state),
                            output_final_state=output_final_state, cu_seqlens=_cu(cu_seqlens))
    return o.to(v.dtype), st


def gla_recurrent(q, k, v, g=None, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    if _unsupported(q, k, v, g, initial_state):
        return _fallback("gla", "recurrent", q, k, v, g, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    gk = None if g is None else _gate_for_keys(g, k)
    o, st = fla().fused_recurrent_gla(q.contiguous(), k.contiguous(), v.contiguous(), gk=gk, scale=scale,
                                      initial_state=_state(initial_state),
                                      output_final_state=output_final_state, cu_seqlens=_cu(cu_seqlens))
    return o.to(v.dtype), st


# ---- delta rule (DeltaNet, Gated DeltaNet, Q-Delta) --------------------------------------------

def comba_p(p, g):
    """Our erase direction p (read against exp(g) S) as fla Comba's (read against S): exp(g) p."""
    return p if g is None else p * g.float().exp().unsqueeze(-1).to(p.dtype)


def _erase_for_fla(q, k, p, lam, g):
    """fla Comba's erase direction exp(g) p (contiguous), or None for p = k: from p, or from lam (Q-Delta's
    p = k + lam q) in one fused pass (`ops/delta/triton_erase.py`)."""
    from hybridize.ops.delta.reference import check_erase

    check_erase(q, p, lam)
    if lam is None:
        return None if p is None else comba_p(p, g).contiguous()
    from hybridize.ops.delta.triton_erase import comba_erase
    return comba_erase(q, k, lam, g)


def _dqkwg_is_ours() -> bool:
    return current_kernel_options().fla_dqkwg != "fla"


class _GatedDelta(torch.autograd.Function):
    """fla chunked gated delta rule (GDN, or Comba when p is given) with a checked backward."""

    @staticmethod
    def forward(ctx, q, k, v, p, g, beta, scale, initial_state, output_final_state, cu_seqlens):
        F = fla()
        chunk_indices = None if cu_seqlens is None else F.prepare_chunk_indices(cu_seqlens, 64)
        if p is None:
            gc, o, A, ht, h0, _ = F.gdn_fwd(q, k, v, g, beta, scale, initial_state, output_final_state,
                                            cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
            ctx.save_for_backward(q, k, v, gc, beta, A, h0)
        else:
            g0, gc, o, A, ht = F.comba_fwd(q, k, v, p, g, beta, scale, initial_state, output_final_state,
                                           cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
            ctx.save_for_backward(q, k, v, gc, beta, A, initial_state, p, g0)
        ctx.comba = p is not None
        ctx.scale, ctx.cu_seqlens, ctx.chunk_indices = scale, cu_seqlens, chunk_indices
        ctx.has_h0 = initial_state is not None
        ctx.dqkwg_ours = _dqkwg_is_ours()   # the forward's option, also for a backward run outside its block
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        F = fla()
        import contextlib
        from hybridize.ops.delta.fla_dqkwg import patched
        q, k, v, gc, beta, A, h0, *rest = ctx.saved_tensors
        kw = dict(cu_seqlens=ctx.cu_seqlens, chunk_indices=ctx.chunk_indices)
        module = F.comba_module if ctx.comba else F.gdn_module
        guard = patched(module) if ctx.dqkwg_ours else contextlib.nullcontext()
        do = do.contiguous()
        dht = None if dht is None else dht.contiguous()
        with guard:
            if ctx.comba:
                p, g0 = rest
                dq, dk, dv, dp, db, dg, dh0 = F.comba_bwd(q, k, v, p, g0, gc, beta, A, ctx.scale, h0, do, dht, **kw)
            else:
                dq, dk, dv, db, dg, dh0, _, _ = F.gdn_bwd(q, k, v, gc, beta, A, ctx.scale, h0, do, dht, **kw)
                dp = None
        dh0 = dh0 if ctx.has_h0 else None
        cast = lambda d, x: None if d is None else d.to(x.dtype)  # noqa: E731
        dp = cast(dp, rest[0]) if ctx.comba else None
        return cast(dq, q), cast(dk, k), cast(dv, v), dp, dg, cast(db, beta), None, dh0, None, None


def delta_chunk(q, k, v, beta, g=None, p=None, scale=None, initial_state=None, output_final_state=False,
                cu_seqlens=None, chunk_size=None, lam=None):
    if _unsupported(q, k, v, beta, g, p, initial_state) or v.shape[2] != q.shape[2]:
        return _fallback("delta", "chunk", q, k, v, beta, g=g, p=p, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, cu_seqlens=cu_seqlens, lam=lam)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    c = lambda t: t.contiguous()  # noqa: E731
    beta = beta.to(q.dtype)  # fla's kernels take beta in the activation dtype
    cu, h0 = _cu(cu_seqlens), _state(initial_state)
    if p is None and lam is None and g is None and q.dtype != torch.float32:  # fla's ungated kernel: 16-bit only
        o, st = fla().chunk_delta_rule(c(q), c(k), c(v), c(beta), scale=scale, initial_state=h0,
                                       output_final_state=output_final_state, cu_seqlens=cu)
        return o.to(v.dtype), st
    gf = q.new_zeros(q.shape[:3], dtype=torch.float32) if g is None else g.float()
    pf = _erase_for_fla(q, k, p, lam, g)
    o, st = _GatedDelta.apply(c(q), c(k), c(v), pf, c(gf), c(beta), scale, h0, output_final_state, cu)
    return o.to(v.dtype), (st if output_final_state else None)


def delta_recurrent(q, k, v, beta, g=None, p=None, scale=None, initial_state=None, output_final_state=False,
                    cu_seqlens=None, lam=None):
    if _unsupported(q, k, v, beta, g, p, initial_state) or v.shape[2] != q.shape[2]:
        return _fallback("delta", "recurrent", q, k, v, beta, g=g, p=p, scale=scale,
                         initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                         lam=lam)
    if _needs_grad(q, k, v, beta, g, p, initial_state, lam):  # fla's fused recurrent kernels are forward-only
        return delta_chunk(q, k, v, beta, g=g, p=p, scale=scale, initial_state=initial_state,
                           output_final_state=output_final_state, cu_seqlens=cu_seqlens, lam=lam)
    c = lambda t: t.contiguous()  # noqa: E731
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    beta = beta.to(q.dtype)
    kw = dict(scale=scale, initial_state=_state(initial_state), output_final_state=output_final_state,
              cu_seqlens=_cu(cu_seqlens))
    gf = q.new_zeros(q.shape[:3], dtype=torch.float32) if g is None else c(g.float())
    pf = _erase_for_fla(q, k, p, lam, g)
    if pf is None:
        o, st = fla().fused_recurrent_gated_delta_rule(c(q), c(k), c(v), g=gf, beta=c(beta), **kw)
    else:
        o, st = fla().fused_recurrent_comba(q=c(q), k=c(k), p=pf, v=c(v), g=gf, beta=c(beta), **kw)
    return o.to(v.dtype), st


# ---- log-linear ----------------------------------------------------------------------------------

def log_linear_chunk(q, k, v, g, level_scales, scale=None, initial_state=None, output_final_state=False,
                     cu_seqlens=None, chunk_size=None, **kw):
    """fla covers: no state in or out, K a multiple of 64, V a power of two, no level clamped by us."""
    args = (q, k, v, g, level_scales)
    kwargs = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                  cu_seqlens=cu_seqlens, **kw)
    longest = q.shape[1] if cu_seqlens is None else int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    levels_needed = max(longest - 1, 0).bit_length() + 1
    if (_unsupported(q, k, v, g, level_scales) or initial_state is not None or output_final_state
            or g is None or level_scales.shape[-1] < levels_needed or kw
            or q.shape[-1] % 64 or v.shape[-1] & (v.shape[-1] - 1)):
        return _fallback("log_linear", "chunk", *args, **kwargs)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    # fla 0.6.0's log-linear kernel does not compile for bf16 q/k/v on Triton 3.6 (gpu_check): fp32 inputs
    c = lambda t: t.float().contiguous()  # noqa: E731
    o, _ = fla().chunk_log_linear_attn(c(q), c(k), c(v), c(g), c(level_scales),
                                       cu_seqlens=_cu(cu_seqlens), scale=scale)
    return o.to(v.dtype), None


# ---- ccq covariance read -----------------------------------------------------------------------

def cumsum_time(x, block: int = 128):
    """`x.cumsum(1)` for x `[B, T, ...]`, as a two-level scan (within blocks of `block` steps, then over
    block totals). PyTorch scans a non-innermost dim sequentially per column: with T = 64k and
    H * K = 2048 columns that took ~30 ms on an H100 (first device run); this takes T / block + block
    sequential steps instead of T."""
    B, T = x.shape[:2]
    n = -(-T // block)
    if n <= 1:
        return x.cumsum(1)
    pad = n * block - T
    xp = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, pad)) if pad else x
    inner = xp.reshape(B, n, block, *x.shape[2:]).cumsum(2)
    totals = inner[:, :, -1]
    offsets = totals.cumsum(1) - totals                                     # exclusive scan over blocks
    return (inner + offsets.unsqueeze(2)).reshape(B, n * block, *x.shape[2:])[:, :T]


def ccq_chunk(q, k, mask=None, initial_state=None, output_final_state=False, cu_seqlens=None, chunk_size=None):
    """Sigma_t q_t = C_t q_t - mu_t (mu_t . q_t); C_t q_t is linear attention with values = keys."""
    if (_unsupported(q, k) or (mask is not None and cu_seqlens is not None)
            or (cu_seqlens is not None and bool((cu_seqlens[1:] == cu_seqlens[:-1]).any()))):
        return _fallback("ccq", "chunk", q, k, mask=mask, initial_state=initial_state,
                         output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    B, T, H, K = q.shape
    cu = _cu(cu_seqlens)
    nseq = B if cu is None else len(cu) - 1
    m = torch.ones(B, T, device=q.device) if mask is None else mask.float()
    kf = k.float() * m[:, :, None, None]
    if initial_state is None:
        S0, M0 = None, q.new_zeros(nseq, H, K, dtype=torch.float32)
        t0 = torch.zeros(nseq, dtype=torch.long, device=q.device)
    else:
        C0, mu0, t0 = initial_state
        t0 = t0.to(device=q.device, dtype=torch.long)
        S0 = C0.float() * t0.float().view(-1, 1, 1, 1)
        M0 = mu0.float() * t0.float().view(-1, 1, 1)
    kb = k if mask is None else kf.to(q.dtype)
    Sq, S_end = fla().chunk_gla(q.contiguous(), kb.contiguous(), kb.contiguous(), _gate_for_keys(None, q),
                                scale=1.0, initial_state=S0, output_final_state=True, cu_seqlens=cu)
    Sq = Sq.float()
    if cu is None:
        M = M0.unsqueeze(1) + cumsum_time(kf)                               # [B, T, H, K]
        t = t0.unsqueeze(1) + m.long().cumsum(1)                            # [B, T]
    else:  # restart the running sums at every document start
        seq = torch.repeat_interleave(torch.arange(nseq, device=q.device), cu[1:] - cu[:-1])
        csum = cumsum_time(kf)[0]                                           # [T, H, K]
        before = torch.cat([csum.new_zeros(1, H, K), csum])[cu[:-1]]        # [N, H, K] sum before start
        M = (csum - before[seq] + M0[seq]).unsqueeze(0)
        pos = torch.arange(T, device=q.device) - cu[:-1][seq] + 1
        t = (pos + t0[seq]).unsqueeze(0)
    inv = 1.0 / t.clamp(min=1).float().view(B, T, 1, 1)
    o = Sq * inv - M * (M * q.float()).sum(-1, keepdim=True) * inv.square()
    if not output_final_state:
        return o.to(q.dtype), None
    if cu is None:
        t_end, M_end = t[:, -1], M[:, -1]
    else:
        last = cu[1:] - 1
        t_end, M_end = t[0, last], M[0, last]
    inv_end = 1.0 / t_end.clamp(min=1).float()
    return o.to(q.dtype), (S_end * inv_end.view(-1, 1, 1, 1), M_end * inv_end.view(-1, 1, 1), t_end)


def ccq_fused(*args, **kwargs):
    from hybridize.ops.ccq.triton_read import ccq_triton  # imports triton on the first CUDA call only
    return ccq_triton(*args, **kwargs)


def ccq_clean_fused(*args, **kwargs):
    from hybridize.ops.ccq.triton_clean import ccq_clean_fused as fused  # imports triton on the first CUDA call only
    return fused(*args, **kwargs)


def ccq_clean_fused_chunk(*args, **kwargs):
    from hybridize.ops.ccq.triton_clean import ccq_clean_fused_chunk as fused  # the chunk read cleans in its epilogue
    return fused(*args, **kwargs)


WRAPPERS = {
    ("gla", "chunk"): gla_chunk,
    ("gla", "recurrent"): gla_recurrent,
    ("delta", "chunk"): delta_chunk,
    ("delta", "recurrent"): delta_recurrent,
    ("log_linear", "chunk"): log_linear_chunk,
    ("ccq", "chunk"): ccq_fused,
    ("ccq_clean", "chunk"): ccq_clean_fused_chunk,
    ("ccq_clean", "recurrent"): ccq_clean_fused,
}
