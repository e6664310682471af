"""The family table (issue 27): every family converts, decodes, saves and generates like the first four.

Tiny random teachers of each family (tests/convert/common.py) with the features that set the family
apart switched on. Beside the family-parametrized tests of test_modeling.py (zero layers converted ==
teacher logits; padding / packing / decode with the toy mixer on every family) and test_convert.py
(every teacher tensor copied), this file runs, per family:
- full forward == prefill + token-by-token decode for every registered mixer;
- save / reload exact (state dict, config, logits); generate cached == uncached on a left-padded batch;
- the mapping checked against the teacher itself: an SWA mixer whose window covers what the teacher's
  layer sees reproduces that attention layer's output (fused qkv split, q/k norm kind and Gemma gain,
  query scale, per-layer RoPE base, partial rotary all have to be right for this to hold), except where
  the family does what SWA does not (Gemma 2's soft-capped logits: reported as dropped, and the kept
  softmax layers stay exact - the zero-layer test of test_modeling.py);
- what the report says the mixer layers drop.
"""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridize.convert.convert import convert_model
from hybridize.convert.report import capture_attention_io, family_record
from hybridize.families import FAMILIES as TABLE
from hybridize.families import family_of
from hybridize.families.traits import window_layers
from hybridize.mixers import mixer_names
from hybridize.mixers.base import FlatRMSNorm
from hybridize.modeling import HybridForCausalLM
from tests.convert.common import CASES, FAMILIES, FP32_TOL, left_padded, rel_err, tiny_teacher
from tests.test_modeling import _check_plain_decode, _hybrid, _ids


def test_the_table_covers_the_tested_families():
    assert set(FAMILIES) == set(TABLE)


# ------------------------------------------------------------------ decode == forward, every mixer
@pytest.mark.parametrize("kind", mixer_names())
@pytest.mark.parametrize("family", CASES)
def test_decode_equals_forward(family, kind):
    _, model = _hybrid(kind, family)
    assert _check_plain_decode(model) < FP32_TOL


# ------------------------------------------------------------------ save / reload, generate
@pytest.mark.parametrize("family", CASES)
def test_save_reload_exact(family, tmp_path):
    _, model = _hybrid("sse", family)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is HybridForCausalLM and loaded.config.source_config.model_type == family.removesuffix("_bias")
    assert loaded.config.mixer_settings == model.config.mixer_settings
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids = _ids(2, 11)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


@pytest.mark.parametrize("family", CASES)
def test_generate_cached_equals_uncached(family):
    _, model = _hybrid("gla", family)
    ids, mask, _ = left_padded([_ids(1, 9, seed=3)[0], _ids(1, 5, seed=4)[0]])
    kw = dict(attention_mask=mask, max_new_tokens=7, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kw), model.generate(ids, use_cache=False, **kw))


# ------------------------------------------------------------------ the mapping, against the teacher
@pytest.mark.parametrize("family", CASES)
def test_swa_reproduces_the_teachers_attention_layer(family):
    """SWA = softmax attention over a window: with the teacher's window on sliding layers and one longer
    than the sequence elsewhere, the converted layer's output equals the teacher attention's."""
    teacher = tiny_teacher(family)
    cfg = teacher.config
    windows = window_layers(family_of(cfg), cfg)
    plan = ["swa", "attn", "swa"]
    hybrid = convert_model(teacher, plan, mixer="swa", mixer_settings={"window": 64}).eval()
    records, handles = capture_attention_io(teacher, [0, 2])
    try:
        with torch.no_grad():
            teacher(_ids(2, 14), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    for i in (0, 2):
        slot = hybrid.model.layers[i].self_attn
        slot.config.window = windows.get(i, 64)  # the teacher's own window on its sliding layers
        slot.slots = slot.config.window - 1
        (x, pe, y_teacher), = records[i]
        with torch.no_grad():
            y = slot.mixer_forward(x, pe)
        if getattr(cfg, "attn_logit_softcapping", None) and family_of(cfg).attn_softcap:
            # Gemma 2 caps its logits, which SWA does not: the report says so, and the outputs differ
            assert rel_err(y, y_teacher) > 1e-3, (family, i)
            assert any(line.startswith("swa: attention soft-capping") for line in family_record(hybrid)["dropped"])
        else:
            assert rel_err(y, y_teacher) < FP32_TOL, (family, i)


def test_fused_qkv_is_split_into_the_mixer_projections():
    teacher = tiny_teacher("phi3")
    hybrid = convert_model(teacher, "1:1", mixer="gla")
    qkv = teacher.model.layers[0].self_attn.qkv_proj.weight
    slot = hybrid.model.layers[0].self_attn
    assert torch.equal(torch.cat([slot.q_proj.weight, slot.k_proj.weight, slot.v_proj.weight]), qkv)
    assert slot.k_proj.weight.shape == (2 * 16, 64)
    sd = hybrid.state_dict()
    assert "model.layers.0.self_attn.qkv_proj.weight" not in sd  # converted: held split
    kept = teacher.model.layers[1].self_attn.qkv_proj.weight
    assert torch.equal(sd["model.layers.1.self_attn.qkv_proj.weight"], kept)  # a softmax layer keeps it fused


def test_qk_norm_kinds():
    olmo = convert_model(tiny_teacher("olmo2"), "1:1", mixer="gla").model.layers[0].self_attn
    assert isinstance(olmo.q_norm, FlatRMSNorm) and olmo.q_norm.weight.shape == (4 * 16,)
    assert olmo.k_norm.weight.shape == (2 * 16,)
    gemma = convert_model(tiny_teacher("gemma3_text"), "1:1", mixer="gla").model.layers[0].self_attn
    assert gemma.q_norm.offset == 1.0 and gemma.config.attn_scale == pytest.approx(24 ** -0.5)
    granite = convert_model(tiny_teacher("granite"), "1:1", mixer="gla").model.layers[0].self_attn
    assert granite.config.attn_scale == pytest.approx(0.09) and not granite.config.qk_norm


def test_moe_experts_are_copied_untouched():
    teacher = tiny_teacher("qwen3_moe")
    hybrid = convert_model(teacher, "all", mixer="gla")
    t, h = teacher.state_dict(), hybrid.state_dict()
    experts = [k for k in t if ".mlp." in k]
    assert any("experts" in k for k in experts) and all(torch.equal(t[k], h[k]) for k in experts)


# ------------------------------------------------------------------ what the report says is dropped
def _dropped(family, plan, settings=None):
    hybrid = convert_model(tiny_teacher(family), plan, mixer_settings=settings)
    return family_record(hybrid)


def test_report_states_dropped_features():
    rec = _dropped("gemma3_text", ["sse", "attn", "sse"])
    assert rec["model_type"] == "gemma3_text"
    text = "\n".join(rec["dropped"])
    assert "sse: query scale" in text and "sse: sliding window" in text and "sse: RoPE" in text
    feats = {f["feature"]: f for f in rec["features"]}
    assert feats["q/k norm"]["mixers"]["sse"]["kept"] and "1 + weight" in feats["q/k norm"]["teacher"]
    assert feats["final_logit_softcapping"]["mixers"]["sse"]["kept"]
    # SWA with the teacher's window and RoPE keeps both; its scale is the teacher's
    rec = _dropped("gemma3_text", ["attn", "swa", "swa"], {"swa": {"window": 8}})
    assert rec["dropped"] == []
    granite = _dropped("granite", ["sse", "attn", "swa"], {"swa": {"window": 64}})
    assert any(line.startswith("sse: query scale") for line in granite["dropped"])
    assert not any(line.startswith("swa:") for line in granite["dropped"])
    feats = {f["feature"]: f for f in granite["features"]}
    assert {"embedding_multiplier", "residual_multiplier", "logits_scaling"} <= set(feats)


def test_report_table_prints_dropped_lines():
    from rich.console import Console

    from hybridize.convert.report import conversion_report, report_table, sample_inputs

    teacher = tiny_teacher("phi3")
    hybrid = convert_model(teacher, "1:1", mixer="gla").eval()
    rep = conversion_report(teacher, hybrid, sample_inputs(None, 97, n=1, length=10))
    console = Console(width=200, record=True)
    console.print(report_table(rep))
    out = console.export_text()
    assert "the mixer layers drop" in out and "gla: sliding window" in out and "partial rotary" in out


# ------------------------------------------------------------------ code that runs the decoder by hand
@pytest.mark.parametrize("family", CASES)
def test_rl_fast_generate_same_tokens_or_falls_back(family):
    """The RL decode loop runs embed -> layers -> norm -> lm_head itself: where that is the family's forward it
    gives HF's tokens; where it is not (a RoPE per layer type, embedding multiplier, logits transform) it
    falls back to HF generate and says why."""
    from hybridize.generation.fast import FastGenerator

    _, model = _hybrid("gla", family)
    ids, mask, _ = left_padded([_ids(1, 9, seed=3)[0], _ids(1, 5, seed=4)[0]])
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    gen = FastGenerator(model)
    assert torch.equal(gen(input_ids=ids, **kw), model.generate(ids, **kw))
    reason = gen.last_fallback_reason
    if family in ("gemma3_text", "gemma2", "granite"):
        assert reason is not None and family in reason
    else:
        assert reason is None


@pytest.mark.parametrize("family", ["granite", "gemma3_text", "llama"])
def test_eval_token_nll_uses_the_family_logits(family):
    """`hybridize eval ppl` scores with the family's logits (Granite divides, Gemma soft-caps lm_head's)."""
    import torch.nn.functional as F

    from hybridize.eval.perplexity import token_nll

    teacher, model = _hybrid("gla", family)
    ids = _ids(1, 12)[0]
    for m in (teacher, model):
        with torch.no_grad():
            ref = F.cross_entropy(m(ids[None]).logits[0, :-1].float(), ids[1:], reduction="none")
        assert rel_err(token_nll(m, ids), ref) < FP32_TOL


@pytest.mark.parametrize("family", ["granite", "gemma2", "llama"])
def test_select_probe_scores_with_the_family_logits(family):
    """`hybridize select` runs the LM head by hand on cached final hidden states: `head_logits` gives the
    teacher's own logits (Granite divides them, Gemma 2 soft-caps them), and the probe's KL uses it."""
    import torch.nn.functional as F

    from hybridize.convert.select.probe import _row_cost
    from hybridize.families import head_logits

    teacher = tiny_teacher(family)
    ids = _ids(1, 12)
    with torch.no_grad():
        h = teacher.get_decoder()(input_ids=ids).last_hidden_state[0]
        assert rel_err(head_logits(teacher, h), teacher(ids).logits[0]) < FP32_TOL
        h2 = h + 0.5 * torch.randn_like(h)
        lt, lm = (F.log_softmax(head_logits(teacher, x).float(), -1) for x in (h, h2))
        kl_ref = float((lt.exp() * (lt - lm)).sum())
        kl, _, n = _row_cost(teacher, h, h2, torch.ones(12, dtype=torch.bool), None, "cpu")
    assert n == 12 and kl == pytest.approx(kl_ref, rel=1e-5)
