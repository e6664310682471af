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

`run_grpo` hands every reward function to TRL through `guard_reward`: a reward that raises on a whole call
stops the run with one line (`RewardError`), one that raises on a few odd completions scores those 0 with a
counted warning (see `guard_reward` for why).
"""
from __future__ import annotations

import sys
from collections.abc import Sequence

from hybridize.errors import UserError, first_line
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


class RewardError(UserError):
    """A reward function raised on every completion of a call: the run stops with this one line."""


class GuardedReward:
    """A reward function as TRL calls it (`f(prompts=, completions=, completion_ids=, **columns)`), with its
    exceptions caught at the call; see `guard_reward`. Logged under the wrapped function's `__name__`."""

    def __init__(self, fn):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.failed = 0   # completions scored 0 because the reward raised on them, over the run

    def __call__(self, prompts=None, completions=None, completion_ids=None, **kwargs):
        state = kwargs.get("trainer_state")
        where = f"step {state.global_step + 1}" if state is not None else "a scoring call"
        call = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
        try:
            return self.fn(**call)
        except Exception as e:  # noqa: BLE001 - any failure of user-facing reward code is reported, not a traceback
            batch_error = e
        n = len(completions) if completions is not None else 0
        scores, errors = [], []
        for i in range(n):   # one completion at a time (every per-completion list sliced): which ones fail?
            one = {k: v[i:i + 1] if isinstance(v, list) and len(v) == n else v for k, v in call.items()}
            try:
                scores.append(self.fn(**one)[0])
            except Exception as e:  # noqa: BLE001
                errors.append(e)
                scores.append(0.0)
        if len(errors) == n:   # a broken reward, not an odd completion (n == 0: the batch error itself)
            e = errors[0] if errors else batch_error
            raise RewardError(f"reward {self.__name__} raised at {where} on all {n} completions "
                              f"({type(e).__name__}: {first_line(e)})") from e
        if errors:
            self.failed += len(errors)
            e = errors[0]
            print(f"warning: reward {self.__name__} raised at {where} on {len(errors)} of {n} completions "
                  f"({type(e).__name__}: {first_line(e)}): scored 0 ({self.failed} so far in this run)",
                  file=sys.stderr)
        else:
            print(f"warning: reward {self.__name__} raised at {where} on the batch of {n} completions "
                  f"({type(batch_error).__name__}: {first_line(batch_error)}) but not on any one of them: "
                  "scored one by one", file=sys.stderr)
        return scores


def guard_reward(fn):
    """`fn` wrapped so that its exceptions are caught at the reward call.

    A call that raises is retried one completion at a time. When every completion raises, the reward is
    broken (a bug, a missing dataset column, a dead verifier service): `RewardError`, one line naming the
    reward, the step and the original error's type and message; `run_grpo` adds the last checkpoint to
    `--resume` from, and nothing is saved from that step (the error comes before its update). When only some
    raise, those score 0 and a warning line counts them.

    Why 0 rather than stop for a few: the rewards grade free model text. math-verify parses it with sympy and
    can fail on a pathological completion (deep nesting, huge powers, a timeout in the parser): one such sample
    in thousands should not end a multi-hour run, and 0 is what a grader would give an answer it cannot verify
    - the same rule `is_correct` already applies to math-verify's own exceptions. The warning keeps the count
    visible, so a reward that fails often is noticed. Async reward functions are returned unchanged."""
    import inspect

    if isinstance(fn, GuardedReward) or inspect.iscoroutinefunction(fn) or \
            inspect.iscoroutinefunction(getattr(fn, "__call__", None)):
        return fn
    return GuardedReward(fn)
