"""Perplexity and length extrapolation: perplexity of a causal LM at several context lengths on the
SAME token budget, and the mean loss by position inside the longest windows.

The text (default: WikiText-2 test from the shared data dir, else any text / JSONL-with-`text` file)
is tokenised once; the first `tokens` tokens are cut into non-overlapping windows of each length L,
so every L is scored on the same tokens (departure from the sliding-window protocol with a stride:
cheaper, and the ppl differences between lengths then come from context alone). Within a window every
token but the first is predicted, so longer windows give each token more context on average; past
the model's training length, the loss-by-position curve shows whether extra context still helps
(extrapolation) or hurts (breakdown).

Logits are computed in chunks from the decoder's last hidden state, so the full `[L, vocab]` fp32
tensor of an 8k window (1.6 GB for a 49k vocabulary) is never materialised.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from hybridize.builtin_text import builtin_texts
from hybridize.distill.data import special_prefix
from hybridize.errors import read_jsonl, read_text
from hybridize.families import head_logits
from .common import data_file, model_device, save_line_plot, write_csv, write_json


@dataclass
class PplConfig:
    text: str = field(default="wikitext2", metadata={"help": "'wikitext2' (shared data; where it is missing, "
                                                            "'python-reference'), 'python-reference' (Python's "
                                                            "Language Reference, built in) or a .txt / .jsonl file"})
    lengths: tuple[int, ...] = field(default=(256, 512, 1024, 2048, 4096), metadata={"help": "context lengths (tokens)"})
    tokens: int = field(default=16384, metadata={"help": "token budget scored at every length (>= the longest length)"})
    buckets: int = field(default=16, metadata={"help": "position buckets of the loss-by-position curve"})
    chunk: int = field(default=1024, metadata={"help": "positions per lm-head chunk"})


def load_text(source: str) -> str:
    if source in ("wikitext2", "wikitext-2", "wikitext"):
        p = data_file("wikitext2/test.txt")
        if p is not None:
            return p.read_text(encoding="utf-8")
        print("wikitext2 is not here (no ../shared/data): scoring the built-in python-reference text instead "
              "(--text FILE for your own)")
        source = "python-reference"
    builtin = builtin_texts(source)
    if builtin is not None:
        return "\n\n".join(builtin)
    p = Path(source)
    if not p.is_file():
        raise ValueError(f"text source {source!r} is not a file (or 'wikitext2', 'python-reference')")
    if p.suffix == ".jsonl":
        return "\n\n".join(r.get("text", "") for r in read_jsonl(p))

    return read_text(p)


def tokenize_budget(tokenizer, text: str, tokens: int) -> torch.Tensor:
    """The first `tokens` token ids of `text` `[tokens]` (tokenising only as much text as needed)."""
    chars = max(4 * tokens, 4096)
    while True:
        ids = tokenizer(text[:chars], add_special_tokens=False)["input_ids"]
        if len(ids) >= tokens or chars >= len(text):
            break
        chars *= 2
    if len(ids) < tokens:
        raise ValueError(f"the text has only {len(ids)} tokens, fewer than --tokens {tokens}; lower it or use a longer text")
    return torch.tensor(ids[:tokens], dtype=torch.long)


@torch.no_grad()
def token_nll(model, ids: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """NLL (nats) of each token given its prefix in one window: ids `[L]` -> `[L - 1]` (fp32)."""
    dev = model_device(model)
    x = ids.unsqueeze(0).to(dev)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if head is None or decoder is None:
        logits = model(input_ids=x).logits[0, :-1].float()
        return F.cross_entropy(logits, x[0, 1:], reduction="none")
    h = decoder(input_ids=x).last_hidden_state[0, :-1]
    out = []
    for s in range(0, h.shape[0], chunk):
        logits = head_logits(model, h[s:s + chunk]).float()   # lm_head + the family's transform (Granite, Gemma)
        out.append(F.cross_entropy(logits, x[0, 1 + s:1 + s + chunk], reduction="none"))
    return torch.cat(out).cpu()


def evaluate_ppl(model, tokenizer, cfg: PplConfig, out_dir: str | Path | None = None, progress: bool = True) -> dict:
    """Rows `{length, windows, tokens_scored, nll, ppl}` and the loss-by-position curve of the longest
    length; writes ppl.csv, summary.json, ppl_vs_length.png, loss_vs_position.png under `out_dir`."""
    from tqdm.auto import tqdm

    lengths = sorted(cfg.lengths)
    if cfg.tokens < lengths[-1]:
        raise ValueError(f"--tokens {cfg.tokens} is smaller than the longest length {lengths[-1]}")
    ids = tokenize_budget(tokenizer, load_text(cfg.text), cfg.tokens)
    prefix = torch.tensor(special_prefix(tokenizer), dtype=torch.long)   # BOS where the model expects one
    rows, curve = [], None
    total = sum(cfg.tokens // L for L in lengths)
    bar = tqdm(total=total, desc="ppl", disable=not progress)
    for L in lengths:
        n = cfg.tokens // L
        per_window = []
        for i in range(n):
            # each window starts as a sequence does (the tokenizer's BOS first, not scored): the same L - 1
            # predictions of the window's own tokens with or without it
            nll = token_nll(model, torch.cat([prefix, ids[i * L:(i + 1) * L]]), cfg.chunk)
            per_window.append(nll[len(prefix):])
            bar.update(1)
        nll = torch.stack(per_window)                          # [n, L-1]
        mean = nll.mean().item()
        rows.append({"length": L, "windows": n, "tokens_scored": nll.numel(), "nll": mean, "ppl": math.exp(mean)})
        if L == lengths[-1]:
            curve = position_curve(nll.mean(0), cfg.buckets)
    bar.close()
    summary = {"text": cfg.text, "rows": rows, "loss_by_position": curve}
    if out_dir is not None:
        out = Path(out_dir)
        write_csv(out / "ppl.csv", rows)
        write_json(out / "summary.json", {**summary, "config": cfg.__dict__})
        save_line_plot(out / "ppl_vs_length.png", {"ppl": ([r["length"] for r in rows], [r["ppl"] for r in rows])},
                       xlabel="context length (tokens)", ylabel="perplexity", title=f"perplexity on {cfg.text}", logx=True)
        save_line_plot(out / "loss_vs_position.png",
                       {f"L={lengths[-1]}": ([c["position"] for c in curve], [c["nll"] for c in curve])},
                       xlabel="token position", ylabel="mean NLL (nats)", title="loss by position")
    return summary


def position_curve(nll_by_pos: torch.Tensor, buckets: int) -> list[dict]:
    """Mean NLL in `buckets` equal position ranges; `position` = the bucket's last position + 1."""
    P = nll_by_pos.numel()
    edges = [round(P * i / buckets) for i in range(buckets + 1)]
    return [{"position": b, "nll": nll_by_pos[a:b].mean().item()} for a, b in zip(edges, edges[1:]) if b > a]


def compare_rows(results: dict[str, dict], lengths: Sequence[int]) -> list[dict]:
    """One row per length with each model's ppl side by side."""
    out = []
    for L in lengths:
        row = {"length": L}
        for name, res in results.items():
            row[name] = next((r["ppl"] for r in res["rows"] if r["length"] == L), float("nan"))
        out.append(row)
    return out
