"""MQAR data is what it claims (every query key's label is the value it was paired with), and the
train-and-test loop runs and learns with softmax attention and with our mixers."""
from __future__ import annotations

import pytest
import torch

from hybridize.eval.mqar import IGNORE, MQARModel, MqarConfig, mqar_batch, parse_settings, run_mqar, train_mqar


def test_batch_labels_are_the_paired_values():
    g = torch.Generator().manual_seed(0)
    x, y = mqar_batch(8, 64, 6, 40, g)
    for b in range(8):
        pairs = {x[b, 2 * i].item(): x[b, 2 * i + 1].item() for i in range(6)}
        assert len(pairs) == 6 and all(1 <= k < 20 and 20 <= v < 40 for k, v in pairs.items())
        q = (y[b] != IGNORE).nonzero().flatten().tolist()
        assert len(q) == 6 and all(p >= 12 for p in q)
        assert sorted(x[b, q].tolist()) == sorted(pairs)          # every key queried once
        for p in q:
            assert y[b, p].item() == pairs[x[b, p].item()] == x[b, p + 1].item()
        rest = [p for p in range(12, 64) if p not in q and p - 1 not in q]
        assert (x[b, rest] == 0).all()
    with pytest.raises(ValueError):
        mqar_batch(1, 10, 6, 40)


def test_model_is_causal():
    torch.manual_seed(0)
    for mixer in ("attention", "deltanet"):
        m = MQARModel(mixer, 32, d=16, layers=1, heads=2, max_len=32).eval()
        x = torch.randint(0, 32, (1, 20))
        x2 = x.clone()
        x2[0, 15:] = (x2[0, 15:] + 1) % 32
        a, b = m(x)[0], m(x2)[0]
        assert torch.allclose(a[0, :15], b[0, :15], atol=1e-5) and not torch.allclose(a[0, 15:], b[0, 15:])


def test_attention_learns_a_small_mqar():
    cfg = MqarConfig(seq_len=16, num_kv=2, vocab=16, d_model=32, layers=2, heads=2, steps=250, batch_size=32,
                     lr=3e-3, test_size=128, device="cpu")
    r = train_mqar("attention", cfg, progress=False)
    assert r["final_loss"] < r["first_loss"] - 1.0
    assert r["accuracy"] > 0.5     # chance is 1/8


def test_run_mqar_smoke_with_mixers(tmp_path):
    cfg = MqarConfig(mixers=("gla", "deltanet"), seq_len=16, num_kv=2, vocab=16, d_model=16, steps=3,
                     batch_size=4, test_size=8, mixer_settings=parse_settings(["short_conv=true"]), device="cpu")
    rows = run_mqar(cfg, tmp_path, progress=False)
    assert [r["mixer"] for r in rows] == ["gla", "deltanet"] and all(0 <= r["accuracy"] <= 1 for r in rows)
    assert (tmp_path / "mqar.csv").exists() and (tmp_path / "mqar.json").exists()
    assert parse_settings(["a=1", "b=x", "c=[1,2]"]) == {"a": 1, "b": "x", "c": [1, 2]}


@pytest.mark.parametrize("setting,needle", [
    ('use_rope="false"', 'gla.use_rope must be a JSON bool (true or false), got the string "false"'),
    ("chunk_size=0", "gla.chunk_size is a size or count and must be an integer >= 1, got 0"),
    ("chunk_size=-4", "gla.chunk_size is a size or count"),
    ("--steps=0", "mqar steps must be >= 1, got 0"),          # ZeroDivisionError in the LR schedule before
    ("--heads=0", "mqar heads must be >= 1, got 0"),          # ZeroDivisionError in the head size before
    ("--heads=3", "mqar d_model 64 must be a multiple of heads 3"),
])
def test_mqar_checks_mixer_settings_before_training(tmp_path, monkeypatch, setting, needle):
    """`eval mqar -s` goes through the checks of `convert --mixer-settings` (issue 29): one line before any
    mixer trains, not a truthy string or a ZeroDivisionError in a forward."""
    from typer.testing import CliRunner

    import hybridize.eval.mqar as mqar
    from hybridize.cli import app
    from hybridize.errors import UserError

    monkeypatch.setattr(mqar, "train_mqar", lambda *a, **k: pytest.fail("trained with bad settings"))
    extra = [setting] if setting.startswith("--") else ["-s", setting]
    r = CliRunner().invoke(app, ["eval", "mqar", "--mixers", "attention,gla", "--steps", "1", "--device", "cpu",
                                 *extra, "--out", str(tmp_path / "o")])
    assert isinstance(r.exception, UserError), r.output
    assert needle in str(r.exception) and "\n" not in str(r.exception)
