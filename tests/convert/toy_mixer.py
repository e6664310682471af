"""A deliberately simple mixer for the integration tests: the hybrid machinery is tested with it
independently of the real mixers (which are tested here too, parametrized over `mixer_names()`).

Per head: S_t = a_t S_{t-1} + phi(k_t) v_t^T, o_t = phi(q_t)^T S_t, phi = elu + 1, a_t = sigmoid(x_t w + b)
(one scalar per head), one plain Python loop over time in every mode; aux loss = mean(a_t) so the
aux-loss plumbing has something to sum.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from hybridize.ops.common.varlen import pack_to_padded, padded_to_pack
from hybridize.mixers.base import ConvState, Mixer, MixerConfig, MixerOutput, MixerState, mask_tokens, repeat_kv


@dataclass
class ToyConfig(MixerConfig):
    decay_bias: float = field(default=4.0, metadata={"help": "initial gate bias (sigmoid(4) ~ 0.98)"})
    with_aux: bool = field(default=True, metadata={"help": "return an aux loss"})


@dataclass
class ToyState(MixerState):
    S: torch.Tensor | None = None
    conv: ConvState | None = None


class ToyMixer(Mixer):
    name = "toy"
    config_class = ToyConfig

    def __init__(self, config: ToyConfig):
        super().__init__(config)
        self.gate = nn.Linear(config.hidden_size, config.num_heads)

    def reset_new_parameters(self) -> None:
        super().reset_new_parameters()
        nn.init.zeros_(self.gate.weight)
        nn.init.constant_(self.gate.bias, self.config.decay_bias)

    def forward(self, x, state=None, attention_mask=None, cu_seqlens=None, position_embeddings=None,
                output_state=False, mode=None):
        c = self.config
        q, k, v, conv = self.project_qkv(x, attention_mask, cu_seqlens, position_embeddings,
                                         state.conv if state is not None else None)
        k, v = repeat_kv(k, self.n_rep), repeat_kv(v, self.n_rep)
        q, k = F.elu(q) + 1, F.elu(k) + 1
        a = torch.sigmoid(self.gate(x).float())  # [B, T, H]
        k, v = mask_tokens(k, attention_mask), mask_tokens(v, attention_mask)
        if attention_mask is not None:
            a = torch.where(attention_mask[..., None], a, torch.ones_like(a))
        if cu_seqlens is not None:
            q, k, v = (pack_to_padded(t, cu_seqlens) for t in (q, k, v))
            a = pack_to_padded(a, cu_seqlens, 1.0)
        B, T, H, D = q.shape
        S = state.S if (state is not None and state.S is not None) else q.new_zeros(B, H, D, D, dtype=torch.float32)
        outs = []
        for t in range(T):
            S = a[:, t, :, None, None] * S + k[:, t, :, :, None].float() * v[:, t, :, None, :].float()
            outs.append(torch.einsum("bhd,bhde->bhe", q[:, t].float(), S))
        o = torch.stack(outs, 1).to(x.dtype) if outs else q.new_zeros(B, 0, H, D)
        if cu_seqlens is not None:
            o = padded_to_pack(o, cu_seqlens)
        o = self.o_proj(o.reshape(*o.shape[:2], H * D))
        aux = a.mean() if c.with_aux else None
        return MixerOutput(o, ToyState(S=S, conv=conv) if output_state else None, aux)
