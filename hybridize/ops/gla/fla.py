"""GLA's GPU wrappers: fla-core's `chunk_gla` / `fused_recurrent_gla` with our argument conventions
(registered with dispatch by `hybridize.ops.gpu`; the table of GPU paths is in `ops/common/fla_adapter.py`).
"""
from __future__ import annotations

import torch

from hybridize.ops.common.fla_adapter import fallback, fla, fp32_state, long_cu, unsupported


def gate_for_keys(g, k):
    """Our gla gate (None, scalar `[B, T, H]` or vector `[B, T, H, K]`) as fla's `[B, T, H, K]` fp32."""
    if g is None:
        return k.new_zeros(k.shape, dtype=torch.float32)
    g = g.float()
    return g.unsqueeze(-1).expand_as(k).contiguous() if g.dim() == 3 else g.contiguous()



def chunk_gla(q, k, v, g=None, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
              chunk_size=None):
    if unsupported(q, k, v, g, initial_state):
        return fallback("gla", "chunk", q, k, v, g, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    o, st = fla().chunk_gla(q.contiguous(), k.contiguous(), v.contiguous(), gate_for_keys(g, k),
                            scale=scale, initial_state=fp32_state(initial_state),
                            output_final_state=output_final_state, cu_seqlens=long_cu(cu_seqlens))
    return o.to(v.dtype), st


def fused_recurrent_gla(q, k, v, g=None, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    if unsupported(q, k, v, g, initial_state):
        return fallback("gla", "recurrent", q, k, v, g, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    gk = None if g is None else gate_for_keys(g, k)
    o, st = fla().fused_recurrent_gla(q.contiguous(), k.contiguous(), v.contiguous(), gk=gk, scale=scale,
                                      initial_state=fp32_state(initial_state),
                                      output_final_state=output_final_state, cu_seqlens=long_cu(cu_seqlens))
    return o.to(v.dtype), st
