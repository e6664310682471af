"""Log-linear attention's GPU wrapper: fla-core's `chunk_log_linear_attn` where it covers the case, the PyTorch
op otherwise (registered with dispatch by `hybridize.ops.gpu`; GPU paths: `ops/common/fla_adapter.py`).
"""
from __future__ import annotations

from hybridize.ops.common.fla_adapter import fallback, fla, long_cu, unsupported


def chunk_log_linear(q, k, v, g, level_scales, scale=None, initial_state=None, output_final_state=False,
                     cu_seqlens=None, chunk_size=None, **kw):
    """fla covers: no state in or out, K a multiple of 64, V a power of two, no level clamped by us."""
    args = (q, k, v, g, level_scales)
    kwargs = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                  cu_seqlens=cu_seqlens, **kw)
    longest = q.shape[1] if cu_seqlens is None else int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    levels_needed = max(longest - 1, 0).bit_length() + 1
    if (unsupported(q, k, v, g, level_scales) or initial_state is not None or output_final_state
            or g is None or level_scales.shape[-1] < levels_needed or kw
            or q.shape[-1] % 64 or v.shape[-1] & (v.shape[-1] - 1)):
        return fallback("log_linear", "chunk", *args, **kwargs)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    # fla 0.6.0's log-linear kernel does not compile for bf16 q/k/v on Triton 3.6 (gpu_check): fp32 inputs
    c = lambda t: t.float().contiguous()  # noqa: E731
    o, _ = fla().chunk_log_linear_attn(c(q), c(k), c(v), c(g), c(level_scales),
                                       cu_seqlens=long_cu(cu_seqlens), scale=scale)
    return o.to(v.dtype), None
