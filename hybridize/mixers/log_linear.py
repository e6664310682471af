"""Log-linear attention (Guo et al. 2025, Mamba-2 form) with the adaptive level weights of
"Adaptive Memory Decay for Log-Linear Attention".

Per head, with phi(q), phi(k) the teacher's q/k through a feature map and a scalar decay per head:

    o_t = scale * sum_l lambda_t^l (M_t^l)^T phi(q_t),   M_t^l = sum_{s in level l of t} exp(G_t - G_s) phi(k_s) v_s^T

where the levels are the Fenwick buckets of the prefix [0, t] (level 0 = token t, level l = the 2^(l-1)
tokens that differ from t first in bit l-1; see `hybridize/ops/log_linear/reference.py`, which holds both
forms and the O(log T) decode state), and
    y_t = W_o [ act(x_t W_g + b_g) * RMSNorm_head(o_t) ]      (gate and norm optional).

Scalar decay, Mamba-2 style: g_t = -exp(A_log) * softplus(x_t W_dt + dt_bias) per head (the log of
the decay). Departure from Mamba-2: the value is not multiplied by dt (v is the teacher's value, as
in fla's chunk_log_linear_attn, which takes g and v separately); A starts at 1, not U[1, 16].

Level weights lambda `[B, T, H, L]`, L = ceil(log2(max_seq_len)) + 1 (longer inputs pile the oldest
history into the top level). Both parameterisations read the same "baseline level projection"
d_t = x_t W_lambda `[B, T, H, L]`:
- `lambda_mode="baseline"` (Guo et al., the "positive" mode of the authors' code):
  lambda = softplus(Lambda * d_t) with a learned per-head, per-level Lambda `[H, L]` (init 1);
- `lambda_mode="adaptive"` (Adaptive Memory Decay eq. 4 with sec. 4.1's GELU): lambda = softplus(GELU(d_t W1 + b1) W2 + b2),
  one MLP over the level axis shared by all heads, hidden 64. W1 Xavier-uniform, b1 = 0, W2 = 0,
  b2 = 0.54 (the paper's "scalar bias" is a per-level bias here, all 0.54 at init: softplus(0.54) ~ 1).

Feature maps (`feature_map`, `q_feature_map`, `k_feature_map`; the choices of linear_attn.py).
Default "softmax" over the head dim, as for the other converted mixers: phi(q).phi(k) lies in [0, 1]
whatever the scale of the teacher's q/k, is non-negative like the teacher's attention weights and is
dominated by its largest channels, so an unnormalised, decayed sum over hundreds of tokens stays
bounded; "identity" keeps the teacher's logits (signed, they cancel), elu1/relu/silu let
similarities grow with |q||k|. The read scale is head_dim^-0.5 for identity q, else 1.

Init rule (`reset_new_parameters`), a converted layer starts as normalised linear attention with a
long memory:
- decay: W_dt = 0, A_log = 0, dt_bias so that head h starts with a data-independent decay exp(-dt_h),
  dt_h log-spaced over [init_dt_min, init_dt_max] = [1e-3, 1e-2] (decays 0.999 .. 0.990, a multi-
  scale memory like RetNet's); W_dt learns at once because g is linear in it;
- adaptive lambda: as above, so lambda = softplus(0.54) = 0.9992 on every level and the layer is its
  linear backbone times 0.9992 (the levels partition the prefix; the output norm removes the factor); W_lambda ~ N(0, 1/hidden) so that d_t
  carries content into W1 from the first step (W2 gets gradient GELU(d_t W1 + b1));
- baseline lambda: Lambda = 1, W_lambda ~ N(0, 1/hidden): lambda = softplus(d_t) ~ 0.69 +- noise
  (the paper's baseline, which starts neither uniform nor at 1; the output norm absorbs the scale);
- output gate W_g = 0 with act(b_g) = 1 (silu) / 0.982 (sigmoid); output-norm weight 1.

Padding (`attention_mask` False) must neither write, decay nor advance the Fenwick counter (which
decides the level structure), so masked batches are packed into documents (`cu_seqlens`) around the
op and scattered back; padded outputs are 0 before o_proj.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from hybridize.ops.common import dispatch
from hybridize.ops.log_linear.reference import LogLinearState

from .base import ConvState, Mixer, MixerConfig, MixerOutput, MixerState, RMSNorm, repeat_kv
from .gla import SIGMOID_GATE_BIAS, SILU_ONE
from .linear_attn import FEATURE_MAPS, FeatureMapChoice, _check_choice, apply_feature_map

LAMBDA_MODES = ("adaptive", "baseline")
OUTPUT_GATES = ("silu", "sigmoid", "none")


@dataclass
class LogLinearConfig(FeatureMapChoice, MixerConfig):
    lambda_mode: str = field(default="adaptive", metadata={
        "help": "level weights: adaptive (MLP-softplus) or baseline (softplus(Lambda * x W_lambda))"})
    max_seq_len: int = field(default=65536, metadata={
        "help": "sets the number of levels L = ceil(log2(max_seq_len)) + 1; longer inputs clamp into the top level"})
    lambda_hidden: int = field(default=64, metadata={"help": "hidden width of the adaptive lambda MLP"})
    lambda_bias_init: float = field(default=0.54, metadata={"help": "b2 of the lambda MLP at init (softplus(0.54) ~ 1)"})
    feature_map: str = field(default="softmax", metadata={
        "help": "feature map of q and k: identity, elu1, relu, softmax (over head dim), silu"})
    q_feature_map: str | None = field(default=None, metadata={"help": "override feature_map for q"})
    k_feature_map: str | None = field(default=None, metadata={"help": "override feature_map for k"})
    scale: float | None = field(default=None, metadata={
        "help": "read scale; default head_dim**-0.5 when the q map is identity, else 1"})
    init_dt_min: float = field(default=1e-3, metadata={"help": "smallest per-head dt at init (decay exp(-dt))"})
    init_dt_max: float = field(default=1e-2, metadata={"help": "largest per-head dt at init"})
    output_gate: str = field(default="silu", metadata={"help": "output gate act(x W_g + b_g): silu, sigmoid or none"})
    output_norm: bool = field(default=True, metadata={"help": "per-head RMSNorm on the read (weight 1 at init)"})

    def __post_init__(self):
        _check_choice("lambda_mode", self.lambda_mode, LAMBDA_MODES)
        _check_choice("output_gate", self.output_gate, OUTPUT_GATES)
        for name in ("feature_map", "q_feature_map", "k_feature_map"):
            value = getattr(self, name)
            if value is not None:
                _check_choice(name, value, tuple(FEATURE_MAPS))
        if self.max_seq_len < 2:
            raise ValueError(f"max_seq_len={self.max_seq_len} must be >= 2 (log-linear needs 2 levels)")
        if not 0 < self.init_dt_min <= self.init_dt_max:
            raise ValueError(f"need 0 < init_dt_min <= init_dt_max, got {self.init_dt_min}, {self.init_dt_max}")
        if self.lambda_hidden < 1:
            raise ValueError(f"lambda_hidden={self.lambda_hidden} must be >= 1")

    @property
    def num_levels(self) -> int:
        return math.ceil(math.log2(self.max_seq_len)) + 1


@dataclass
class LogLinearMixerState(MixerState):
    """levels `[N, H, L, K, V]` fp32 (the Fenwick states), t `[N]` int64 (tokens consumed), conv windows."""

    levels: torch.Tensor | None = None
    t: torch.Tensor | None = None
    conv: ConvState | None = None


class LogLinearAttention(Mixer):
    name = "log_linear"
    config_class = LogLinearConfig
    state_class = LogLinearMixerState

    def __init__(self, config: LogLinearConfig):
        super().__init__(config)
        c = config
        H, L = c.num_heads, c.num_levels
        self.dt_proj = nn.Linear(c.hidden_size, H, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(H))
        self.A_log = nn.Parameter(torch.zeros(H))
        self.lambda_proj = nn.Linear(c.hidden_size, H * L, bias=False)
        if c.lambda_mode == "baseline":
            self.lambda_scale = nn.Parameter(torch.ones(H, L))
        else:
            self.lambda_mlp = nn.Sequential(nn.Linear(L, c.lambda_hidden), nn.GELU(), nn.Linear(c.lambda_hidden, L))
        if c.output_norm:
            self.o_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        if c.output_gate != "none":
            self.g_proj = nn.Linear(c.hidden_size, H * c.head_dim, bias=True)
        self.init_new_parameters()

    def reset_new_parameters(self) -> None:
        """The init rule of the module docstring."""
        super().reset_new_parameters()
        c = self.config
        H = c.num_heads
        with torch.no_grad():
            self.dt_proj.weight.zero_()
            frac = torch.arange(H, dtype=torch.float64) / max(H - 1, 1)
            dt = c.init_dt_min * (c.init_dt_max / c.init_dt_min) ** frac
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))       # inverse softplus
            self.A_log.zero_()
            nn.init.normal_(self.lambda_proj.weight, std=c.hidden_size ** -0.5)
            if hasattr(self, "lambda_scale"):
                self.lambda_scale.fill_(1.0)
            if hasattr(self, "lambda_mlp"):
                nn.init.xavier_uniform_(self.lambda_mlp[0].weight)
                self.lambda_mlp[0].bias.zero_()
                self.lambda_mlp[2].weight.zero_()
                self.lambda_mlp[2].bias.fill_(c.lambda_bias_init)
            if hasattr(self, "o_norm"):
                self.o_norm.weight.fill_(1.0)
            if hasattr(self, "g_proj"):
                self.g_proj.weight.zero_()
                self.g_proj.bias.fill_(SILU_ONE if c.output_gate == "silu" else SIGMOID_GATE_BIAS)

    # ---- per-token gates ---------------------------------------------------------------------
    def log_decay(self, x: torch.Tensor) -> torch.Tensor:
        """x `[B, T, hidden]` -> g `[B, T, H]` fp32, g = -exp(A_log) * softplus(x W_dt + dt_bias) < 0."""
        dt = F.softplus(self.dt_proj(x).float() + self.dt_bias.float())
        return -self.A_log.float().exp() * dt

    def level_weights(self, x: torch.Tensor) -> torch.Tensor:
        """x `[B, T, hidden]` -> lambda `[B, T, H, L]` fp32 (> 0)."""
        c = self.config
        B, T, _ = x.shape
        d = self.lambda_proj(x).view(B, T, c.num_heads, c.num_levels)
        if c.lambda_mode == "baseline":
            return F.softplus(self.lambda_scale.float() * d.float())
        return F.softplus(self.lambda_mlp(d).float())

    def read_out(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o `[B, T, H, V]` -> norm, then output gate."""
        if hasattr(self, "o_norm"):
            o = self.o_norm(o)
        if hasattr(self, "g_proj"):
            B, T, _ = x.shape
            gate = self.g_proj(x).view(B, T, self.config.num_heads, self.config.head_dim)
            gate = F.silu(gate) if self.config.output_gate == "silu" else torch.sigmoid(gate)
            o = o * gate.to(o.dtype)
        return o

    # ---- forward ------------------------------------------------------------------------------
    def forward(self, x, state: LogLinearMixerState | None = None, attention_mask=None, cu_seqlens=None,
                position_embeddings=None, output_state: bool = False, mode: str | None = None) -> MixerOutput:
        """x `[B, T, hidden]` -> MixerOutput(hidden `[B, T, hidden]`, state if `output_state`)."""
        c = self.config
        B, T, _ = x.shape
        mode = self.pick_mode(mode, T, state)
        if attention_mask is not None and cu_seqlens is not None:
            raise ValueError("pass either attention_mask (padded batch) or cu_seqlens (packed documents), not both")
        initial = self._initial(state, B, cu_seqlens)
        q, k, v, conv = self.project_qkv(x, attention_mask, cu_seqlens, position_embeddings,
                                         state.conv if state is not None else None)
        q, k = apply_feature_map(c.q_map, q), apply_feature_map(c.k_map, k)
        k, v = repeat_kv(k, self.n_rep), repeat_kv(v, self.n_rep)
        g, lam = self.log_decay(x), self.level_weights(x)

        mask = None if attention_mask is None or bool(attention_mask.all()) else attention_mask.bool()
        if mask is not None:   # pack the real tokens: padding must not advance the Fenwick counter
            lengths = mask.sum(1)
            cu_seqlens = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
            q, k, v, g, lam = (t[mask].unsqueeze(0) for t in (q, k, v, g, lam))
        extra = {"chunk_size": c.chunk_size} if mode == "chunk" else {}
        o, fin = dispatch.run("log_linear", mode, q, k, v, g, lam, scale=c.read_scale, initial_state=initial,
                              output_final_state=output_state, cu_seqlens=cu_seqlens, **extra)
        if mask is not None:
            out = o.new_zeros(B, T, *o.shape[2:])
            out[mask] = o[0]
            o = out
        o = self.read_out(o, x)
        hidden = self.o_proj(o.reshape(B, T, -1).to(x.dtype))
        new_state = LogLinearMixerState(levels=fin.levels, t=fin.t, conv=conv) if output_state else None
        return MixerOutput(hidden=hidden, state=new_state)

    def _initial(self, state, B, cu_seqlens) -> LogLinearState | None:
        if state is None or state.levels is None:
            return None
        c = self.config
        n_seq = len(cu_seqlens) - 1 if cu_seqlens is not None else B
        want = (n_seq, c.num_heads, c.num_levels, c.head_dim, c.head_dim)
        if tuple(state.levels.shape) != want or state.t is None or state.t.shape != (n_seq,):
            raise ValueError(f"state levels {tuple(state.levels.shape)} do not fit {want} (sequences, heads, "
                             "levels, K, V); pass the state this mixer returned for the same batch")
        return LogLinearState(state.levels, state.t)
