"""Speed harness: runs side by side, reports sane numbers, and measures the cache size correctly."""
from __future__ import annotations

import torch

from hybridize.eval.speed import SpeedConfig, cache_bytes, measure, run_speed
from tests.eval.conftest import make_tiny_llama


def test_cache_bytes_is_the_kv_size(tiny_model):
    ids = torch.randint(0, 100, (2, 40))
    with torch.no_grad():
        out = tiny_model(input_ids=ids, use_cache=True)
    c = tiny_model.config
    head_dim = c.hidden_size // c.num_attention_heads
    want = c.num_hidden_layers * 2 * 2 * c.num_key_value_heads * 40 * head_dim * 4   # layers, k+v, batch, fp32
    assert cache_bytes(out.past_key_values) == want


def test_run_speed_side_by_side(tmp_path, tiny_model):
    other = make_tiny_llama(tiny_model.config.vocab_size, seed=1, layers=1)
    cfg = SpeedConfig(lengths=(32, 64), batch_sizes=(1, 2), decode_tokens=3)
    rows = run_speed({"teacher": tiny_model, "small": other}, cfg, tmp_path, progress=False)
    assert len(rows) == 8
    for r in rows:
        assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 and r["cache_MB"] > 0
    t = next(r for r in rows if r["model"] == "teacher" and r["length"] == 64 and r["batch"] == 2)
    s = next(r for r in rows if r["model"] == "small" and r["length"] == 64 and r["batch"] == 2)
    assert abs(t["cache_MB"] - 2 * s["cache_MB"]) < 1e-9     # 2 layers vs 1 layer of KV
    assert t["decode_speedup"] == 1.0
    assert (tmp_path / "speed.png").exists() and (tmp_path / "speed.csv").exists()


def test_measure_grows_cache_with_decoding(tiny_model):
    a = measure(tiny_model, 20, 1, 0)
    b = measure(tiny_model, 20, 1, 4)
    assert b["cache_MB"] > a["cache_MB"]


def test_fast_decode_mode_and_deadline(tmp_path, tiny_model):
    """The CUDA-graph decode path (eager on CPU) is timed as (n+1 tokens) - (1 token): positive numbers,
    the prefill cache size; a deadline in the past measures nothing but still returns."""
    import time

    r = measure(tiny_model, 24, 2, 3, decode="fast")
    assert r["decode"] == "fast" and r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0
    assert r["cache_MB"] == measure(tiny_model, 24, 2, 0)["cache_MB"]   # cache of the 24 prompt tokens
    cfg = SpeedConfig(lengths=(16, 32), decode_tokens=2, decode="fast")
    lines = []
    rows = run_speed({"t": tiny_model}, cfg, tmp_path, progress=False, log=lines.append)
    assert [x["length"] for x in rows] == [16, 32] and all(x["decode"] == "fast" for x in rows)
    assert len(lines) == 2
    assert run_speed({"t": tiny_model}, cfg, tmp_path / "late", progress=False, deadline=time.time() - 1) == []
