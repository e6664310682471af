"""One entry point for every op: picks the PyTorch form or a GPU kernel.

`run(op, mode, ...)` calls the op's PyTorch form `chunk_<op>` or `naive_recurrent_<op>` (mode "chunk" or
"recurrent"; `registry.torch_impl` finds them) on CPU tensors. On CUDA tensors it prefers a GPU
implementation registered with `register_gpu` (fla-core adapters, our Triton kernels) unless the kernel
option `kernels` is "torch" (`HYBRIDIZE_KERNELS=torch`, `use_kernel_options(kernels="torch")`,
`set_backend("torch")`), which forces the PyTorch path; "gpu" makes a missing GPU kernel an error instead (`hybridize.ops.common.options`).
The tables of implementations live in `hybridize.ops.common.registry`, below this module and
`hybridize.ops.gpu` (`torch_impl` and `register_gpu` are re-exported here).
"""
from __future__ import annotations

import torch

from hybridize.ops.common.options import BACKENDS as _BACKENDS
from hybridize.ops.common.options import current_kernel_options, set_kernel_options
from hybridize.ops.common import registry
from hybridize.ops.common.registry import register_gpu, torch_impl

__all__ = ["run", "set_backend", "get_backend", "register_gpu", "torch_impl"]

_gpu_tried = False  # the fla adapter is imported on the first CUDA call only (CPU never loads triton/fla)


def set_backend(name: str) -> None:
    """Make the current options (explicit, else the environment's) with `kernels=name` current for the process
    (`hybridize.ops.common.options.set_kernel_options`; `use_kernel_options(kernels=...)` for a block)."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; use one of {', '.join(_BACKENDS)}")
    set_kernel_options(current_kernel_options().replace(kernels=name))


def get_backend() -> str:
    """The `kernels` option in force: auto | torch | gpu."""
    return current_kernel_options().kernels


def run(op: str, mode: str, *args, **kwargs):
    if mode not in ("chunk", "recurrent"):
        raise ValueError(f"mode must be 'chunk' or 'recurrent', got {mode!r}")
    first = args[0] if args else next(iter(kwargs.values()))
    backend = current_kernel_options().kernels
    if first.is_cuda and backend != "torch":
        global _gpu_tried
        if not _gpu_tried:
            _gpu_tried = True
            from hybridize.ops import gpu   # the wrappers' modules: loaded on the first CUDA call only
            gpu.activate()
        fn = registry._GPU.get((op, mode))
        if fn is not None:
            if torch.compiler.is_compiling():   # fla / Triton launchers stay opaque inside a compiled region
                return torch.compiler.disable(fn)(*args, **kwargs)
            return fn(*args, **kwargs)
        if backend == "gpu":
            raise RuntimeError(f"no GPU kernel registered for {op}/{mode}; set the kernel option kernels=auto "
                               "(HYBRIDIZE_KERNELS=auto) to fall back")
    return torch_impl(op, mode)(*args, **kwargs)
