"""Issue 23: `hybridize distill sft` on rows without the text it trains on, or with a NaN loss (or weights), ends
in one line (exit 2 through the CLI), and the last complete checkpoint is intact and resumes."""
from __future__ import annotations

import json
import math
import sys

import pytest
import torch
from transformers import TrainerCallback

import hybridize.distill.sft as sft_mod
from hybridize.distill.config import SFTStageConfig, load_config
from hybridize.distill.loop import NonFiniteLoss
from hybridize.distill.sft import build_sft_dataset, latest_complete, sft
from hybridize.errors import UserError

from .helpers import smol_tokenizer, tiny_llama_vocab, write_rows


@pytest.fixture(scope="module")
def tok():
    return smol_tokenizer()


def _student(tok):
    from hybridize.convert.convert import convert_model

    return convert_model(tiny_llama_vocab(len(tok)), "2:1", mixer="gla").train()


def _cfg(tmp_path, max_steps, **extra):
    data = write_rows(tmp_path / "g.jsonl", [{"problem": f"What is {i}+{i}?", "solution": f"{2 * i}"} for i in range(16)])
    return load_config(SFTStageConfig, None, {
        "traces": str(data), "max_examples": 16, "max_length": 64, "batch_size": 2, **extra,
        "train": {"run_dir": str(tmp_path / "sft"), "save_every": 1, "lr": 1e-3, "progress": False,
                  "warmup_steps": 0, "max_steps": max_steps}})


def _finite(ckpt) -> bool:
    from safetensors.torch import load_file

    return all(torch.isfinite(t).all() for t in load_file(f"{ckpt}/model.safetensors").values())


# ---- rows without the text SFT trains on ----------------------------------------------------------

def test_some_rows_without_the_completion_are_dropped_with_one_warning_line(tmp_path, tok, capsys):
    f = write_rows(tmp_path / "t.jsonl", [{"problem": "1+1?", "solution": "2"}, {"problem": "x"},
                                     {"problem": "2+2?", "solution": "4"}, {"problem": "", "solution": " "}])
    ds = build_sft_dataset(load_config(SFTStageConfig, None, {"traces": str(f)}), tok)
    assert len(ds) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("warning:")]
    assert err == [f"warning: {f}: dropped 2 of 4 rows: 1 with no text in 'problem' (prompt_field, first: row 4); "
                   "2 with no text in 'solution' (completion_field, first: row 2)"], err


def test_no_row_with_the_completion_field_is_one_line(tmp_path, tok):
    f = write_rows(tmp_path / "t.jsonl", [{"problem": "1+1?", "completion": "2"}, {"problem": "2+2?", "completion": "4"}])
    with pytest.raises(UserError) as e:
        build_sft_dataset(load_config(SFTStageConfig, None, {"traces": str(f)}), tok)
    msg = str(e.value)
    assert msg.startswith(f"{f}: none of its 2 rows can be trained on: 2 with no text in 'solution' "
                          "(completion_field, first: row 1); its columns are ['problem', 'completion']: set "), msg
    assert "completion_field=" in msg and "\n" not in msg


def test_cli_no_row_with_the_completion_field_exits_2(tmp_path, tok, monkeypatch, capsys):
    from hybridize.cli import main

    student = tmp_path / "student"
    _student(tok).save_pretrained(student)
    tok.save_pretrained(student)
    f = write_rows(tmp_path / "t.jsonl", [{"question": "1+1?", "solution": "2"}])
    monkeypatch.setattr(sys, "argv", ["hybridize", "distill", "sft", f"student={student}", f"traces={f}",
                                      f"train.run_dir={tmp_path / 'sft'}", "train.progress=false"])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert err == [f"error: {f}: none of its 1 rows can be trained on: 1 with no text in 'problem' (prompt_field, "
                   "first: row 1); its columns are ['question', 'solution']: set prompt_field= / completion_field= "
                   "to the ones that hold them"], err


# ---- NaN loss / weights -----------------------------------------------------------------------------

def test_nan_loss_at_step_3_stops_before_saving_and_the_run_resumes(tmp_path, tok, monkeypatch):
    from trl import SFTTrainer

    real = SFTTrainer.compute_loss

    def nan_from_step_3(self, model, inputs, *args, **kwargs):
        out = real(self, model, inputs, *args, **kwargs)
        if self.state.global_step + 1 < 3:
            return out
        return (out[0] * math.nan, *out[1:]) if isinstance(out, tuple) else out * math.nan

    monkeypatch.setattr(SFTTrainer, "compute_loss", nan_from_step_3)
    ckpts = tmp_path / "sft" / "checkpoints"
    with pytest.raises(NonFiniteLoss) as e:
        sft(_student(tok), tok, _cfg(tmp_path, 4))
    msg = str(e.value)
    assert msg.startswith("sft: the loss is nan at step 3 (stopped before its update); nothing was saved from this "
                          f"state - the last good checkpoint is {ckpts / 'checkpoint-2'}: "), msg
    assert "train.lr" in msg and "\n" not in msg and isinstance(e.value, UserError)
    assert latest_complete(tmp_path / "sft") == str(ckpts / "checkpoint-2")
    assert not (ckpts / "checkpoint-3").exists() and not (tmp_path / "sft" / "final").exists()
    assert _finite(ckpts / "checkpoint-2")

    monkeypatch.undo()
    out, _ = sft(_student(tok), tok, _cfg(tmp_path, 3), resume=True)
    assert out.global_step == 3 and _finite(ckpts / "checkpoint-3")
    steps = [json.loads(x)["step"] for x in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(x)]
    assert steps == [1, 2, 3]


class PoisonAfterUpdate(TrainerCallback):
    """A weight turns NaN in step `step`'s update (an optimizer blow-up the loss check cannot see)."""

    def __init__(self, step: int):
        self.step = step

    def on_optimizer_step(self, args, state, control, model=None, **kw):
        if state.global_step + 1 == self.step:
            with torch.no_grad():
                next(p for p in model.parameters() if p.requires_grad).view(-1)[0] = math.nan


def test_nan_weights_are_never_checkpointed(tmp_path, tok, monkeypatch):
    real = sft_mod.sft_callbacks
    monkeypatch.setattr(sft_mod, "sft_callbacks", lambda run_dir: [*real(run_dir), PoisonAfterUpdate(2)])
    with pytest.raises(NonFiniteLoss, match=r"^sft: training diverged by step 2: some trainable weights are not "
                                            r"finite; nothing was saved from this state - the last good checkpoint "
                                            r"is .*checkpoint-1: "):
        sft(_student(tok), tok, _cfg(tmp_path, 3))
    assert latest_complete(tmp_path / "sft").endswith("checkpoint-1")
    assert not (tmp_path / "sft" / "checkpoints" / "checkpoint-2").exists()
