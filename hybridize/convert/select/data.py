"""The text `hybridize select` measures on: the first `tokens` tokens of the training text (whole documents,
joined by EOS) become the KL rows, the documents after them the alignment rows (`align_data`).

Only training text: the default `python-docs` (standard-library docstrings) is what the recipes train on;
evaluation text is refused in `config.check_config`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridize.distill.data import load_texts, tokenize_docs
from hybridize.errors import UserError


def load_docs(tokenizer, source: str, max_tokens: int) -> list[list[int]]:
    """Tokenized documents of `source` (each + EOS), in order, until `max_tokens` tokens are reached."""
    texts = load_texts(source)
    docs, total = [], 0
    for start in range(0, len(texts), 32):
        for d in tokenize_docs(tokenizer, texts[start:start + 32]):
            docs.append(d)
            total += len(d)
            if total >= max_tokens:
                return docs
    return docs


def split_docs(docs: list[list[int]], kl_tokens: int, source: str,
               need_rest: bool = True) -> tuple[torch.Tensor, list[list[int]]]:
    """(KL token stream `[kl_tokens]`, the remaining documents for alignment; `need_rest`: refuse none)."""
    stream: list[int] = []
    k = 0
    while k < len(docs) and len(stream) < kl_tokens:
        stream.extend(docs[k])
        k += 1
    rest = docs[k:]
    if len(stream) < kl_tokens or (need_rest and not rest):
        have = sum(len(d) for d in docs)
        raise UserError(f"--text {source} holds {have} tokens: not enough for --tokens {kl_tokens} of KL text plus "
                        "alignment text; lower --tokens or use a longer text")
    return torch.tensor(stream[:kl_tokens], dtype=torch.long), rest


def kl_batches(stream: torch.Tensor, seq_len: int, batch_tokens: int = 8192) -> list[dict]:
    """`[N]` ids -> batches of whole rows `{"input_ids": [R, seq_len]}` (no padding; the tail is dropped).
    Every position counts for the KL (`mask`); documents inside a row see each other, for teacher and
    hybrid alike."""
    n = stream.numel() // seq_len
    rows = stream[: n * seq_len].view(n, seq_len)
    per = max(1, batch_tokens // seq_len)
    return [{"input_ids": rows[i:i + per], "mask": torch.ones_like(rows[i:i + per], dtype=torch.bool)}
            for i in range(0, n, per)]


@dataclass
class AlignRows:
    """Alignment batches as a pure function of the step: `per_step` rows `[R, seq_len]` of contiguous text
    (documents joined by EOS), in a fresh `seed`-ed order each epoch."""

    rows: torch.Tensor
    per_step: int
    seed: int

    def batch(self, step: int, micro: int = 0) -> dict:
        n = self.rows.shape[0]
        picks = []
        for k in range(step * self.per_step, (step + 1) * self.per_step):
            epoch, i = divmod(k, n)
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            picks.append(int(torch.randperm(n, generator=g)[i]))
        return {"input_ids": self.rows[picks]}


def align_data(docs: list[list[int]], seq_len: int, batch_tokens: int, seed: int) -> AlignRows:
    """The alignment rows. Departure from stage A's packing (`hybridize.distill.data.PackedData`): no position
    reset at document starts, so the mixers take the batch as it is, no varlen path (faster), and teacher and
    mixers still see the same context."""
    stream = torch.tensor([t for d in docs for t in d], dtype=torch.long)
    n = stream.numel() // seq_len
    if n == 0:
        raise UserError(f"only {stream.numel()} tokens left for alignment: less than one --align-seq-len {seq_len} "
                        "row; lower --tokens or --align-seq-len")
    return AlignRows(stream[: n * seq_len].view(n, seq_len), max(1, batch_tokens // seq_len), seed)


def kl_stream(tokenizer, source: str, kl_tokens: int) -> torch.Tensor:
    """The KL token stream alone (the alignment documents are not tokenized)."""
    return split_docs(load_docs(tokenizer, source, kl_tokens), kl_tokens, source, need_rest=False)[0]
