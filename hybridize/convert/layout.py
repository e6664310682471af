"""Where a converted layer's tensors live in a hybrid: the attention prefix of each layer and the full names
of the parameters the teacher does not have (the mixers' new parameters). Used by the conversion, its
calibration and its report."""
from __future__ import annotations

from hybridize.modeling import AttentionSlot, HybridForCausalLM


def attention_prefix(hybrid: HybridForCausalLM, layer: int) -> str:
    """`"model.layers.3.self_attn."`: where layer `layer`'s attention (or mixer) tensors live, per the family."""
    f = hybrid.family
    return f"{hybrid.base_model_prefix}.{f.layers}.{layer}.{f.attention}."


def new_parameter_names(hybrid: HybridForCausalLM) -> list[str]:
    """Full names of every parameter the teacher does not have (mixers' new parameters)."""
    names = []
    for i, layer in enumerate(getattr(hybrid.model, hybrid.family.layers)):
        slot = getattr(layer, hybrid.family.attention)
        if isinstance(slot, AttentionSlot):
            names += [attention_prefix(hybrid, i) + n for n in slot.new_parameter_names()]
    return names
