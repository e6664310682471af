"""Rows dropped from prompt sets are counted and explained (issue 29: rows without an answer vanished
silently, and when all lacked one GRPO blamed `max_prompt_tokens=512 too small?`); held-out scoring
passes the prompts to the reward, so number-only prompts are graded as in training."""
from __future__ import annotations

import json

import pytest

from hybridize.errors import UserError
from hybridize.eval.math import NUMBER_INSTRUCTION, load_math_dataset
from hybridize.rl.data import build_records
from tests.rl.helpers import byte_tokenizer, tiny_hybrid, write_problems


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_grpo_all_rows_without_answer_names_the_real_cause(tmp_path):
    p = _jsonl(tmp_path / "noans.jsonl", [{"problem": "1+1?"}, {"problem": "2+2?", "solution": "4"}])
    with pytest.raises(UserError) as e:
        build_records(str(p), byte_tokenizer(), instruction="", max_prompt_tokens=512)
    msg = str(e.value)
    assert "none of its 2 rows has an 'answer'" in msg and "max_prompt_tokens" not in msg and "\n" not in msg


def test_grpo_says_how_many_rows_it_dropped_and_why(tmp_path, capsys):
    p = _jsonl(tmp_path / "some.jsonl", [{"problem": "1+1?", "answer": "2"}, {"problem": "2+2?"},
                                          {"problem": "y" * 400, "answer": "1"}])
    recs = build_records(str(p), byte_tokenizer(), instruction="", max_prompt_tokens=100, chat="off")
    assert [r["answer"] for r in recs] == ["2"]
    err = capsys.readouterr().err
    assert "dropped 1 of 3 rows with no 'answer'" in err and "(first: row 2)" in err
    assert "dropped 1 of 2 prompts" in err and "longer than data.max_prompt_tokens=100" in err


def test_grpo_all_prompts_too_long_says_so(tmp_path):
    p = _jsonl(tmp_path / "long.jsonl", [{"problem": "y" * 400, "answer": "1"}])
    with pytest.raises(UserError, match=r"all 1 are longer than data.max_prompt_tokens=10"):
        build_records(str(p), byte_tokenizer(), instruction="", max_prompt_tokens=10)


def test_eval_math_says_how_many_rows_it_dropped(tmp_path, capsys):
    p = _jsonl(tmp_path / "m.jsonl", [{"problem": "1+1?", "answer": "2"}, {"problem": "x?", "answer": ""}])
    assert len(load_math_dataset(str(p))) == 1
    assert "dropped 1 of 2 rows with no 'answer'" in capsys.readouterr().err
    none = _jsonl(tmp_path / "none.jsonl", [{"problem": "x?"}])
    with pytest.raises(UserError, match="none of its 1 rows has an 'answer'"):
        load_math_dataset(str(none))


def test_score_prompts_passes_the_prompts_to_the_reward(tmp_path, monkeypatch):
    import hybridize.rl.rewards as rewards
    from hybridize.rl.trainer import score_prompts

    seen = {}
    real = rewards.combined_reward

    def spy(*a, **kw):
        seen.update(kw)
        return real(*a, **kw)

    monkeypatch.setattr("hybridize.rl.trainer.combined_reward", spy)
    model, tok = tiny_hybrid()
    recs = build_records(str(write_problems(tmp_path / "p.jsonl", n=2)), tok, instruction=NUMBER_INSTRUCTION)
    score_prompts(model, tok, recs, max_new_tokens=2, fast=False)
    assert seen.get("prompts") == [r["prompt"] for r in recs]
