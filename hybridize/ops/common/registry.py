"""Which implementations each (op, mode) has: the PyTorch forms and the registered GPU wrappers.

`torch_impl(op, mode)` returns the op's PyTorch form, `chunk_<op>` or `naive_recurrent_<op>` (fla's naming),
from the module `_TORCH_MODULES` names for it. `register_gpu(op, mode, fn)` records a GPU wrapper
(`hybridize.ops.gpu.activate` registers the ops' `fla.py` wrappers). `dispatch.run` reads both; the GPU
wrappers' fallbacks (`fla_adapter.fallback`) read `torch_impl`.

Why a module of its own below `dispatch`: `dispatch.run` imports `hybridize.ops.gpu` (on its first CUDA call),
and the wrappers `gpu` registers need the PyTorch forms; with the tables here, neither `gpu` nor `fla_adapter`
imports `dispatch`, so there is no import cycle. Imports nothing heavy (no triton, no fla).
"""
from __future__ import annotations

import importlib
from typing import Callable

_GPU: dict[tuple[str, str], Callable] = {}


def register_gpu(op: str, mode: str, fn: Callable) -> None:
    """Make `fn` the GPU implementation of (op, mode) for `dispatch.run` on CUDA tensors."""
    _GPU[(op, mode)] = fn


_TORCH: dict[tuple[str, str], Callable] = {}
# the module holding each op's PyTorch forms `chunk_<op>` / `naive_recurrent_<op>` (fla's naming)
_TORCH_MODULES = {
    "gla": "hybridize.ops.gla.reference",
    "delta": "hybridize.ops.delta.reference",
    "log_linear": "hybridize.ops.log_linear.reference",
    "ccq": "hybridize.ops.ccq.reference",
    "ccq_clean": "hybridize.ops.ccq.clean",
}


def torch_impl(op: str, mode: str) -> Callable:
    """The PyTorch form of (op, mode): `chunk_<op>` (mode "chunk") or `naive_recurrent_<op>` (mode "recurrent")."""
    fn = _TORCH.get((op, mode))
    if fn is None:   # looked up once: a dict read is also what torch.compile can trace (import_module is not)
        module = importlib.import_module(_TORCH_MODULES[op])
        fn = _TORCH[(op, mode)] = getattr(module, f"chunk_{op}" if mode == "chunk" else f"naive_recurrent_{op}")
    return fn
