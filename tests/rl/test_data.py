"""Prompt loading: local JSONL, the shared GSM8K / MATH / AIME copies, chat prompts, filtering."""
from __future__ import annotations

import json

import pytest

from hybridize.errors import UserError
from hybridize.rl.data import build_records, load_problems, make_prompt, parse_hub_spec, to_dataset
from tests.rl.helpers import byte_tokenizer, write_problems


def _shared(name):
    try:
        return load_problems(name)
    except UserError as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("name,count", [("gsm8k", 7473), ("math", 7498), ("aime", 975)])
def test_shared_sets(name, count):
    recs = _shared(name)
    assert len(recs) == count   # MATH train: 2 of 7500 have an empty reference box (SOURCES.md)
    assert all(r["problem"] and r["answer"] for r in recs)


def test_gsm8k_answer_is_the_number():
    recs = _shared("gsm8k")
    assert recs[0]["answer"] == "72" and "Natalia" in recs[0]["problem"]


def test_local_jsonl_and_question_field(tmp_path):
    p = tmp_path / "q.jsonl"
    p.write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n" + json.dumps({"problem": "x", "answer": ""}) + "\n")
    recs = load_problems(str(p))
    assert [(r["problem"], r["answer"]) for r in recs] == [("1+1?", "2")]   # no answer: dropped


def test_unknown_and_hub_spec():
    with pytest.raises(UserError, match="unknown prompt set"):
        load_problems("no-such-set")
    assert parse_hub_spec("openai/gsm8k@main:test") == ("openai/gsm8k", "main", "test")
    assert parse_hub_spec("owner/ds") == ("owner/ds", None, "train")


def test_chat_prompts_limit_and_length_filter(tmp_path):
    tok = byte_tokenizer()
    path = write_problems(tmp_path / "p.jsonl", n=8)
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"problem": "y" * 500, "answer": "1"}) + "\n")
    recs = build_records([str(path), str(long)], tok, instruction="Box it.", max_prompt_tokens=100, seed=1)
    assert len(recs) == 8                       # the long prompt is dropped
    r = recs[0]
    assert r["prompt"][-1]["role"] == "user" and r["prompt"][-1]["content"].endswith("\nBox it.")
    assert len(build_records(str(path), tok, instruction="", limit=3)) == 3
    plain = build_records(str(path), tok, instruction="I", chat="off")
    assert isinstance(plain[0]["prompt"], str) and plain[0]["prompt"].endswith("\nI")
    ds = to_dataset(recs)
    assert {"prompt", "answer"} <= set(ds.column_names)
    with pytest.raises(UserError, match="no prompts left"):
        build_records(str(long), tok, instruction="", max_prompt_tokens=10)


def test_make_prompt_system():
    msgs = make_prompt("p", "i", "sys", chat=True)
    assert msgs[0] == {"role": "system", "content": "sys"} and msgs[1]["content"] == "p\ni"
