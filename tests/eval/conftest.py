"""Fixtures for the eval tests: a small BPE tokenizer trained on the haystack essays (so tokens span
several characters, as with real tokenizers) with a ChatML template, and a tiny random Llama.

No hub, no network. Everything is built once per test session."""
from __future__ import annotations

import pytest
import torch

from hybridize.eval.common import data_file

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _corpus() -> list[str]:
    p = data_file("haystack/paul_graham_essays.txt")
    text = p.read_text(encoding="utf-8")[:150_000] if p else ("the quick brown fox jumps over the lazy dog. " * 500)
    extra = ["The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.",
             "One of the special magic numbers for calm-rabbit is: 1234567. 0123456789 boxed answer"]
    return text.splitlines() + extra * 50


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(unk_token=None))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(_corpus(), trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  bos_token="<|endoftext|>")
    tok.chat_template = CHATML
    return tok


def make_tiny_llama(vocab_size: int, seed: int = 0, layers: int = 2, hidden: int = 32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=8192, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="session")
def tiny_model(tiny_tokenizer):
    return make_tiny_llama(len(tiny_tokenizer))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_model, tiny_tokenizer):
    d = tmp_path_factory.mktemp("tiny_llama")
    tiny_model.save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return d
