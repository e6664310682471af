"""Reward functions: verified correctness (math-verify), format, weights, TRL's calling convention."""
from __future__ import annotations

import pytest

from hybridize.rl.rewards import (
    combined_reward,
    completion_text,
    correctness_reward,
    format_reward,
    reward_functions,
)


def test_correctness_plain_strings():
    comps = ["So the answer is \\boxed{72}.", "I think \\boxed{71}", "72", "\\boxed{\\frac{1}{2}}",
             "first \\boxed{3} then corrected: \\boxed{4}"]
    answers = ["72", "72", "72", "0.5", "4"]
    # bare "72" has no box: not rewarded; 1/2 == 0.5 symbolically; the LAST box counts
    assert correctness_reward(prompts=[""] * 5, completions=comps, completion_ids=[[]] * 5,
                              answer=answers) == [1.0, 0.0, 0.0, 1.0, 1.0]


def test_correctness_conversational_completions_and_extra_columns():
    comps = [[{"role": "assistant", "content": "x = \\boxed{\\sqrt{2}}"}],
             [{"role": "assistant", "content": "x = \\boxed{2}"}]]
    # TRL passes every dataset column; unknown ones are ignored
    got = correctness_reward(prompts=[[], []], completions=comps, completion_ids=[[1], [2]],
                             answer=["\\sqrt{2}", "\\sqrt{2}"], problem=["p", "q"], trainer_state=None)
    assert got == [1.0, 0.0]


def test_format_reward():
    comps = ["\\boxed{5}", "no box", "\\boxed{}", "\\boxed{5", [{"role": "assistant", "content": "\\fbox{7}"}]]
    assert format_reward(completions=comps) == [1.0, 0.0, 0.0, 0.0, 1.0]


def test_reward_functions_weights_and_names():
    funcs, weights = reward_functions(1.0, 0.1)
    assert [f.__name__ for f in funcs] == ["correctness_reward", "format_reward"] and weights == [1.0, 0.1]
    funcs, weights = reward_functions(1.0, 0.0)
    assert funcs == [correctness_reward] and weights == [1.0]
    with pytest.raises(ValueError, match="every reward weight is 0"):
        reward_functions(0, 0)


def test_combined_reward():
    r = combined_reward(["\\boxed{2}", "\\boxed{3}", "nothing"], ["2", "2", "2"], correct=1.0, format=0.5)
    assert r["correct"] == pytest.approx(1 / 3) and r["format"] == pytest.approx(2 / 3)
    assert r["reward"] == pytest.approx((1.5 + 0.5 + 0) / 3)


def test_errors_are_clear():
    with pytest.raises(ValueError, match="answer"):
        correctness_reward(completions=["\\boxed{1}"])
    with pytest.raises(ValueError, match="1 completions but 2 answers"):
        correctness_reward(completions=["\\boxed{1}"], answer=["1", "2"])
    assert completion_text([{"content": "a"}, {"content": "b"}]) == "ab"


def test_gsm8k_reference_answers_score_one():
    """The rewards agree with the dataset: each GSM8K train reference, boxed, is correct; shifted by
    one problem, (almost) never."""
    from hybridize.errors import UserError
    from hybridize.rl.data import load_problems

    try:
        recs = load_problems("gsm8k")[:40]
    except UserError as e:  # no local copy of the data (any other error is a failure)
        pytest.skip(str(e))
    answers = [r["answer"] for r in recs]
    boxed = [f"... so \\boxed{{{a}}}." for a in answers]
    assert correctness_reward(completions=boxed, answer=answers) == [1.0] * 40
    shifted = correctness_reward(completions=boxed[1:] + boxed[:1], answer=answers)
    same = sum(a == b for a, b in zip(answers[1:] + answers[:1], answers))
    assert sum(shifted) == same
