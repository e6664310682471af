"""`hybridize.eval.compare` (command line: `benchmarks/pipeline/eval_default.py`) end to end on tiny models
(CPU): every labelled model gets a column of the combined table, raw per-task files are written, a saved
conversion scores like the in-process one, and the time budget / an interruption still leave a table behind."""
from __future__ import annotations

import json

import pytest

from hybridize.eval.common import data_file

pytestmark = pytest.mark.skipif(data_file("gsm8k/test.jsonl") is None, reason="shared data not present")


@pytest.fixture(scope="module")
def script():
    from hybridize.eval import compare
    return compare


@pytest.fixture(scope="module")
def saved_hybrid(tmp_path_factory, tiny_model, tiny_tokenizer):
    """The same conversion the script does in-process (--plan 1:1 --mixer gla, output gains calibrated on
    the teacher's own text, as `hybridize convert` does), saved as a folder."""
    from hybridize.convert.calibrate import calibration_inputs
    from hybridize.convert.convert import convert_model

    d = tmp_path_factory.mktemp("hybrid")
    calib = calibration_inputs(tiny_model, tiny_tokenizer)
    convert_model(tiny_model, "1:1", mixer="gla", calibration_inputs=calib).eval().save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return d


def _tiny_args(teacher, out, *extra):
    return ["--teacher", str(teacher), "--plan", "1:1", "--mixer", "gla", "--gsm8k-n", "3", "--max-new-tokens", "4",
            "--batch-size", "2", "--niah-lengths", "300", "--niah-depths", "0,1", "--niah-samples", "1",
            "--speed-lengths", "16,32", "--decode-tokens", "2", "--device", "cpu", "--dtype", "float32",
            "--out", str(out), *extra]


def test_models_side_by_side(script, tmp_path, tiny_model_dir, saved_hybrid):
    md = script.main(_tiny_args(tiny_model_dir, tmp_path, "--model", "conv=convert", "--model", f"saved={saved_hybrid}"))
    assert "| metric | teacher | conv | saved |" in md
    for row in ("GSM8K accuracy (greedy, 3 problems)", "S-NIAH-1 accuracy @ 300", "prefill tok/s @ 32",
                "decode tok/s @ 16", "cache MB @ 32"):
        assert f"| {row} |" in md
    assert (tmp_path / "results.md").read_text() == md
    res = json.loads((tmp_path / "results.json").read_text())["results"]
    assert set(res["gsm8k"]) == set(res["niah"]) == {"teacher", "conv", "saved"}
    assert {r["model"] for r in res["speed"]} == {"teacher", "conv", "saved"}
    # the saved folder holds the in-process conversion: same completions, problem by problem
    rows = {m: [json.loads(x)["completions"] for x in (tmp_path / "gsm8k" / m / "problems.jsonl").read_text().splitlines()]
            for m in ("conv", "saved")}
    assert rows["conv"] == rows["saved"] and len(rows["conv"]) == 3
    assert (tmp_path / "niah" / "saved" / "samples.jsonl").exists() and (tmp_path / "speed" / "speed.csv").exists()


def test_no_time_left_still_writes_a_table(script, tmp_path, tiny_model_dir):
    md = script.main(_tiny_args(tiny_model_dir, tmp_path, "--time-budget", "1"))
    assert "tasks with results: none" in md and (tmp_path / "results.md").exists()


def test_interruption_prints_what_finished(script, tmp_path, tiny_model_dir, monkeypatch):
    """A SIGTERM (what a timeout sends) during NIAH: the speed results are still printed and written."""
    import os
    import signal
    import time

    def killed(*a):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)   # the handler raises before this ends
        raise AssertionError("SIGTERM was not handled")

    monkeypatch.setitem(script.RUNNERS, "niah", killed)
    md = script.main(_tiny_args(tiny_model_dir, tmp_path))
    assert "Interrupted by SIGTERM" in md and "| decode tok/s @ 32 |" in md and "GSM8K accuracy" not in md
    assert "tasks with results: speed." in md and (tmp_path / "results.md").read_text() == md
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL   # handler removed again


def test_bad_labels(script):
    with pytest.raises(ValueError, match="distinct"):
        script.main(["--model", "teacher=convert"])
    with pytest.raises(ValueError, match="unknown task"):
        script.main(["--tasks", "speed,mmlu"])
