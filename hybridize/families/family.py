"""`Family`: what one transformers `model_type` does in its attention, as data, and the few functions that read it.

An entry answers, for its family:
- where the attention sits: `<base model>.<layers>[i].<attention>` (every supported family: `layers`,
  `self_attn`), the module a converted layer's mixer replaces;
- how q/k/v/o map onto the mixer's `q_proj/k_proj/v_proj/o_proj`: separate projections copied by name,
  or one fused `qkv_proj` whose output rows are `[q (H*D) | k (Hkv*D) | v (Hkv*D)]`, split into three;
  which of them carry a bias;
- the q/k norm: none, per head (RMSNorm over head_dim, Qwen3 / Gemma 3) or full width (over H*D, OLMo 2),
  and its gain (`weight`, or Gemma's `1 + weight`);
- the attention math beyond `softmax(q k^T / sqrt(D)) v`: the query scale, logit soft-capping;
- what the family applies around the attention (embedding / residual multipliers in its decoder code,
  logit scaling or soft-capping in its LM head), sliding windows, and its RoPE variant;
- config settings no conversion can take (`refuse`), and the family names a user may pass as `--src`.

The functions here turn an entry and a teacher config into the mixers' teacher fields (`mixer_fields`),
the mixer-named tensors of one attention module (`mixer_state`), the LM head's logits transform
(`finish_logits`) and the one-line refusal (`check`). What the converted layers keep or drop is in
`hybridize.families.traits`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hybridize.errors import UserError

#: q/k/v layouts
SEPARATE, FUSED = "separate", "fused"
#: q/k norm kinds
NO_NORM, HEAD_NORM, FULL_NORM = "none", "head", "full"
#: where sliding windows apply
NO_WINDOW, ALL_LAYERS, LAYER_TYPES = "none", "all", "layer_types"
#: RoPE variants
ONE_ROPE, ROPE_PER_LAYER_TYPE = "single", "per_layer_type"


class UnsupportedFamily(UserError, ValueError):
    """A teacher the table has no entry for, or a setting its entry cannot convert (one line: what is missing)."""



def _flag(spec: str, config) -> bool:
    """A bias spec of the table: "never", "always", or the name of a config flag."""
    if spec in ("never", "always"):
        return spec == "always"
    return bool(getattr(config, spec, False))

@dataclass(frozen=True)
class Refusal:
    """A config flag the conversion cannot take: refused when `getattr(config, flag)` is truthy."""

    flag: str
    why: str


@dataclass(frozen=True)
class Family:
    """One row of the family table (see the module docstring for what each group of fields answers)."""

    model_type: str
    title: str
    # where the attention sits (attributes of the family's base model / decoder layer)
    layers: str = "layers"
    attention: str = "self_attn"
    # projections
    qkv: str = SEPARATE
    qkv_bias: str = "never"              # "never" | "always" | a config flag (Llama-style `attention_bias`)
    o_bias: str = "never"                # the same for o_proj (Llama-style `attention_bias` biases both)
    qk_norm: str = NO_NORM
    qk_norm_offset: float = 0.0          # Gemma: the norm's gain is 1 + weight
    # attention math (config attribute names)
    query_scale: tuple[str, float] | None = None   # (attr, power): scale = config.attr ** power; None: D**-0.5
    attn_softcap: str | None = None      # the attention soft-caps its logits: tanh(s / c) * c
    ignored: tuple[tuple[str, str], ...] = ()       # (attr, why): config values the teacher itself never applies
    # around the attention
    multipliers: tuple[str, ...] = ()    # applied by the family's decoder code (so kept by the hybrid)
    logits_divisor: str | None = None    # the LM head divides logits by this config value (Granite)
    logits_softcap: str | None = None    # the LM head soft-caps logits (Gemma)
    # positions and windows
    sliding: str = NO_WINDOW
    rope: str = ONE_ROPE
    partial_rotary: bool = False         # rope may cover only the first `partial_rotary_factor` of each head
    notes: tuple[str, ...] = ()
    refuse: tuple[Refusal, ...] = ()
    # `--src` names (lower case) and the checkpoint they resolve to
    names: tuple[str, ...] = ()
    default_checkpoint: str | None = None

    # ---- the teacher's shapes -------------------------------------------------------------------
    @staticmethod
    def shapes(config) -> tuple[int, int, int]:
        """(query heads H, key/value heads Hkv, head_dim D) of a teacher config."""
        heads = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return heads, kv, head_dim

    def has_qkv_bias(self, config) -> bool:
        return _flag(self.qkv_bias, config)

    def has_o_bias(self, config) -> bool:
        return _flag(self.o_bias, config)

    def attn_scale(self, config) -> float | None:
        """The teacher's attention logit scale when it is not head_dim**-0.5 by construction, else None."""
        if self.query_scale is None:
            return None
        attr, power = self.query_scale
        return float(getattr(config, attr)) ** power

    def check(self, config) -> None:
        """Raise `UnsupportedFamily` (one line) for a config setting this entry cannot convert."""
        for r in self.refuse:
            value = getattr(config, r.flag, None)
            if value:
                raise UnsupportedFamily(f"{self.model_type} with {r.flag}={value!r} is not supported: {r.why}")

    # ---- what the mixers take from the teacher --------------------------------------------------
    def mixer_fields(self, config) -> dict[str, Any]:
        """MixerConfig fields fixed by the teacher (`hybridize.modeling.TEACHER_FIELDS`)."""
        self.check(config)
        heads, kv, head_dim = self.shapes(config)
        return dict(
            hidden_size=config.hidden_size,
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=head_dim,
            qkv_bias=self.has_qkv_bias(config),
            o_bias=self.has_o_bias(config),
            qk_norm=self.qk_norm != NO_NORM,
            qk_norm_scope="full" if self.qk_norm == FULL_NORM else "head",
            qk_norm_offset=self.qk_norm_offset,
            attn_scale=self.attn_scale(config),
            rms_norm_eps=float(config.rms_norm_eps),
        )

    def mixer_state(self, attention: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
        """One teacher attention module's tensors (names relative to it) -> the same tensors under the
        mixer's names: a fused `qkv_proj.weight` `[(H + 2 Hkv) D, hidden]` (and bias) is split row-wise
        into q `[H D, hidden]`, k and v `[Hkv D, hidden]`; every other tensor keeps its name (one the mixer
        has no place for is reported by the converter, never dropped here)."""
        if self.qkv == SEPARATE:
            return dict(attention)
        heads, kv, head_dim = self.shapes(config)
        sizes = [heads * head_dim, kv * head_dim, kv * head_dim]
        out = {}
        for name, tensor in attention.items():
            module, _, param = name.partition(".")
            if module != "qkv_proj":
                out[name] = tensor
                continue
            if tensor.shape[0] != sum(sizes):
                raise UnsupportedFamily(f"{self.model_type}: qkv_proj.{param} has {tensor.shape[0]} rows, expected "
                                        f"{sum(sizes)} = (heads + 2 kv_heads) * head_dim")
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), torch.split(tensor, sizes, dim=0)):
                out[f"{part}.{param}"] = piece.clone()
        return out

    # ---- code that runs the decoder by hand -----------------------------------------------------
    def hand_loop_blocker(self, config) -> str | None:
        """Why `lm_head(norm(layers(embed_tokens(ids), rotary_emb(h, pos))))` - what the RL fast decode loop
        runs - would not be this family's forward, or None. The decoder layers themselves (residual
        multipliers, sandwich norms) are called as they are, so only the base model's and LM head's own
        steps count: a RoPE per layer type, an embedding multiplier, a logits transform."""
        if self.rope == ROPE_PER_LAYER_TYPE:
            return f"{self.model_type} computes a RoPE per layer type"
        for attr in self.multipliers:
            if attr.startswith("embedding") and getattr(config, attr, 1) not in (None, 1):
                return f"{self.model_type} scales embeddings by {attr}={getattr(config, attr)!r} in its forward"
        if self.has_logits_transform(config):
            return f"{self.model_type} transforms lm_head's logits ({self.logits_divisor or self.logits_softcap})"
        return None

    def has_logits_transform(self, config) -> bool:
        """Whether the family's CausalLM changes `lm_head(h)` for this config (`finish_logits` is not the identity)."""
        divisor = getattr(config, self.logits_divisor, None) if self.logits_divisor else None
        cap = getattr(config, self.logits_softcap, None) if self.logits_softcap else None
        return bool(cap) or divisor not in (None, 1)

    # ---- the LM head --------------------------------------------------------------------------
    def finish_logits(self, config, logits: torch.Tensor) -> torch.Tensor:
        """What the family's CausalLM does to `lm_head(h)` `[B, T, V]`: divide (Granite), soft-cap (Gemma)."""
        if self.logits_divisor and getattr(config, self.logits_divisor, None):
            logits = logits / getattr(config, self.logits_divisor)
        cap = getattr(config, self.logits_softcap, None) if self.logits_softcap else None
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
