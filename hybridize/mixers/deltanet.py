"""DeltaNet and Gated DeltaNet mixers ("Parallelizing Linear Transformers with the Delta Rule over
Sequence Length", Yang et al. 2024; "Gated Delta Networks: Improving Mamba2 with Delta Rule", Yang et al. 2025).

Per head: S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,  o_t = scale * S_t^T q_t,
with q, k L2-normalised per head, beta_t = sigmoid(b_proj(x_t)) per head, and alpha_t = 1 (DeltaNet)
or alpha_t = exp(g_t) with a scalar log-decay per head (Gated DeltaNet). The op is
`hybridize.ops.delta.reference` (called through `dispatch.run("delta", mode, ...)`); the chunked form is
its WY / UT-transform, the recurrent form the per-token ground truth.

Front end (shared with every mixer, base.py): teacher q/k/v/o projections, optional short conv,
optional RoPE, GQA kept in the projections (k/v at KV width) and repeated to the H query heads
before the op, so each query head owns one state `[K, V]`. Output as in GDN:
o_proj(RMSNorm(o) * silu(g_proj(x))), both parts optional.

Departures from the GDN paper / fla layer, all for conversion from a pretrained attention layer:
- no SiLU on q/k by default (`qk_activation`), since it would discard the negative half of the
  teacher's q/k; the short conv is optional and off by default (identity at init when on);
- new parameters start from stated rules (`reset_new_parameters`): beta = `beta_init` (0.5) for
  every token (b_proj weight 0), output gate exactly 1 (g_proj weight 0, bias = 1.27846, the root
  of silu(c) = 1), norm weight 1, per-head decays spread log-uniformly in 1 - alpha over
  [1 - decay_max, 1 - decay_min] = [0.001, 0.1] (a_proj weight 0, A = 1), i.e. long memory;
- beta lies in (0, 1) (no negative-eigenvalue variant).

Padding (attention_mask False): k = 0, beta = 0 and g = 0 on those tokens, so the state is untouched.

Subclass hooks: `log_decay` (GDN), `erase_feedback` (Q-Delta) and `transform_query` (between the
front end and the op: swaps the read query and adds fields to the returned state; used by CCQ).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from hybridize.ops.common import dispatch

from .base import ConvState, Mixer, MixerConfig, MixerOutput, MixerState, RMSNorm, mask_tokens, repeat_kv

#: silu(SILU_ONE) == 1 (Newton root, fp64): an output gate with zero weight and this bias is the identity
SILU_ONE = 1.278464542761074


@dataclass
class DeltaNetConfig(MixerConfig):
    qk_activation: str = field(default="identity", metadata={
        "help": "feature map on q/k before the L2 norm: 'identity' (keeps the teacher's q/k) or 'silu' (fla)"})
    beta_init: float = field(default=0.5, metadata={
        "help": "initial write strength beta = sigmoid(b) for every token (b_proj weight 0), in (0, 1)"})
    output_gate: bool = field(default=True, metadata={
        "help": "multiply the output by silu(g_proj(x)) (GDN); starts as exactly 1"})
    output_norm: bool = field(default=True, metadata={
        "help": "per-head RMSNorm of the mixer output before the gate (GDN); weight starts at 1"})


@dataclass
class GatedDeltaNetConfig(DeltaNetConfig):
    decay_fn: str = field(default="mamba2", metadata={
        "help": "log-decay g: 'mamba2' = -exp(A_log) * softplus(a_proj(x) + dt_bias), "
                "or 'logsigmoid' = logsigmoid(a_proj(x) + dt_bias)"})
    decay_min: float = field(default=0.9, metadata={
        "help": "smallest initial per-head decay alpha = exp(g) (heads spread log-uniformly in 1 - alpha)"})
    decay_max: float = field(default=0.999, metadata={"help": "largest initial per-head decay alpha"})


@dataclass
class DeltaState(MixerState):
    """recurrent `[N, H, K, V]` (fp32) and the short-conv tails (None when `short_conv` is off)."""

    recurrent: torch.Tensor | None = None
    conv: ConvState | None = None


class DeltaNet(Mixer):
    """DeltaNet: the delta rule without decay (alpha = 1)."""

    name: ClassVar[str] = "deltanet"
    config_class: ClassVar[type[MixerConfig]] = DeltaNetConfig
    state_class: ClassVar[type[MixerState]] = DeltaState

    def __init__(self, config: DeltaNetConfig):
        super().__init__(config)
        self.build_new_parameters()
        self.init_new_parameters()

    def build_new_parameters(self) -> None:
        """Create the parameters the teacher lacks (subclasses extend; values set by reset_new_parameters)."""
        c = self.config
        if c.qk_activation not in ("identity", "silu"):
            raise ValueError(f"qk_activation must be 'identity' or 'silu', got {c.qk_activation!r}")
        if not 0.0 < c.beta_init < 1.0:
            raise ValueError(f"beta_init must lie in (0, 1), got {c.beta_init}")
        self.b_proj = nn.Linear(c.hidden_size, c.num_heads, bias=True)
        if c.output_gate:
            self.g_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=True)
        if c.output_norm:
            self.o_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    # ---- initialisation -------------------------------------------------------------------
    def reset_new_parameters(self) -> None:
        """beta = beta_init everywhere, output gate = 1, norm weight = 1 (module docstring)."""
        super().reset_new_parameters()
        c = self.config
        with torch.no_grad():
            self.b_proj.weight.zero_()
            self.b_proj.bias.fill_(math.log(c.beta_init / (1.0 - c.beta_init)))
            if c.output_gate:
                self.g_proj.weight.zero_()
                self.g_proj.bias.fill_(SILU_ONE)
            if c.output_norm:
                self.o_norm.weight.fill_(1.0)

    # ---- pieces subclasses override ---------------------------------------------------------
    def log_decay(self, x: torch.Tensor) -> torch.Tensor | None:
        """Scalar log-decay g `[B, T, H]` (<= 0) in fp32, or None for no decay."""
        return None

    def erase_feedback(self) -> torch.Tensor | None:
        """lam `[H]` when the erase direction of (I - beta k p^T) is p = k + lam q (Q-Delta): the op forms
        p itself (one fused pass on the GPU). None: p = k."""
        return None

    def transform_query(self, q, k, state, attention_mask, cu_seqlens, mode, output_state):
        """Hook for read-side wrappers (CCQ): q, k `[B, T, H, K]` as the op gets them -> (query the op
        reads with, extra fields merged into the returned state). Default: unchanged q, no fields."""
        return q, {}

    # ---- forward ----------------------------------------------------------------------------
    def features(self, x, state=None, attention_mask=None, cu_seqlens=None, position_embeddings=None):
        """x `[B, T, hidden]` -> dict of the op inputs (q, k, v `[B, T, H, D]`, beta, g `[B, T, H]`,
        p) with padding applied, and the new ConvState (or None)."""
        c = self.config
        q, k, v, conv = self.project_qkv(x, attention_mask, cu_seqlens, position_embeddings,
                                         state.conv if state is not None else None)
        if c.qk_activation == "silu":
            q, k = F.silu(q), F.silu(k)
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        k, v = repeat_kv(k, self.n_rep), repeat_kv(v, self.n_rep)
        beta = torch.sigmoid(self.b_proj(x).float())
        g = self.log_decay(x)
        lam = self.erase_feedback()
        if attention_mask is not None:
            # padded tokens: no write (k = 0, beta = 0), hence no erase, and no decay (g = 0)
            k, v = (mask_tokens(t, attention_mask) for t in (k, v))
            beta = mask_tokens(beta, attention_mask)
            g = mask_tokens(g, attention_mask)
        return dict(q=q, k=k, v=v, beta=beta, g=g, p=None, **({} if lam is None else {"lam": lam})), conv

    def finish(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o `[B, T, H, D]` -> hidden `[B, T, hidden]`: RMSNorm, silu output gate, o_proj."""
        c = self.config
        B, T = o.shape[:2]
        if c.output_norm:
            o = self.o_norm(o)
        if c.output_gate:
            o = o * F.silu(self.g_proj(x)).view(B, T, c.num_heads, c.head_dim)
        return self.o_proj(o.reshape(B, T, -1).to(x.dtype))

    def forward(self, x, state: DeltaState | None = None, attention_mask=None, cu_seqlens=None,
                position_embeddings=None, output_state: bool = False, mode: str | None = None) -> MixerOutput:
        mode = self.pick_mode(mode, x.shape[1], state)
        if cu_seqlens is not None and x.shape[0] != 1:
            raise ValueError(f"cu_seqlens needs a packed batch of size 1, got batch {x.shape[0]}")
        inputs, conv = self.features(x, state, attention_mask, cu_seqlens, position_embeddings)
        inputs["q"], extra_state = self.transform_query(inputs["q"], inputs["k"], state, attention_mask,
                                                        cu_seqlens, mode, output_state)
        kw = {"chunk_size": self.config.chunk_size} if mode == "chunk" else {}
        o, S = dispatch.run("delta", mode, **inputs,
                            initial_state=state.recurrent if state is not None else None,
                            output_final_state=output_state, cu_seqlens=cu_seqlens, **kw)
        new_state = self.state_class(recurrent=S, conv=conv, **extra_state) if output_state else None
        return MixerOutput(hidden=self.finish(o, x), state=new_state)


def _inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    return y + torch.log(-torch.expm1(-y))


class GatedDeltaNet(DeltaNet):
    """Gated DeltaNet: DeltaNet plus a data-dependent scalar decay alpha_t = exp(g_t) per head."""

    name: ClassVar[str] = "gdn"
    config_class: ClassVar[type[MixerConfig]] = GatedDeltaNetConfig

    def build_new_parameters(self) -> None:
        super().build_new_parameters()
        c = self.config
        if c.decay_fn not in ("mamba2", "logsigmoid"):
            raise ValueError(f"decay_fn must be 'mamba2' or 'logsigmoid', got {c.decay_fn!r}")
        if not 0.0 < c.decay_min <= c.decay_max < 1.0:
            raise ValueError(f"need 0 < decay_min <= decay_max < 1, got {c.decay_min}, {c.decay_max}")
        self.a_proj = nn.Linear(c.hidden_size, c.num_heads, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(c.num_heads))
        if c.decay_fn == "mamba2":
            self.A_log = nn.Parameter(torch.zeros(c.num_heads))

    def reset_new_parameters(self) -> None:
        """Decay data-independent at init (a_proj weight 0), per-head alpha log-spread in 1 - alpha."""
        super().reset_new_parameters()
        c = self.config
        one_minus = torch.logspace(math.log10(1 - c.decay_max), math.log10(1 - c.decay_min), c.num_heads,
                                   dtype=torch.float64)
        neg_log_alpha = -torch.log1p(-one_minus)                 # -g > 0 at init
        with torch.no_grad():
            self.a_proj.weight.zero_()
            if c.decay_fn == "mamba2":
                self.A_log.zero_()                               # A = 1: g = -softplus(dt_bias)
                self.dt_bias.copy_(_inverse_softplus(neg_log_alpha))
            else:                                                # g = logsigmoid(logit(alpha))
                alpha = 1 - one_minus
                self.dt_bias.copy_(torch.log(alpha / one_minus))

    def log_decay(self, x: torch.Tensor) -> torch.Tensor:
        z = self.a_proj(x).float() + self.dt_bias.float()
        if self.config.decay_fn == "mamba2":
            return -self.A_log.float().exp() * F.softplus(z)
        return F.logsigmoid(z)


__all__ = ["DeltaNet", "DeltaNetConfig", "DeltaState", "GatedDeltaNet", "GatedDeltaNetConfig", "SILU_ONE"]
