"""A gated MLP's gate product in its stacked gate / up decode GEMM: the PyTorch reference.

`down(silu(x W_gate^T) * (x W_up^T))`: with gate and up stacked as one weight `[2 I, K]` (`stacked.stacked_weight`),
the decode GEMM can apply `silu(gate) * up` in its epilogue and write `[M, I]` instead of `[M, 2 I]`, so the step
needs no separate kernel for the product (`triton_gemm`'s `GLU`: each program holds its gate rows and their up rows
in two accumulators). `glu_reference` is that product after `F.linear`, the path off the kernel.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def glu_reference(y: torch.Tensor) -> torch.Tensor:
    """y `[..., 2 I]` (gate then up) -> `silu(gate) * up` `[..., I]`, in fp32, rounded once to y's dtype."""
    gate, up = y.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(y.dtype)
