"""Long-context questions: prompts that ask a question after thousands of tokens of text, for the teacher to
answer (`hybridize distill traces`), so that the long-context stage distils how the teacher answers there.

Why: the converted students of issue 22 copy a value as well as their teacher once they start their answer with it,
but after 4k tokens of haystack they start with a different form (a numbered list) where the teacher starts with the
value (benchmarks/RESULTS.md, "How the needle tasks fail now"). The long-context stage trained on articles alone, so
no training position ever held a chat answer after a long document, and the chat traces of stages A and B are
short. A prompt here is one long text (consecutive documents joined, cut at a sentence boundary to a length drawn
between `min_chars` and `max_chars`) followed by a question in the chat template's user turn; the teacher's greedy
answer completes the conversation, and the logit KL then covers the first answer token after the long context,
where the form is decided, and the answer itself.

Questions (per prompt, from `seed` and the prompt's index, so a rerun builds the same file): with probability
`record_fraction` 1-3 records ("The code for harbour signal is 9fb64943-...", the recall drills' sentence forms and
random values) are planted at random sentence boundaries and the question asks for one of them by its label, so its
answer is a copy from far back; otherwise the question asks about the text itself (its subject, the first person or
place it names, ...), which the teacher answers in its usual form. None of it is an evaluation's haystack or
wording (S-NIAH's "special magic number"), and the texts are training sources, so evaluation text stays out of the
training mix. Not from a paper: the synthetic long-context question answering that long-context training mixes add.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from hybridize.convert.select.record import atomic_write
from hybridize.errors import UserError

from .recall_drills import BOUNDARY, KINDS, TEMPLATES, WORD, draw_label, insert_sentences, random_value

#: questions that ask for a planted record by its label ({kind}: code, number, ...)
RECORD_QUESTIONS = (
    "What is the {kind} for {label} in the text above?",
    "Which {kind} was {label} given in the document above?",
    "Find the {kind} of {label} in the text above and state it.",
    "According to the text above, what is the {kind} of {label}?",
)
#: questions about the text itself
TEXT_QUESTIONS = (
    "What is the text above mainly about? Answer in one sentence.",
    "Which person or place does the text above name first?",
    "Give a title for the text above.",
    "Which year is mentioned first in the text above?",
    "List three topics the text above covers.",
)


def _cut(text: str, limit: int) -> str:
    """`text` up to its last sentence boundary at or before `limit` characters (the whole prefix if none)."""
    if len(text) <= limit:
        return text
    cuts = [m.end() for m in BOUNDARY.finditer(text, 0, limit + 1) if m.end() <= limit]
    return text[:cuts[-1]].rstrip() if cuts else text[:limit]


def long_text(docs: list[str], start: int, target: int) -> tuple[str, int]:
    """Consecutive documents from `start` (wrapping around) joined by blank lines until `target` characters, cut at
    a sentence boundary; returns the text and the index after the last document used."""
    parts, n, i = [], 0, start
    while n < target and i < start + len(docs):
        d = docs[i % len(docs)].strip()
        if d:
            parts.append(d)
            n += len(d) + 2
        i += 1
    return _cut("\n\n".join(parts), target), i % len(docs)


def plant_records(text: str, rng: random.Random) -> tuple[str, str, str, str]:
    """1-3 records planted at random sentence boundaries of `text`; returns the text, and the label, kind and value
    of the one the question asks for."""
    cuts = [m.end() for m in BOUNDARY.finditer(text)] or [len(text)]
    words = WORD.findall(text)
    records, taken = [], set()
    for _ in range(rng.randrange(1, 4)):
        label = draw_label(rng, words, taken)
        taken.add(label)
        kind, value = rng.choice(KINDS), random_value(rng)
        records.append((rng.choice(cuts), label, kind, value, rng.choice(TEMPLATES).format(
            kind=kind, label=label, value=value)))
    text = insert_sentences(text, [(pos, k, r[-1]) for k, (pos, *r) in enumerate(records)])
    _, label, kind, value, _ = rng.choice(records)
    return text.strip(), label, kind, value


def build_prompts(docs: list[str], n: int, min_chars: int, max_chars: int, record_fraction: float,
                  seed: int = 0) -> list[dict]:
    """`n` prompt rows: `problem` (the long text, a blank line, the question), `answer` (the asked record's value;
    "" for a question about the text), `kind` ("record" | "text") and `chars` (the text's length)."""
    if not 0 < min_chars <= max_chars:
        raise UserError(f"long questions: need 0 < min_chars <= max_chars (got {min_chars}, {max_chars})")
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise UserError("long questions: the texts hold no document; name a source with text (texts=...)")
    total = sum(len(d) + 2 for d in docs)
    if total < min_chars:
        raise UserError(f"long questions: the texts hold {total} characters in all, fewer than min_chars="
                        f"{min_chars}; add sources or lower min_chars")
    rows, start = [], 0
    for i in range(n):
        rng = random.Random(seed * 1_000_003 + i)
        text, start = long_text(docs, start, rng.randint(min_chars, max_chars))
        if rng.random() < record_fraction:
            text, label, kind, value = plant_records(text, rng)
            question, answer, what = rng.choice(RECORD_QUESTIONS).format(kind=kind, label=label), value, "record"
        else:
            question, answer, what = rng.choice(TEXT_QUESTIONS), "", "text"
        rows.append({"problem": f"{text}\n\n{question}", "answer": answer, "kind": what, "chars": len(text)})
    return rows


def write_prompts(rows: list[dict], out: str | Path) -> Path:
    """The rows as JSONL, written to a temporary file and renamed (a crash leaves no half file)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, "".join(json.dumps(r) + "\n" for r in rows))
    return out


def run_long_questions(cfg) -> Path:
    """`hybridize distill long-questions`: read `cfg.texts`, build `cfg.num_prompts` prompts, write `cfg.out`."""
    from .data import load_texts

    docs = load_texts(cfg.texts, txt_document=cfg.txt_document)
    rows = build_prompts(docs, cfg.num_prompts, cfg.min_chars, cfg.max_chars, cfg.record_fraction, cfg.seed)
    path = write_prompts(rows, cfg.out)
    n_rec = sum(r["kind"] == "record" for r in rows)
    mean = sum(r["chars"] for r in rows) / max(len(rows), 1)
    print(f"long questions: {len(rows)} prompts ({n_rec} ask for a planted record), mean {mean:.0f} characters "
          f"of text, in {path}")
    return path
