"""`hybridize demo` (the README's main job) end to end on a tiny random teacher: convert + stage A +
stage B + perplexity table, with local text files and with no data at all (text the teacher writes)."""
from __future__ import annotations

import json
import math

import pytest

from hybridize.distill import demo as demo_mod
from hybridize.distill.demo import demo_config, run_demo
from tests.distill.helpers import write_texts
from tests.rl.helpers import byte_tokenizer, tiny_teacher


@pytest.fixture
def teacher_dir(tmp_path):
    path = tmp_path / "teacher"
    tiny_teacher().save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def _run(tmp_path, teacher_dir, **over):
    base = {"out": str(tmp_path / "demo"), "teacher": str(teacher_dir), "layers": "2:1", "mixer": "sse",
            "eval_tokens": 256, "eval_seq_len": 64, "align_steps": 2, "e2e_steps": 2, "seq_len": 32,
            "batch_tokens": 64, "generated_tokens": 48, "threads": 1, "device": "cpu"}
    return run_demo(demo_config([f"{k}={v}" for k, v in {**base, **over}.items()]))


def test_demo_with_local_text(tmp_path, teacher_dir):
    held = tmp_path / "held.txt"
    held.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    s = _run(tmp_path, teacher_dir, train_text=str(write_texts(tmp_path / "train.jsonl")), heldout_text=str(held))
    ppl = s["perplexity"]
    assert set(ppl) == {"teacher", "converted", "after_align", "after_e2e"}
    assert all(math.isfinite(v) and v > 1 for v in ppl.values()), ppl
    assert s["align"]["steps"] == 2 and s["e2e"]["steps"] == 2
    out = tmp_path / "demo"
    assert json.loads((out / "summary.json").read_text())["perplexity"] == ppl
    assert "after stage B" in (out / "summary.md").read_text()
    assert (out / "student" / "config.json").is_file()
    assert not (out / "align" / "checkpoints").exists()  # resume points are removed at the end


def test_demo_without_any_data_uses_teacher_text(tmp_path, teacher_dir, monkeypatch):
    monkeypatch.setattr(demo_mod, "shared_data", lambda rel: None)   # as on a user's machine
    s = _run(tmp_path, teacher_dir)
    assert s["heldout"].startswith("teacher-generated")
    assert (tmp_path / "demo" / "data" / "train.jsonl").is_file()
    assert all(math.isfinite(v) for v in s["perplexity"].values())
