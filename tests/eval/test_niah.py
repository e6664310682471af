"""NIAH prompts: the needle is where the sample says (token depth), the prompt has the asked length,
every expected value is in the text, and the scorer and the run/heatmap plumbing work."""
from __future__ import annotations

import json

import pytest

from hybridize.eval.common import data_file, encode
from hybridize.eval.niah import NOISE, TASKS, NiahConfig, build_sample, evaluate_niah, get_task, score

pytestmark = pytest.mark.skipif(data_file("haystack/paul_graham_essays.txt") is None, reason="shared data not present")


def _unit_tokens(tok, task_name):
    """Largest haystack unit in tokens (the granularity of the length and of the placement)."""
    t = get_task(task_name)
    if t.haystack == "noise":
        return len(tok(NOISE)["input_ids"]) + 2
    if t.haystack == "needle":
        import random

        from hybridize.eval.niah import _rand, needle_sentence

        rng = random.Random(0)
        return max(len(tok(" " + needle_sentence(_rand(t.key_type, rng), _rand(t.value_type, rng), t.value_type))
                       ["input_ids"]) for _ in range(20)) + 2
    return 60   # one essay sentence


@pytest.mark.parametrize("task", list(TASKS))
@pytest.mark.parametrize("length", [512, 1500])
def test_length_and_needle_position(tiny_tokenizer, task, length):
    tok = tiny_tokenizer
    for depth in (0.0, 0.3, 0.5, 1.0):
        s = build_sample(tok, get_task(task), length, depth, seed=3)
        n = len(s.input_ids)
        slack = _unit_tokens(tok, task)
        assert length - slack <= n <= length, (n, length)
        assert s.input_ids == encode(tok, s.prompt, True)
        # the needle text starts exactly at the recorded token and sits inside the haystack span
        t0, t1 = s.context_tokens
        assert t0 <= s.needle_token < t1
        assert tok.decode(s.input_ids[s.needle_token:]).lstrip().startswith(s.needle)
        # the measured depth is re-derived independently from the token ids
        needle_len = len(tok(" " + s.needle)["input_ids"])
        independent = (s.needle_token - t0) / (t1 - t0 - needle_len)
        assert abs(independent - s.depth_actual) < 0.02
        # placed at the nearest sentence boundary: within one unit of the request (single-needle
        # tasks; with several needles the others may sit between it and the end)
        tol = slack / (t1 - t0) + 0.01
        if get_task(task).num_keys * get_task(task).num_values == 1 or depth < 1.0:
            assert abs(s.depth_actual - depth) <= tol, (task, depth, s.depth_actual)
        for a in s.answers:
            assert s.prompt.count(a) == 1
        assert s.prompt.endswith("mentioned in the provided text are")


def test_multi_variants_have_their_needles(tiny_tokenizer):
    mk = build_sample(tiny_tokenizer, get_task("mk-niah-1"), 1024, 0.5)
    assert mk.prompt.count("One of the special magic numbers for") == 4 and len(mk.answers) == 1
    mv = build_sample(tiny_tokenizer, get_task("mv-niah"), 1024, 0.5)
    assert len(mv.answers) == 4 and all(mv.prompt.count(a) == 1 for a in mv.answers)
    mq = build_sample(tiny_tokenizer, get_task("mq-niah"), 1024, 0.5)
    assert len(mq.answers) == 4 and " and " in mq.prompt.split("What are all")[-1]
    hay = build_sample(tiny_tokenizer, get_task("mk-niah-2"), 1024, 0.5)
    assert hay.prompt.count("One of the special magic numbers for") > 10


def test_plain_prompt_and_errors(tiny_tokenizer):
    s = build_sample(tiny_tokenizer, get_task("s-niah-2"), 700, 0.5, chat=False)
    assert "<|im_start|>" not in s.prompt and len(s.input_ids) <= 700
    with pytest.raises(ValueError, match="too short"):
        build_sample(tiny_tokenizer, get_task("s-niah-1"), 20, 0.5)
    with pytest.raises(ValueError, match="unknown NIAH task"):
        get_task("s-niah-9")


def test_score():
    assert score("The numbers are 1234567 and 7654321.", ["1234567", "7654321"]) == 1.0
    assert score("The number is 1234567.", ["1234567", "7654321"]) == 0.5
    assert score("ABC-def", ["abc-DEF"]) == 1.0
    assert score("", ["1"]) == 0.0


def test_evaluate_niah_smoke(tmp_path, tiny_model, tiny_tokenizer):
    cfg = NiahConfig(task="s-niah-1", lengths=(256, 384), depths=(0.0, 1.0), samples=1, max_new_tokens=4)
    s = evaluate_niah(tiny_model, tiny_tokenizer, cfg, tmp_path, progress=False)
    assert len(s["table"]) == 2 and set(s["table"][0]) == {"length", "d=0", "d=1", "mean"}
    rows = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["prompt_tokens"] <= r["length"] for r in rows)
    assert (tmp_path / "heatmap.png").stat().st_size > 1000 and (tmp_path / "accuracy.csv").exists()
