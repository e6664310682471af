"""Issue 29, lost work: bad step counts fail at parse time, `export -o` and `distill` refuse to replace a
folder they did not write, the NaN guard names a checkpoint from before the divergence, `--resume`
honours a new train.lr (and refuses settings it cannot change), and resuming never unpickles code."""
from __future__ import annotations

from pathlib import Path

import pytest

from hybridize.distill.config import AlignConfig, E2EConfig, SFTStageConfig, load_config
from hybridize.errors import UserError


def _one_line(e: BaseException) -> str:
    msg = str(e)
    assert isinstance(e, UserError) and "\n" not in msg, repr(e)
    return msg


# ---- 5: counts checked at parse time -----------------------------------------------------------------

@pytest.mark.parametrize("cls, override, key", [
    (E2EConfig, "train.max_steps=-5", "train.max_steps"),
    (E2EConfig, "train.max_steps=0", "train.max_steps"),
    (AlignConfig, "train.grad_accum=0", "train.grad_accum"),
    (AlignConfig, "train.warmup_steps=-1", "train.warmup_steps"),
    (E2EConfig, "data.seq_len=0", "data.seq_len"),
    (E2EConfig, "data.batch_tokens=-8", "data.batch_tokens"),
    (E2EConfig, "train.save_every=-1", "train.save_every"),
    (E2EConfig, "train.lr=-1e-4", "train.lr"),
    (E2EConfig, "lora.r=0", "lora.r"),
    (SFTStageConfig, "batch_size=0", "batch_size"),
    (SFTStageConfig, "max_length=-1", "max_length"),
])
def test_bad_counts_fail_at_parse_time(cls, override, key):
    with pytest.raises(UserError) as e:
        load_config(cls, None, [override])
    assert _one_line(e.value).startswith(f"{key} must be >=")


def test_zero_where_zero_means_off_still_parses():
    c = load_config(E2EConfig, None, ["train.save_every=0", "train.warmup_steps=0", "train.max_grad_norm=0",
                                      "data.max_docs=0", "train.threads=0", "train.max_steps=1"])
    assert (c.train.save_every, c.train.warmup_steps, c.train.max_steps) == (0, 0, 1)


# ---- 1: export -o never loses a folder it did not write ------------------------------------------------

@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A 2-step stage B run (checkpoints/step-000002) on a converted tiny hybrid."""
    from tests.distill.test_scale import e2e_config, make_student_folder, run_e2e

    tmp = tmp_path_factory.mktemp("trained")
    run_e2e(e2e_config(tmp, "b", make_student_folder(tmp / "student"), params="mixer"))
    return tmp / "b"


def _export(*args):
    from typer.testing import CliRunner

    from hybridize.cli import app
    return CliRunner().invoke(app, ["export", *map(str, args)])


def test_export_refuses_a_foreign_folder_and_overwrite_replaces_it(trained_run, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    r = _export("-c", trained_run, "-o", out)
    assert r.exit_code != 0 and "--overwrite" in _one_line(r.exception)
    assert (out / "notes.txt").read_text() == "mine"
    r = _export("-c", trained_run, "-o", out, "--overwrite")
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert not (out / "notes.txt").exists() and (out / "config.json").is_file() and (out / "export.json").is_file()
    r = _export("-c", trained_run, "-o", out)  # an earlier export is replaced without asking
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging folder left behind


def test_export_never_deletes_a_parent_of_the_cwd_or_of_the_checkpoint(trained_run, tmp_path, monkeypatch):
    sub = tmp_path / "work" / "sub"
    sub.mkdir(parents=True)
    (tmp_path / "work" / "notes.txt").write_text("mine")
    monkeypatch.chdir(sub)
    r = _export("-c", trained_run, "-o", "..", "--overwrite")
    assert r.exit_code != 0 and "current directory" in _one_line(r.exception)
    assert (tmp_path / "work" / "notes.txt").is_file() and sub.is_dir()
    for out in (trained_run, trained_run.parent, trained_run / "checkpoints" / "step-000002"):
        r = _export("-c", trained_run, "-o", out, "--overwrite")
        assert r.exit_code != 0 and "the checkpoint" in _one_line(r.exception)
    assert (trained_run / "checkpoints" / "step-000002" / "trainer_state.json").is_file()


# ---- 2: distill into a folder holding a run ------------------------------------------------------------

@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A saved tiny teacher, its converted student (both with a tokenizer) and a text file."""
    from tests.distill.helpers import tiny_llama, write_texts
    from tests.distill.test_scale import make_student_folder

    tmp = tmp_path_factory.mktemp("folders")
    make_student_folder(tmp / "student")
    tiny_llama(0).save_pretrained(tmp / "teacher")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tmp / "student" / name).is_file():
            (tmp / "teacher" / name).write_bytes((tmp / "student" / name).read_bytes())
    write_texts(tmp / "texts.jsonl")
    return tmp


def _distill(folders, run_dir, *args, stage="e2e"):
    """`hybridize distill <stage>` on the tiny folders into `run_dir` (extra args: overrides and flags)."""
    from typer.testing import CliRunner

    from hybridize.cli import app
    common = [f"student={folders / 'student'}", f"teacher={folders / 'teacher'}", f"data.train={folders / 'texts.jsonl'}",
              "data.seq_len=16", "data.batch_tokens=32", "train.progress=false", "train.save_every=1",
              "train.warmup_steps=1", "train.scheduler=constant", "train.threads=1", f"train.run_dir={run_dir}"]
    return CliRunner().invoke(app, ["distill", stage, *common, *map(str, args)])


def _metric_rows(run_dir):
    import json
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def _steps(run_dir):
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


@pytest.mark.parametrize("stage", ["e2e", "align"])
def test_distill_refuses_to_start_over_in_a_run_folder(folders, tmp_path, stage):
    run = tmp_path / "run"
    r = _distill(folders, run, "train.max_steps=3", stage=stage)
    assert r.exit_code == 0, r.output + repr(r.exception)
    before = (run / "metrics.jsonl").read_text()
    r = _distill(folders, run, "train.max_steps=2", stage=stage)
    msg = _one_line(r.exception)
    assert r.exit_code != 0 and str(run) in msg and "--resume" in msg and "--overwrite" in msg
    assert (run / "metrics.jsonl").read_text() == before and _steps(run) == ["step-000002", "step-000003"]
    r = _distill(folders, run, "train.max_steps=2", "--resume", "--overwrite", stage=stage)
    assert r.exit_code != 0 and "not both" in _one_line(r.exception)
    r = _distill(folders, run, "train.max_steps=2", "--overwrite", stage=stage)
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert _steps(run) == ["step-000001", "step-000002"]  # the old run's step-3 is gone: not kept, not resumed
    assert [row["step"] for row in _metric_rows(run) if "loss" in row] == [1, 2]


def test_distill_sft_refuses_to_start_over_in_a_run_folder(tmp_path):
    """Stage C (TRL's checkpoint-N layout) is guarded as A and B: refused before the student loads, nothing
    of the old run touched."""
    from typer.testing import CliRunner

    from hybridize.cli import app
    run = tmp_path / "run"
    (run / "checkpoints" / "checkpoint-4").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 4, "loss": 1.0}\n')
    r = CliRunner().invoke(app, ["distill", "sft", f"student={tmp_path / 'nowhere'}", f"train.run_dir={run}"])
    msg = _one_line(r.exception)
    assert r.exit_code != 0 and str(run) in msg and "--resume" in msg and "--overwrite" in msg
    assert (run / "checkpoints" / "checkpoint-4").is_dir() and (run / "metrics.jsonl").read_text().startswith("{")


# ---- 6: resuming never unpickles code -----------------------------------------------------------------

class Payload:
    """Unpickling this creates the file `marker` (a harmless stand-in for code a checkpoint could run)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def spy_free_unpickles() -> tuple[list[str], object]:
    """Replace `torch.load` (looked up at call time by DeepSpeed and the Trainer) by a wrapper that records every
    file unpickled without `weights_only`; returns (that list, the real `torch.load`). For subprocess workers."""
    import torch

    opened, real_load = [], torch.load

    def spy(f, *a, **k):
        if not k.get("weights_only", True):
            opened.append(str(f))
        return real_load(f, *a, **k)
    torch.load = spy
    return opened, real_load


def plant_payload(tmp) -> tuple[Path, bool]:
    """Save a `Payload` as TMP/payload.pt and unpickle it freely once: (its marker path, whether the payload ran,
    i.e. the control that the refusal tests guard something live). The marker is removed again."""
    import torch

    marker = Path(tmp) / "pwned"
    torch.save(Payload(marker), Path(tmp) / "payload.pt")
    torch.load(Path(tmp) / "payload.pt", weights_only=False)
    live = marker.is_file()
    marker.unlink()
    return marker, live


@pytest.mark.parametrize("part", ["custom_checkpoint_0.pkl", "scheduler.json", "random_states_0.pkl",
                                  "optimizer.bin"])
def test_resume_refuses_a_pickled_payload(folders, tmp_path, part):
    import shutil

    import torch

    marker = tmp_path / "pwned"
    torch.save(Payload(marker), tmp_path / "probe.pkl")
    torch.load(tmp_path / "probe.pkl", weights_only=False)  # the payload works when unpickled freely
    assert marker.is_file()
    marker.unlink()
    run = tmp_path / "run"
    r = _distill(folders, run, "train.max_steps=2")
    assert r.exit_code == 0, r.output + repr(r.exception)
    ckpt = run / "checkpoints" / "step-000002"
    if part == "custom_checkpoint_0.pkl":  # a checkpoint of the layout accelerate pickles the scheduler in
        (ckpt / "scheduler.json").unlink(missing_ok=True)
    shutil.copy(tmp_path / "probe.pkl", ckpt / part)
    r = _distill(folders, run, "train.max_steps=3", "--resume")
    msg = _one_line(r.exception)
    assert r.exit_code != 0 and str(ckpt) in msg, msg
    assert not marker.exists()


# ---- 3: the NaN guard names a checkpoint from before the divergence ------------------------------------

def test_huge_lr_stops_naming_a_checkpoint_from_before_the_divergence(tmp_path):
    """Warm-up makes step 1 an lr-0 step (a healthy checkpoint), then lr 1e3 blows the weights up: the run
    must stop naming step 1, whose weights are the sane starting ones, and save nothing later."""
    import re

    import torch
    from safetensors.torch import load_file

    from hybridize.distill.e2e import e2e
    from tests.distill.helpers import ToyTokenizer, tiny_llama, toy_convert, write_texts

    student = toy_convert(tiny_llama(1), layers=(0, 1))
    start = max(p.detach().abs().max().item() for p in student.parameters())
    cfg = load_config(E2EConfig, None, {
        "train": {"run_dir": str(tmp_path / "run"), "max_steps": 20, "lr": 1e4, "warmup_steps": 10,
                  "scheduler": "constant", "save_every": 1, "progress": False, "threads": 1},
        "data": {"train": str(write_texts(tmp_path / "t.jsonl")), "seq_len": 24, "batch_tokens": 48}})
    with pytest.raises(UserError) as e:
        e2e(student, tiny_llama(0), ToyTokenizer(), cfg)
    msg = _one_line(e.value)
    named = re.search(r"(\S+/checkpoints/step-\d+)", msg)
    assert named and named.group(1).endswith("step-000001"), msg
    assert _steps(tmp_path / "run") == ["step-000001"]
    weights = load_file(f"{named.group(1)}/model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert max(w.abs().max().item() for w in weights.values()) <= 2 * start


def test_guard_refuses_a_loss_spike_and_a_non_finite_grad_norm():
    import torch

    from hybridize.distill.loop import DivergenceGuard

    class Acc:
        num_processes = 1

    guard = DivergenceGuard(Acc(), [torch.ones(3)])
    for _ in range(DivergenceGuard.WINDOW):
        guard.note(1.0, 0.5)
    assert guard.problem() is None
    guard.note(1.0, float("inf"))
    assert "gradient norm" in guard.problem()
    for _ in range(DivergenceGuard.WINDOW):
        guard.note(1e3, 0.5)
    assert "mean loss" in guard.problem()


# ---- 4: --resume honours a new train.lr, refuses settings it cannot change -----------------------------

def test_resume_uses_a_new_lr_and_refuses_other_changes(folders, tmp_path):
    import yaml

    run = tmp_path / "run"
    r = _distill(folders, run, "train.max_steps=2", "train.lr=3e-3")
    assert r.exit_code == 0, r.output + repr(r.exception)
    r = _distill(folders, run, "train.max_steps=4", "train.lr=3e-3", "data.seq_len=8", "--resume")
    msg = _one_line(r.exception)
    assert r.exit_code != 0 and "data.seq_len" in msg and "--overwrite" in msg and "train.lr" not in msg.split(";")[0]
    r = _distill(folders, run, "train.max_steps=4", "train.lr=1e-4", "--resume")
    assert r.exit_code == 0, r.output + repr(r.exception)
    lrs = {row["step"]: row["lr"] for row in _metric_rows(run) if "lr" in row}
    assert lrs == {1: 3e-3, 2: 3e-3, 3: pytest.approx(1e-4), 4: pytest.approx(1e-4)}, lrs
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["lr"] == 1e-4


def test_resume_with_a_new_cosine_schedule_continues_from_its_position(tmp_path):
    """The restored schedule takes the new lr and max_steps but keeps its step: after 2 of 4 steps,
    resuming with max_steps=6 and lr=1e-3 logs lr(3) = 1e-3 * cosine(3 / 6)."""
    import math

    from hybridize.distill.e2e import e2e
    from tests.distill.helpers import ToyTokenizer, tiny_llama, toy_convert, write_texts

    def cfg(steps, lr):
        return load_config(E2EConfig, None, {
            "train": {"run_dir": str(tmp_path / "run"), "max_steps": steps, "lr": lr, "warmup_steps": 0,
                      "scheduler": "cosine", "save_every": 1, "progress": False, "threads": 1},
            "data": {"train": str(write_texts(tmp_path / "t.jsonl")), "seq_len": 24, "batch_tokens": 48}})

    e2e(toy_convert(tiny_llama(1), layers=(0,)), tiny_llama(0), ToyTokenizer(), cfg(4, 3e-3), stop_after=2)
    e2e(toy_convert(tiny_llama(1), layers=(0,)), tiny_llama(0), ToyTokenizer(), cfg(6, 1e-3), resume=True)
    lrs = {row["step"]: row["lr"] for row in _metric_rows(tmp_path / "run") if "lr" in row}
    assert lrs[3] == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * 3 / 6)))


@pytest.mark.parametrize("stage", ["e2e", "align"])
def test_time_budget_writes_final_and_a_resumable_checkpoint(folders, tmp_path, stage):
    """`train.max_minutes` ends the run early: the model so far is `final/` (what a time-boxed run is for)
    and the checkpoint lets `--resume` go on to `train.max_steps`."""
    run = tmp_path / "run"
    r = _distill(folders, run, "train.max_steps=50", "train.max_minutes=0.000001", "train.save_every=0", stage=stage)
    assert r.exit_code == 0, r.output
    assert "time budget" in r.output
    assert (run / "final" / "config.json").is_file()
    steps = _steps(run)
    assert len(steps) == 1 and steps[0] < "step-000050", steps
