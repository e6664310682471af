"""Programmatic dependent launch (PDL) for the decode step's Triton kernels.

A decode step is a chain of a few hundred small kernels, each waiting for the one before it. With PDL (Hopper
and later, CUDA's `cudaLaunchAttributeProgrammaticStreamSerialization`) a kernel is launched before the kernel
before it has finished, and each of its programs waits in-kernel (`griddepcontrol.wait`, Triton's
`gdc_wait`) before it reads that kernel's outputs, so the launch and the program start overlap the previous
kernel's tail. The wait is for the whole previous grid's completion and memory flush, and every program of
ours waits before it reads or writes anything, so the stream order is kept transitively. CUDA-graph capture
keeps the launches' attribute.

Kernel option `pdl` (default on) turns it on for our decode kernels (the decode GEMM, SSE's one-kernel step,
the split-KV attention and the window step) and, in a compiled step replayed from a CUDA graph, for inductor's
kernels (`generation/fast.py`). Measured on one H100 (`benchmarks/RESULTS.md`, "Decode: programmatic dependent
launch"; `python -m benchmarks.generation.compile_auto --modes on`, HYBRIDIZE_PDL=0 against the default): the 135M
shape's compiled step at 1k x 1 11-13% faster for the hybrid and its teacher, the 1.7B shape's 2-5% (2k x 1,
16k x 8); uncompiled steps, whose kernels are mostly PyTorch's own, unchanged.
"""
from __future__ import annotations

import functools
import os

import torch

from hybridize.ops.common.options import current_kernel_options


def pdl_launch(device: torch.device) -> bool:
    """Whether kernels launched now on `device` use PDL: kernel option `pdl`, an NVIDIA GPU of compute capability 9
    or later, a Triton with grid dependency control, not the Triton interpreter."""
    if (not current_kernel_options().pdl or device.type != "cuda" or torch.version.hip is not None
            or os.environ.get("TRITON_INTERPRET") == "1"):
        return False   # ROCm's "cuda" devices have no grid dependency control
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


def pdl_args(device: torch.device) -> dict:
    """A launch's PDL arguments: the kernel's `PDL` constexpr (wait in-kernel) and Triton's `launch_pdl` (the launch
    attribute), both `pdl_launch(device)`. Our decode kernels take `**pdl_args(device)`."""
    on = pdl_launch(device)
    return {"PDL": on, "launch_pdl": on}


@functools.lru_cache(maxsize=None)
def _supported(index: int) -> bool:
    try:
        import triton.language.extra.cuda as tl_cuda
    except ImportError:
        return False
    return hasattr(tl_cuda, "gdc_wait") and torch.cuda.get_device_capability(index)[0] >= 9
