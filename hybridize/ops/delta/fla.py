"""The delta rule's GPU wrappers (DeltaNet, Gated DeltaNet, Q-Delta): fla-core's delta-rule, gated delta rule
and Comba kernels with our argument conventions, our erase direction (`triton_erase.py`) and dqkwg fix
(`fla_dqkwg.py`); registered with dispatch by `hybridize.ops.gpu` (GPU paths: `ops/common/fla_adapter.py`).
"""
from __future__ import annotations

import contextlib

import torch

from hybridize.ops.common.fla_adapter import fallback, fla, fp32_state, long_cu, needs_grad, unsupported
from hybridize.ops.common.options import current_kernel_options
from hybridize.ops.delta.fla_dqkwg import patched
from hybridize.ops.delta.reference import check_erase


def comba_p(p, g):
    """Our erase direction p (read against exp(g) S) as fla Comba's (read against S): exp(g) p."""
    return p if g is None else p * g.float().exp().unsqueeze(-1).to(p.dtype)


def _erase_for_fla(q, k, p, lam, g):
    """fla Comba's erase direction exp(g) p (contiguous), or None for p = k: from p, or from lam (Q-Delta's
    p = k + lam q) in one fused pass (`ops/delta/triton_erase.py`)."""
    check_erase(q, p, lam)
    if lam is None:
        return None if p is None else comba_p(p, g).contiguous()
    from hybridize.ops.delta.triton_erase import comba_erase  # deferred: imports triton (optional, GPU only)
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


def chunk_delta(q, k, v, beta, g=None, p=None, scale=None, initial_state=None, output_final_state=False,
                cu_seqlens=None, chunk_size=None, lam=None):
    if unsupported(q, k, v, beta, g, p, initial_state) or v.shape[2] != q.shape[2]:
        return fallback("delta", "chunk", q, k, v, beta, g=g, p=p, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, cu_seqlens=cu_seqlens, lam=lam)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    c = lambda t: t.contiguous()  # noqa: E731
    beta = beta.to(q.dtype)  # fla's kernels take beta in the activation dtype
    cu, h0 = long_cu(cu_seqlens), fp32_state(initial_state)
    if p is None and lam is None and g is None and q.dtype != torch.float32:  # fla's ungated kernel: 16-bit only
        o, st = fla().chunk_delta_rule(c(q), c(k), c(v), c(beta), scale=scale, initial_state=h0,
                                       output_final_state=output_final_state, cu_seqlens=cu)
        return o.to(v.dtype), st
    gf = q.new_zeros(q.shape[:3], dtype=torch.float32) if g is None else g.float()
    pf = _erase_for_fla(q, k, p, lam, g)
    o, st = _GatedDelta.apply(c(q), c(k), c(v), pf, c(gf), c(beta), scale, h0, output_final_state, cu)
    return o.to(v.dtype), (st if output_final_state else None)


def fused_recurrent_delta(q, k, v, beta, g=None, p=None, scale=None, initial_state=None, output_final_state=False,
                          cu_seqlens=None, lam=None):
    if unsupported(q, k, v, beta, g, p, initial_state) or v.shape[2] != q.shape[2]:
        return fallback("delta", "recurrent", q, k, v, beta, g=g, p=p, scale=scale,
                         initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                         lam=lam)
    if needs_grad(q, k, v, beta, g, p, initial_state, lam):  # fla's fused recurrent kernels are forward-only
        return chunk_delta(q, k, v, beta, g=g, p=p, scale=scale, initial_state=initial_state,
                           output_final_state=output_final_state, cu_seqlens=cu_seqlens, lam=lam)
    c = lambda t: t.contiguous()  # noqa: E731
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    beta = beta.to(q.dtype)
    kw = dict(scale=scale, initial_state=fp32_state(initial_state), output_final_state=output_final_state,
              cu_seqlens=long_cu(cu_seqlens))
    gf = q.new_zeros(q.shape[:3], dtype=torch.float32) if g is None else c(g.float())
    pf = _erase_for_fla(q, k, p, lam, g)
    if pf is None:
        o, st = fla().fused_recurrent_gated_delta_rule(c(q), c(k), c(v), g=gf, beta=c(beta), **kw)
    else:
        o, st = fla().fused_recurrent_comba(q=c(q), k=c(k), p=pf, v=c(v), g=gf, beta=c(beta), **kw)
    return o.to(v.dtype), st
