"""The generated arithmetic task: seeded generation, the train/test split by operand triple, answers,
loading by name (evaluation, GRPO prompts, traces), the number-only grader and the per-level summary."""
from __future__ import annotations

import json
import re

import pytest

from hybridize.errors import UserError
from hybridize.eval import arith
from hybridize.eval.math import (NUMBER_INSTRUCTION, MathEvalConfig, check_checker, evaluate_math, extract_number,
                                 grade, is_correct, is_correct_number, load_math_dataset, summarize)

ALL = "arith:{split}:L1-6:n=100000"


def _triple(row) -> tuple[int, str, int]:
    """The operands and operator of a row, read back from its id (`arith/L<k>/<a><op><b>`)."""
    m = re.fullmatch(r"arith/L(\d)/(\d+)([-+*])(\d+)", row["id"])
    assert m, row["id"]
    assert int(m.group(1)) == row["level"]
    return int(m.group(2)), m.group(3), int(m.group(4))


def test_same_seed_same_rows_other_seed_other_draw():
    a, b = arith.load("arith:train:seed=3"), arith.load("arith:train:seed=3")
    assert a == b
    t0, t1 = arith.load("arith:test:seed=0"), arith.load("arith:test:seed=1")
    assert t0 != t1
    # the seed changes the draw and the wording, never the split
    assert {_triple(r) for r in arith.load(ALL.format(split="test"))} == \
           {_triple(r) for r in arith.load(ALL.format(split="test") + ":seed=7")}


def test_train_and_test_disjoint_over_all_levels_and_seeds():
    test = {_triple(r) for seed in (0, 1, 2) for r in arith.load(ALL.format(split="test") + f":seed={seed}")}
    train = {_triple(r) for seed in (0, 1, 2) for r in arith.load(ALL.format(split="train") + f":seed={seed}")}
    assert test and train and not (test & train)
    # together the splits hold every triple of every level
    every = {t for lv in arith.LEVELS for t in arith.level_triples(lv)}
    assert test | train == every
    # and each level has both splits, the test split about a quarter
    for lv in arith.LEVELS:
        n_test, n_all = len(arith.split_triples(lv, "test")), len(arith.level_triples(lv))
        assert 0.1 < n_test / n_all < 0.4, (lv, n_test, n_all)
    # problem texts (the same triple worded at level 6 too) never cross either
    test_text = {r["problem"] for r in arith.load(ALL.format(split="test"))}
    assert not test_text & {r["problem"] for r in arith.load(ALL.format(split="train"))}


def test_answers_and_levels():
    rows = arith.load(ALL.format(split="train")) + arith.load(ALL.format(split="test"))
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    for r in rows:
        a, op, b = _triple(r)
        lv = r["level"]
        assert r["answer"] == str(ops[op](a, b)) and int(r["answer"]) >= 0
        assert set(r) == {"id", "problem", "answer", "solution", "level"}
        if lv in (1, 2, 3):
            assert 0 <= a <= 9 and 0 <= b <= 9 and op == "+-*"[lv - 1]
        elif lv in (4, 5):
            assert 10 <= a <= 99 and 10 <= b <= 99 and op == "+-"[lv - 4]
        else:
            assert 2 <= a <= 20 and 2 <= b <= 20 and op in "+-"
        if lv < 6:
            assert r["problem"] == f"What is {a} {'×' if op == '*' else op} {b}?"
        else:   # the operands appear in the words, in order
            nums = [int(x) for x in re.findall(r"\d+", r["problem"])]
            assert nums == [a, b] and r["problem"].endswith("?")
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids))


def test_name_parsing_and_sizes():
    rows = arith.load("arith")
    assert {r["level"] for r in rows} == set(arith.LEVELS)
    per = {lv: sum(r["level"] == lv for r in rows) for lv in arith.LEVELS}
    assert per[4] == per[5] == per[6] == 50 and per[2] == len(arith.split_triples(2, "test"))
    assert [r["level"] for r in rows[:6]] == [1, 2, 3, 4, 5, 6]   # levels interleaved: a limit mixes them
    assert {r["level"] for r in arith.load("arith:test:L3")} == {3}
    assert {r["level"] for r in arith.load("arith:L2-4:train:n=5")} == {2, 3, 4}
    assert len(arith.load("arith:train:L4:L6:n=7")) == 14
    assert arith.load("ARITH:Test:L1") == arith.load("arith:test:l1")
    assert arith.parse_spec("arith").split is None and arith.load("arith", default_split="train")[0]["id"] in \
        {r["id"] for r in arith.load("arith:train:n=100000")}
    for bad in ("arith:L7", "arith:L0", "arith:L3-1", "arith:val", "arith:n=0", "arith:seed=x"):
        with pytest.raises(UserError):
            arith.load(bad)
    assert not arith.is_arith_spec("arithmetic") and arith.is_arith_spec("arith:train")


def test_load_by_name_eval_and_grpo():
    from hybridize.rl.data import load_problems

    recs = load_math_dataset("arith:test:L3")
    assert recs == arith.load("arith:test:L3")   # the normaliser keeps every field, level included
    assert load_math_dataset("arith", limit=6) == arith.load("arith")[:6]
    probs = load_problems("arith:train:L1-2")
    assert probs and {r["level"] for r in probs} == {1, 2} and all(r["problem"] and r["answer"] for r in probs)
    assert [r["id"] for r in load_problems("arith")] == [r["id"] for r in arith.load("arith")]


def test_traces_dataset_and_checker_check():
    ds = arith.as_dataset("arith:L6", default_split="train", max_rows=5)
    assert len(ds) == 5 and "prompt" in ds.column_names and ds[0]["prompt"].startswith(ds[0]["problem"] + "\n")
    train_ids = {r["id"] for r in arith.load("arith:train:n=100000")}
    assert all(i in train_ids for i in ds["id"])
    r = check_checker(arith.load("arith"))
    assert r["answers_boxed"] == 1.0 and r["solutions"] == 1.0 and r["answers_raw"] == 1.0
    assert r["shuffled"] == r["shuffled_same_string"]


@pytest.mark.parametrize("completion, ok", [
    ("12", True),
    ("12\n", True),
    ("The answer is 12.", True),
    ("5+7=12", True),
    ("5 + 7 = 12. So Ana has 12 apples.", True),
    ("Ana has 12 apples now.", True),
    ("\\boxed{12}", True),
    ("12.0", True),
    ("13", False),
    ("-12", False),
    ("The answer is 1.", False),
    ("5+7=13", False),
    ("12 + 1 = 13", False),
    ("no idea", False),
    ("", False),
])
def test_number_only_grader(completion, ok):
    assert is_correct_number(completion, "12") is ok
    assert grade(completion, "12", "number") is ok


def test_number_grader_details():
    assert extract_number("9-4=5") == "5" and extract_number("x = -3") == "-3" and extract_number("9-4") == "4"
    assert extract_number("1,234 apples") == "1234"
    assert is_correct_number("0", "0") and not is_correct_number("10", "0")
    # the boxed grader still wants a box; the number grader does not
    assert not grade("12", "12", "boxed") and grade("\\boxed{12}", "12", "boxed")
    with pytest.raises(ValueError):
        grade("12", "12", "words")
    # a reference that is not a plain number falls back to math-verify
    assert is_correct_number("\\boxed{0.5}", "\\frac{1}{2}") and not is_correct_number("\\frac{1}{2}", "0.5")


def test_rewards_follow_the_prompt_instruction():
    from hybridize.rl.rewards import combined_reward, correctness_reward, format_reward

    num = [{"role": "user", "content": f"What is 5 + 7?\n{NUMBER_INSTRUCTION}"}]
    box = [{"role": "user", "content": "What is 5 + 7?\nPlease put your final answer within \\boxed{}."}]
    comps = ["12", "12", "\\boxed{12}", "13"]
    prompts = [num, box, box, num]
    assert correctness_reward(prompts=prompts, completions=comps, answer=["12"] * 4) == [1.0, 0.0, 1.0, 0.0]
    assert format_reward(prompts=prompts, completions=comps) == [1.0, 0.0, 1.0, 1.0]
    assert correctness_reward(completions=comps, answer=["12"] * 4) == [0.0, 0.0, 1.0, 0.0]   # no prompts: boxed
    assert combined_reward(["12", "7"], ["12", "12"], prompts=[num, num])["correct"] == 0.5


def _row(level, avg):
    return {"level": level, "avg": avg, "pass@1": avg, "completions": ["\\boxed{1}"], "num_tokens": [3],
            "finished": [True]}


def test_summary_by_level():
    s = summarize([_row(1, 1.0), _row(1, 0.0), _row(3, 1.0)], 1, [1])
    assert s["avg@1"] == pytest.approx(2 / 3)
    assert s["by_level"] == [{"level": 1, "problems": 2, "avg@1": 0.5, "pass@1": 0.5},
                             {"level": 3, "problems": 1, "avg@1": 1.0, "pass@1": 1.0}]
    assert "by_level" not in summarize([{k: v for k, v in _row(1, 1.0).items() if k != "level"}], 1, [1])


def test_evaluate_math_on_arith(tmp_path, tiny_model, tiny_tokenizer):
    cfg = MathEvalConfig(dataset="arith:test:n=1", greedy=True, max_new_tokens=4, batch_size=8,
                         answer_format="number")
    s = evaluate_math(tiny_model, tiny_tokenizer, cfg, tmp_path, progress=False)
    assert s["problems"] == 6 and s["answer_format"] == "number"
    assert [x["level"] for x in s["by_level"]] == list(arith.LEVELS) and all(x["problems"] == 1 for x in s["by_level"])
    rows = [json.loads(x) for x in (tmp_path / "problems.jsonl").read_text().splitlines()]
    assert sorted(r["level"] for r in rows) == list(arith.LEVELS)
    for r in rows:   # what was recorded is what the number grader decides
        assert r["is_correct"] == [is_correct_number(c, r["answer"]) for c in r["completions"]]
    assert json.loads((tmp_path / "summary.json").read_text())["by_level"] == s["by_level"]


def test_boxed_checker_on_arith_solutions():
    for r in arith.load("arith:test:n=3"):
        assert is_correct(r["solution"], r["answer"], require_boxed=False)
        assert is_correct(f"\\boxed{{{r['answer']}}}", r["answer"])


def test_distill_traces_takes_arith_by_name(tmp_path, tiny_model, tiny_tokenizer):
    from hybridize.distill.config import TracesConfig, load_config
    from hybridize.distill.traces import write_traces

    cfg = load_config(TracesConfig, None, {"prompts": "arith:L1-2", "prompt_field": "prompt", "num_prompts": 3,
                                           "out": str(tmp_path / "tr.jsonl"), "max_new_tokens": 3, "batch_size": 3})
    write_traces(tiny_model, tiny_tokenizer, cfg, "tiny")
    rows = [json.loads(x) for x in (tmp_path / "tr.jsonl").read_text().splitlines()]
    train_ids = {r["id"] for r in arith.load("arith:train:n=100000")}   # `split` (train) when the name has none
    assert len(rows) == 3 and all(r["id"] in train_ids and r["level"] in (1, 2) for r in rows)
    assert all(r["prompt"].endswith("\\boxed{}.") and isinstance(r["completion"], str) for r in rows)
