"""Copying-aware scores: the teacher's induction heads and previous-token heads, per layer (no conversion).

Two classic probes of "In-context Learning and Induction Heads" (Olsson et al.), on the teacher with eager
attention:
- induction: on R random tokens repeated once, the mean attention that a token of the second copy puts on the
  token after its earlier occurrence (where a copy of what came next is read). A layer scores by its best head.
- previous-token: the mean attention on position t-1 over training text (positions past the 16th), best head.

Copying a long value exactly takes both: a previous-token head writes each token's predecessor into it, and an
induction head later finds "the token after the one just written". A linear-attention mixer reproduces neither
sharply, so `--criterion copying` keeps the K layers with the strongest induction heads as softmax, and `--windows
N` gives the N strongest previous-token layers among the rest sliding-window attention (`swa`), which copies
the previous token exactly. Measured on the embedded default (benchmarks/RESULTS.md, issue 22's variant (viii)):
keeping the 7 induction layers plus layer 16 and windows on the previous-token layers brought UUID needles back
at 1k-2k, where 5 softmax layers chosen by KL and needle attention kept none.

Forward hooks (`retrieval.reduced_attention`) reduce each layer's `[B, H, T, T]` probabilities to `[H]` at once,
so only one layer's matrix exists at a time.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from hybridize.distill.models import decoder_layers

from .probe import amp
from .retrieval import reduced_attention

#: previous-token positions skipped at the start (the first tokens attend to the start of the sequence)
SKIP = 16


def previous_token_mass(probs: torch.Tensor, skip: int = SKIP) -> torch.Tensor:
    """`[H, T, T]` attention probabilities -> `[H]` mean attention on t-1 over positions t > skip."""
    return torch.diagonal(probs, offset=-1, dim1=-2, dim2=-1)[:, skip:].float().mean(-1)


def induction_mass(probs: torch.Tensor, start: int, period: int) -> torch.Tensor:
    """`[H, T, T]` probabilities of a sequence whose tokens [start, start + period) repeat right after ->
    `[H]` mean attention from the second copy's token i onto the first copy's token i + 1."""
    rows = torch.arange(start + period, start + 2 * period - 1, device=probs.device)
    return probs[:, rows, rows - period + 1].float().mean(-1)


@torch.no_grad()
def copying_scores(teacher: nn.Module, text_ids: torch.Tensor, device: str, period: int = 100, seed: int = 0) -> dict:
    """{"induction": [L], "induction_head": [L], "previous_token": [L], "previous_head": [L]}: each layer's best
    head and its score. `text_ids` `[T]` (T > SKIP + 1): training text for the previous-token score."""
    L = len(decoder_layers(teacher))
    vocab = teacher.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    rnd = torch.randint(min(100, vocab // 2), vocab, (period,), generator=g)
    seq = torch.cat([text_ids[:1], rnd, rnd])   # the text's first token (BOS where the model has one), then R x 2
    res = {}
    for name, ids, reduce in (("previous_token", text_ids, previous_token_mass),
                              ("induction", seq, lambda p: induction_mass(p, 1, period))):
        with reduced_attention(teacher, reduce) as mass, amp(device):
            teacher.model(input_ids=ids.unsqueeze(0).to(device), use_cache=False)
        best = torch.stack([mass[i] for i in range(L)]).max(-1)
        res[name] = best.values.tolist()
        res["previous_head" if name == "previous_token" else "induction_head"] = best.indices.tolist()
    return res
