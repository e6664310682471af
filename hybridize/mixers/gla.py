"""Gated linear attention (GLA, Yang et al. 2024), in the form SSE uses as its backbone
("Scaling Linear Attention with Sparse State Expansion").

    S_t = diag(alpha_t) S_{t-1} + phi(k_t) v_t^T,   o_t = scale * S_t^T phi(q_t)
    alpha_t = exp(g_t),  g_t = logsigmoid(x_t W_down W_up + b) / gate_logit_normalizer   `[B, T, H, K]`
    y_t = W_o [ RMSNorm_head(o_t) * act(x_t W_g + b_g) ]

The per-key-channel gate comes from a low-rank projection (hidden -> `gate_low_rank_dim` = 16 ->
H*K); the normaliser 16 keeps every per-step decay close to 1. The output gate (`output_gate`: silu
as in GLA, sigmoid, or none) and the per-head RMSNorm (`output_norm`) follow GLA/SSE. Feature maps,
GQA handling, the row-sparse top-k option (`row_topk`: only the chosen rows are written AND decayed),
padding and the state layout are those of `LinearAttention` (see linear_attn.py).

Departures from the paper's model: q/k/v/o keep the teacher's shapes and names (GQA: k/v at KV-head
width, repeated per query head), the gate's up-projection and the output gate have biases (so the
init below can pin them), and the default feature map is the softmax of linear_attn.py (GLA uses
identity: set feature_map="identity" for that; SSE uses k "softmax", q "silu", v "silu").

Init rule for new parameters (`reset_new_parameters`), chosen so a converted layer starts as plain
(normalised) linear attention with the teacher's q/k/v/o and a long memory:
- gate: W_up = 0 and b = logit(init_decay ** gate_logit_normalizer), so every decay is exactly
  `init_decay` (0.995, a ~200-token horizon) at init; W_down ~ N(0, 1/hidden) so W_up learns at once;
- output gate: W_g = 0, bias b_g with act(b_g) = 1 for silu (b_g = 1.2785), 0.982 for sigmoid (b_g = 4):
  the gate starts as (nearly) the identity;
- output norm weight 1; short-conv taps identity (base rule).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from .linear_attn import LinearAttention, LinearAttentionConfig, LinearAttentionState, _check_choice

OUTPUT_GATES = ("silu", "sigmoid", "none")
#: silu(b) = 1: b sigmoid(b) = 1 solved by Newton (1.27846454...)
SILU_ONE = 1.2784645427610738
SIGMOID_GATE_BIAS = 4.0


@dataclass
class GLAConfig(LinearAttentionConfig):
    gate_low_rank_dim: int = field(default=16, metadata={"help": "rank of the gate projection hidden -> r -> H*K"})
    gate_logit_normalizer: float = field(default=16.0, metadata={
        "help": "g = logsigmoid(gate logits) / normaliser (GLA's 16 keeps decays near 1)"})
    init_decay: float = field(default=0.995, metadata={"help": "per-token decay exp(g) of every channel at init"})
    output_gate: str = field(default="silu", metadata={"help": "output gate act(x W_g + b): silu, sigmoid or none"})
    output_norm: bool = field(default=True, metadata={"help": "per-head RMSNorm on the read before the output gate"})

    def __post_init__(self):
        super().__post_init__()
        _check_choice("output_gate", self.output_gate, OUTPUT_GATES)
        if not 0.0 < self.init_decay < 1.0:
            raise ValueError(f"init_decay={self.init_decay} must lie strictly between 0 and 1")
        if self.gate_logit_normalizer <= 0 or self.gate_low_rank_dim < 1:
            raise ValueError("gate_logit_normalizer must be > 0 and gate_low_rank_dim >= 1")


@dataclass
class GLAState(LinearAttentionState):
    """recurrent `[N, H, K, V]` fp32, conv: ConvState | None (short-conv windows)."""


class GLA(LinearAttention):
    name = "gla"
    config_class = GLAConfig
    state_class = GLAState

    def __init__(self, config: GLAConfig):
        super().__init__(config)
        c = config
        self.gk_proj = nn.Sequential(nn.Linear(c.hidden_size, c.gate_low_rank_dim, bias=False),
                                     nn.Linear(c.gate_low_rank_dim, c.num_heads * c.head_dim, bias=True))
        if c.output_gate != "none":
            self.g_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=True)
        self.init_new_parameters()

    def reset_new_parameters(self) -> None:
        """The init rule of the module docstring."""
        super().reset_new_parameters()
        c = self.config
        p = c.init_decay ** c.gate_logit_normalizer          # sigmoid(b) that gives exp(g) = init_decay
        with torch.no_grad():
            nn.init.normal_(self.gk_proj[0].weight, std=c.hidden_size ** -0.5)
            self.gk_proj[1].weight.zero_()
            self.gk_proj[1].bias.fill_(math.log(p / (1.0 - p)))
            if hasattr(self, "g_proj"):
                self.g_proj.weight.zero_()
                self.g_proj.bias.fill_(SILU_ONE if c.output_gate == "silu" else SIGMOID_GATE_BIAS)

    def log_decay(self, x: torch.Tensor) -> torch.Tensor:
        """x `[B, T, hidden]` -> g `[B, T, H, K]` fp32, each entry in (-inf, 0)."""
        c = self.config
        B, T, _ = x.shape
        logits = self.gk_proj(x).float().view(B, T, c.num_heads, c.head_dim)
        return F.logsigmoid(logits) / c.gate_logit_normalizer

    def read_out(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        o = super().read_out(o, x)
        if not hasattr(self, "g_proj"):
            return o
        B, T, _ = x.shape
        gate = self.g_proj(x).view(B, T, self.config.num_heads, self.config.head_dim)
        gate = F.silu(gate) if self.config.output_gate == "silu" else torch.sigmoid(gate)
        return o * gate.to(o.dtype)
