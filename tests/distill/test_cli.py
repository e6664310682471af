"""CLI smoke: the `distill` sub-app and `demo` are registered, configs resolve recipe < overrides, and a
tiny align + e2e run works end to end from a saved converted checkpoint."""
from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from hybridize.distill.cli import register
from hybridize.distill.config import AlignConfig, E2EConfig, load_config, parse_overrides
from hybridize.errors import UserError

from .helpers import tiny_llama


@pytest.fixture
def app():
    a = typer.Typer()

    @a.callback()
    def _root():
        pass
    register(a)
    return a


def test_help_lists_stages_and_demo(app):
    r = CliRunner().invoke(app, ["--help"])
    assert r.exit_code == 0 and "distill" in r.output and "demo" in r.output
    r = CliRunner().invoke(app, ["distill", "--help"])
    assert all(s in r.output for s in ("align", "e2e", "sft", "traces"))
    r = CliRunner().invoke(app, ["distill", "e2e", "--show"])
    assert "data.seq_len_schedule" in r.output and "kl_weight" in r.output


def test_config_layers_recipe_then_overrides(tmp_path):
    rec = tmp_path / "r.yaml"
    rec.write_text("kl_weight: 0.5\ntrain:\n  lr: 1.0e-3\n  max_steps: 7\ndata:\n  seq_len: 64\n")
    c = load_config(E2EConfig, str(rec), ["train.lr=3e-4", "data.seq_len_schedule=[[0,64],[5,128]]"])
    assert (c.kl_weight, c.train.lr, c.train.max_steps, c.data.seq_len) == (0.5, 3e-4, 7, 64)
    assert c.data.seq_len_schedule == [[0, 64], [5, 128]]
    assert c.train.run_dir == "runs/e2e"  # the stage's own default survives a partial section
    with pytest.raises(UserError, match="unknown setting"):
        load_config(E2EConfig, None, ["train.lrr=1"])
    with pytest.raises(UserError, match="cannot use"):
        load_config(AlignConfig, None, ["train.max_steps=abc"])
    with pytest.raises(UserError, match="key=value"):
        parse_overrides(["oops"])


def test_yaml_no_and_ratios_stay_strings_and_bools_still_parse(tmp_path):
    """YAML 1.1 reads `no` as False: `train.mixed_precision=no` used to fail with "got 'False'"."""
    rec = tmp_path / "r.yaml"
    rec.write_text("gradient_checkpointing: yes\ntrain:\n  mixed_precision: no\n  progress: off\n")
    c = load_config(E2EConfig, str(rec), [])
    assert (c.train.mixed_precision, c.gradient_checkpointing, c.train.progress) == ("no", True, False)
    c = load_config(E2EConfig, None, ["train.mixed_precision=no", "train.progress=false", "gradient_checkpointing=true"])
    assert (c.train.mixed_precision, c.train.progress, c.gradient_checkpointing) == ("no", False, True)
    # YAML 1.1 reads 5:1 as the base-60 number 301: `hybridize demo layers=5:1` must keep the plan
    from hybridize.distill.config import DemoConfig
    c = load_config(DemoConfig, None, ["layers=5:1", "align_lr=1e-4"])
    assert (c.layers, c.align_lr) == ("5:1", 1e-4)


def test_cli_align_then_e2e_on_saved_hybrid(app, tmp_path):
    from hybridize.convert.convert import convert_model

    teacher = tiny_llama(0)
    teacher.save_pretrained(tmp_path / "teacher")
    convert_model(teacher, "2:1", mixer="gla").save_pretrained(tmp_path / "student")
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers
    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(95)} | {"[UNK]": 95}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="w2", pad_token="w0")
    for d in ("teacher", "student"):
        fast.save_pretrained(tmp_path / d)
    texts = tmp_path / "t.jsonl"
    with texts.open("w") as f:
        for i in range(30):
            f.write(json.dumps({"text": " ".join(f"w{3 + (i * 7 + j) % 90}" for j in range(5 + i % 9))}) + "\n")
    common = [f"teacher={tmp_path / 'teacher'}", f"data.train={texts}", "data.seq_len=16", "data.batch_tokens=32",
              "train.max_steps=3", "train.progress=false", "train.save_every=2"]
    r = CliRunner().invoke(app, ["distill", "align", f"student={tmp_path / 'student'}",
                                 f"train.run_dir={tmp_path / 'a'}", *common])
    assert r.exit_code == 0, r.output + repr(r.exception)
    assert (tmp_path / "a" / "final" / "config.json").is_file() and (tmp_path / "a" / "loss.png").is_file()
    r = CliRunner().invoke(app, ["distill", "e2e", f"student={tmp_path / 'a' / 'final'}",
                                 f"train.run_dir={tmp_path / 'b'}", "params=mixer", *common])
    assert r.exit_code == 0, r.output + repr(r.exception)
    lines = (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3]
    r = CliRunner().invoke(app, ["distill", "e2e", f"student={tmp_path / 'a' / 'final'}",
                                 f"train.run_dir={tmp_path / 'b'}", "params=mixer", "--resume", *common])
    assert r.exit_code == 0 and "3 steps" in r.output  # already done: resumes at step 3 and stops


def test_malformed_recipe_is_one_line(tmp_path):
    """A recipe that is not valid YAML stops with the file, line and column, no traceback, exit 2."""
    import subprocess
    import sys
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  lr: [1e-3\n  max_steps: 4\n")
    with pytest.raises(UserError, match=r"bad\.yaml, line \d+, column \d+: not valid YAML"):
        load_config(AlignConfig, str(bad))
    r = subprocess.run([sys.executable, "-m", "hybridize.cli", "distill", "align", "-r", str(bad), "student=x"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert "not valid YAML" in r.stderr + r.stdout


def test_demo_show_prints_the_overrides_its_help_suggests(app):
    """`hybridize demo --help` suggests `align_steps=100 out=runs/demo2`; `--show` prints them applied
    (issue 25: the help suggested a setting the demo refused, and --show ignored overrides)."""
    r = CliRunner().invoke(app, ["demo", "--help"])
    assert "align_steps=100" in r.output
    r = CliRunner().invoke(app, ["demo", "--show", "align_steps=100", "out=runs/demo2"])
    assert r.exit_code == 0, r.output
    rows = {line.split()[0]: line.split()[1] for line in r.output.splitlines() if line.strip()}
    assert rows["align_steps"] == "100" and rows["out"] == "'runs/demo2'"
