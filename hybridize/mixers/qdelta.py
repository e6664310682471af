"""Q-Delta mixer ("Q-Delta: Beyond Key-Value Associative State Evolution"): Gated DeltaNet whose erase
direction is x_t = k_t + lambda q_t.

Per head (state `[K, V]`, the transpose of the paper's `[V, K]` layout):

    S_t = alpha_t (I - beta_t k_t x_t^T) S_{t-1} + beta_t k_t v_t^T,   x_t = k_t + lambda q_t,

i.e. the state is corrected by the hybrid error v_t - S'^T k_t - lambda S'^T q_t (key retrieval plus
query read-out), written along k. Everything else (L2-normalised q/k, beta, decay, output gate/norm,
init rules) is `GatedDeltaNet`'s; the op is `hybridize.ops.delta.reference` with `p = x`.

lambda in [0, 1] is one learnable scalar per head, lambda = sigmoid(lambda_logit); the paper writes
lambda_t but describes it as "a learnable per-head query feedback coefficient" - this module reads it
as per head, not per token. Init rule: lambda = `lambda_init` (0.1) for every head, so a converted layer
starts close to Gated DeltaNet and learns how much query feedback to use (the paper's learnable
lambda beat every fixed value). `fixed_lambda` freezes it (the paper's fixed-lambda ablation); 0 gives
Gated DeltaNet exactly.

Stability (Q-Delta paper, Lemma 3.1): contraction needs beta_t a_t in (0, 2), a_t = k_t . x_t =
1 + lambda cos(q_t, k_t) for unit q, k. With beta in (0, 1) and lambda in [0, 1] this always holds
(beta a < 2; a > 0 except lambda = 1 with q = -k): the parameterisation itself guarantees it, which is
why q, k are normalised before x is formed and x is not renormalised.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn as nn

from .base import MixerConfig
from .deltanet import GatedDeltaNet, GatedDeltaNetConfig


@dataclass
class QDeltaConfig(GatedDeltaNetConfig):
    lambda_init: float = field(default=0.1, metadata={
        "help": "initial query-feedback weight lambda = sigmoid(lambda_logit) per head, in (0, 1)"})
    fixed_lambda: float | None = field(default=None, metadata={
        "help": "if set, lambda is this constant in [0, 1] (no parameter); 0 gives Gated DeltaNet"})


class QDelta(GatedDeltaNet):
    name: ClassVar[str] = "qdelta"
    config_class: ClassVar[type[MixerConfig]] = QDeltaConfig

    def build_new_parameters(self) -> None:
        super().build_new_parameters()
        c = self.config
        if c.fixed_lambda is not None:
            if not 0.0 <= c.fixed_lambda <= 1.0:
                raise ValueError(f"fixed_lambda must lie in [0, 1], got {c.fixed_lambda}")
        else:
            if not 0.0 < c.lambda_init < 1.0:
                raise ValueError(f"lambda_init must lie in (0, 1), got {c.lambda_init}")
            self.lambda_logit = nn.Parameter(torch.zeros(c.num_heads))

    def reset_new_parameters(self) -> None:
        """GatedDeltaNet's rules, plus lambda = lambda_init on every head."""
        super().reset_new_parameters()
        c = self.config
        if c.fixed_lambda is None:
            with torch.no_grad():
                self.lambda_logit.fill_(math.log(c.lambda_init / (1.0 - c.lambda_init)))

    def query_feedback(self) -> torch.Tensor:
        """lambda `[H]` in [0, 1] (fp32)."""
        c = self.config
        if c.fixed_lambda is not None:
            return torch.full((c.num_heads,), float(c.fixed_lambda), device=self.b_proj.weight.device)
        return torch.sigmoid(self.lambda_logit.float())

    def erase_feedback(self) -> torch.Tensor:
        """lambda `[H]`: the delta op forms x = k + lambda q itself (q, k already L2-normalised), in one fused
        pass with fla's exp(g) factor on the GPU (`ops/delta/triton_erase.py`)."""
        return self.query_feedback()


__all__ = ["QDelta", "QDeltaConfig"]
