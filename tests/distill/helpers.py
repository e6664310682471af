"""Tiny models and data for the distillation tests (fast on one CPU thread).

- `tiny_llama()`: a random LlamaForCausalLM (3 layers, hidden 32, GQA 4/2 heads, head_dim 8).
- `ToyMixer` / `ToyAdapter` / `toy_convert()`: a plain module swap standing in for the converter:
  layers' `self_attn` become an adapter with the attention's call signature holding a small decayed
  linear attention at `.mixer`, which splits packed rows where `position_ids` restart at 0.
- `ToyTokenizer`: byte-level ids, enough for `data.build_data`.
- `real_convert()`: the project's converter when it exists (tests fall back to `toy_convert`).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 96


def tiny_llama(seed: int = 0, layers: int = 3, attn: str = "sdpa", tie: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                      tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg._attn_implementation = attn
    return LlamaForCausalLM(cfg).eval()


class ToyMixer(nn.Module):
    """Causal linear attention with a learnable per-head decay, written as a masked quadratic form
    (exact and simple at test sizes). Documents are split where position_ids restart at 0."""

    def __init__(self, hidden: int, heads: int, head_dim: int):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.decay = nn.Parameter(torch.full((heads,), 2.0))  # the "new" parameter

    def new_parameter_names(self):
        return ["decay"]

    def forward(self, x, position_ids):
        B, T, _ = x.shape
        q = F.elu(self.q_proj(x).view(B, T, self.heads, -1)) + 1
        k = F.elu(self.k_proj(x).view(B, T, self.heads, -1)) + 1
        v = self.v_proj(x).view(B, T, self.heads, -1)
        doc = (position_ids.expand(B, T) == 0).cumsum(-1)
        t = torch.arange(T)
        allow = (t[:, None] >= t[None, :]) & (doc[:, :, None] == doc[:, None, :])  # [B, T, T]
        logd = F.logsigmoid(self.decay)  # [H]
        dist = (t[:, None] - t[None, :]).clamp(min=0).float()
        w = torch.einsum("bthd,bshd->bhts", q, k) * torch.exp(logd[None, :, None, None] * dist)
        w = w * allow[:, None]
        o = torch.einsum("bhts,bshd->bthd", w, v) / (w.sum(-1).transpose(1, 2)[..., None] + 1e-6)
        return self.o_proj(o.reshape(B, T, -1))


class ToyAdapter(nn.Module):
    """Has the HF attention call signature; holds the mixer at `.mixer`."""

    def __init__(self, mixer: ToyMixer):
        super().__init__()
        self.mixer = mixer

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, position_ids=None, **kw):
        B, T, _ = hidden_states.shape
        if position_ids is None:
            position_ids = torch.arange(T).unsqueeze(0)
        return self.mixer(hidden_states, position_ids), None


def toy_convert(teacher: LlamaForCausalLM, layers=(0, 1), copy_weights: bool = True) -> LlamaForCausalLM:
    """A deep copy of the teacher with `layers` swapped for ToyAdapters (q/k/v/o copied from the teacher
    unless `copy_weights=False`: then the mixers start random and far from the teacher)."""
    student = copy.deepcopy(teacher)
    c = teacher.config
    for i in layers:
        attn = student.model.layers[i].self_attn
        mixer = ToyMixer(c.hidden_size, c.num_attention_heads, c.head_dim)
        if not copy_weights:
            student.model.layers[i].self_attn = ToyAdapter(mixer)
            continue
        with torch.no_grad():
            mixer.q_proj.weight.copy_(attn.q_proj.weight)
            mixer.o_proj.weight.copy_(attn.o_proj.weight)
            rep = c.num_attention_heads // c.num_key_value_heads
            for name in ("k_proj", "v_proj"):
                w = getattr(attn, name).weight.view(c.num_key_value_heads, c.head_dim, -1)
                getattr(mixer, name).weight.copy_(w.repeat_interleave(rep, 0).reshape(-1, c.hidden_size))
        student.model.layers[i].self_attn = ToyAdapter(mixer)
    return student


class ToyTokenizer:
    """Byte-level tokenizer over a 96-token vocabulary (ids 3..95); eos 2, pad 0."""

    eos_token_id, pad_token_id, bos_token_id = 2, 0, 1
    eos_token, pad_token = "</s>", "<pad>"

    def __call__(self, texts, add_special_tokens=False, **kw):
        if isinstance(texts, str):
            return {"input_ids": self._enc(texts)}
        return {"input_ids": [self._enc(t) for t in texts]}

    @staticmethod
    def _enc(t: str) -> list[int]:
        return [3 + (b % (VOCAB - 3)) for b in t.encode()]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(32 + (i - 3) % 95) for i in ids if i >= 3)

    def save_pretrained(self, path):
        Path(path).mkdir(parents=True, exist_ok=True)


def write_rows(path: Path, rows: list[dict]) -> Path:
    """`rows` as a JSONL file at `path`."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_texts(path: Path, n: int = 24, seed: int = 0) -> Path:
    """A JSONL of n short documents of varied lengths."""
    g = torch.Generator().manual_seed(seed)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta", "iota", "kappa"]
    with open(path, "w") as f:
        for i in range(n):
            k = int(torch.randint(3, 12, (1,), generator=g))
            text = " ".join(words[int(j)] for j in torch.randint(0, len(words), (k,), generator=g))
            f.write(json.dumps({"text": text, "id": i}) + "\n")
    return path


def smol_tokenizer():
    """The embedded SmolLM2 tokenizer (ChatML template): from the converter's dense cache when there,
    else from the GGUF (slower)."""
    from transformers import AutoTokenizer
    from hybridize.convert.sources import cache_root, default_gguf_path

    gguf = default_gguf_path()
    for d in sorted(cache_root().glob(gguf.stem + "-*")) if cache_root().is_dir() else []:
        if (d / "tokenizer_config.json").is_file() and ".tmp" not in d.name:
            return AutoTokenizer.from_pretrained(d)
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def tiny_llama_vocab(vocab: int, seed: int = 0) -> LlamaForCausalLM:
    """tiny_llama with a real tokenizer's vocabulary size."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    return LlamaForCausalLM(cfg).eval()
