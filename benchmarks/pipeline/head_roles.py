"""Which attention heads of a teacher copy: its previous-token and induction heads per layer, on a text of your
choice (`hybridize select --criterion copying` measures the same on its training text and turns it into a plan).

    python -m benchmarks.pipeline.head_roles --teacher default --text ../shared/data/wikitext2/valid.txt

The scores are `hybridize.convert.select.copying.copying_scores`: the previous-token score is the mean attention
on t-1 over the first `--tokens` tokens of the text, the induction score the mean attention from a token of the
second copy of `--period` random tokens onto the token after its first occurrence; each layer's best head.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from hybridize.convert.select.copying import SKIP, copying_scores
from hybridize.convert.sources import load_model


def markdown(res: dict) -> str:
    lines = ["| layer | previous-token: best head | score | induction: best head | score |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    for i, (p, ph, d, dh) in enumerate(zip(res["previous_token"], res["previous_head"], res["induction"],
                                           res["induction_head"])):
        lines.append(f"| {i} | {ph} | {p:.2f} | {dh} | {d:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--teacher", default="default")
    p.add_argument("--text", required=True, type=Path, help="text for the previous-token score")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--period", type=int, default=100, help="random tokens repeated once for the induction score")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    if not a.text.is_file():
        raise SystemExit(f"{a.text} is not a file")
    model, tok = load_model(a.teacher)
    ids = tok(a.text.read_text()[:200_000], return_tensors="pt").input_ids[0, :a.tokens]
    if ids.numel() <= 2 * SKIP:
        raise SystemExit(f"{a.text} gives {ids.numel()} tokens: need more than {2 * SKIP}")
    res = copying_scores(model.eval(), ids, "cpu", a.period)
    print(markdown(res))
    if a.json:
        a.json.write_text(json.dumps({**res, "tokens": int(ids.numel()), "period": a.period}))


if __name__ == "__main__":
    main()
