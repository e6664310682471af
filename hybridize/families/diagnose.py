"""One line for a teacher the family table has no entry for: what in its layout or attention is missing.

The family name alone does not help a user ("unsupported model family 'gpt2'"). Here the model is built
on the meta device (no memory, no weights) from its config, and the line names what the converter would
need and does not find: decoder layers at `<base>.layers`, an attention module `self_attn` with
q/k/v (or fused qkv) and o projections; which extra modules that attention has; and which attention
features its config sets that no entry describes (soft-capping, partial rotary, q/k norms, ALiBi, MLA ...).
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from hybridize.errors import first_line

KNOWN_PARTS = {"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "q_norm", "k_norm", "rotary_emb"}

#: config attributes that change what attention computes: (attribute, is it set?, what it means)
CONFIG_FEATURES = (
    ("attn_logit_softcapping", bool, "attention logit soft-capping"),
    ("partial_rotary_factor", lambda v: v is not None and v < 1, "partial rotary"),
    ("qk_layernorm", bool, "q/k layer norms"),
    ("use_qk_norm", bool, "q/k norms"),
    ("clip_qkv", bool, "q/k/v clipping"),
    ("query_pre_attn_scalar", bool, "a query pre-scale"),
    ("attention_multiplier", lambda v: v not in (None, 1), "an attention multiplier"),
    ("alibi", bool, "ALiBi position biases"),
    ("kv_lora_rank", bool, "low-rank (MLA) key/value compression"),
    ("use_bidirectional_attention", bool, "bidirectional attention"),
    ("position_embedding_type", lambda v: v not in (None, "rope", "rotary"), "non-rotary position embeddings"),
)


def _meta_model(config) -> nn.Module:
    """The model of `config` on the meta device, built with at most two layers when the config allows."""
    from transformers import AutoModelForCausalLM

    small = copy.deepcopy(config)
    try:
        if getattr(small, "num_hidden_layers", 0) > 2 and getattr(small, "layer_types", None) is None:
            small.num_hidden_layers = 2
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(small)
    except Exception:  # noqa: BLE001 - a config that needs all its layers: build it whole
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)


def _layer_lists(model: nn.Module) -> list[str]:
    """Names of the ModuleLists that look like the decoder's layers (the longest first)."""
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    return [n for n, _ in sorted(lists, key=lambda nm: -len(nm[1]))]


def _attention_findings(attn: nn.Module, where: str) -> list[str]:
    parts = {n for n, _ in attn.named_children()} | {n for n, _ in attn.named_parameters(recurse=False)}
    missing = [] if {"q_proj", "k_proj", "v_proj"} <= parts or "qkv_proj" in parts else ["q_proj/k_proj/v_proj "
                                                                                      "(or a fused qkv_proj)"]
    missing += [] if "o_proj" in parts else ["o_proj"]
    if missing:
        return [f"attention {where} has no {' and no '.join(missing)} (its parts: "
                f"{', '.join(sorted(parts)) or 'none'})"]
    extra = sorted(parts - KNOWN_PARTS)
    return [f"attention {where} also has {', '.join(extra)}"] if extra else []


def _layout_findings(model: nn.Module) -> list[str]:
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None) or getattr(model, "model", None)
    layers = getattr(base, "layers", None) if base is not None else None
    if not isinstance(layers, nn.ModuleList):
        found = _layer_lists(model)
        return [f"decoder layers at {found[0]}, not model.layers" if found else "no list of decoder layers"]
    layer = layers[0]
    attn = getattr(layer, "self_attn", None)
    if attn is None:
        names = [n for n, _ in layer.named_children() if "att" in n.lower()]
        return [f"decoder layers have {', '.join(names) or 'no attention module'}, not self_attn"]
    return _attention_findings(attn, "model.layers.N.self_attn")


def _config_findings(config) -> list[str]:
    out = []
    for attr, is_set, what in CONFIG_FEATURES:
        value = getattr(config, attr, None)
        if value is None and isinstance(getattr(config, "rope_parameters", None), dict):
            value = config.rope_parameters.get(attr)
        if value is not None and is_set(value):
            out.append(f"{what} ({attr}={value!r})")
    return out


def unsupported_line(config, supported: list[str]) -> str:
    """`"<type> is not in the family table (...): <what is missing>; ..."` - one line."""
    mt = getattr(config, "model_type", None)
    head = f"model family {mt!r} is not in hybridize's family table (supported: {', '.join(supported)})"
    try:
        findings = _layout_findings(_meta_model(config))
    except Exception as e:  # noqa: BLE001 - not a causal LM transformers can build
        findings = [f"transformers cannot build it as a causal LM ({first_line(e, 120)})"]
    features = _config_findings(config)
    if features:
        findings.append("its attention uses " + ", ".join(features))
    if not findings:
        findings = ["its layout matches (model.layers.N.self_attn with q/k/v/o projections) but no entry records "
                    "what its attention computes; add one to hybridize/families/table.py after reading its "
                    "modeling code"]
    return f"{head}: {'; '.join(findings)}"
