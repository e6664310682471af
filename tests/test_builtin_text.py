"""The built-in texts: present in every Python, disjoint by construction, reachable by name everywhere."""
from __future__ import annotations

from hybridize.builtin_text import builtin_texts, language_reference_topics, stdlib_docstrings, _without_overlap
from hybridize.distill.data import load_texts


def test_training_and_heldout_texts_are_disjoint():
    docs, topics = stdlib_docstrings(), language_reference_topics()
    assert len(docs) > 100 and len(topics) > 50
    lines = {ln.strip() for t in topics for ln in t.splitlines() if len(ln.strip()) >= 60}
    assert not any(ln.strip() in lines for d in docs for ln in d.splitlines() if len(ln.strip()) >= 60)


def test_overlap_filter_drops_a_shared_line():
    line = "x" * 70
    assert _without_overlap(["a\n" + line, "b"], ["c\n" + line]) == ["b"]


def test_names_reach_the_data_loaders():
    assert load_texts("python-docs", max_docs=3) == stdlib_docstrings()[:3]
    assert builtin_texts("python-reference") == language_reference_topics()
    assert builtin_texts("no-such-text") is None
