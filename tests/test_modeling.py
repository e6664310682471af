"""The hybrid Hugging Face model: teacher equivalence, cached decoding, padding, packing, HF plumbing.

References are independent of the code under test: the teacher itself (zero layers converted), the
same model run without a cache, each padded row run alone, each packed document run alone.
Every registered mixer runs the decode / padding / packing / generate / cache-size checks
(parametrized over `mixer_names()`); a toy mixer (tests/convert/toy_mixer.py) exercises the plumbing
on every teacher family independently of the real mixers.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from hybridize.convert.convert import convert_model
import hybridize.mixers as mixers_pkg
from hybridize.mixers import mixer_names
from hybridize.modeling import AttentionSlot, HybridCache, HybridConfig, HybridForCausalLM, MixerCacheLayer
from tests.convert.common import (
    CASES,
    FAMILIES,
    FP32_TOL,
    VOCAB,
    left_padded,
    perturb_new_parameters,
    prefill_then_decode,
    rel_err,
    tiny_teacher,
    toy_registered,
)


@pytest.fixture
def toy():
    with toy_registered():
        yield


def _settings(kind: str) -> dict:
    """Small per-mixer settings so every code path is reached at tiny lengths (e.g. SWA window < T)."""
    names = {f.name for f in dataclasses.fields(mixers_pkg.mixer_class(kind).config_class)}
    s = {}
    if "window" in names:
        s["window"] = 5
    if "chunk_size" in names:
        s["chunk_size"] = 4  # several chunks (and a partial one) at T ~ 10-16
    if "lora_rank" in names:
        s["lora_rank"] = 8
    return {kind: s}


def _hybrid(kind: str, family: str = "llama", plan=None, settings=None, seed: int = 0):
    teacher = tiny_teacher(family, seed=seed)
    plan = plan or [kind, "attn", kind]
    model = convert_model(teacher, plan, mixer=kind, mixer_settings=settings if settings is not None else _settings(kind))
    perturb_new_parameters(model)
    return teacher, model.eval()


def _ids(B: int, T: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (B, T), generator=g)


# ------------------------------------------------------------------ teacher equivalence
@pytest.mark.parametrize("family", CASES)
def test_zero_layers_converted_equals_teacher(family):
    teacher = tiny_teacher(family)
    hybrid = convert_model(teacher, "none", mixer="gla").eval()
    assert isinstance(hybrid, HybridForCausalLM) and hybrid.config.mixer_layers == []
    ids = _ids(2, 12)
    with torch.no_grad():
        assert torch.equal(hybrid(ids).logits, teacher(ids).logits)
        pids, mask, pos = left_padded([ids[0, :12], ids[1, :7]])
        assert torch.equal(hybrid(pids, attention_mask=mask).logits, teacher(pids, attention_mask=mask).logits)
    g_t = teacher.generate(ids[:1, :5], max_new_tokens=6, do_sample=False)
    g_h = hybrid.generate(ids[:1, :5], max_new_tokens=6, do_sample=False)
    assert torch.equal(g_t, g_h)


# ------------------------------------------------------------------ decode / padding / packing
def _check_plain_decode(model, n_prefill=5, T=14):
    ids = _ids(2, T)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
    dec, cache = prefill_then_decode(model, ids, n_prefill)
    assert isinstance(cache, HybridCache)
    assert cache.get_seq_length() == T  # layer 0 is a mixer: its token count answers
    return rel_err(dec, full)


def _check_left_padded(model):
    rows = [_ids(1, 12, seed=1)[0], _ids(1, 7, seed=2)[0]]
    ids, mask, pos = left_padded(rows)
    errs = []
    with torch.no_grad():
        full = model(ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        for i, r in enumerate(rows):  # each row alone, no padding: the independent reference
            alone = model(r[None], use_cache=False).logits[0]
            errs.append(rel_err(full[i, -len(r):], alone))
    dec, _ = prefill_then_decode(model, ids, 6, attention_mask=mask, position_ids=pos)
    real = mask.bool()
    errs.append(rel_err(dec[real], full[real]))
    return max(errs)


def _check_packed(model, rows_lens=((5, 7, 4), (6, 3, 7))):
    """Packed rows (position_ids restart per document) == each document on its own; B=1 and B=2."""
    errs = []
    for B in (1, 2):
        docs, ids, pos = [], [], []
        for b in range(B):
            row_docs = [_ids(1, n, seed=10 * b + j)[0] for j, n in enumerate(rows_lens[b])]
            docs.append(row_docs)
            ids.append(torch.cat(row_docs))
            pos.append(torch.cat([torch.arange(len(d)) for d in row_docs]))
        ids, pos = torch.stack(ids), torch.stack(pos)
        with torch.no_grad():
            packed = model(ids, position_ids=pos, use_cache=False).logits
            for b in range(B):
                start = 0
                for d in docs[b]:
                    alone = model(d[None], use_cache=False).logits[0]
                    errs.append(rel_err(packed[b, start:start + len(d)], alone))
                    start += len(d)
    return max(errs)


@pytest.mark.parametrize("family", CASES)
def test_toy_mixer_plumbing(toy, family):
    """Plain / padded / packed decode equivalence on every family (toy mixer with conv + RoPE)."""
    settings = {"toy": {"short_conv": True, "use_rope": True}}
    _, model = _hybrid("toy", family, settings=settings)
    assert _check_plain_decode(model) < FP32_TOL
    assert _check_left_padded(model) < FP32_TOL
    assert _check_packed(model) < FP32_TOL


def _family_for(kind: str) -> str:
    # spread the families over the mixers (every family is covered by the toy test too)
    return FAMILIES[mixer_names().index(kind) % len(FAMILIES)]


@pytest.mark.parametrize("kind", mixer_names())
def test_mixer_decode_padding_packing(kind):
    _, model = _hybrid(kind, _family_for(kind))
    errs = {"decode": _check_plain_decode(model), "left_padded": _check_left_padded(model),
            "packed": _check_packed(model)}
    assert max(errs.values()) < FP32_TOL, errs


@pytest.mark.parametrize("kind", mixer_names())
def test_generate_cached_equals_uncached(kind):
    _, model = _hybrid(kind, _family_for(kind))
    ids, mask, _ = left_padded([_ids(1, 9, seed=3)[0], _ids(1, 5, seed=4)[0]])
    kw = dict(attention_mask=mask, max_new_tokens=7, do_sample=False, pad_token_id=0)
    with_cache = model.generate(ids, **kw)
    without = model.generate(ids, use_cache=False, **kw)
    assert torch.equal(with_cache, without)


@pytest.mark.parametrize("kind", mixer_names())
def test_mixer_cache_size_constant(kind):
    _, model = _hybrid(kind, "llama")
    sizes, kv = [], []
    for T in (6, 30):
        with torch.no_grad():
            cache = model(_ids(1, T), use_cache=True).past_key_values
        sizes.append(cache.mixer_nbytes())
        kv.append(cache.layers[1].keys.shape[-2])
    assert sizes[0] == sizes[1] > 0
    assert kv == [6, 30]  # the softmax layer grows as it should


# ------------------------------------------------------------------ HF plumbing
def test_save_load_roundtrip(tmp_path):
    _, model = _hybrid("gla", "qwen3")
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is HybridForCausalLM
    assert loaded.config.layer_plan == model.config.layer_plan
    assert loaded.config.mixer_settings == model.config.mixer_settings
    assert loaded.config.source_config.model_type == "qwen3"
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids = _ids(2, 9)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_checkpoint_names_are_teacher_names_plus_new():
    teacher, model = _hybrid("gla", "qwen2")
    t_keys, h_keys = set(teacher.state_dict()), set(model.state_dict())
    assert t_keys <= h_keys
    assert "model.layers.0.self_attn.q_proj.bias" in h_keys  # Qwen2 bias kept on the mixer
    assert all(k.startswith(("model.layers.0.self_attn.", "model.layers.2.self_attn.")) for k in h_keys - t_keys)


def test_peft_lora_attaches_and_trains():
    peft = pytest.importorskip("peft")
    _, model = _hybrid("gla", "llama")
    model.train()
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      init_lora_weights=False))
    names = [n for n, _ in lora.named_parameters() if "lora_A" in n]
    assert any("layers.0.self_attn.q_proj" in n for n in names)  # mixer layer
    assert any("layers.1.self_attn.q_proj" in n for n in names)  # softmax layer
    before = {n: p.detach().clone() for n, p in lora.named_parameters() if p.requires_grad}
    opt = torch.optim.SGD([p for p in lora.parameters() if p.requires_grad], lr=0.1)
    ids = _ids(2, 10)
    loss = lora(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss)
    loss.backward()
    opt.step()
    changed = [n for n, p in lora.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert any("layers.0.self_attn.q_proj.lora" in n for n in changed)


def test_gradient_checkpointing_same_grads():
    _, model = _hybrid("gla", "llama")
    model.train()
    ids = _ids(2, 10)

    def grads():
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref = grads()
    model.gradient_checkpointing_enable()
    assert model.model.layers[0].gradient_checkpointing
    ckpt = grads()
    assert ref.keys() == ckpt.keys() and any("self_attn.gk_proj" in n or "layers.0.self_attn" in n for n in ref)
    assert max(rel_err(ckpt[n], ref[n]) for n in ref) < FP32_TOL


def test_bf16_runs():
    _, model = _hybrid("gla", "qwen2")
    ids = _ids(2, 10)
    with torch.no_grad():
        ref = model(ids).logits
        m16 = model.to(torch.bfloat16)
        out = m16(ids).logits
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert rel_err(out.float(), ref) < 0.1
    gen = m16.generate(ids[:, :4], max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert gen.shape == (2, 8)


def test_aux_loss_is_added(toy):
    _, model = _hybrid("toy", "llama")
    ids = _ids(2, 8)
    out = model(input_ids=ids, labels=ids)
    assert out.aux_loss is not None
    expected = sum(s.last_aux_loss for s in model.slots())
    assert torch.allclose(out.aux_loss, expected)
    model.config.aux_loss_weight = 0.0
    ce = model(input_ids=ids, labels=ids).loss
    assert torch.allclose(out.loss, ce + out.aux_loss)


def test_foreign_caches_are_adopted(toy):
    _, model = _hybrid("toy", "mistral")
    ids = _ids(1, 9)
    ref, _ = prefill_then_decode(model, ids, 4)
    for cache in (DynamicCache(), DynamicCache(config=model.config)):
        with torch.no_grad():
            out = model(ids[:, :4], past_key_values=cache, use_cache=True)
            assert isinstance(cache.layers[0], MixerCacheLayer)
            logits = [out.logits]
            for t in range(4, 9):
                logits.append(model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits)
        assert rel_err(torch.cat(logits, 1), ref) < FP32_TOL


def test_beam_search_cached_equals_uncached(toy):
    _, model = _hybrid("toy", "llama")
    ids = _ids(2, 6)
    kw = dict(max_new_tokens=5, num_beams=3, do_sample=False, pad_token_id=0, num_return_sequences=2)
    assert torch.equal(model.generate(ids, **kw), model.generate(ids, use_cache=False, **kw))


def test_base_model_call_gets_mixer_inputs(toy):
    """TRL calls `model.base_model(...)` directly: padding and packing must still reach the mixers."""
    _, model = _hybrid("toy", "llama")
    ids, mask, pos = left_padded([_ids(1, 9, seed=5)[0], _ids(1, 4, seed=6)[0]])
    with torch.no_grad():
        h = model.base_model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).last_hidden_state
        ref = model(ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        real = mask.bool()
        assert rel_err(model.lm_head(h)[real], ref[real]) < FP32_TOL
    assert model.get_output_embeddings() is model.lm_head and type(model.lm_head) is torch.nn.Linear


def test_config_mirrors_teacher_attributes():
    teacher = tiny_teacher("qwen3")
    model = convert_model(teacher, "1:1", mixer="gla")
    cfg = model.config
    assert isinstance(cfg, HybridConfig) and cfg.model_type == "hybridize"
    for name in ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads", "num_key_value_heads",
                 "eos_token_id", "tie_word_embeddings"):
        assert getattr(cfg, name) == getattr(teacher.config, name)
    assert cfg.layer_plan == ["gla", "attn", "gla"]
    assert cfg.mixer_settings["gla"]["qk_norm"] is True and cfg.mixer_settings["gla"]["num_kv_heads"] == 2
    assert cfg.get_text_config() is cfg


def test_swa_with_sinks_through_the_model():
    """Sliding windows with attention sinks in a mixed plan (the SSE paper's sse/swa pattern): decode, padding
    and packing equal the full forward, cached generation equals uncached, the cache stays the same size."""
    _, model = _hybrid("swa", "llama", plan=["swa", "attn", "gla"], settings={"swa": {"window": 4, "sinks": 2}})
    assert model.model.layers[0].self_attn.mixer.config.sinks == 2
    errs = {"decode": _check_plain_decode(model), "left_padded": _check_left_padded(model),
            "packed": _check_packed(model)}
    assert max(errs.values()) < FP32_TOL, errs
    ids, mask, _ = left_padded([_ids(1, 9, seed=3)[0], _ids(1, 5, seed=4)[0]])
    kw = dict(attention_mask=mask, max_new_tokens=7, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kw), model.generate(ids, use_cache=False, **kw))
    sizes = []
    for T in (6, 30):
        with torch.no_grad():
            sizes.append(model(_ids(1, T), use_cache=True).past_key_values.mixer_nbytes())
    assert sizes[0] == sizes[1] > 0


def test_qk_norm_keeps_the_input_dtype():
    """Under bf16 autocast the projections give bf16 while the norm's gain is fp32: the normed q/k must stay bf16
    like v (fla's fused kernels refuse mixed operands; seen on Gemma 3 on an H100)."""
    from hybridize.mixers.base import FlatRMSNorm, RMSNorm
    x = torch.randn(2, 5, 4, 8, dtype=torch.bfloat16)
    for norm in (RMSNorm(8, offset=1.0), FlatRMSNorm(32)):
        assert norm(x).dtype == torch.bfloat16
        assert norm(x.float()).dtype == torch.float32
    norm = RMSNorm(8, offset=1.0)
    xf = x.float()
    ref = norm.gain() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps))
    assert (norm(x).float() - ref).abs().max() < 0.05


@pytest.mark.parametrize("family", CASES)
def test_slots_are_the_layers_attention_slots_without_a_module_walk(family, monkeypatch):
    """`slots()` (asked by every forward) reads each decoder layer's attention, in layer order: the same list as a
    walk of every module, without the walk."""
    _, model = _hybrid("gla", family)
    walk = [m for m in model.modules() if isinstance(m, AttentionSlot)]
    assert len(walk) == 2
    monkeypatch.setattr(type(model), "modules", lambda self: pytest.fail("slots() walked every module"))
    assert model.slots() == walk
