"""Which attention heads of a teacher copy: previous-token heads and induction heads, per layer.

Two classic probes (after "In-context Learning and Induction Heads", Olsson et al.), on the teacher with eager
attention, no training:
- previous-token score: the mean attention weight on position t-1, over held-out text (positions past the 16th);
- induction score: on R random tokens repeated once, the mean attention that a token of the second copy puts on
  the token after its earlier occurrence, i.e. where a copy of what came next is read.

Copying a long value needs both: a previous-token head writes each token's predecessor into it, an induction head
later finds "the token after the one I just wrote". A conversion plan that turns either kind into linear attention
loses exact copying; this table said which layers the `pattern` plan of issue 22's variant (viii) keeps as softmax
(induction) or as a sliding window (previous-token), see benchmarks/RESULTS.md.

    python -m benchmarks.pipeline.head_roles --teacher default --text ../shared/data/wikitext2/valid.txt
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hybridize.convert.sources import load_model


@torch.no_grad()
def attentions(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Per layer `[H, T, T]` attention probabilities of one sequence `ids` `[1, T]`."""
    return [a[0].float() for a in model(ids, output_attentions=True).attentions]


def previous_token_scores(maps: list[torch.Tensor], skip: int = 16) -> torch.Tensor:
    """`[L, H]` mean attention on t-1 over positions t > skip."""
    return torch.stack([torch.diagonal(a, offset=-1, dim1=-2, dim2=-1)[:, skip:].mean(-1) for a in maps])


def induction_scores(maps: list[torch.Tensor], start: int, period: int) -> torch.Tensor:
    """`[L, H]` for a sequence whose tokens [start, start + period) repeat at [start + period, start + 2 period):
    mean attention from the second copy's token i onto the first copy's token i + 1."""
    rows = torch.arange(start + period, start + 2 * period - 1)
    cols = rows - period + 1
    return torch.stack([a[:, rows, cols].mean(-1) for a in maps])


def measure(model, tokenizer, text: str, tokens: int = 512, period: int = 100, seed: int = 0) -> dict:
    model.config._attn_implementation = "eager"   # the probabilities themselves (sdpa does not return them)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[:, :tokens]
    if ids.shape[1] < 64:
        raise SystemExit(f"the text gives {ids.shape[1]} tokens: need at least 64")
    prev = previous_token_scores(attentions(model, ids))
    g = torch.Generator().manual_seed(seed)
    rnd = torch.randint(1000, min(20000, model.config.vocab_size), (1, period), generator=g)
    first = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else int(ids[0, 0])
    seq = torch.cat([torch.tensor([[first]]), rnd, rnd], 1)
    ind = induction_scores(attentions(model, seq), 1, period)
    return {"previous_token": prev.tolist(), "induction": ind.tolist(), "tokens": int(ids.shape[1]), "period": period}


def markdown(res: dict) -> str:
    prev, ind = torch.tensor(res["previous_token"]), torch.tensor(res["induction"])
    lines = ["| layer | previous-token: best head | score | induction: best head | score |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    for layer in range(prev.shape[0]):
        lines.append(f"| {layer} | {int(prev[layer].argmax())} | {prev[layer].max():.2f} | {int(ind[layer].argmax())} | "
                     f"{ind[layer].max():.2f} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--teacher", default="default")
    p.add_argument("--text", required=True, type=Path, help="held-out text for the previous-token score")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--period", type=int, default=100, help="random tokens repeated once for the induction score")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    if not a.text.is_file():
        raise SystemExit(f"{a.text} is not a file")
    model, tok = load_model(a.teacher)
    res = measure(model.eval(), tok, a.text.read_text()[:200_000], a.tokens, a.period)
    print(markdown(res))
    if a.json:
        a.json.write_text(json.dumps(res))


if __name__ == "__main__":
    main()
