"""CCQ, the curvature-conditioned query ("Don't Read Everything: A Curvature-Conditioned
Query for Linear Attention", sec. 3, appendices B-D), as a read-side wrapper.

The backbone (GLA or Gated DeltaNet) is used unchanged; only the query it reads with is replaced:

    mu_t = (1/t) sum_{j<=t} kbar_j      C_t = (1/t) sum_{j<=t} kbar_j kbar_j^T      Sigma_t = C_t - mu_t mu_t^T
    lambda_t = sigmoid(w_lambda . qbar_t + b_lambda)   (one scalar per head and token)
    q_clean_t = q_t - lambda_t Sigma_t q_t             (eq. 9), then o_t = backbone read with q_clean_t

with kbar, qbar the L2-normalised keys/queries, token t included in the statistics, no decay, t the
number of real tokens of the sequence so far (restarting for every `cu_seqlens` document; padding not
counted). Sigma_t q_t is `hybridize.ops.ccq.reference` (chunked: linear attention with values = keys;
recurrent: the paper's Algorithm 2); the normalisations, the gate and the update of q around it are
`hybridize.ops.ccq.clean` (fused Triton passes on CUDA). The decode state is the backbone state
plus (C_t, mu_t, t).

Reuse of the backbone: `CCQGLA` subclasses `GLA`, `CCQGDN` subclasses `GatedDeltaNet`; each
overrides only the backbones' `transform_query` hook, which gets q, k as the op would (after the
front end: projections, feature maps, GQA repeat, padding) plus the incoming state, and returns
q_clean and the new statistics, which the backbone's `forward` merges into its state. The write
(keys, values, gates, beta) and the output path (norm, gate, o_proj) are the backbone's code.

Reading of the paper for this codebase (documented departures):
- Statistics use the L2-normalised keys *as the backbone's op sees them* (after its feature map, bias,
  q/k norm, RoPE and GQA repeat), so C_t is `[H, K, K]` per query head. For GDN these keys are already
  unit-norm (exactly the paper). For GLA the backbone's own keys (softmax feature map by default) are
  normalised for the statistics only, keeping ||Sigma_t|| <= 1 (appendix F).
- The operator (I - lambda_t Sigma_t) is applied to the backbone's read query q_t itself. For GDN
  q_t = qbar_t (exactly eq. 9). For GLA, whose query is not unit-norm, this is the paper's operator on
  the backbone's query (the same contraction, scaled by ||q_t||), so lambda = 0 gives the backbone
  exactly; lambda is always computed from the normalised qbar_t as in Algorithm 2.
- W_lambda is one linear map K -> 1 per head (`ccq_weight` `[H, K]`, `ccq_bias` `[H]`, appendix D);
  init: weight 0 and sigmoid(bias) = `ccq_gate_init` = 0.1, so every gate starts at 0.1 and the weight
  still gets a gradient. `ccq_fixed_lambda` pins lambda to a constant (0 turns CCQ off: the backbone).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn as nn

from hybridize.ops.common import dispatch

from .base import MixerConfig, MixerState
from .deltanet import DeltaState, GatedDeltaNet, GatedDeltaNetConfig
from .gla import GLA, GLAConfig, GLAState


# ---- config and state -------------------------------------------------------------------------

@dataclass
class CCQSettings:
    """The CCQ fields shared by both wrappers (mixed into each backbone's config)."""

    ccq_gate_init: float = field(default=0.1, metadata={
        "help": "sigmoid(b_lambda) at init (paper appendix D: 0.1); the gate weight starts at 0"})
    ccq_fixed_lambda: float | None = field(default=None, metadata={
        "help": "if set, lambda is this constant in [0, 1] (no gate parameters); 0 gives the backbone"})

    def __post_init__(self):
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:
            parent()
        if not 0.0 < self.ccq_gate_init < 1.0:
            raise ValueError(f"ccq_gate_init must lie in (0, 1), got {self.ccq_gate_init}")
        if self.ccq_fixed_lambda is not None and not 0.0 <= self.ccq_fixed_lambda <= 1.0:
            raise ValueError(f"ccq_fixed_lambda must lie in [0, 1] or be None, got {self.ccq_fixed_lambda}")


@dataclass
class CCQGLAConfig(CCQSettings, GLAConfig):
    """GLA settings plus the CCQ gate settings."""


@dataclass
class CCQGDNConfig(CCQSettings, GatedDeltaNetConfig):
    """Gated DeltaNet settings plus the CCQ gate settings."""


@dataclass
class _CCQStats:
    """Key statistics fields added to a backbone state (None until a state has been produced)."""

    key_moment: torch.Tensor | None = None   # C_t  [N, H, K, K] fp32, (1/t) sum k k^T
    key_mean: torch.Tensor | None = None     # mu_t [N, H, K] fp32
    key_count: torch.Tensor | None = None    # t    [N] int64, real tokens seen


@dataclass
class CCQGLAState(GLAState, _CCQStats):
    """GLA state (recurrent `[N, H, K, V]`, conv) plus (C_t, mu_t, t)."""


@dataclass
class CCQGDNState(DeltaState, _CCQStats):
    """Gated DeltaNet state (recurrent `[N, H, K, V]`, conv) plus (C_t, mu_t, t)."""


# ---- the shared read-side logic ----------------------------------------------------------------

class _CCQRead:
    """Mixin holding the gate parameters and the query cleaning; used before the backbone in the MRO."""

    config: Any
    #: the keys the hook gets are already unit rows (GDN normalises q and k in its front end), so the
    #: statistics use them as they are: one normalisation pass less each way on the GPU, same values
    keys_are_unit: ClassVar[bool] = False

    def _build_ccq(self) -> None:
        c = self.config
        if c.ccq_fixed_lambda is None:
            self.ccq_weight = nn.Parameter(torch.zeros(c.num_heads, c.head_dim))
            self.ccq_bias = nn.Parameter(torch.zeros(c.num_heads))
        self._reset_ccq()

    def _reset_ccq(self) -> None:
        """Gate weight 0, sigmoid(bias) = ccq_gate_init (appendix D)."""
        if not hasattr(self, "ccq_bias"):
            return
        p = self.config.ccq_gate_init
        with torch.no_grad():
            self.ccq_weight.zero_()
            self.ccq_bias.fill_(math.log(p / (1.0 - p)))

    def _gate_args(self):
        """(weight, bias, fixed lambda) for `ops.ccq.clean`: the gate parameters, or a fixed lambda."""
        fixed = self.config.ccq_fixed_lambda
        if fixed is not None:
            return None, None, fixed
        return self.ccq_weight, self.ccq_bias, None

    def transform_query(self, q, k, state, attention_mask, cu_seqlens, mode, output_state):
        """The backbone hook: q, k `[B, T, H, K]` as the op gets them -> (q_clean = q - lambda Sigma_t q,
        new statistics as state fields, empty unless `output_state`)."""
        stats = None
        if state is not None and getattr(state, "key_moment", None) is not None:
            stats = (state.key_moment, state.key_mean, state.key_count)
        kw = {"chunk_size": self.config.chunk_size} if mode == "chunk" else {}

        def read(query, k_unit, **extra):  # statistics over unit keys (padding: zero keys; the mask keeps them
            # out of t); `extra`: the GPU cleaning may ask the read to clean in its epilogue (`clean=`)
            return dispatch.run("ccq", mode, query, k_unit, mask=attention_mask, initial_state=stats,
                                output_final_state=output_state, cu_seqlens=cu_seqlens, **kw, **extra)

        # normalising k, the gate and q - lambda Sigma q: fused around the read on the GPU (ops/ccq/clean.py)
        q_clean, new = dispatch.run("ccq_clean", mode, q, k, *self._gate_args(), read, unit_keys=self.keys_are_unit)
        if not output_state:
            return q_clean, {}
        C, mu, t = new
        return q_clean, {"key_moment": C, "key_mean": mu, "key_count": t}


# ---- the two wrappers ----------------------------------------------------------------------------

class CCQGLA(_CCQRead, GLA):
    """GLA whose read uses the CCQ-cleaned query; write, gates and output path are GLA's."""

    name: ClassVar[str] = "ccq_gla"
    config_class: ClassVar[type[MixerConfig]] = CCQGLAConfig
    state_class: ClassVar[type[MixerState]] = CCQGLAState

    def __init__(self, config: CCQGLAConfig):
        super().__init__(config)
        self._build_ccq()

    def reset_new_parameters(self) -> None:
        """GLA's rules, plus the CCQ gate (weight 0, sigmoid(bias) = ccq_gate_init)."""
        super().reset_new_parameters()
        self._reset_ccq()


class CCQGDN(_CCQRead, GatedDeltaNet):
    """Gated DeltaNet whose read uses the CCQ-cleaned query; the delta-rule write is GDN's."""

    name: ClassVar[str] = "ccq_gdn"
    config_class: ClassVar[type[MixerConfig]] = CCQGDNConfig
    state_class: ClassVar[type[MixerState]] = CCQGDNState
    keys_are_unit: ClassVar[bool] = True

    def build_new_parameters(self) -> None:
        super().build_new_parameters()
        self._build_ccq()

    def reset_new_parameters(self) -> None:
        """Gated DeltaNet's rules, plus the CCQ gate (weight 0, sigmoid(bias) = ccq_gate_init)."""
        super().reset_new_parameters()
        self._reset_ccq()


__all__ = ["CCQGLA", "CCQGLAConfig", "CCQGLAState", "CCQGDN", "CCQGDNConfig", "CCQGDNState"]
