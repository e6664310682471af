"""Long-context questions (hybridize/distill/long_questions.py): long texts cut to the drawn length, records planted
without changing the text, the question asking for one of them, deterministic rows, and the CLI."""
from __future__ import annotations

import json
import random
import re

import pytest
from typer.testing import CliRunner

from hybridize.distill.long_questions import (
    RECORD_QUESTIONS,
    TEXT_QUESTIONS,
    build_prompts,
    long_text,
    plant_records,
)
from hybridize.distill.recall_drills import KINDS
from hybridize.errors import UserError

from .test_cli import app  # noqa: F401  (the fixture: the distill sub-app on a bare Typer)

SENTENCES = ["Lobsters moult in summer.", "The harbour was rebuilt twice.", "Fishermen set traps at dawn.",
             "Prices rose after the storm.", "Markets opened early that year."]


def docs(n: int = 12, sentences: int = 60) -> list[str]:
    rng = random.Random(1)
    return [f"Document {i}. " + " ".join(rng.choice(SENTENCES) for _ in range(sentences)) for i in range(n)]


def split(problem: str) -> tuple[str, str]:
    text, question = problem.rsplit("\n\n", 1)
    return text, question


def test_long_text_joins_documents_in_order_and_cuts_at_a_sentence():
    d = docs()
    text, nxt = long_text(d, 2, 3000)
    assert text.startswith("Document 2.") and "Document 3." in text
    assert 3000 - 60 < len(text) <= 3000 and text.endswith(".")
    assert nxt == 2 + text.count("Document ")
    assert long_text(d, 11, 3000)[0].startswith("Document 11.") and "Document 0." in long_text(d, 11, 3000)[0]


def test_records_are_whole_sentences_added_to_an_unchanged_text():
    text = long_text(docs(), 0, 4000)[0]
    for seed in range(20):
        out, label, kind, value = plant_records(text, random.Random(seed))
        added = [s for s in re.split(r"(?<=\.)\s+", out) if s not in SENTENCES and not s.startswith("Document")]
        assert 1 <= len(added) <= 3
        assert any(label in s and value in s for s in added)
        rest = out
        for s in added:
            rest = rest.replace(s, "", 1)
        assert rest.split() == text.split()   # the same words in the same order: nothing but the records added
        assert kind in KINDS and out.count(value) == 1


def asked(question: str) -> tuple[str, str]:
    """The kind and label a record question asks for (it must be one of RECORD_QUESTIONS)."""
    for template in RECORD_QUESTIONS:
        pattern = re.escape(template).replace(r"\{kind\}", r"(?P<kind>\w+)").replace(r"\{label\}", r"(?P<label>.+)")
        m = re.fullmatch(pattern, question)
        if m:
            return m["kind"], m["label"]
    raise AssertionError(f"not a record question: {question!r}")


def test_a_record_question_asks_for_a_planted_value_by_its_label():
    rows = build_prompts(docs(), 30, 2000, 6000, record_fraction=1.0, seed=3)
    assert {r["kind"] for r in rows} == {"record"}
    for r in rows:
        text, question = split(r["problem"])
        assert r["answer"] and text.count(r["answer"]) == 1 and r["answer"] not in question
        kind, lab = asked(question)
        sentence = next(s for s in re.split(r"(?<=\.)\s+", text) if r["answer"] in s)
        assert lab in sentence and kind in sentence   # the record that holds the value names the asked label


def test_lengths_fractions_and_text_questions():
    rows = build_prompts(docs(40), 60, 2000, 6000, record_fraction=0.5, seed=0)
    for r in rows:
        text, question = split(r["problem"])
        assert r["chars"] == len(text)
        extra = 400 if r["kind"] == "record" else 0   # up to three planted sentences
        assert 2000 - 80 <= len(text) <= 6000 + extra
        if r["kind"] == "text":
            assert question in TEXT_QUESTIONS and r["answer"] == ""
    kinds = [r["kind"] for r in rows]
    assert 15 < kinds.count("record") < 45
    assert len({r["chars"] for r in rows}) > 30   # drawn lengths, not one
    assert {r["kind"] for r in build_prompts(docs(), 10, 2000, 6000, record_fraction=0.0)} == {"text"}


def test_rows_are_deterministic_per_seed():
    a = build_prompts(docs(), 8, 2000, 6000, 0.6, seed=5)
    assert a == build_prompts(docs(), 8, 2000, 6000, 0.6, seed=5)
    assert a != build_prompts(docs(), 8, 2000, 6000, 0.6, seed=6)


@pytest.mark.parametrize("kw, match", [
    (dict(docs=[], min_chars=10, max_chars=20), "no document"),
    (dict(docs=["short text."], min_chars=1000, max_chars=2000), "fewer than min_chars"),
    (dict(docs=["some text."], min_chars=50, max_chars=20), "min_chars <= max_chars"),
])
def test_bad_settings_are_one_line(kw, match):
    with pytest.raises(UserError, match=match):
        build_prompts(n=2, record_fraction=0.5, **kw)


def test_cli_writes_the_prompts_and_names_missing_texts(app, tmp_path):
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs()))
    out = tmp_path / "q" / "long.jsonl"
    r = CliRunner().invoke(app, ["distill", "long-questions", f"texts={src}", f"out={out}", "num_prompts=5",
                                 "min_chars=1500", "max_chars=3000"])
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 5 and all(set(x) == {"problem", "answer", "kind", "chars"} for x in rows)
    assert "5 prompts" in r.output and not (out.parent / "long.jsonl.tmp").exists()
    r = CliRunner().invoke(app, ["distill", "long-questions", f"out={out}"])
    assert r.exit_code != 0 and "name the documents" in str(r.exception or r.output)
    r = CliRunner().invoke(app, ["distill", "long-questions", "--show"])
    assert "record_fraction" in r.output
