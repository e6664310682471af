"""Perplexity: chunked per-token NLL equals plain cross-entropy on full logits; the length sweep runs."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hybridize.eval.perplexity import PplConfig, evaluate_ppl, position_curve, token_nll, tokenize_budget


def test_token_nll_matches_full_logits(tiny_model):
    ids = torch.randint(0, tiny_model.config.vocab_size, (70,))
    got = token_nll(tiny_model, ids, chunk=16)
    with torch.no_grad():
        logits = tiny_model(input_ids=ids[None]).logits[0, :-1].double()
    want = F.cross_entropy(logits, ids[1:], reduction="none")
    assert got.shape == (69,)
    assert (got.double() - want).abs().max() / want.abs().max() < 1e-5


def test_position_curve():
    c = position_curve(torch.arange(10.0), 3)
    assert [x["position"] for x in c] == [3, 7, 10]
    assert abs(c[0]["nll"] - 1.0) < 1e-6


def test_evaluate_ppl_smoke(tmp_path, tiny_model, tiny_tokenizer):
    text = tmp_path / "t.txt"
    text.write_text("The sky is blue and the grass is green. " * 200)
    cfg = PplConfig(text=str(text), lengths=(32, 64), tokens=128, buckets=4)
    s = evaluate_ppl(tiny_model, tiny_tokenizer, cfg, tmp_path / "out", progress=False)
    assert [r["length"] for r in s["rows"]] == [32, 64] and [r["windows"] for r in s["rows"]] == [4, 2]
    # ppl is exp(mean NLL) of the very windows: recompute the 64-token one directly
    ids = tokenize_budget(tiny_tokenizer, text.read_text(), 128)
    nll = torch.cat([token_nll(tiny_model, ids[i * 64:(i + 1) * 64]) for i in range(2)]).mean().item()
    assert abs(s["rows"][1]["ppl"] - math.exp(nll)) < 1e-4 * math.exp(nll)
    assert len(s["loss_by_position"]) == 4
    for f in ("ppl.csv", "summary.json", "ppl_vs_length.png", "loss_vs_position.png"):
        assert (tmp_path / "out" / f).exists()


class _BosTokenizer:
    """Wraps a tokenizer so that, like Gemma's and Llama 3's, it puts a BOS id before every encoded text."""

    def __init__(self, inner, bos: int):
        self.inner, self.bos = inner, bos

    def __call__(self, text, add_special_tokens=True, **kw):
        enc = self.inner(text, add_special_tokens=False, **kw)
        if add_special_tokens:
            ids = enc["input_ids"]
            enc["input_ids"] = [[self.bos] + x for x in ids] if ids and isinstance(ids[0], list) else [self.bos] + ids
        return enc


def test_evaluate_ppl_starts_each_window_with_the_tokenizers_bos(tmp_path, tiny_model, tiny_tokenizer):
    """A model that expects BOS (Gemma: about 2x worse perplexity without it) is scored on windows that start with
    it; the same L - 1 tokens of each window are scored, and a tokenizer without BOS is scored as before."""
    text = tmp_path / "t.txt"
    text.write_text("The sky is blue and the grass is green. " * 200)
    cfg = PplConfig(text=str(text), lengths=(64,), tokens=128, buckets=4)
    bos_tok = _BosTokenizer(tiny_tokenizer, bos=1)
    s = evaluate_ppl(tiny_model, bos_tok, cfg, None, progress=False)
    ids = tokenize_budget(tiny_tokenizer, text.read_text(), 128)
    with_bos = torch.cat([token_nll(tiny_model, torch.cat([torch.tensor([1]), ids[i * 64:(i + 1) * 64]]))[1:]
                          for i in range(2)])
    assert s["rows"][0]["tokens_scored"] == 2 * 63 == with_bos.numel()
    assert abs(s["rows"][0]["ppl"] - math.exp(with_bos.mean().item())) < 1e-4 * s["rows"][0]["ppl"]
    plain = evaluate_ppl(tiny_model, tiny_tokenizer, cfg, None, progress=False)["rows"][0]["ppl"]
    assert abs(plain - s["rows"][0]["ppl"]) > 1e-3 * plain   # the BOS changed what the model saw
