"""Thin adapter to fla-core 0.6.0: its entry points (`fla()`) and what every op's GPU wrappers share.

The wrappers live with their ops (`hybridize/ops/<op>/fla.py`); `hybridize.ops.gpu.activate()` registers one
per (op, mode) with `registry.register_gpu` and imports nothing heavy. Each wrapper imports fla-core on its
first call (so `import hybridize` on a CPU machine never imports triton or
fla), maps our argument conventions onto fla's, and hands any case fla does not cover back to the
PyTorch op (`registry.torch_impl`) instead of guessing.

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
|                    | chunked pass fwd + Triton bwd); `chunk_ccq` here (a `chunk_gla` call with     |
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

from hybridize.ops.common.autotune import limit_from_options
from hybridize.ops.common.options import current_kernel_options
from hybridize.ops.common.registry import torch_impl

_FLA: SimpleNamespace | None = None


def available() -> bool:
    """CUDA present and fla-core + triton importable (checked without importing them)."""
    return (torch.cuda.is_available() and importlib.util.find_spec("fla") is not None
            and importlib.util.find_spec("triton") is not None)


_CAP = 0   # the autotune cap applied (kernel option autotune_top; 0: Triton's autotuner untouched)


def _apply_cap() -> None:
    global _CAP
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


# ---- shared by the op wrappers (hybridize/ops/<op>/fla.py) -----------------------------------------

def fallback(op: str, mode: str, *args, **kwargs):
    """The PyTorch form of (op, mode) on the same arguments: what a wrapper runs for a case fla does not cover."""
    return torch_impl(op, mode)(*args, **kwargs)


def unsupported(*tensors) -> bool:
    """Cases the PyTorch ops handle and fla does not: fp64, empty time axis."""
    ts = [t for t in tensors if isinstance(t, torch.Tensor)]
    return any(t.dtype == torch.float64 for t in ts) or ts[0].shape[1] == 0


def fp32_state(s):
    return None if s is None else s.float().contiguous()


def long_cu(cu_seqlens):
    return None if cu_seqlens is None else cu_seqlens.to(torch.long)


def needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)
