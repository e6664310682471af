"""Recall drills (hybridize/distill/recall_drills.py): records planted and stated again, nothing else changed."""
from __future__ import annotations

import random

import pytest

from hybridize.distill.config import E2EConfig, load_config
from hybridize.distill.data import build_data
from hybridize.distill.recall_drills import TEMPLATES, add_recall_drills, apply_drills, plan_drills

from .helpers import ToyTokenizer, write_rows

SENTENCES = ["Lobsters moult in summer.", "The harbour was rebuilt twice.", "Fishermen set traps at dawn.",
             "Prices rose after the storm.", "Markets opened early that year."]


def doc(n_sentences: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    lines = []
    for i in range(n_sentences):
        lines.append(rng.choice(SENTENCES) + ("\n" if i % 7 == 6 else " "))
    return "".join(lines)


def planted(text: str, fraction: float = 1.0, reach: int = 600, seed: int = 0):
    drills = plan_drills(text, random.Random(seed), fraction, reach)
    return drills, apply_drills(text, drills)


def test_zero_fraction_leaves_the_texts_alone():
    texts = [doc(80, s) for s in range(3)]
    assert add_recall_drills(texts, 0.0, 600) == texts


def test_only_the_drill_sentences_are_added():
    text = doc(200)
    drills, out = planted(text)
    assert drills and out != text
    for d in drills:
        for _, _, sentence in d.records:
            out = out.replace(sentence, "")
    assert " ".join(out.split()) == " ".join(text.split())


def test_each_restatement_follows_its_record_within_reach():
    text = doc(300)
    reach = 600
    drills, out = planted(text, reach=reach)
    assert len(drills) >= len(text) // reach - 1
    for d in drills:
        label, value, sentence = d.records[d.recalled]
        assert out.count(sentence) == 2, "the record once, its restatement once"
        first, second = out.index(sentence), out.rindex(sentence)
        assert first < second
        assert 0 < d.at - d.planted[d.recalled] <= reach
        assert value in sentence and label in sentence


def test_records_of_a_drill_differ_by_label_and_value():
    """Copying the wrong record must be wrong: within a drill no two records share a label or a value."""
    drills, _ = planted(doc(600), fraction=1.0, reach=900)
    several = [d for d in drills if len(d.records) > 1]
    assert several
    for d in several:
        labels = [r[0] for r in d.records]
        values = [r[1] for r in d.records]
        assert len(set(labels)) == len(labels) and len(set(values)) == len(values)


def test_fraction_sets_the_density_and_the_seed_the_draw():
    texts = [doc(400, s) for s in range(6)]
    count = lambda ts, base: sum(len(t) - len(b) for t, b in zip(ts, base))
    dense, sparse = add_recall_drills(texts, 1.0, 600, 0), add_recall_drills(texts, 0.25, 600, 0)
    assert count(dense, texts) > 2 * count(sparse, texts) > 0
    assert add_recall_drills(texts, 1.0, 600, 0) == dense
    assert add_recall_drills(texts, 1.0, 600, 1) != dense


def test_wording_is_not_the_needle_tasks():
    for t in TEMPLATES:
        assert "magic" not in t.lower() and "special" not in t.lower()


def test_short_documents_get_no_drill():
    assert add_recall_drills(["Too short. To drill."], 1.0, 600) == ["Too short. To drill."]


def test_build_data_plants_drills_from_the_config(tmp_path):
    src = write_rows(tmp_path / "t.jsonl", [{"text": doc(200, s)} for s in range(4)])
    base = load_config(E2EConfig, None, [f"data.train={src}", "data.seq_len=64"])
    drilled = load_config(E2EConfig, None, [f"data.train={src}", "data.seq_len=64", "data.recall_drills=1.0",
                                            "data.recall_reach=600"])
    assert drilled.data.recall_drills == 1.0 and drilled.data.recall_reach == 600
    tok = ToyTokenizer()
    n0 = sum(map(len, build_data(base.data, tok, seed=0).docs))
    n1 = sum(map(len, build_data(drilled.data, tok, seed=0).docs))
    assert n1 > n0


def test_a_negative_fraction_is_refused():
    with pytest.raises(Exception, match="recall_drills"):
        load_config(E2EConfig, None, ["data.recall_drills=-0.5"])


def test_build_data_counts_each_sources_tokens_drills_included(tmp_path):
    """`PackedData.sources`: each data.train source's documents and tokens, in order, summing to the mix (drills
    grow a document in place, so they count with its source); `sources_line` gives the shares."""
    from hybridize.distill.data import sources_line

    a = write_rows(tmp_path / "a.jsonl", [{"text": doc(200, s)} for s in range(3)])
    b = write_rows(tmp_path / "b.jsonl", [{"text": "short one"}])
    tok = ToyTokenizer()
    for drills in ("0", "1.0"):
        cfg = load_config(E2EConfig, None, [f"data.train=[{a},{b}]", "data.seq_len=64",
                                            f"data.recall_drills={drills}", "data.recall_reach=600"])
        data = build_data(cfg.data, tok, seed=0)
        got = [(s["source"], s["docs"]) for s in data.sources]
        assert got == [(str(a), 3), (str(b), 1)]
        assert [s["tokens"] for s in data.sources] == [sum(map(len, data.docs[:3])), len(data.docs[3])]
        assert data.sources[1]["tokens"] == len(tok("short one")["input_ids"]) + 1   # + the document's EOS
    line = sources_line(data.sources)
    share = 100 * data.sources[0]["tokens"] / sum(s["tokens"] for s in data.sources)
    assert line.startswith(f"data: {sum(map(len, data.docs)):,} tokens; a.jsonl {share:.1f}%, b.jsonl")
