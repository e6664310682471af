"""GRPO reward functions: verified correctness (math-verify) and answer format.

TRL calls each reward function as `f(prompts=..., completions=..., completion_ids=..., **columns)`
(every dataset column - here `answer` - comes as a list aligned with the completions) and logs it
under the function's `__name__`. Completions are strings, or message lists
(`[{"role": "assistant", "content": ...}]`) for conversational prompts.

The checking is the evaluation's (`hybridize.eval.math`): the answer is the content of the LAST
`\\boxed{}`; math-verify decides equivalence with the reference. A completion without a boxed
answer scores 0 on both rewards, so the format reward is the only gradient a model that never boxes
gets; its default weight is small (0.1) so it cannot outweigh one correct answer.

Number-only prompts: when a prompt holds the instruction "Answer with the number only."
(`data.instruction="Answer with the number only."`, e.g. on the generated `arith:train` set), that
completion is checked by the evaluation's answer format "number" instead: correct when the number after
the last "=" (else the last number) equals the reference exactly; format when it holds a number.
"""
from __future__ import annotations

from collections.abc import Sequence

from hybridize.eval.math import NUMBER_INSTRUCTION, answer_format_ok, grade


def completion_text(completion) -> str:
    """The text of one completion: a string, or the concatenated contents of a message list."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return str(completion.get("content", ""))
    if isinstance(completion, Sequence):
        return "".join(completion_text(m) for m in completion)
    raise TypeError(f"unsupported completion type {type(completion).__name__}")


def answer_formats(prompts, n: int) -> list[str]:
    """Per completion: "number" when its prompt asks for the number only, else "boxed"."""
    if prompts is None:
        return ["boxed"] * n
    if len(prompts) != n:
        raise ValueError(f"{n} completions but {len(prompts)} prompts")
    return ["number" if NUMBER_INSTRUCTION in completion_text(p) else "boxed" for p in prompts]


def correctness_reward(prompts=None, completions=None, completion_ids=None, answer=None, **kwargs) -> list[float]:
    """1.0 when the completion's last boxed answer equals `answer` (math-verify), else 0.0 (number-only
    prompts: the strict numeric check)."""
    if completions is None:
        raise ValueError("correctness_reward needs completions")
    if answer is None:
        raise ValueError("correctness_reward needs an `answer` column in the dataset")
    if len(answer) != len(completions):
        raise ValueError(f"{len(completions)} completions but {len(answer)} answers")
    fmts = answer_formats(prompts, len(completions))
    return [1.0 if grade(completion_text(c), str(a), f) else 0.0 for c, a, f in zip(completions, answer, fmts)]


def format_reward(prompts=None, completions=None, completion_ids=None, **kwargs) -> list[float]:
    """1.0 when the completion holds a closed, non-empty `\\boxed{}` answer (number-only prompts: a
    number), else 0.0."""
    if completions is None:
        raise ValueError("format_reward needs completions")
    fmts = answer_formats(prompts, len(completions))
    return [1.0 if answer_format_ok(completion_text(c), f) else 0.0 for c, f in zip(completions, fmts)]


def reward_functions(correct: float = 1.0, format: float = 0.1) -> tuple[list, list[float]]:
    """(functions, weights) for TRL's `reward_funcs` / `GRPOConfig.reward_weights`; zero weights dropped."""
    pairs = [(correctness_reward, correct), (format_reward, format)]
    pairs = [(f, float(w)) for f, w in pairs if w]
    if not pairs:
        raise ValueError("every reward weight is 0: set rewards.correct or rewards.format")
    return [f for f, _ in pairs], [w for _, w in pairs]


def combined_reward(texts: list[str], answers: list[str], correct: float = 1.0, format: float = 0.1,
                    prompts: list | None = None) -> dict:
    """Mean rewards of plain completions (for scoring outside the trainer): correct, format, weighted.
    `prompts` (optional, aligned with `texts`) select the number-only check where they ask for it."""
    c = correctness_reward(prompts=prompts, completions=texts, answer=answers)
    f = format_reward(prompts=prompts, completions=texts)
    n = max(1, len(texts))
    return {"correct": sum(c) / n, "format": sum(f) / n,
            "reward": sum(correct * a + format * b for a, b in zip(c, f)) / n}
