"""`hybridize convert` / `hybridize generate` end to end: tiny local teacher (fast) and the embedded
default (slow: loads the real GGUF on first use), plus one-line errors with exit status 2."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from hybridize.convert.cli import parse_settings
from tests.convert.common import tiny_teacher, tiny_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("teacher")
    tiny_teacher("qwen3").save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return d


def _app():
    from hybridize.cli import app

    return app


def test_convert_tiny_teacher_end_to_end(teacher_dir, tmp_path):
    out = tmp_path / "hyb"
    res = CliRunner().invoke(_app(), ["convert", "--src", str(teacher_dir), "--layers", "gla,attn,sse",
                                      "--mixer", "gla", "--out", str(out), "--mixer-settings", "sse.num_partitions=2",
                                      "--mixer-settings", '{"gla": {"init_decay": 0.9}}', "--prompt", "Hi",
                                      "--max-new-tokens", "3"])
    assert res.exit_code == 0, res.output
    assert "layer plan" in res.output and "conversion report" in res.output
    for f in ("config.json", "model.safetensors", "report.json", "tokenizer.json"):
        assert (out / f).exists(), f
    report = json.loads((out / "report.json").read_text())
    assert [r["kind"] for r in report["layers"]] == ["gla", "attn", "sse"]
    assert report["mixer_settings"]["sse"]["num_partitions"] == 2
    assert report["mixer_settings"]["gla"]["init_decay"] == 0.9
    assert set(report["sample"]) == {"prompt", "teacher", "hybrid"}
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.teacher_source == str(teacher_dir) and model.config.layer_plan == ["gla", "attn", "sse"]
    res = CliRunner().invoke(_app(), ["generate", "--model", str(out), "--prompt", "Hi", "--max-new-tokens", "3"])
    assert res.exit_code == 0, res.output


def test_convert_refuses_a_non_empty_out(teacher_dir, tmp_path):
    (tmp_path / "x").write_text("keep me")
    res = CliRunner().invoke(_app(), ["convert", "--src", str(teacher_dir), "--out", str(tmp_path)])
    assert res.exit_code != 0 and "not empty" in str(res.exception)


def test_parse_settings():
    assert parse_settings(["a=1,b=true", "c=x", '{"d": [1, 2]}', "sse.top_k=2"]) == \
        {"a": 1, "b": True, "c": "x", "d": [1, 2], "sse.top_k": 2}
    with pytest.raises(ValueError, match="key=value"):
        parse_settings(["oops"])


@pytest.mark.parametrize("args,needle", [
    (["--layers", "5:"], "bad layer plan"),
    (["--mixer", "mamba"], "unknown mixer"),
    (["--mixer-settings", "nope=1"], "no mixer in the plan"),
    (["--mixer-settings", "num_heads=2"], "set from the teacher"),
    (["--dtype", "int8"], "--dtype"),
])
def test_bad_input_raises_one_line_errors(teacher_dir, tmp_path, args, needle):
    res = CliRunner().invoke(_app(), ["convert", "--src", str(teacher_dir), "--out", str(tmp_path / "o"), *args])
    assert isinstance(res.exception, ValueError), res.output
    assert needle in str(res.exception) and "\n" not in str(res.exception)
    assert not (tmp_path / "o").exists()  # failed before writing anything


def test_main_prints_one_line_and_exits_2(tmp_path):
    cmd = [sys.executable, "-m", "hybridize.cli", "convert", "--src", "nonsense", "--out", str(tmp_path / "o")]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "unknown model" in lines[0], res.stderr


def test_convert_family_name_says_which_checkpoint_and_offline_names_the_local_alternatives(tmp_path):
    """`hybridize convert --src Qwen --layers 5:1 --mixer sse` (issue 27): the family name resolves to its default
    checkpoint, printed before anything loads; with no hub (HF_HUB_OFFLINE here) one line names the local
    alternatives and the exit status is 2."""
    cmd = [sys.executable, "-m", "hybridize.cli", "convert", "--src", "Qwen", "--layers", "5:1", "--mixer", "sse",
           "--out", str(tmp_path / "o")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120, env=env)
    assert res.returncode == 2, res.stderr
    assert "--src Qwen: the qwen3 family's (Qwen3) default checkpoint Qwen/Qwen3-1.7B" in res.stdout
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), res.stderr
    assert "Qwen/Qwen3-1.7B" in lines[0] and all(x in lines[0] for x in ("--src default", "local model folder",
                                                                           ".gguf file"))
    assert not (tmp_path / "o").exists()


def test_import_hybridize_registers_the_model_type():
    code = ("import hybridize, transformers; c = transformers.AutoConfig.for_model('hybridize', "
            "source_config={'model_type': 'llama', 'num_hidden_layers': 1}); print(type(c).__name__)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 0 and "HybridConfig" in res.stdout, (
        "`import hybridize` must register model_type 'hybridize' (hybridize/__init__.py imports "
        f"hybridize.modeling); stderr tail: {res.stderr[-300:]}")


@pytest.mark.slow
def test_convert_embedded_default(tmp_path):
    """The README's job: the real SmolLM2 GGUF, 5:1 SSE; the checkpoint loads and generates."""
    out = tmp_path / "demo"
    res = CliRunner().invoke(_app(), ["convert", "--src", "default", "--layers", "5:1", "--mixer", "sse",
                                      "--out", str(out), "--samples", "1", "--prompt", ""])
    assert res.exit_code == 0, res.output
    report = json.loads((out / "report.json").read_text())
    assert sum(r["kind"] == "sse" for r in report["layers"]) == 25
    assert all(r["rel_err"] is not None and r["rel_err"] == r["rel_err"] for r in report["layers"] if r["kind"] == "sse")
    from transformers import AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("The capital of France is", return_tensors="pt")
    gen = model.generate(**ids, max_new_tokens=3, do_sample=False)
    assert gen.shape[1] == ids.input_ids.shape[1] + 3
    assert torch.isfinite(model(**ids).logits).all()


@pytest.mark.parametrize("args,needle", [
    (["--samples", "0"], "--samples 0: choose 1 to 3"),          # was "max() arg is an empty sequence"
    (["--samples", "9"], "--samples 9: choose 1 to 3"),          # was silently 3
    (["--max-new-tokens", "-1"], "--max-new-tokens -1 must be >= 1"),  # failed after the checkpoint was saved
])
def test_convert_report_options_checked_before_anything_loads(teacher_dir, tmp_path, monkeypatch, args, needle):
    import hybridize.convert.sources as sources

    monkeypatch.setattr(sources, "load_model", lambda *a, **k: pytest.fail("the teacher loaded"))
    out = tmp_path / "o"
    r = CliRunner().invoke(_app(), ["convert", "--src", str(teacher_dir), "--out", str(out), "--layers", "2:1",
                                    "--no-calibrate", *args])
    assert isinstance(r.exception, ValueError) and needle in str(r.exception), r.output + repr(r.exception)
    assert not out.exists()
