"""The family table: one `Family` entry per supported transformers `model_type` (adding a family = adding an
entry here, after reading its `modeling_<family>.py` attention and decoder code).

Checked against transformers 5.23. What each entry records is what that code does; what the converted
mixer layers keep or drop of it is derived in `hybridize.families.traits` and stated in the report.
"""
from __future__ import annotations

from .family import (
    ALL_LAYERS,
    FULL_NORM,
    FUSED,
    HEAD_NORM,
    LAYER_TYPES,
    ROPE_PER_LAYER_TYPE,
    Family,
    Refusal,
)

#: Llama-style `attention_bias`: one flag biases q/k/v and o_proj alike (transformers 5.23's attention code)
BIAS = dict(qkv_bias="attention_bias", o_bias="attention_bias")

_ENTRIES = (
    Family("llama", "Llama (incl. SmolLM2)", **BIAS,
           names=("llama",), default_checkpoint="meta-llama/Llama-3.2-1B-Instruct"),
    Family("qwen2", "Qwen2 / Qwen2.5 (incl. R1-distill-Qwen)", qkv_bias="always", sliding=LAYER_TYPES,
           names=("qwen2", "qwen2.5"), default_checkpoint="Qwen/Qwen2.5-1.5B-Instruct"),
    Family("qwen3", "Qwen3", **BIAS, qk_norm=HEAD_NORM, sliding=LAYER_TYPES,
           names=("qwen", "qwen3"), default_checkpoint="Qwen/Qwen3-1.7B"),
    Family("mistral", "Mistral", sliding=ALL_LAYERS,
           names=("mistral",), default_checkpoint="mistralai/Mistral-7B-Instruct-v0.3"),
    Family("gemma3_text", "Gemma 3 (text)", **BIAS, qk_norm=HEAD_NORM, qk_norm_offset=1.0,
           query_scale=("query_pre_attn_scalar", -0.5),
           ignored=(("attn_logit_softcapping", "transformers' Gemma3Attention never passes it to the attention "
                                               "function, so the teacher does not cap"),),
           logits_softcap="final_logit_softcapping", sliding=LAYER_TYPES, rope=ROPE_PER_LAYER_TYPE,
           notes=("embeddings scaled by sqrt(hidden_size) and norms before and after attention and MLP "
                  "(decoder code around the attention)",),
           refuse=(Refusal("use_bidirectional_attention", "bidirectional attention is not a causal "
                                        "decoder's, and the mixers are causal"),),
           names=("gemma", "gemma3"), default_checkpoint="google/gemma-3-270m-it"),
    Family("gemma2", "Gemma 2", **BIAS, query_scale=("query_pre_attn_scalar", -0.5),
           attn_softcap="attn_logit_softcapping", logits_softcap="final_logit_softcapping", sliding=LAYER_TYPES,
           notes=("embeddings scaled by sqrt(hidden_size) and norms before and after attention and MLP "
                  "(decoder code around the attention)",),
           names=("gemma2",), default_checkpoint="google/gemma-2-2b-it"),
    Family("phi3", "Phi-3", qkv=FUSED, sliding=ALL_LAYERS, partial_rotary=True,
           names=("phi", "phi3"), default_checkpoint="microsoft/Phi-3-mini-4k-instruct"),
    Family("olmo2", "OLMo 2", **BIAS, qk_norm=FULL_NORM,
           notes=("norms after attention and MLP, none before (decoder code around the attention)",),
           names=("olmo", "olmo2"), default_checkpoint="allenai/OLMo-2-0425-1B-Instruct"),
    Family("granite", "Granite", **BIAS, query_scale=("attention_multiplier", 1.0),
           multipliers=("embedding_multiplier", "residual_multiplier"), logits_divisor="logits_scaling",
           names=("granite",), default_checkpoint="ibm-granite/granite-3.3-2b-instruct"),
    Family("qwen3_moe", "Qwen3-MoE", **BIAS, qk_norm=HEAD_NORM, sliding=ALL_LAYERS,
           notes=("mixture-of-experts MLPs (router and experts) are copied untouched: only attention converts",),
           names=("qwen3-moe", "qwen3_moe"),
           default_checkpoint="Qwen/Qwen3-30B-A3B-Instruct-2507"),
)

#: model_type -> entry
FAMILIES: dict[str, Family] = {f.model_type: f for f in _ENTRIES}
#: `--src` family name (lower case) -> entry
FAMILY_NAMES: dict[str, Family] = {name: f for f in _ENTRIES for name in f.names}
