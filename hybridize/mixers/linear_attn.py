"""Vanilla linear attention ("Transformers are RNNs", Katharopoulos et al. 2020):
S_t = S_{t-1} + phi(k_t) v_t^T,  o_t = scale * S_t^T phi(q_t).

Per head, q/k `[B, T, H, K]` come from the teacher's projections (GQA: keys/values at KV-head width,
repeated to the H query heads before the op, so the state `[N, H, K, V]` is per query head).
Both forms run through the GLA op with no gate (`dispatch.run("gla", mode, ...)`).

Feature map (`feature_map`, per-tensor overrides `q_feature_map` / `k_feature_map`):
"identity", "elu1" (elu + 1, Katharopoulos et al.), "relu", "softmax" (over the head dim), "silu".
Default "softmax": it keeps every similarity phi(q).phi(k) in [0, 1] whatever the scale of the
teacher's q/k (which can reach tens per channel), so an unnormalised read stays bounded per token,
and, like the teacher's softmax weights, it is non-negative and dominated by the largest channels;
identity gives signed weights that cancel, elu1/relu give similarities growing with |q||k|.
`scale` defaults to the teacher's logit scale for "identity" (`attn_scale`, else head_dim ** -0.5) and 1 otherwise.

Row-sparse update (`row_topk`, "Scaling Linear Attention with Sparse State Expansion" sec. 3.2,
eq. 7-8): the key becomes
k_t = softmax(top-k(x_t W_k)) - softmax over the k largest entries of the raw key, every other entry 0 -
so only k state rows are written. On a gated backbone (GLA) only those rows also decay (the other
rows get log-decay 0 and stay bit-identical); vanilla linear attention has no decay to mask. "Raw
key" here is the key after the shared front end (bias, q/k norm, short conv, RoPE when enabled),
which is x W_k in the paper's plain setting. The paper's row-balance auxiliary loss is not added.

Optional per-head RMSNorm on the output (`output_norm`, off by default; weight 1 at init).
Padding (`attention_mask` False) gets zero key, value and log-decay, so the state is untouched.

Subclass hooks: `log_decay` / `read_out` (GLA's gates) and `transform_query` (between the front end
and the op: swaps the read query and adds fields to the returned state; used by CCQ).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from hybridize.ops.common import dispatch

from .base import ConvState, Mixer, MixerConfig, MixerOutput, MixerState, RMSNorm, mask_tokens, repeat_kv

FEATURE_MAPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "identity": lambda x: x,
    "elu1": lambda x: F.elu(x) + 1.0,
    "relu": F.relu,
    "softmax": lambda x: x.float().softmax(-1).to(x.dtype),
    "silu": F.silu,
}


def apply_feature_map(name: str, x: torch.Tensor) -> torch.Tensor:
    """Apply a named feature map over the last (head) dim of `[B, T, H, D]`."""
    return FEATURE_MAPS[name](x)


def topk_softmax(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """"Scaling Linear Attention with Sparse State Expansion", eq. 7: softmax over the `k` largest entries of the last dim, 0 elsewhere.

    x `[..., D]` -> (key `[..., D]`, selected `[..., D]` bool)."""
    vals, idx = x.topk(k, dim=-1)
    probs = vals.float().softmax(-1).to(x.dtype)
    key = torch.zeros_like(x).scatter(-1, idx, probs)
    selected = torch.zeros(x.shape, dtype=torch.bool, device=x.device).scatter(-1, idx, True)
    return key, selected


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(map(repr, choices))}")


class FeatureMapChoice:
    """Resolved feature maps and read scale of a config with `feature_map`, `q_feature_map`,
    `k_feature_map` and `scale` fields (linear attention and its relatives)."""

    @property
    def q_map(self) -> str:
        return self.q_feature_map or self.feature_map

    @property
    def k_map(self) -> str:
        return self.k_feature_map or self.feature_map

    @property
    def read_scale(self) -> float:
        if self.scale is not None:
            return self.scale
        if self.q_map != "identity":
            return 1.0
        return self.teacher_scale


@dataclass
class LinearAttentionConfig(FeatureMapChoice, MixerConfig):
    feature_map: str = field(default="softmax", metadata={
        "help": "feature map of q and k: identity, elu1 (elu+1), relu, softmax (over head dim), silu"})
    q_feature_map: str | None = field(default=None, metadata={"help": "override feature_map for q"})
    k_feature_map: str | None = field(default=None, metadata={"help": "override feature_map for k"})
    v_feature_map: str = field(default="identity", metadata={"help": "map on v: identity or silu"})
    scale: float | None = field(default=None, metadata={
        "help": "read scale; default head_dim**-0.5 when the q map is identity, else 1"})
    output_norm: bool = field(default=False, metadata={"help": "per-head RMSNorm on the read (weight 1 at init)"})
    row_topk: int | None = field(default=None, metadata={
        "help": "row-sparse update (SSE paper eq. 7): key = softmax over its top-k entries; None = off"})

    def __post_init__(self):
        for name in ("feature_map", "q_feature_map", "k_feature_map", "v_feature_map"):
            value = getattr(self, name)
            if value is not None:
                _check_choice(name, value, tuple(FEATURE_MAPS))
        if self.row_topk is not None and not 1 <= self.row_topk <= self.head_dim:
            raise ValueError(f"row_topk={self.row_topk} must be between 1 and head_dim={self.head_dim} (or None)")



@dataclass
class LinearAttentionState(MixerState):
    recurrent: torch.Tensor | None = None   # [N, H, K, V], fp32
    conv: ConvState | None = None           # short-conv windows, when short_conv is on


class LinearAttention(Mixer):
    """Ungated linear attention; the base of the GLA mixer (which adds gates through the hooks
    `log_decay` and `read_out`) and of CCQGLA (which swaps the read query through `transform_query`)."""

    name = "linear_attn"
    config_class = LinearAttentionConfig
    state_class = LinearAttentionState

    def __init__(self, config: LinearAttentionConfig):
        super().__init__(config)
        if config.output_norm:
            self.o_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def reset_new_parameters(self) -> None:
        """Conv taps to identity (base rule) and output-norm weight to 1."""
        super().reset_new_parameters()
        if hasattr(self, "o_norm"):
            with torch.no_grad():
                self.o_norm.weight.fill_(1.0)

    # ---- hooks for gated subclasses ----------------------------------------------------------
    def log_decay(self, x: torch.Tensor) -> torch.Tensor | None:
        """x `[B, T, hidden]` -> log-decay g `[B, T, H, K]` (fp32, <= 0), or None for no decay."""
        return None

    def read_out(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o `[B, T, H, V]` -> o after the output norm (and, in subclasses, the output gate)."""
        return self.o_norm(o) if hasattr(self, "o_norm") else o

    # ---- forward ----------------------------------------------------------------------------
    def features(self, x, attention_mask=None, cu_seqlens=None, position_embeddings=None, conv_state=None):
        """Shared front end + feature maps + row top-k + GQA repeat + padding mask.

        Returns q, k `[B, T, H, K]`, v `[B, T, H, V]`, g `[B, T, H, K]` or None, new ConvState or None."""
        c = self.config
        q, k, v, conv = self.project_qkv(x, attention_mask, cu_seqlens, position_embeddings, conv_state)
        q = apply_feature_map(c.q_map, q)
        v = apply_feature_map(c.v_feature_map, v)
        if c.row_topk is not None:
            k, selected = topk_softmax(k, c.row_topk)
        else:
            k, selected = apply_feature_map(c.k_map, k), None
        k, v = repeat_kv(k, self.n_rep), repeat_kv(v, self.n_rep)
        g = self.log_decay(x)
        if g is not None and selected is not None:
            # eq. 8 with row sparsity: unselected rows neither written nor decayed
            g = g * repeat_kv(selected, self.n_rep).to(g.dtype)
        k, v, g = (mask_tokens(t, attention_mask) for t in (k, v, g))
        return q, k, v, g, conv

    def transform_query(self, q, k, state, attention_mask, cu_seqlens, mode, output_state):
        """Hook for read-side wrappers (CCQ): q, k `[B, T, H, K]` as the op gets them -> (query the op
        reads with, extra fields merged into the returned state). Default: unchanged q, no fields."""
        return q, {}

    def forward(self, x, state: LinearAttentionState | None = None, attention_mask=None, cu_seqlens=None,
                position_embeddings=None, output_state: bool = False, mode: str | None = None) -> MixerOutput:
        """x `[B, T, hidden]` -> MixerOutput(hidden `[B, T, hidden]`, state if `output_state`)."""
        c = self.config
        B, T, _ = x.shape
        mode = self.pick_mode(mode, T, state)
        initial = state.recurrent if state is not None else None
        if initial is not None:
            n_seq = len(cu_seqlens) - 1 if cu_seqlens is not None else B
            if initial.shape[0] != n_seq or initial.shape[1] != c.num_heads:
                raise ValueError(f"state of shape {tuple(initial.shape)} does not fit {n_seq} sequences x "
                                 f"{c.num_heads} heads; pass the state this mixer returned for the same batch")
        q, k, v, g, conv = self.features(x, attention_mask, cu_seqlens, position_embeddings,
                                         state.conv if state is not None else None)
        q, extra_state = self.transform_query(q, k, state, attention_mask, cu_seqlens, mode, output_state)
        extra = {"chunk_size": c.chunk_size} if mode == "chunk" else {}
        o, S = dispatch.run("gla", mode, q, k, v, g, scale=c.read_scale, initial_state=initial,
                            output_final_state=output_state, cu_seqlens=cu_seqlens, **extra)
        o = self.read_out(o, x)
        hidden = self.o_proj(o.reshape(B, T, -1).to(x.dtype))
        new_state = self.state_class(recurrent=S, conv=conv, **extra_state) if output_state else None
        return MixerOutput(hidden=hidden, state=new_state)
