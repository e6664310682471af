"""CCQ query cleaning around the covariance read, PyTorch form (eq. 9 and Algorithm 2 of
"Don't Read Everything: A Curvature-Conditioned Query for Linear Attention").

    kbar = k / ||k||     qbar = q / ||q||     lambda_t = sigmoid(w_h . qbar_t + b_h)  (or a fixed lambda)
    q_clean = q - lambda_t * Sigma_t q_t,  with Sigma_t q_t = read(q, kbar)  (`hybridize.ops.ccq.reference`)

q, k `[B, T, H, K]` as the backbone's op gets them; weight `[H, K]`, bias `[H]` (None with a fixed
lambda); `read(q, kbar) -> (Sigma_t q_t, statistics)` is the covariance read with its mask / state /
varlen arguments already bound. Returns (q_clean `[B, T, H, K]` in q's dtype, the read's statistics).

This is the reference the mixer runs on CPU. On CUDA `dispatch` swaps in `ops/ccq/triton_clean.py`, which
does the same in two fused passes around the read (the normalisation of k; the gate and the update of
q) instead of a dozen PyTorch elementwise kernels each way, which at 16k tokens cost the CCQ layer as
much as the read itself. Both modes (chunk and recurrent) use the same function.
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


def chunk_ccq_clean(q, k, weight, bias, fixed_lambda, read, unit_keys: bool = False):
    """(q_clean, statistics); see the module docstring. `unit_keys`: the caller's k rows are already unit
    (or zero), as in Gated DeltaNet, so kbar = k (normalising twice is normalising once, gradient included)."""
    check_gate(q, weight, bias, fixed_lambda)
    sigma_q, stats = read(q, k if unit_keys else unit_rows(k))
    lam = gate(unit_rows(q), weight, bias, fixed_lambda)
    return q - lam.unsqueeze(-1).to(q.dtype) * sigma_q, stats


naive_recurrent_ccq_clean = chunk_ccq_clean
