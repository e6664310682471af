"""Tiny models, tokenizer and data for the GRPO tests (fast on one CPU thread).

- `byte_tokenizer()`: a byte-level BPE tokenizer with no merges (256 byte tokens + ChatML specials),
  a real `PreTrainedTokenizerFast` with a ChatML chat template, so TRL's prompt path runs unchanged.
- `tiny_teacher()`: a random LlamaForCausalLM (hidden 32, 3 layers, GQA 4/2 heads, head_dim 8).
- `tiny_hybrid(tmp)`: the project's converter on that teacher (layers 0, 1 -> mixer, 2 kept softmax),
  saved with the tokenizer so it can be reloaded by name (TRL's reference model needs that).
- `write_problems(path)`: a JSONL of short arithmetic problems with `problem` / `answer` fields.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|im_start|>", "<|im_end|>", "<pad>"]


def byte_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<pad>",
                                   bos_token="<|im_start|>")
    fast.chat_template = CHATML
    return fast


VOCAB = 256 + len(SPECIALS)


def tiny_teacher(seed: int = 0, layers: int = 3) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    tok = byte_tokenizer()
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).eval()


def tiny_hybrid(out_dir: str | Path | None = None, mixer: str = "gla", seed: int = 0, layers: int = 3,
                mixer_settings: dict | None = None):
    """(hybrid model, tokenizer); saved to `out_dir` (with the tokenizer) when given."""
    from hybridize.convert.convert import convert_model

    teacher = tiny_teacher(seed, layers)
    plan = [mixer] * (layers - 1) + ["attn"]
    model = convert_model(teacher, plan, mixer=mixer, mixer_settings=mixer_settings).eval()
    tok = byte_tokenizer()
    if out_dir is not None:
        model.save_pretrained(out_dir)
        tok.save_pretrained(out_dir)
    return model, tok


PROBLEMS = [("What is 2+3?", "5"), ("What is 4*2?", "8"), ("What is 9-7?", "2"), ("What is 6/3?", "2"),
            ("What is 1+1?", "2"), ("What is 3*3?", "9"), ("What is 10-4?", "6"), ("What is 8/2?", "4")]


def write_problems(path: str | Path, n: int = 8) -> Path:
    path = Path(path)
    with path.open("w") as f:
        for i in range(n):
            p, a = PROBLEMS[i % len(PROBLEMS)]
            f.write(json.dumps({"problem": p, "answer": a, "id": i}) + "\n")
    return path


def left_padded_batch(B: int = 3, T: int = 9, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random byte ids `[B, T]` and their mask, rows 0 and 1 left-padded (3 and 1 pad tokens)."""
    pad = byte_tokenizer().pad_token_id
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (B, T), generator=g)
    am = torch.ones_like(ids)
    am[0, :3] = 0
    am[1, :1] = 0
    ids[am == 0] = pad
    return ids, am
