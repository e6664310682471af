"""Model sources: classification of --src, local folders, the dense cache, one-line errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hybridize.convert import sources
from hybridize.convert.sources import ALIASES, load_config, load_model, resolve_source
from hybridize.errors import UserError
from tests.convert.common import tiny_teacher, tiny_tokenizer


def test_default_resolves_to_the_packaged_gguf():
    kind, target = resolve_source("default")
    assert kind == "default" and target.endswith(".gguf") and Path(target).is_file()
    assert resolve_source("SmolLM2")[0] == "default"


def test_aliases_and_hub_ids():
    assert resolve_source("qwen3-1.7b") == ("hub", "Qwen/Qwen3-1.7B")
    assert resolve_source("r1-distill-qwen-1.5b") == ("hub", ALIASES["r1-distill-qwen-1.5b"])
    assert resolve_source("Qwen/Qwen2.5-1.5B") == ("hub", "Qwen/Qwen2.5-1.5B")


@pytest.mark.parametrize("src,match", [
    ("./missing-folder", "not found"),
    ("/no/such/dir", "not found"),
    ("missing.gguf", "GGUF file"),
    ("nonsense", "unknown model"),
])
def test_bad_sources_are_one_line_user_errors(src, match):
    with pytest.raises(UserError, match=match) as e:
        resolve_source(src)
    assert "\n" not in str(e.value)


def test_hub_alias_offline_names_the_local_alternative(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import time
    with pytest.raises(UserError) as e:
        load_model("qwen3-1.7b")
    msg = str(e.value)
    assert "\n" not in msg and "Qwen/Qwen3-1.7B" in msg and "--src DIR" in msg


def test_local_teacher_folder(tmp_path):
    teacher = tiny_teacher("qwen2")
    teacher.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    model, tok = load_model(str(tmp_path), dtype=torch.bfloat16)
    assert model.config.model_type == "qwen2" and model.dtype == torch.bfloat16 and not model.training
    assert tok is not None and tok.pad_token is not None
    assert load_config(str(tmp_path)).num_hidden_layers == 3


def test_unsupported_family_names_what_is_missing(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1}))
    with pytest.raises(UserError, match="supported: llama, qwen2, qwen3, mistral, gemma3_text") as e:
        load_model(str(tmp_path))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(tmp_path))
    assert "decoder layers at transformer.h, not model.layers" in msg


@pytest.mark.parametrize("model_type,config,expected", [
    # Llama's layout, but an attention feature no entry covers
    ("stablelm", {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64,
                  "vocab_size": 50, "partial_rotary_factor": 0.25, "qk_layernorm": True},
     ["its attention uses partial rotary (partial_rotary_factor=0.25), q/k layer norms (qk_layernorm=True)"]),
    # GPT-OSS: attention sinks (a learned logit per head that no entry describes)
    ("gpt_oss", {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1,
                 "head_dim": 16, "intermediate_size": 64, "vocab_size": 50, "num_local_experts": 2},
     ["attention model.layers.N.self_attn also has sinks"]),
    # a supported family with a setting its entry refuses
    ("gemma3_text", {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "head_dim": 16,
                     "intermediate_size": 64, "vocab_size": 50, "use_bidirectional_attention": True},
     ["use_bidirectional_attention=True is not supported"]),
])
def test_unsupported_attention_features_are_named(tmp_path, model_type, config, expected):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, **config}))
    with pytest.raises(UserError) as e:
        load_config(str(tmp_path))
    msg = str(e.value)
    assert "\n" not in msg and all(x in msg for x in expected), msg


@pytest.mark.parametrize("name,hub_id", [
    ("Qwen", "Qwen/Qwen3-1.7B"), ("qwen", "Qwen/Qwen3-1.7B"), ("LLAMA", "meta-llama/Llama-3.2-1B-Instruct"),
    ("gemma", "google/gemma-3-270m-it"), ("Phi", "microsoft/Phi-3-mini-4k-instruct"),
    ("olmo", "allenai/OLMo-2-0425-1B-Instruct"), ("Granite", "ibm-granite/granite-3.3-2b-instruct"),
])
def test_a_family_name_is_a_source(name, hub_id):
    from hybridize.convert.sources import describe_source, family_source_note

    assert resolve_source(name) == ("hub", hub_id)
    note = family_source_note(name)
    assert note is not None and hub_id in note and "\n" not in note
    assert describe_source(name)["target"] == hub_id


def test_smollm2_is_the_embedded_default_and_a_folder_wins_over_a_family_name(tmp_path, monkeypatch):
    from hybridize.convert.sources import family_source_note

    assert resolve_source("SmolLM2")[0] == "default" and family_source_note("smollm2") is None
    (tmp_path / "gemma").mkdir()
    monkeypatch.chdir(tmp_path)
    assert resolve_source("gemma") == ("local", "gemma") and family_source_note("gemma") is None


def test_a_family_name_offline_names_the_local_alternatives(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError) as e:
        load_config("Qwen")
    msg = str(e.value)
    assert "\n" not in msg and "Qwen/Qwen3-1.7B" in msg
    assert "--src default" in msg and "local model folder" in msg and ".gguf file" in msg


def test_dense_cache_is_written_atomically(tmp_path):
    teacher, tok = tiny_teacher("llama"), tiny_tokenizer()
    dense = tmp_path / "cache" / "model-1-2"
    sources._write_dense_cache(teacher, tok, dense)
    assert (dense / "config.json").exists() and (dense / "model.safetensors").exists()
    sources._write_dense_cache(teacher, tok, dense)  # already there: the second copy is dropped
    assert sorted(p.name for p in dense.parent.iterdir()) == ["model-1-2"]
    model, _ = load_model(str(dense))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), teacher.state_dict().values()))
