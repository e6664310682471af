"""Shared pieces of the converter / hybrid-model tests: tiny teachers of every family, a toy mixer
registered for the duration of a test, perturbation of new parameters, and the decode drivers.

Tiny teachers: 3 layers, hidden 64, 4 query heads, 2 KV heads (GQA), head_dim 16, vocab 97, random
weights; Qwen2 has q/k/v biases, Qwen3 q/k norms, Mistral a sliding window of 8 (so the hybrid cache
holds a sliding KV layer too). The newer families turn on what sets them apart, each at a value that
changes the output: Gemma 2 soft-capped attention logits (cap 2, q/k weights x10 so logits reach it),
query_pre_attn_scalar 24, final soft-cap 3; Gemma 3 per-head q/k norms with the 1 + weight gain, query_pre_attn_scalar 24 (not
head_dim 16), sliding layers 1 and 2 (window 8) with their own RoPE base, final logit soft-capping 3;
Phi-3 a fused qkv_proj, partial rotary 0.5 and a window of 8; OLMo 2 q/k norms over the whole
projection; Granite attention / embedding / residual multipliers and logits_scaling; Qwen3-MoE 4 experts
(2 per token) on layers 0 and 2, a dense MLP on layer 1.
"""
from __future__ import annotations

import contextlib

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

import hybridize.mixers as mixers_pkg

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text", "gemma2", "phi3", "olmo2", "granite", "qwen3_moe")
#: the families plus variants of one: "llama_bias" is Llama with attention_bias=True (biases on q/k/v and o_proj)
CASES = FAMILIES + ("llama_bias",)
VOCAB = 97
FP32_TOL = 1e-5


def tiny_teacher_config(family: str, layers: int = 3, **kw):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    common.update(kw)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "llama_bias":
        return LlamaConfig(attention_bias=True, **common)
    if family == "qwen2":
        return Qwen2Config(**common)
    if family == "qwen3":
        return Qwen3Config(**common)
    if family == "mistral":
        return MistralConfig(sliding_window=8, **common)
    if family == "gemma3_text":
        types = (["full_attention", "sliding_attention", "sliding_attention"] * layers)[:layers]
        return Gemma3TextConfig(**{"query_pre_attn_scalar": 24, "sliding_window": 8, "layer_types": types,
                                   "final_logit_softcapping": 3.0, "rope_parameters": {
                                       "full_attention": {"rope_type": "default", "rope_theta": 100000.0},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}},
                                   **common})
    if family == "gemma2":
        types = (["full_attention", "sliding_attention", "sliding_attention"] * layers)[:layers]
        return Gemma2Config(query_pre_attn_scalar=24, sliding_window=8, layer_types=types,
                            attn_logit_softcapping=2.0, final_logit_softcapping=3.0, **common)
    if family == "phi3":
        return Phi3Config(partial_rotary_factor=0.5, sliding_window=8, **common)
    if family == "olmo2":
        return Olmo2Config(**common)
    if family == "granite":
        return GraniteConfig(attention_multiplier=0.09, embedding_multiplier=3.0, residual_multiplier=0.5,
                             logits_scaling=2.0, **common)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                              mlp_only_layers=[1], **common)
    raise ValueError(family)


def tiny_teacher(family: str = "llama", seed: int = 0, **kw):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_teacher_config(family, **kw)).eval()
    # random biases / norm weights: the default zero/one init would hide a bias or norm not copied
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if getattr(model.config, "attn_logit_softcapping", None) and name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(10.0)  # q.k logits of a few units, so the soft-cap (Gemma 2) changes the attention
    return model


@contextlib.contextmanager
def toy_registered():
    """Make mixer name "toy" resolve to tests/convert/toy_mixer.ToyMixer (plans, build, load)."""
    from tests.convert.toy_mixer import ToyMixer

    orig_class, orig_names = mixers_pkg.mixer_class, mixers_pkg.mixer_names
    mixers_pkg.mixer_class = lambda name: ToyMixer if name == "toy" else orig_class(name)
    mixers_pkg.mixer_names = lambda: [*orig_names(), "toy"]
    try:
        yield
    finally:
        mixers_pkg.mixer_class, mixers_pkg.mixer_names = orig_class, orig_names


def perturb_new_parameters(model, scale: float = 0.05, seed: int = 1) -> None:
    """Add noise to every mixer parameter so identity-like inits (conv taps, zero LoRA) hide nothing."""
    from hybridize.convert.convert import new_parameter_names

    g = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in new_parameter_names(model):
            p = params[name]
            p.add_((torch.randn(p.shape, generator=g) * scale).to(p.dtype))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max|b| in fp64."""
    a, b = a.detach().double(), b.detach().double()
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)


def left_padded(rows: list[torch.Tensor], pad_id: int = 0):
    """Left-pad 1-D id tensors -> ids `[B, T]`, attention_mask `[B, T]`, position_ids `[B, T]` (as generate)."""
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, T - len(r):] = r
        mask[i, T - len(r):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, pos


@torch.no_grad()
def prefill_then_decode(model, ids, n_prefill: int, attention_mask=None, position_ids=None, **kw):
    """Logits `[B, T, V]`: a cached prefill of the first `n_prefill` tokens, then one token per call."""
    sl = lambda t, a, b: None if t is None else t[:, a:b]  # noqa: E731
    out = model(ids[:, :n_prefill], attention_mask=sl(attention_mask, 0, n_prefill),
                position_ids=sl(position_ids, 0, n_prefill), use_cache=True, **kw)
    cache, logits = out.past_key_values, [out.logits]
    for t in range(n_prefill, ids.shape[1]):
        out = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True,
                    attention_mask=sl(attention_mask, 0, t + 1), position_ids=sl(position_ids, t, t + 1), **kw)
        logits.append(out.logits)
    return torch.cat(logits, dim=1), cache


def tiny_tokenizer():
    """A character-level fast tokenizer with VOCAB entries (ids 0-3 special), no files needed."""
    import string

    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    chars = list(" \n" + string.ascii_letters + string.digits + string.punctuation)[: VOCAB - 4]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{c: i + 4 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
