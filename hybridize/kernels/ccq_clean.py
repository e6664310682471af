"""CCQ query cleaning around the covariance read (seed 000, eq. 9 and Algorithm 2), PyTorch form.

    kbar = k / ||k||     qbar = q / ||q||     lambda_t = sigmoid(w_h . qbar_t + b_h)  (or a fixed lambda)
    q_clean = q - lambda_t * Sigma_t q_t,  with Sigma_t q_t = read(q, kbar)  (`hybridize.kernels.ccq`)

q, k `[B, T, H, K]` as the backbone's op gets them; weight `[H, K]`, bias `[H]` (None with a fixed
lambda); `read(q, kbar, gate=(weight, bias, fixed_lambda)) -> (q - lambda Sigma_t q_t, statistics)` is the
covariance read (`hybridize.kernels.ccq`) with its mask / state / varlen arguments already bound: every
form of the read takes the gate, so the fused GPU read can apply it in its own kernels (the PyTorch
forms apply `apply_gate` to their output). Returns (q_clean `[B, T, H, K]` in q's dtype, the read's
statistics).

This is the reference the mixer runs on CPU. On CUDA `dispatch` swaps in `triton/ccq_clean.py` (one
fused pass for the normalisation of k) and the read becomes the Triton read, whose output and backward
passes compute lambda and q - lambda Sigma q themselves: at 16k tokens on an H100 the dozen PyTorch
elementwise kernels each way cost the CCQ layer as much as the read, and even two separate fused passes
cost ~0.2 ms per layer step. Both modes (chunk and recurrent) use the same function.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def unit_rows(x: torch.Tensor) -> torch.Tensor:
    """x / max(||x||, 1e-12) over the last dim (`F.normalize`)."""
    return F.normalize(x, dim=-1)


def gate(q_unit: torch.Tensor, weight, bias, fixed_lambda) -> torch.Tensor:
    """lambda `[B, T, H]` in fp32 (fp64 for fp64) from qbar `[B, T, H, K]`."""
    acc = torch.float64 if q_unit.dtype == torch.float64 else torch.float32
    if fixed_lambda is not None:
        return q_unit.new_full(q_unit.shape[:-1], float(fixed_lambda), dtype=acc)
    logits = torch.einsum("bthk,hk->bth", q_unit.to(acc), weight.to(acc)) + bias.to(acc)
    return torch.sigmoid(logits)


def check_gate(q, weight, bias, fixed_lambda) -> None:
    H, K = q.shape[-2:]
    if fixed_lambda is None and (weight is None or bias is None):
        raise ValueError("ccq_clean needs weight and bias, or a fixed_lambda")
    if fixed_lambda is None and (tuple(weight.shape) != (H, K) or tuple(bias.shape) != (H,)):
        raise ValueError(f"ccq_clean: weight must be [{H}, {K}] and bias [{H}], got {tuple(weight.shape)} "
                         f"and {tuple(bias.shape)}")


def apply_gate(q, sigma_q, gate_args) -> torch.Tensor:
    """q - lambda * Sigma q, gate_args = (weight, bias, fixed lambda): what a read given `gate=` returns."""
    lam = gate(unit_rows(q), *gate_args)
    return q - lam.unsqueeze(-1).to(q.dtype) * sigma_q


def ccq_clean_chunk(q, k, weight, bias, fixed_lambda, read):
    """(q_clean, statistics); see the module docstring."""
    check_gate(q, weight, bias, fixed_lambda)
    return read(q, unit_rows(k), gate=(weight, bias, fixed_lambda))


ccq_clean_recurrent = ccq_clean_chunk
