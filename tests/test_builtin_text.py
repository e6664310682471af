"""The built-in texts: present in every Python, disjoint by construction, reachable by name everywhere."""
from __future__ import annotations

import sysconfig
from pathlib import Path

from hybridize.builtin_text import (SKIP_SOURCE_DIRS, _source_files, _without_overlap, builtin_texts,
                                    language_reference_topics, stdlib_docstrings, stdlib_sources)
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


def _long_lines(texts):
    return {ln.strip() for t in texts for ln in t.splitlines() if len(ln.strip()) >= 60}


def test_source_text_is_whole_stdlib_files_within_the_cap_and_disjoint_from_the_heldout():
    root = Path(sysconfig.get_paths()["stdlib"])
    files = {p.read_text(encoding="utf-8", errors="replace").strip(): p for p in _source_files(root)}
    docs = stdlib_sources(max_chars=300_000)
    assert 5 < len(docs) and 250_000 < sum(map(len, docs)) <= 300_000
    assert all(d in files for d in docs)                      # whole files, unchanged
    assert not _long_lines(docs) & _long_lines(language_reference_topics())
    assert stdlib_sources(max_chars=300_000) == docs          # a fixed order
    assert builtin_texts("python-source") == stdlib_sources()


def test_source_files_skip_tests_and_the_heldout_package():
    rel = [p.relative_to(Path(sysconfig.get_paths()["stdlib"])).parts for p in
           _source_files(Path(sysconfig.get_paths()["stdlib"]))]
    assert rel and not any(set(r[:-1]) & SKIP_SOURCE_DIRS or r[-1].startswith("test_") for r in rel)
    assert ("pydoc_data", "topics.py") not in rel


def test_source_size_by_name_and_a_bad_size_is_one_line():
    import pytest

    from hybridize.errors import UserError

    assert builtin_texts("python-source:300k") == stdlib_sources(max_chars=300_000)
    assert load_texts("python-source:0.3M") == stdlib_sources(max_chars=300_000)
    for bad in ("python-source:lots", "python-source:0", "python-source:"):
        with pytest.raises(UserError, match="python-source:4M"):
            builtin_texts(bad)
    assert builtin_texts("python-docs:3") is None   # only the source text takes a size
