"""Registers every op's GPU wrappers (`hybridize/ops/<op>/fla.py`) with `registry.register_gpu` (what
`dispatch.run` reads).

`dispatch.run` imports this module on its first CUDA call and calls `activate()`. Importing it imports nothing
heavy: each wrapper imports fla-core (`ops/common/fla_adapter.fla`) or our Triton kernels on its first call, so
`import hybridize` on a CPU machine never imports triton or fla. The table of GPU paths per (op, mode) is in
`ops/common/fla_adapter.py`.
"""
from __future__ import annotations

from hybridize.ops.ccq import fla as ccq_fla
from hybridize.ops.common import fla_adapter, registry
from hybridize.ops.delta import fla as delta_fla
from hybridize.ops.gla import fla as gla_fla
from hybridize.ops.log_linear import fla as log_linear_fla

_ACTIVE = False

WRAPPERS = {
    ("gla", "chunk"): gla_fla.chunk_gla,
    ("gla", "recurrent"): gla_fla.fused_recurrent_gla,
    ("delta", "chunk"): delta_fla.chunk_delta,
    ("delta", "recurrent"): delta_fla.fused_recurrent_delta,
    ("log_linear", "chunk"): log_linear_fla.chunk_log_linear,
    ("ccq", "chunk"): ccq_fla.ccq_fused,
    ("ccq_clean", "chunk"): ccq_fla.ccq_clean_fused_chunk,
    ("ccq_clean", "recurrent"): ccq_fla.ccq_clean_fused,
}


def activate(force: bool = False) -> bool:
    """Register the GPU wrappers with dispatch (idempotent). Returns whether they are registered."""
    global _ACTIVE
    if _ACTIVE:
        return True
    if not (force or fla_adapter.available()):
        return False
    for (op, mode), fn in WRAPPERS.items():
        registry.register_gpu(op, mode, fn)
    _ACTIVE = True
    return True
