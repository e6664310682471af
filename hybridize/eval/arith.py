"""`arith`: arithmetic problems the project generates itself, with difficulty levels and a train/test split
that is disjoint by construction. No third-party text: the word problems come from templates written here.

Levels (operands a, b; the answer is a non-negative integer):

| level | problems | operands |
| --- | --- | --- |
| 1 | single-digit addition, "What is 3 + 5?" | a, b in 0..9 |
| 2 | single-digit subtraction, "What is 9 - 4?" | a, b in 0..9, a >= b |
| 3 | single-digit multiplication, "What is 6 × 7?" | a, b in 0..9 |
| 4 | two-digit addition | a, b in 10..99 |
| 5 | two-digit subtraction | a, b in 10..99, a >= b |
| 6 | one-step word problems ("Ana has 7 apples and buys 5 more. ...") | a, b in 2..20; + or - (a > b) |

Split rule: every problem is an operand triple (a, op, b) with op one of + - *. A triple is in the test
split when the SHA-256 of its text ("7+5") is 0 mod 4 (about a quarter), else in train. The rule does
not look at the level or the seed, so no test triple ever appears in train at any level, under any seed
(a level-6 word problem "7 + 5" is test exactly when level 1's "What is 7 + 5?" is). The seed only picks
which triples are drawn and, at level 6, the template, name and object of each.

Names (`hybridize eval math --dataset`, `hybridize grpo data.train=[...]`, `hybridize distill traces
prompts=...`, `load_math_dataset`, `rl.data.load_problems`): `arith` followed by `:`-separated parts in any
order:

- `train` or `test`: the split (default `test`; in `distill traces` the `split` setting, default `train`);
- `L3` (one level) or `L1-3` (a range); repeat for several (`arith:train:L1:L4`); default all six;
- `n=50`: problems per level, drawn without repetition (default 50 for test, every problem for train;
  a level holds fewer when its split is smaller, e.g. level 2 has 55 triples in all);
- `seed=1`: the draw and the wording (default 0).

Examples: `arith` (the test split, 50 problems per level), `arith:train`, `arith:test:L3`,
`arith:train:L1-3:n=200:seed=2`.

Rows have the math datasets' fields, `{"id", "problem", "answer", "solution", "level"}`: `answer` the
integer as a string, `solution` the worked equation ending in a boxed answer, `level` an int. Checking is
the math checker's (`hybridize.eval.math`): the boxed answer by math-verify, or with
`answer_format="number"` ("Answer with the number only.") the strict numeric rule of `is_correct_number`
(`hybridize eval math --answer-format number`; in GRPO `data.instruction="Answer with the number only."`
makes the rewards use it).
"""
from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from hybridize.errors import UserError

from .formats import BOXED_INSTRUCTION

NAME = "arith"
LEVELS = (1, 2, 3, 4, 5, 6)
TEST_DEFAULT_PER_LEVEL = 50

_SYMBOL = {"+": "+", "-": "-", "*": "×"}


def _value(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def is_test_triple(a: int, op: str, b: int) -> bool:
    """The split rule: the test split holds the triples whose text's SHA-256 is 0 mod 4."""
    return int(hashlib.sha256(f"{a}{op}{b}".encode()).hexdigest(), 16) % 4 == 0


def level_triples(level: int) -> list[tuple[int, str, int]]:
    """Every (a, op, b) of a level, both splits, in a fixed order."""
    one, two, word = range(10), range(10, 100), range(2, 21)
    if level == 1:
        return [(a, "+", b) for a in one for b in one]
    if level == 2:
        return [(a, "-", b) for a in one for b in one if a >= b]
    if level == 3:
        return [(a, "*", b) for a in one for b in one]
    if level == 4:
        return [(a, "+", b) for a in two for b in two]
    if level == 5:
        return [(a, "-", b) for a in two for b in two if a >= b]
    if level == 6:
        return [(a, "+", b) for a in word for b in word] + [(a, "-", b) for a in word for b in word if a > b]
    raise UserError(f"arith has levels {LEVELS[0]}..{LEVELS[-1]}, not {level}")


def split_triples(level: int, split: str) -> list[tuple[int, str, int]]:
    if split not in ("train", "test"):
        raise UserError(f"arith split must be train or test, got {split!r}")
    want_test = split == "test"
    return [t for t in level_triples(level) if is_test_triple(*t) == want_test]


# ---- level 6: one-step word problems (templates written for this project) -------------------------

_NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Femi", "Gita", "Hugo", "Ines", "Jon", "Kofi", "Lena", "Mio",
          "Nora", "Omar", "Pia")
_ITEMS = ("apples", "pencils", "stickers", "marbles", "cookies", "cards", "shells", "stamps")

_WORD_TEMPLATES = {
    "+": (
        "{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?",
        "There are {a} {item} in a box. {name} puts {b} more {item} in the box. How many {item} are in the box now?",
        "{name} found {a} {item} in the morning and {b} {item} in the afternoon. How many {item} did {name} "
        "find in all?",
        "A class has {a} girls and {b} boys. How many children are in the class?",
    ),
    "-": (
        "{name} has {a} {item} and gives {b} of them to a friend. How many {item} does {name} have left?",
        "There are {a} {item} on a table. {name} takes {b} of them away. How many {item} are on the table now?",
        "A bus has {a} passengers. At the next stop {b} passengers get off and nobody gets on. How many "
        "passengers are on the bus now?",
        "{name} had {a} {item} and lost {b} of them. How many {item} does {name} have now?",
    ),
}


def _problem(level: int, a: int, op: str, b: int, rng: random.Random) -> str:
    if level < 6:
        return f"What is {a} {_SYMBOL[op]} {b}?"
    template = rng.choice(_WORD_TEMPLATES[op])
    return template.format(a=a, b=b, name=rng.choice(_NAMES), item=rng.choice(_ITEMS))


def make_row(level: int, a: int, op: str, b: int, rng: random.Random) -> dict:
    c = _value(a, op, b)
    return {"id": f"{NAME}/L{level}/{a}{op}{b}", "problem": _problem(level, a, op, b, rng), "answer": str(c),
            "solution": f"{a} {_SYMBOL[op]} {b} = {c}\nThe answer is $\\boxed{{{c}}}$.", "level": level}


def generate(split: str = "test", levels=LEVELS, per_level: int | None = None, seed: int = 0) -> list[dict]:
    """Rows of `split` for `levels`: per level, `per_level` triples drawn without repetition (all of the
    split's triples when None or more than it holds) in the seeded draw's order; the levels interleaved
    (one row of each in turn) so that the first N rows mix the levels."""
    per = []
    for level in levels:
        triples = split_triples(level, split)
        rng = random.Random(f"{NAME}:{seed}:{level}")   # str seeds hash the same in every process
        rng.shuffle(triples)
        if per_level is not None:
            triples = triples[:per_level]
        per.append([make_row(level, a, op, b, rng) for a, op, b in triples])
    return [r for i in range(max(map(len, per), default=0)) for rows in per if i < len(rows) for r in [rows[i]]]


# ---- names -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ArithSpec:
    split: str | None = None          # None: the caller's default
    levels: tuple[int, ...] = LEVELS
    per_level: int | None = None      # None: 50 for test, all for train
    seed: int = 0


def is_arith_spec(name: str) -> bool:
    """True for `arith` and `arith:...` (any case)."""
    key = str(name).strip().lower()
    return key == NAME or key.startswith(NAME + ":")


def parse_spec(name: str) -> ArithSpec:
    """`arith[:train|test][:L<k>|:L<a>-<b>]...[:n=N][:seed=S]` -> ArithSpec (see the module docstring)."""
    if not is_arith_spec(name):
        raise UserError(f"{name!r} is not an arith name (arith[:train|test][:L3|:L1-3][:n=N][:seed=S])")
    split, levels, per_level, seed = None, [], None, 0
    usage = "arith[:train|test][:L3|:L1-3 ...][:n=N][:seed=S]"
    for part in str(name).strip().lower().split(":")[1:]:
        part = part.strip()
        try:
            if part in ("train", "test"):
                split = part
            elif part.startswith("l") and part[1:]:
                lo, _, hi = part[1:].partition("-")
                lo, hi = int(lo), int(hi or lo)
                if not (LEVELS[0] <= lo <= hi <= LEVELS[-1]):
                    raise ValueError
                levels += [k for k in range(lo, hi + 1) if k not in levels]
            elif part.startswith("n="):
                per_level = int(part[2:])
                if per_level < 1:
                    raise ValueError
            elif part.startswith("seed="):
                seed = int(part[5:])
            else:
                raise ValueError
        except ValueError:
            raise UserError(f"{name!r}: cannot read {part!r}; levels are L1..L6 or a range like L1-3; "
                            f"the form is {usage}") from None
    return ArithSpec(split, tuple(sorted(levels)) or LEVELS, per_level, seed)


def load(name: str, default_split: str = "test") -> list[dict]:
    """The rows an arith name stands for (`default_split` when the name gives none)."""
    spec = parse_spec(name)
    split = spec.split or default_split
    per_level = spec.per_level if spec.per_level is not None else (TEST_DEFAULT_PER_LEVEL if split == "test" else None)
    return generate(split, spec.levels, per_level, spec.seed)


def as_dataset(name: str, default_split: str = "train", max_rows: int = 0, instruction: str = BOXED_INSTRUCTION):
    """A `datasets.Dataset` of the rows for `distill traces`, with a `prompt` column too (the problem and
    `instruction` on the next line; `prompt_field=problem` gives the bare problem)."""
    import datasets  # deferred: slow import (pyarrow); only `distill traces` needs it

    rows = [{**r, "prompt": f"{r['problem']}\n{instruction}"} for r in load(name, default_split)]
    if max_rows:
        rows = rows[:max_rows]
    return datasets.Dataset.from_list(rows)
