"""Linear layers of a decode step through the weight-streaming GEMM (`ops/decode_gemm/triton_gemm.py`).

`decode_linear(x, weight, bias, mode)` runs the Triton kernel when it applies (CUDA, or the Triton
interpreter with mode "triton"; 16-bit x and weight of one dtype; at most 16 rows; row-major weight)
and `F.linear` otherwise, so callers never check. `linears_routed(model, mode)` routes every plain
`nn.Linear` of a model through it for the duration of a block (the fast rollout loop's decode steps),
restoring the modules after: HF's own layers (MLP, attention, lm_head) and PEFT's base/adapter
linears included, without touching their classes or checkpoints. Prefill and training calls have
more rows and go to `F.linear` unchanged.

Modes: "auto" (the kernel on CUDA), "triton" (also on CPU under TRITON_INTERPRET=1, for tests),
"torch" (always F.linear). Code that calls `decode_linear` without a mode (SSE's fused decode
projections) gets the mode of the enclosing `linears_routed` block, and "torch" outside one, so plain
`model.generate` is unchanged.
"""
from __future__ import annotations

import os
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

MODES = ("auto", "triton", "torch")
_KERNEL = None      # the kernel module, or False without triton
_OP = None          # its custom op, torch.ops.hybridize.decode_linear (registered by the module's import)
_ACTIVE = "torch"   # the mode of the enclosing linears_routed block


def _kernel():
    """`hybridize.ops.decode_gemm.triton_gemm`, or None without triton."""
    global _KERNEL, _OP
    if _KERNEL is None:
        try:
            from hybridize.ops.decode_gemm import triton_gemm as mod  # deferred: imports triton (optional, GPU only)
        except ImportError:
            mod = None
        _KERNEL = mod if mod is not None and mod.triton is not None else False
        _OP = torch.ops.hybridize.decode_linear if _KERNEL else None
    return _KERNEL or None


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"decode GEMM mode must be one of {' | '.join(MODES)}, got {mode!r}")
    return mode


def applies(x: torch.Tensor, weight: torch.Tensor, mode: str = "auto", bias: torch.Tensor | None = None) -> bool:
    """Whether `decode_linear` runs the kernel for these tensors (device / shape / dtype checks only)."""
    if mode == "torch":
        return False
    if not (x.is_cuda or (mode == "triton" and os.environ.get("TRITON_INTERPRET") == "1")):
        return False
    kernel = _kernel()
    return kernel is not None and kernel.unsupported(x, weight, bias) is None


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  mode: str | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through the decode GEMM kernel when it applies (`mode` None: the
    enclosing `linears_routed` block's)."""
    mode = _ACTIVE if mode is None else mode
    if applies(x, weight, mode, bias):
        return _OP(x, weight, bias)
    return F.linear(x, weight, bias)


def kept_forward(module: nn.Module, attr: str, mode: str, make):
    """`make()`'s forward for (module, mode), made once and kept in `module.__dict__[attr]`: the same function object
    at every call, so a compiled decode step that traced it is not recompiled. Tagged with the module's id: a deep
    copy of the module (TRL's reference model) carries the dict but gets its own functions."""
    owner, cache = module.__dict__.get(attr, (None, None))
    if owner != id(module):
        cache = {}
        module.__dict__[attr] = (id(module), cache)
    if mode not in cache:
        cache[mode] = make()
    return cache[mode]


def _routed_forward(module: nn.Linear, mode: str):
    """The module's routed forward (`kept_forward`)."""
    def make():
        def forward(x):
            return decode_linear(x, module.weight, module.bias, mode)
        return forward
    return kept_forward(module, "_decode_linear_forwards", mode, make)


@contextmanager
def linears_routed(model: nn.Module, mode: str = "auto"):
    """Within the block every plain `nn.Linear` of `model` (exact type, no forward override of its own:
    accelerate's offload hooks, for one, keep theirs) calls `decode_linear`; restored after. Mode "torch"
    changes nothing."""
    global _ACTIVE
    check_mode(mode)
    patched = []
    if mode != "torch":
        _kernel()   # import (and register the op) now, not while torch.compile traces a step
        for mod in model.modules():
            if type(mod) is nn.Linear and "forward" not in mod.__dict__:
                mod.forward = _routed_forward(mod, mode)
                patched.append(mod)
    before, _ACTIVE = _ACTIVE, mode
    try:
        yield len(patched)
    finally:
        _ACTIVE = before
        for mod in patched:
            mod.__dict__.pop("forward", None)
