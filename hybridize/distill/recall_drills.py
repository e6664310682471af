"""Recall drills: records planted in training documents and stated again further on, so that distillation sees
the teacher copy a value it read far back.

Why: in a converted model the kept softmax layers stop finding and copying what they read far back (benchmarks/
RESULTS.md, "Retrieval: do the kept softmax layers still read the needle?"). Copying each token right 90% of the
time instead of 99% loses a 25-token identifier nearly always, and ordinary prose rarely asks for an exact copy of a
random string, so the logit KL on it carries little of that skill. A drill plants one to three records
"<label> ... <value>" at sentence boundaries of a document and, up to `reach` characters later, states one of them
again with the same words. Nothing else changes: the student is trained on the teacher's predictions at the
restatement as at every other token (no labels; the teacher decides what the continuation is), and it can only match
them by finding the record by its label and copying its value.

What is drawn (per document, from `seed` and the document's index, so every run and every resume sees the same
text): the values at random (digits, hexadecimal groups shaped like a UUID, letter-digit codes), the labels from
the document's own words, the sentence from a few neutral templates. None of it is an evaluation's haystack or
wording (S-NIAH's "special magic number"), so evaluation text stays out of the training mix. Not from a paper:
the same idea as the synthetic passkey and key-value retrieval data that long-context training mixes in.
"""
from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass

#: the record's wording; the restatement repeats its record's sentence word for word
TEMPLATES = (
    "The {kind} for {label} is {value}.",
    "Note: {label} was given the {kind} {value}.",
    "For reference, the {kind} of {label} reads {value}.",
)
KINDS = ("code", "number", "identifier", "key", "serial")
# a boundary where a sentence may be put: after a full stop and a space, or at a line break
BOUNDARY = re.compile(r"(?<=[.!?]) (?=[A-Z(])|\n")
WORD = re.compile(r"[A-Za-z]{4,12}")


@dataclass(frozen=True)
class Drill:
    """One drill of a document: its records (label, value, sentence) and which one is stated again."""

    records: tuple[tuple[str, str, str], ...]
    recalled: int   # index into records
    at: int         # where the restatement goes, a boundary of the original document (characters)
    planted: tuple[int, ...]   # where each record goes, boundaries before `at`


def random_value(rng: random.Random) -> str:
    """A value no text could predict: 5-9 digits, a UUID-shaped hex string, or a letter-digit code."""
    form = rng.randrange(3)
    if form == 0:
        return str(rng.randrange(1, 10)) + "".join(rng.choice(string.digits) for _ in range(rng.randrange(4, 9)))
    if form == 1:
        return "-".join("".join(rng.choice("0123456789abcdef") for _ in range(n)) for n in (8, 4, 4, 4, 12))
    groups = [rng.randrange(2, 5) for _ in range(rng.randrange(2, 4))]
    return "-".join("".join(rng.choice(string.ascii_uppercase + string.digits) for _ in range(n)) for n in groups)


def draw_label(rng: random.Random, words: list[str], taken: set[str]) -> str:
    """Two of the document's words ("harbour signal"); other letters when the document has too few words."""
    for _ in range(20):
        label = " ".join(rng.choice(words).lower() for _ in range(2)) if len(words) >= 2 else \
            "".join(rng.choice(string.ascii_lowercase) for _ in range(7))
        if label not in taken:
            return label
    return label + f" {len(taken)}"


def plan_drills(doc: str, rng: random.Random, fraction: float, reach: int) -> list[Drill]:
    """The drills of one document: one candidate every `reach` characters, each kept with probability `fraction`;
    a kept one puts its restatement at the last boundary before the candidate point and its 1-3 records at random
    boundaries of the `reach` characters before that."""
    cuts = [m.end() for m in BOUNDARY.finditer(doc)]
    words = WORD.findall(doc)
    drills, taken = [], set()
    for point in range(reach, len(doc) + 1, reach):
        if rng.random() >= fraction:
            continue
        before = [c for c in cuts if c <= point]
        if not before:
            continue
        at = before[-1]
        window = [c for c in cuts if at - reach <= c < at]
        if not window:
            continue
        n = rng.randrange(1, 4)
        planted = tuple(sorted(rng.choice(window) for _ in range(n)))
        records = []
        for _ in range(n):
            label = draw_label(rng, words, taken)
            taken.add(label)
            value = random_value(rng)
            sentence = rng.choice(TEMPLATES).format(kind=rng.choice(KINDS), label=label, value=value)
            records.append((label, value, sentence))
        drills.append(Drill(tuple(records), rng.randrange(n), at, planted))
    return drills


def insert_sentences(doc: str, inserts: list[tuple[int, int, str]]) -> str:
    """`doc` with each (position, order, sentence) inserted as its own sentence at that boundary (ties by order)."""
    out, last = [], 0
    for pos, _, sentence in sorted(inserts, key=lambda x: (x[0], x[1])):
        out.append(doc[last:pos])
        sep = "" if pos == 0 or doc[pos - 1] in " \n" else " "
        out.append(f"{sep}{sentence}{'' if pos < len(doc) and doc[pos] == chr(10) else ' '}")
        last = pos
    out.append(doc[last:])
    return "".join(out)


def apply_drills(doc: str, drills: list[Drill]) -> str:
    """The document with every drill's records and restatement inserted (each as its own sentence)."""
    inserts = [(pos, k, rec[2]) for d in drills for k, (pos, rec) in enumerate(zip(d.planted, d.records))]
    inserts += [(d.at, len(d.records), d.records[d.recalled][2]) for d in drills]
    return insert_sentences(doc, inserts)


def add_recall_drills(texts: list[str], fraction: float, reach: int, seed: int = 0) -> list[str]:
    """`texts` with recall drills planted (`fraction` of every `reach` characters of text gets one; 0 = unchanged)."""
    if fraction <= 0:
        return texts
    out = []
    for i, doc in enumerate(texts):
        rng = random.Random(seed * 1_000_003 + i)
        out.append(apply_drills(doc, plan_drills(doc, rng, fraction, reach)))
    return out
