"""A converted checkpoint records its teacher as an absolute path (names stay names) with a fingerprint of
the teacher's weight files; distillation checks it (issue 29: a relative `--src` run from another folder
distilled against a different model of that name, and config.yaml recorded `teacher: ''`)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from hybridize.errors import UserError
from tests.convert.common import tiny_teacher, tiny_tokenizer


def _save_teacher(path: Path, seed: int = 0) -> Path:
    tiny_teacher("llama", seed=seed).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture()
def converted(tmp_path, monkeypatch):
    """`hybridize convert --src teacher` run inside tmp_path (a relative --src) -> (student folder, teacher)."""
    from hybridize.cli import app

    teacher = _save_teacher(tmp_path / "teacher")
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["convert", "--src", "teacher", "--layers", "2:1", "--mixer", "gla",
                                   "--out", "student", "--prompt", "", "--no-calibrate", "--samples", "1"])
    assert res.exit_code == 0, res.output
    return tmp_path / "student", teacher


def test_convert_records_the_absolute_teacher_and_its_fingerprint(converted):
    student, teacher = converted
    cfg = json.loads((student / "config.json").read_text())
    assert cfg["teacher_source"] == str(teacher.resolve())
    assert cfg["teacher_fingerprint"].startswith("sha256:")
    report = json.loads((student / "report.json").read_text())
    assert report["source"]["teacher"] == str(teacher.resolve())
    assert report["source"]["fingerprint"] == cfg["teacher_fingerprint"]


def test_recorded_source_keeps_names():
    from hybridize.convert.fingerprint import recorded_source

    assert recorded_source("Qwen/Qwen3-1.7B") == "Qwen/Qwen3-1.7B"
    assert recorded_source("qwen3-1.7b") == "qwen3-1.7b"


def _e2e_config(tmp_path: Path, student: Path, **over):
    from hybridize.distill.config import E2EConfig, load_config
    from tests.distill.helpers import write_texts

    base = {"student": str(student),
            "train": {"run_dir": str(tmp_path / "run"), "max_steps": 1, "progress": False, "save_every": 0,
                      "warmup_steps": 0},
            "data": {"train": str(write_texts(tmp_path / "texts.jsonl")), "seq_len": 16, "batch_tokens": 32}}
    base.update(over)
    return load_config(E2EConfig, None, base)


def test_distill_records_the_teacher_it_used_in_config_yaml(converted, tmp_path):
    from hybridize.distill.e2e import run_e2e

    student, teacher = converted
    run_e2e(_e2e_config(tmp_path, student))
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["teacher"] == str(teacher.resolve())


def test_distill_stops_when_the_recorded_teacher_has_other_weights(converted, tmp_path):
    from hybridize.distill.e2e import run_e2e

    student, teacher = converted
    _save_teacher(teacher, seed=1)  # another model under the same name
    with pytest.raises(UserError) as e:
        run_e2e(_e2e_config(tmp_path, student))
    msg = str(e.value)
    assert "different weights" in msg and str(teacher.resolve()) in msg and "\n" not in msg
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_recorded_teacher_that_no_longer_resolves_is_one_line(converted, tmp_path):
    """A checkpoint converted before the fix records a relative path; from elsewhere it does not resolve."""
    from hybridize.distill.models import load_student, teacher_source_of

    student, _ = converted
    cfg = json.loads((student / "config.json").read_text())
    cfg["teacher_source"], cfg["teacher_fingerprint"] = "./gone/teacher", None
    (student / "config.json").write_text(json.dumps(cfg))
    model, _ = load_student(str(student))
    with pytest.raises(UserError) as e:
        teacher_source_of(model)
    assert "does not resolve" in str(e.value) and "teacher=" in str(e.value) and "\n" not in str(e.value)


# ---- --resume continues with the teacher the run started with, and only with it ---------------------------

def _distill_e2e(tmp_path: Path, *args):
    """`hybridize distill e2e` of the converted student into tmp_path/run (cwd: tmp_path)."""
    from hybridize.cli import app
    from tests.distill.helpers import write_texts

    common = ["student=student", f"data.train={write_texts(tmp_path / 'texts.jsonl')}", "data.seq_len=16",
              "data.batch_tokens=32", "train.progress=false", "train.save_every=1", "train.warmup_steps=0",
              "train.threads=1", "train.run_dir=run"]
    return CliRunner().invoke(app, ["distill", "e2e", *common, *args])


def _one_line(res) -> str:
    assert isinstance(res.exception, UserError), res.output + repr(res.exception)
    assert "\n" not in str(res.exception)
    return str(res.exception)


def test_resume_continues_with_the_recorded_teacher_and_refuses_another(converted, tmp_path):
    """A run started on the student's recorded teacher resumes without naming it (config.yaml holds it
    resolved, which once read as a changed setting), or naming it by a relative path; a run resumed with
    another teacher is refused."""
    _, teacher = converted
    assert _distill_e2e(tmp_path, "train.max_steps=1").exit_code == 0
    r = _distill_e2e(tmp_path, "train.max_steps=2", "--resume")
    assert r.exit_code == 0, r.output + repr(r.exception)
    record = json.loads((tmp_path / "run" / "teacher.json").read_text())
    assert record["teacher"] == str(teacher.resolve()) and record["fingerprint"].startswith("sha256:")
    r = _distill_e2e(tmp_path, "train.max_steps=3", "teacher=teacher", "--resume")
    assert r.exit_code == 0, r.output + repr(r.exception)
    _save_teacher(tmp_path / "other", seed=1)
    msg = _one_line(_distill_e2e(tmp_path, "train.max_steps=4", "teacher=other", "--resume"))
    assert msg.startswith("--resume: settings differ") and "teacher: '" in msg and "/other'" in msg
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())[-1] == "step-000003"


def test_resume_refuses_a_teacher_folder_that_now_holds_other_weights(converted, tmp_path):
    """Same name, other weights: the run's teacher.json fingerprint stops the resume before the teacher loads."""
    from hybridize.distill import models

    _, teacher = converted
    assert _distill_e2e(tmp_path, "train.max_steps=1", "teacher=teacher").exit_code == 0
    _save_teacher(teacher, seed=1)
    loaded = []
    real = models.load_teacher
    models.load_teacher = lambda *a, **k: loaded.append(a) or real(*a, **k)
    try:
        msg = _one_line(_distill_e2e(tmp_path, "train.max_steps=2", "teacher=teacher", "--resume"))
    finally:
        models.load_teacher = real
    assert "different weights" in msg and "--overwrite" in msg and not loaded


def test_resume_with_nothing_to_resume_records_the_new_teacher(converted, tmp_path):
    """A run that stopped before its first checkpoint resumes from step 0: any teacher may start it."""
    from hybridize.distill.models import check_run_teacher

    _, teacher = converted
    other = _save_teacher(tmp_path / "other", seed=1)
    check_run_teacher(tmp_path / "run", str(teacher), resume=False)
    assert check_run_teacher(tmp_path / "run", str(other), resume=True) == str(other.resolve())
    assert json.loads((tmp_path / "run" / "teacher.json").read_text())["teacher"] == str(other.resolve())
