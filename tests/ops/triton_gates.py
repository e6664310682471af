"""Shared gates of the Triton kernel tests that run under the CPU interpreter or on CUDA, and their error
measure.

- `interp_only`: `TRITON_INTERPRET=1` and triton importable (CPU, tiny shapes);
- `cuda_only`: CUDA and triton, interpreter off (the compiled kernels).
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and HAS_TRITON
CUDA = torch.cuda.is_available() and HAS_TRITON and not INTERPRET

interp_only = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and triton importable")
cuda_only = pytest.mark.skipif(not CUDA, reason="needs CUDA and triton (and TRITON_INTERPRET unset)")


def rel(a, b):
    """max|a - b| / max|b| (b the fp64 reference)."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12)).item()
