"""Issue 23: `hybridize grpo` on rows without an answer (or problem), with a reward that raises, or with a NaN
loss ends in one line (exit 2 through the CLI), and the checkpoint saved before is intact and resumes."""
from __future__ import annotations

import json
import math
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, TrainerCallback

from hybridize.distill.loop import NonFiniteLoss
from hybridize.errors import UserError
from hybridize.rl.data import build_records
from hybridize.rl.rewards import GuardedReward, RewardError, correctness_reward, guard_reward
from hybridize.rl.trainer import read_metrics, run_grpo
from tests.rl.helpers import byte_tokenizer, tiny_hybrid, write_problems
from tests.rl.test_trainer import _cfg, digit_reward


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_main(monkeypatch, capsys, args: list[str]) -> str:
    """`hybridize ARGS` through the real entry point; returns its one error line, the last on stderr (exit
    status 2; progress bars and library warnings before it are not ours)."""
    from hybridize.cli import main

    monkeypatch.setattr(sys, "argv", ["hybridize", *args])
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert e.value.code == 2, err
    assert [ln for ln in lines if ln.startswith("error:")] == lines[-1:] and "Traceback" not in err, err
    return lines[-1]


@pytest.fixture
def setup(tmp_path):
    tiny_hybrid(tmp_path / "m", mixer="gla")
    write_problems(tmp_path / "p.jsonl")
    return tmp_path


def _cli(tmp_path, data, *extra):
    return ["grpo", "--model", str(tmp_path / "m"), "--output-dir", str(tmp_path / "run"), f"data.train=[{data}]",
            "grpo.num_generations=4", "grpo.per_device_train_batch_size=4", "grpo.max_completion_length=8",
            "save_steps=1", "progress=false", *extra]


def _finite(folder) -> bool:
    model = AutoModelForCausalLM.from_pretrained(folder)
    return all(torch.isfinite(p).all() for p in model.parameters())


# ---- rows without the answer (or problem) field -------------------------------------------------

def test_cli_all_rows_without_answer_is_one_line_exit_2(setup, monkeypatch, capsys):
    data = _jsonl(setup / "noans.jsonl", [{"problem": "1+1?"}, {"problem": "2+2?", "solution": "4"}])
    line = run_main(monkeypatch, capsys, _cli(setup, data, "grpo.max_steps=1"))
    assert str(data) in line and "none of its 2 rows has an 'answer'" in line
    assert not (setup / "run" / "checkpoint-1").exists()


def test_some_rows_without_problem_are_dropped_with_a_warning_line(tmp_path, capsys):
    """They used to stop the run (`records [1] have no 'problem'`), unlike rows without an answer."""
    p = _jsonl(tmp_path / "some.jsonl", [{"problem": "1+1?", "answer": "2"}, {"answer": "4"},
                                          {"question": "3+3?", "answer": "6"}, {"solution": "x"}])
    recs = build_records(str(p), byte_tokenizer(), instruction="", chat="off")
    assert sorted(r["answer"] for r in recs) == ["2", "6"]
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert f"warning: {p}: dropped 2 of 4 rows with no 'problem' (or 'question') field (first: row 2)" in err
    assert f"warning: {p}: dropped 1 of 4 rows with no 'answer' (or 'final_answer') field (first: row 4)" in err
    none = _jsonl(tmp_path / "none.jsonl", [{"answer": "1"}, {"answer": "2"}])
    with pytest.raises(UserError) as e:
        build_records(str(none), byte_tokenizer(), instruction="")
    assert f"{none}: none of its 2 rows has a 'problem'" in str(e.value) and "\n" not in str(e.value)


def test_a_line_that_is_not_an_object_is_one_line(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"problem": "1+1?", "answer": "2"}\n[1, 2]\n')
    with pytest.raises(UserError, match=r"x\.jsonl: 1 of 2 rows are not JSON objects \(first: row 2, a list\)"):
        build_records(str(p), byte_tokenizer(), instruction="")


# ---- a reward that raises ------------------------------------------------------------------------

def test_guarded_reward_keeps_the_name_and_scores_one_odd_completion_zero(capsys):
    def picky(completions, answer, **kw):
        if any(c == "odd" for c in completions):
            raise RecursionError("maximum recursion depth exceeded in sympy")
        return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]

    g = guard_reward(picky)
    assert g.__name__ == "picky" and guard_reward(g) is g
    assert guard_reward(correctness_reward).__name__ == "correctness_reward"
    out = g(prompts=["p"] * 3, completions=["5", "odd", "7"], completion_ids=[[1], [2], [3]], answer=["5", "6", "1"])
    assert out == [1.0, 0.0, 0.0]
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["warning: reward picky raised at a scoring call on 1 of 3 completions (RecursionError: maximum "
                   "recursion depth exceeded in sympy): scored 0 (1 so far in this run)"]

    def broken(completions, **kw):
        raise KeyError("score")

    with pytest.raises(RewardError) as e:
        GuardedReward(broken)(prompts=["p", "q"], completions=["a", "b"])
    assert str(e.value) == "reward broken raised at a scoring call on all 2 completions (KeyError: 'score')"


def test_reward_raising_at_step_3_is_one_line_and_the_run_resumes(setup, monkeypatch, capsys):
    """Save every step, 2 good steps, then a reward that raises on every call: one line naming the reward,
    the step and the error; checkpoint-2 is intact and `--resume` with a fixed reward finishes the run."""
    def verifier(completions, trainer_state=None, **kw):
        if trainer_state is not None and trainer_state.global_step >= 2:
            raise ConnectionError("verifier service at localhost:9 refused the connection")
        return digit_reward(completions)

    monkeypatch.setattr("hybridize.rl.trainer.reward_functions", lambda *a, **k: ([verifier], [1.0]))
    args = _cli(setup, setup / "p.jsonl", "grpo.max_steps=4")
    line = run_main(monkeypatch, capsys, args)
    run = setup / "run"
    assert line.startswith("error: reward verifier raised at step 3 on all 4 completions (ConnectionError: "
                           "verifier service at localhost:9 refused the connection); "), line
    assert f"the last checkpoint, saved before it, is {run / 'checkpoint-2'}" in line and "--resume" in line
    assert (run / "checkpoint-2").is_dir() and not (run / "checkpoint-3").exists() and not (run / "final").exists()
    assert _finite(run / "checkpoint-2")
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if "reward" in r] == [1, 2]

    monkeypatch.setattr("hybridize.rl.trainer.reward_functions", lambda *a, **k: ([digit_reward], [1.0]))  # fixed
    s = run_grpo(_cfg(setup, "grpo.max_steps=3"), resume=True)
    assert s["steps"] == 3 and (run / "final" / "config.json").is_file()
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if "reward" in r] == [1, 2, 3]


# ---- NaN loss / gradients ---------------------------------------------------------------------

def _nan_loss_at(monkeypatch, cls, step: int):
    """`cls.compute_loss` returns NaN (with a NaN gradient) from optimizer step `step` (1-based) on."""
    real = cls.compute_loss

    def compute_loss(self, model, inputs, *args, **kwargs):
        out = real(self, model, inputs, *args, **kwargs)
        if self.state.global_step + 1 < step:
            return out
        return (out[0] * math.nan, *out[1:]) if isinstance(out, tuple) else out * math.nan

    monkeypatch.setattr(cls, "compute_loss", compute_loss)


def test_nan_loss_at_step_3_stops_before_saving_and_the_run_resumes(setup, monkeypatch):
    from trl import GRPOTrainer

    _nan_loss_at(monkeypatch, GRPOTrainer, 3)
    monkeypatch.setattr("hybridize.rl.trainer.reward_functions", lambda *a, **k: ([digit_reward], [1.0]))
    run = setup / "run"
    with pytest.raises(NonFiniteLoss) as e:
        run_grpo(_cfg(setup, "grpo.max_steps=4"))
    msg = str(e.value)
    assert msg.startswith("grpo: the loss is nan at step 3 (stopped before its update); nothing was saved from "
                          f"this state - the last good checkpoint is {run / 'checkpoint-2'}: "), msg
    assert "grpo.learning_rate" in msg and "\n" not in msg and isinstance(e.value, UserError)
    assert not (run / "checkpoint-3").exists() and not (run / "final").exists() and _finite(run / "checkpoint-2")

    monkeypatch.undo()
    monkeypatch.setattr("hybridize.rl.trainer.reward_functions", lambda *a, **k: ([digit_reward], [1.0]))
    s = run_grpo(_cfg(setup, "grpo.max_steps=3"), resume=True)
    assert s["steps"] == 3 and _finite(run / "final")


class NanGradAt(TrainerCallback):
    """From optimizer step `step` on, the first trainable parameter's gradient is NaN (the loss stays finite)."""

    def __init__(self, step: int):
        self.step, self.hooked = step, False

    def on_step_begin(self, args, state, control, model=None, **kw):
        if state.global_step + 1 >= self.step and not self.hooked:
            p = next(p for p in model.parameters() if p.requires_grad)
            p.register_hook(lambda g: g * math.nan)
            self.hooked = True


def test_nan_gradient_with_a_finite_loss_stops_before_the_update(setup, monkeypatch):
    monkeypatch.setattr("hybridize.rl.trainer.reward_functions", lambda *a, **k: ([digit_reward], [1.0]))
    run = setup / "run"
    with pytest.raises(NonFiniteLoss, match=r"^grpo: the gradients are not finite at step 2 with a finite loss"):
        run_grpo(_cfg(setup, "grpo.max_steps=3"), callbacks=[NanGradAt(2)])
    assert (run / "checkpoint-1").is_dir() and not (run / "checkpoint-2").exists() and _finite(run / "checkpoint-1")
