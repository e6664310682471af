"""`eval needle-attention`: kept softmax layers' needle mass, teacher vs hybrid, on tiny models with the real
SmolLM2 tokenizer."""
from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from hybridize.convert.convert import convert_model
from hybridize.errors import UserError
from hybridize.eval.needle_attention import NeedleAttentionConfig, compare, markdown, softmax_layers
from tests.distill.helpers import smol_tokenizer, tiny_llama_vocab

CFG = NeedleAttentionConfig(length=320, samples=2)


@pytest.fixture(scope="module")
def tok():
    return smol_tokenizer()


@pytest.fixture(scope="module")
def teacher(tok):
    return tiny_llama_vocab(len(tok))


def test_no_layer_converted_matches_the_teacher(tok, teacher):
    hybrid = convert_model(teacher, "none", mixer="gla").eval()
    rep = compare(teacher, hybrid, tok, CFG, torch.device("cpu"))
    assert [r["layer"] for r in rep["layers"]] == [0, 1, 2]
    for r in rep["layers"]:
        assert 0 < r["teacher_mass"] <= 1
        assert r["model_mass_same_head"] == pytest.approx(r["teacher_mass"], rel=1e-5)
        assert r["model_head"] == r["teacher_head"]
    assert rep["model"]["answer_logprob"] == pytest.approx(rep["teacher"]["answer_logprob"], rel=1e-5)
    assert rep["model"]["answer_logprob"] < 0 and 0 <= rep["model"]["answer_top1"] <= 1


def test_a_converted_layer_below_changes_the_kept_layers_reads(tok, teacher):
    hybrid = convert_model(teacher, "gla,attn,attn").eval()
    assert softmax_layers(hybrid) == [1, 2] and softmax_layers(teacher) == [0, 1, 2]
    rep = compare(teacher, hybrid, tok, CFG, torch.device("cpu"))
    assert [r["layer"] for r in rep["layers"]] == [1, 2]
    assert any(abs(r["model_mass_same_head"] - r["teacher_mass"]) > 1e-3 * r["teacher_mass"] for r in rep["layers"])
    assert rep["model"]["answer_logprob"] != pytest.approx(rep["teacher"]["answer_logprob"], rel=1e-6)
    assert "| 1 |" in markdown(rep) and "answer top-1" in markdown(rep)


def test_a_model_without_softmax_layers_is_one_line(tok, teacher):
    with pytest.raises(UserError, match="keeps no softmax attention layer"):
        compare(teacher, convert_model(teacher, "all", mixer="gla").eval(), tok, CFG, torch.device("cpu"))


def test_cli_writes_json_and_markdown(tmp_path, tok, teacher, monkeypatch):
    import hybridize.eval.common as common
    from hybridize.cli import app

    hybrid = convert_model(teacher, "gla,attn,attn").eval()
    models = {"T": (teacher, tok), "H": (hybrid, tok)}
    monkeypatch.setattr(common, "load_model", lambda src, **kw: models[src])
    res = CliRunner().invoke(app, ["eval", "needle-attention", "--teacher", "T", "-m", "H", "--length", "320",
                                   "--samples", "2", "--out", str(tmp_path / "na")])
    assert res.exit_code == 0, res.output
    rep = json.loads((tmp_path / "na" / "needle_attention.json").read_text())
    assert [r["layer"] for r in rep["layers"]] == [1, 2]
    assert (tmp_path / "na" / "needle_attention.md").read_text().startswith("S-NIAH-1 needle mass")


@pytest.mark.parametrize("task", ["s-niah-2", "s-niah-3"])
def test_the_essay_tasks_locate_their_value_and_report_it(tok, teacher, task):
    """S-NIAH-2 / -3 (a number / a UUID in essays): the needle's value is found among the prompt's tokens, the
    teacher's answer is the value, and the report names its task."""
    from hybridize.convert.select.needle import needle_prompts

    prompts = needle_prompts(tok, 320, 2, task)
    for p in prompts:
        value = tok.decode([p.input_ids[i] for i in p.value_tokens])
        assert p.answer in value or value.strip() in p.answer
        assert tok.decode(p.input_ids[p.prompt_len:]).strip() == p.answer
    if task == "s-niah-3":
        assert all(p.answer.count("-") == 4 for p in prompts)   # a UUID
    with pytest.raises(UserError, match="^--length 16: "):
        compare(teacher, teacher, tok, NeedleAttentionConfig(length=16, samples=1, task=task), torch.device("cpu"))
    hybrid = convert_model(teacher, "gla,attn,attn").eval()
    rep = compare(teacher, hybrid, tok, NeedleAttentionConfig(length=320, samples=2, task=task), torch.device("cpu"))
    assert rep["task"] == task and markdown(rep).startswith(f"{task.upper()} needle mass")


def test_cli_unknown_task_is_one_line_before_loading(monkeypatch, capsys):
    import sys

    import hybridize.eval.common as common
    from hybridize.cli import main

    monkeypatch.setattr(common, "load_model", lambda src, **kw: pytest.fail("loaded a model"))
    monkeypatch.setattr(sys, "argv", ["hybridize", "eval", "needle-attention", "--teacher", "T", "-m", "H",
                                      "--task", "s-niah-9"])
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "unknown NIAH task 's-niah-9'" in err
