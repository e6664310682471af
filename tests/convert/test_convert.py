"""The converter: weight mapping per family (GQA, biases, q/k norms, fused qkv), settings, errors, report."""
from __future__ import annotations

import math

import pytest
import torch
from transformers import GPT2Config

from hybridize.convert.convert import convert_model, new_parameter_names, split_settings
from hybridize.convert.report import conversion_report, report_table, sample_inputs
from hybridize.mixers import mixer_names
from hybridize.modeling import AttentionSlot, mixer_common_settings
from tests.convert.common import CASES, rel_err, tiny_teacher, tiny_teacher_config, toy_registered


@pytest.mark.parametrize("family", CASES)
def test_every_teacher_tensor_is_copied(family):
    """Every teacher tensor is in the hybrid, by name, or split by the family's entry (Phi-3's fused
    qkv_proj of a converted layer is held as the mixer's q/k/v_proj); nothing else is added but the
    mixers' new parameters."""
    from hybridize.convert.convert import teacher_state_for

    teacher = tiny_teacher(family)
    hybrid = convert_model(teacher, "1:1", mixer="gla")
    t, h = teacher_state_for(hybrid, teacher.state_dict()), hybrid.state_dict()
    for k, v in t.items():
        assert torch.equal(h[k], v), k
    assert (set(teacher.state_dict()) == set(t)) == (family != "phi3")
    slot = hybrid.model.layers[0].self_attn
    assert isinstance(slot, AttentionSlot)
    assert slot.k_proj.weight.shape == (2 * 16, 64)  # GQA kept: KV-head width
    assert (slot.q_proj.bias is not None) == (family in ("qwen2", "llama_bias"))
    assert (slot.o_proj.bias is not None) == (family == "llama_bias")
    if family == "llama_bias":   # a converted layer (gla) keeps the teacher's o_proj bias
        mixer = hybrid.model.layers[1].self_attn
        assert torch.equal(mixer.o_proj.bias, teacher.model.layers[1].self_attn.o_proj.bias)
    assert hasattr(slot, "q_norm") == (family in ("qwen3", "gemma3_text", "olmo2", "qwen3_moe"))
    new = set(new_parameter_names(hybrid))
    assert new and set(h) - set(t) == new


@pytest.mark.parametrize("kind", mixer_names())
def test_every_mixer_converts_and_runs(kind):
    teacher = tiny_teacher("qwen3")
    hybrid = convert_model(teacher, "all", mixer=kind).eval()
    assert hybrid.config.layer_plan == [kind] * 3
    with torch.no_grad():
        out = hybrid(torch.randint(3, 97, (1, 9))).logits
    assert torch.isfinite(out).all()


def test_dtype_device_and_mode_follow_teacher():
    teacher = tiny_teacher("llama").to(torch.bfloat16)
    hybrid = convert_model(teacher, "all", mixer="gla")
    assert all(p.dtype == torch.bfloat16 for p in hybrid.parameters())
    assert not hybrid.training
    teacher.train()
    assert convert_model(teacher, "all", mixer="gla").training


def test_settings_forms_and_errors():
    plan = ["sse", "swa", "attn"]
    assert split_settings({"window": 7}, plan) == {"sse": {}, "swa": {"window": 7}}
    assert split_settings({"sse.top_k": 2, "swa": {"window": 3}}, plan) == {"sse": {"top_k": 2}, "swa": {"window": 3}}
    assert split_settings({"use_rope": True}, plan) == {"sse": {"use_rope": True}, "swa": {"use_rope": True}}
    with pytest.raises(ValueError, match="no mixer in the plan"):
        split_settings({"nope": 1}, plan)
    with pytest.raises(ValueError, match="does not use"):
        split_settings({"gla.init_decay": 0.9}, plan)
    teacher = tiny_teacher("llama")
    with pytest.raises(ValueError, match="set from the teacher"):
        convert_model(teacher, "all", mixer="gla", mixer_settings={"num_heads": 2})
    h = convert_model(teacher, "all", mixer="gla", mixer_settings={"init_decay": 0.9})
    assert h.config.mixer_settings["gla"]["init_decay"] == 0.9


def test_common_settings_from_teacher_config():
    c = mixer_common_settings(tiny_teacher_config("qwen2"))
    assert c == dict(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True, o_bias=False, qk_norm=False,
                     qk_norm_scope="head", qk_norm_offset=0.0, attn_scale=None, rms_norm_eps=1e-6)
    assert mixer_common_settings(tiny_teacher_config("qwen3"))["qk_norm"] is True
    assert mixer_common_settings(tiny_teacher_config("olmo2"))["qk_norm_scope"] == "full"
    gemma = mixer_common_settings(tiny_teacher_config("gemma3_text"))
    assert gemma["qk_norm_offset"] == 1.0 and gemma["attn_scale"] == 24 ** -0.5
    biased = mixer_common_settings(tiny_teacher_config("llama", attention_bias=True))
    assert biased["qkv_bias"] is True and biased["o_bias"] is True


def test_unsupported_family_is_refused_naming_what_is_missing():
    from transformers import AutoModelForCausalLM

    from hybridize.errors import UserError

    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="'gpt2' is not in hybridize's family table") as e:
        convert_model(gpt2, "all", mixer="gla")
    msg = str(e.value)
    assert isinstance(e.value, UserError) and "\n" not in msg
    assert "supported: llama, qwen2, qwen3, mistral, gemma3_text, gemma2, phi3, olmo2, granite, qwen3_moe" in msg
    assert "decoder layers at transformer.h, not model.layers" in msg


def test_teacher_tensor_without_a_place_is_an_error():
    teacher = tiny_teacher("llama")
    sd = teacher.state_dict()
    teacher.state_dict = lambda: {**sd, "model.layers.0.self_attn.extra.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match="no place in the hybrid"):
        convert_model(teacher, "all", mixer="gla")


def test_parameter_left_unset_by_a_mixer_is_an_error():
    from tests.convert.toy_mixer import ToyMixer

    class Forgetful(ToyMixer):
        def reset_new_parameters(self):  # forgets the gate bias
            torch.nn.init.zeros_(self.gate.weight)

    with toy_registered():
        import hybridize.mixers as M

        orig = M.mixer_class
        M.mixer_class = lambda n: Forgetful if n == "toy" else orig(n)
        try:
            with pytest.raises(RuntimeError, match="gate.bias"):
                convert_model(tiny_teacher("llama"), "all", mixer="toy")
        finally:
            M.mixer_class = orig


# ------------------------------------------------------------------ report
def _manual_layer_error(teacher, hybrid, layer: int, inputs) -> float:
    """||mixer(x) - attn(x)|| / ||attn(x)|| with x rebuilt from the teacher's hidden states by hand."""
    num = den = 0.0
    with torch.no_grad():
        for ids in inputs:
            T = ids.shape[1]
            hs = teacher(ids, output_hidden_states=True, use_cache=False).hidden_states[layer]
            x = teacher.model.layers[layer].input_layernorm(hs)
            pe = teacher.model.rotary_emb(x, torch.arange(T)[None])
            causal = torch.full((T, T), float("-inf")).triu(1)[None, None]
            y_t = teacher.model.layers[layer].self_attn(x, position_embeddings=pe, attention_mask=causal)[0]
            y_m = hybrid.model.layers[layer].self_attn(x, position_embeddings=pe)[0]
            num += (y_m - y_t).pow(2).sum().item()
            den += y_t.pow(2).sum().item()
    return math.sqrt(num / den)


def test_report_matches_independent_computation():
    teacher = tiny_teacher("qwen3")
    hybrid = convert_model(teacher, "1:1", mixer="gla").eval()
    inputs = sample_inputs(None, 97, n=2, length=11)
    inputs[1] = inputs[1][:, :7]  # unequal lengths: the report right-pads them into one batch
    rep = conversion_report(teacher, hybrid, inputs, source={"src": "tiny"})
    assert [r["kind"] for r in rep["layers"]] == ["gla", "attn", "gla"]
    assert rep["layers"][1]["rel_err"] is None and rep["layers"][1]["new_params"] == 0
    for i in (0, 2):
        row = rep["layers"][i]
        assert abs(row["rel_err"] - _manual_layer_error(teacher, hybrid, i, inputs)) < 1e-5 * row["rel_err"]
        slot = hybrid.model.layers[i].self_attn
        params = dict(slot.named_parameters())
        assert row["new_params"] == sum(params[n].numel() for n in slot.new_parameter_names()) > 0
    assert rep["params"]["hybrid"] - rep["params"]["teacher"] == rep["params"]["new"]
    assert rep["tokens"] == 18 and 0.0 <= rep["model"]["top1_agreement"] <= 1.0
    from rich.console import Console

    console = Console(width=120, record=True)
    console.print(report_table(rep))
    assert "gla" in console.export_text()


def test_report_of_unconverted_model_is_exact():
    teacher = tiny_teacher("llama")
    hybrid = convert_model(teacher, "none", mixer="gla").eval()
    rep = conversion_report(teacher, hybrid, sample_inputs(None, 97, n=1, length=8))
    assert rep["model"]["logits_rel_err"] == 0.0 and rep["model"]["top1_agreement"] == 1.0
    assert abs(rep["model"]["kl_teacher_hybrid"]) < 1e-6 and rep["params"]["new"] == 0


def test_unconverted_hybrid_matches_teacher_rel_error():
    teacher = tiny_teacher("mistral")
    hybrid = convert_model(teacher, "none", mixer="gla").eval()
    ids = torch.randint(3, 97, (2, 12))
    with torch.no_grad():
        assert rel_err(hybrid(ids).logits, teacher(ids).logits) == 0.0
