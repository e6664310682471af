"""`benchmarks/generation/prefill_host.py`'s pieces on the CPU: the Python table lists the function that spent the
host time, a sync's frame is the innermost one of ours, and the script refuses to run without a GPU in one line."""
from __future__ import annotations

import traceback

import pytest

from benchmarks.generation import prefill_host


def _slow_piece():
    x = 0
    for i in range(300_000):   # pure Python: the time is this function's own
        x += i * i
    return x


def test_python_top_names_the_function_that_spent_the_time():
    rows = prefill_host.python_top(lambda: [_slow_piece() for _ in range(3)], top=3)
    assert "_slow_piece" in rows[0]["function"] and rows[0]["calls"] == 3
    assert rows[0]["own ms"] > 0 and rows[0]["cumulative ms"] >= rows[0]["own ms"]


def test_own_frame_is_the_innermost_of_ours():
    F = traceback.FrameSummary
    stack = [F("/x/benchmarks/generation/run.py", 3, "main"), F("/x/hybridize/mixers/sse.py", 40, "forward"),
             F("/x/hybridize/ops/sse/reference.py", 7, "plan"), F("/usr/lib/torch/_tensor.py", 9, "tolist")]
    assert prefill_host._own_frame(stack) == "sse/reference.py:7 plan"
    assert prefill_host._own_frame(stack[-1:]) == "(no frame of ours)"


def test_refuses_without_a_gpu(monkeypatch, capsys):
    monkeypatch.setattr(prefill_host.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        prefill_host.main([])
    assert "no CUDA device" in capsys.readouterr().err
