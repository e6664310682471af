"""`hybridize eval <task>`: every command runs end to end on a tiny saved model and writes its files."""
from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from hybridize.eval.cli import register


@pytest.fixture(scope="module")
def app():
    a = typer.Typer()

    @a.callback()
    def main():  # a group, like the real `hybridize` app
        pass

    register(a)
    return a


def run(app, args):
    r = CliRunner().invoke(app, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r.output


def test_help_lists_every_task(app):
    out = run(app, ["eval", "--help"])
    for cmd in ("math", "niah", "mqar", "ppl", "kv-probe", "speed"):
        assert cmd in out
    assert "temperature" in run(app, ["eval", "math", "--help"])


def test_math_and_check_checker(app, tmp_path, tiny_model_dir):
    data = tmp_path / "mini.jsonl"
    data.write_text("\n".join(json.dumps({"problem": f"{i}+1?", "answer": str(i + 1), "solution": f"\\boxed{{{i + 1}}}"})
                              for i in range(3)))
    run(app, ["eval", "math", "-m", str(tiny_model_dir), "-d", str(data), "--samples", "2", "--max-new-tokens", "4",
              "--out", str(tmp_path / "m"), "--device", "cpu"])
    s = json.loads((tmp_path / "m" / "summary.json").read_text())
    assert s["problems"] == 3 and "avg@2" in s
    out = run(app, ["eval", "math", "--check-checker", "-d", str(data), "--out", str(tmp_path / "c")])
    rows = json.loads((tmp_path / "c" / "check_checker.json").read_text())
    assert rows[0]["answers_boxed"] == 1.0 and rows[0]["solutions"] == 1.0 and rows[0]["shuffled"] == 0.0
    assert "answers_boxed" in out


def test_niah(app, tmp_path, tiny_model_dir):
    run(app, ["eval", "niah", "-m", f"tiny={tiny_model_dir}", "--task", "s-niah-2", "--lengths", "256,300",
              "--depths", "0,1", "--samples", "1", "--max-new-tokens", "2", "--out", str(tmp_path), "--device", "cpu"])
    assert (tmp_path / "heatmap.png").exists() and (tmp_path / "summary.json").exists()


def test_mqar(app, tmp_path):
    run(app, ["eval", "mqar", "--mixers", "attention,deltanet", "--seq-len", "16", "--num-kv", "2", "--vocab", "16",
              "--d-model", "16", "--steps", "2", "--batch-size", "4", "--test-size", "8", "--device", "cpu",
              "--out", str(tmp_path)])
    assert len(json.loads((tmp_path / "mqar.json").read_text())["rows"]) == 2


def test_ppl(app, tmp_path, tiny_model_dir):
    text = tmp_path / "t.txt"
    text.write_text("A short text about the sky and the sea. " * 100)
    run(app, ["eval", "ppl", "-m", f"a={tiny_model_dir}", "-m", f"b={tiny_model_dir}", "--text", str(text),
              "--lengths", "16,32", "--tokens", "64", "--out", str(tmp_path / "p"), "--device", "cpu"])
    assert (tmp_path / "p" / "ppl_compare.csv").read_text().splitlines()[0] == "length,a,b"


def test_kv_probe(app, tmp_path):
    out = run(app, ["eval", "kv-probe", "--dim", "8", "--length", "64", "--lengths", "32,64", "--trials", "1",
                    "--out", str(tmp_path)])
    assert "deltanet" in out and (tmp_path / "scaling_identity.png").exists()
    assert (tmp_path / "probe.json").exists()


def test_speed(app, tmp_path, tiny_model_dir):
    run(app, ["eval", "speed", "-m", f"teacher={tiny_model_dir}", "-m", f"other={tiny_model_dir}", "--lengths", "16,32",
              "--decode-tokens", "2", "--out", str(tmp_path), "--device", "cpu"])
    rows = json.loads((tmp_path / "speed.json").read_text())["rows"]
    assert {r["model"] for r in rows} == {"teacher", "other"}


def test_bad_input_is_one_clear_error(app):
    with pytest.raises(ValueError, match="unknown NIAH task"):
        CliRunner().invoke(app, ["eval", "niah", "--task", "nope"], catch_exceptions=False)
    with pytest.raises(ValueError, match="cannot read"):
        CliRunner().invoke(app, ["eval", "speed", "--lengths", "1x"], catch_exceptions=False)
