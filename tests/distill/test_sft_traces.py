"""Stage C (TRL SFTTrainer) and teacher traces on tiny random models with the real SmolLM2 tokenizer."""
from __future__ import annotations

import json

import pytest
import torch

from hybridize.distill.config import SFTStageConfig, TracesConfig, load_config
from hybridize.distill.sft import build_sft_dataset, latest_complete, sft
from hybridize.distill.traces import write_traces

from .helpers import smol_tokenizer, tiny_llama_vocab, write_rows


@pytest.fixture(scope="module")
def tok():
    return smol_tokenizer()


def test_sft_dataset_skips_malformedwrite_rows(tmp_path, tok, capsys):
    f = write_rows(tmp_path / "t.jsonl", [{"problem": "1+1?", "solution": "2"}, {"problem": "x", "solution": None},
                                     {"problem": "2+2?", "solution": "4"}])
    cfg = load_config(SFTStageConfig, None, {"traces": str(f)})
    ds = build_sft_dataset(cfg, tok)
    assert len(ds) == 2 and ds[0]["completion"][0] == {"role": "assistant", "content": "2"}
    assert f"warning: {f}: dropped 1 of 3 rows: 1 with no text in 'solution'" in capsys.readouterr().err


def test_sft_runs_resumes_and_marks_complete_checkpoints(tmp_path, tok):
    from hybridize.convert.convert import convert_model

    data = "../shared/data/gsm8k/train.jsonl"
    import pathlib
    if not pathlib.Path(data).exists():
        data = str(write_rows(tmp_path / "g.jsonl", [{"problem": f"What is {i}+{i}?", "solution": f"{2 * i}"}
                                                for i in range(16)]))
    base = {"traces": data, "max_examples": 16, "max_length": 64, "batch_size": 2,
            "train": {"run_dir": str(tmp_path / "sft"), "save_every": 2, "lr": 1e-3, "progress": False,
                      "warmup_steps": 0}}

    def student():
        return convert_model(tiny_llama_vocab(len(tok)), "2:1", mixer="gla").train()
    sft(student(), tok, load_config(SFTStageConfig, None, {**base, "train": {**base["train"], "max_steps": 2}}))
    ck = latest_complete(tmp_path / "sft")
    assert ck and ck.endswith("checkpoint-2")
    sft(student(), tok, load_config(SFTStageConfig, None, {**base, "train": {**base["train"], "max_steps": 4}}),
        resume=True)
    steps = [json.loads(x)["step"] for x in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(x)]
    assert steps == [1, 2, 3, 4]
    assert (tmp_path / "sft" / "final" / "config.json").is_file()


def test_traces_written_and_rerun_skips_done(tmp_path, tok):
    torch.manual_seed(0)
    model = tiny_llama_vocab(len(tok))
    prompts = write_rows(tmp_path / "p.jsonl", [{"problem": "What is 2+3?", "answer": "5"},
                                           {"problem": "Name a colour.", "answer": "red"}, {"problem": None}])
    cfg = load_config(TracesConfig, None, {"prompts": str(prompts), "out": str(tmp_path / "tr.jsonl"),
                                           "max_new_tokens": 4, "batch_size": 2, "num_prompts": 0})
    write_traces(model, tok, cfg, "tiny")
    rows = [json.loads(x) for x in (tmp_path / "tr.jsonl").read_text().splitlines()]
    assert [r["prompt_index"] for r in rows] == [0, 1]
    assert rows[0]["answer"] == "5" and isinstance(rows[0]["completion"], str) and rows[0]["teacher"] == "tiny"
    # `text`: the conversation in the chat template, the completion inside the assistant's turn
    msgs = [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": rows[0]["completion"]}]
    assert rows[0]["text"] == tok.apply_chat_template(msgs, tokenize=False)
    assert rows[0]["text"].startswith(tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True))
    write_traces(model, tok, cfg, "tiny")  # the malformed row is retried and skipped, the others are done
    assert len((tmp_path / "tr.jsonl").read_text().splitlines()) == 2


def test_traces_keep_correct_is_rejection_sampling(tmp_path, tok, monkeypatch):
    """keep=correct writes only the completions the checker grades right; the rest go to the side file and a
    rerun generates neither again."""
    import hybridize.distill.traces as traces

    calls = []

    def fake_generate(model, tokenizer, prompts, *a, **k):
        calls.append(len(prompts))
        return ["12" if "5 + 7" in p else "3" for p in prompts]

    monkeypatch.setattr(traces, "generate", fake_generate)
    prompts = write_rows(tmp_path / "p.jsonl", [{"problem": "What is 5 + 7?", "answer": "12"},
                                                 {"problem": "What is 2 + 2?", "answer": "4"}])
    cfg = load_config(TracesConfig, None, {"prompts": str(prompts), "out": str(tmp_path / "tr.jsonl"),
                                           "num_prompts": 0, "batch_size": 2, "samples_per_prompt": 2,
                                           "keep": "correct", "answer_format": "number"})
    traces.write_traces(None, tok, cfg, "fake")
    kept = [json.loads(x) for x in (tmp_path / "tr.jsonl").read_text().splitlines()]
    rejected = [json.loads(x) for x in (tmp_path / "tr.rejected.jsonl").read_text().splitlines()]
    assert [(r["prompt_index"], r["sample"], r["completion"]) for r in kept] == [(0, 0, "12"), (0, 1, "12")]
    assert sorted((r["prompt_index"], r["sample"]) for r in rejected) == [(1, 0), (1, 1)]
    traces.write_traces(None, tok, cfg, "fake")
    assert sum(calls) == 4      # the rerun found every (prompt, sample) done, kept or rejected


def test_traces_bad_keep_or_format_is_one_line(tmp_path, tok):
    from hybridize.errors import UserError
    from hybridize.distill.traces import write_traces

    for bad in ({"keep": "best"}, {"answer_format": "latex"}):
        cfg = load_config(TracesConfig, None, {"prompts": "arith:L1", "out": str(tmp_path / "t.jsonl"), **bad})
        with pytest.raises(UserError, match="keep=|answer_format="):
            write_traces(None, tok, cfg, "x")


def test_traces_arith_prompt_carries_the_number_instruction(tmp_path, tok, monkeypatch):
    import hybridize.distill.traces as traces

    monkeypatch.setattr(traces, "generate", lambda m, t, prompts, *a, **k: ["0"] * len(prompts))
    cfg = load_config(TracesConfig, None, {"prompts": "arith:L1", "prompt_field": "prompt", "num_prompts": 2,
                                           "out": str(tmp_path / "t.jsonl"), "answer_format": "number"})
    traces.write_traces(None, tok, cfg, "x")
    rows = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["prompt"].endswith("\nAnswer with the number only.") for r in rows)


def test_traces_load_the_teacher_on_the_configured_device(tmp_path, monkeypatch):
    """`device=auto` puts the teacher on the GPU when there is one (a CPU-only load made the H100 run's traces
    take 20 minutes); an explicit device is passed through."""
    import hybridize.distill.traces as traces
    seen = {}

    def fake_load(source, dtype, device):
        seen["device"] = device
        raise SystemExit(0)   # stop before any generation

    monkeypatch.setattr(traces, "load_teacher", fake_load)
    monkeypatch.setattr(traces.torch.cuda, "is_available", lambda: True)
    prompts = write_rows(tmp_path / "p.jsonl", [{"problem": "What is 2+3?"}])
    for device, want in (("auto", "cuda"), ("cpu", "cpu"), ("cuda:1", "cuda:1")):
        with pytest.raises(SystemExit):
            traces.run_traces(TracesConfig(teacher="default", prompts=str(prompts), out=str(tmp_path / "t.jsonl"),
                                           device=device))
        assert seen["device"] == want


def test_traces_of_a_finished_file_do_not_load_the_teacher(tmp_path, monkeypatch, capsys):
    """A rerun over a complete traces file says so without loading the teacher (40-50 s a time on the device
    for a GGUF teacher); a file missing a row loads it."""
    import hybridize.distill.traces as traces
    loads = []

    def fake_load(source, dtype, device):
        loads.append(source)
        raise SystemExit(0)

    monkeypatch.setattr(traces, "load_teacher", fake_load)
    prompts = write_rows(tmp_path / "p.jsonl", [{"problem": "What is 2+3?"}, {"problem": "Name a colour."}])
    out = tmp_path / "t.jsonl"
    cfg = TracesConfig(teacher="default", prompts=str(prompts), out=str(out), num_prompts=0)
    write_rows(out, [{"prompt_index": 0, "sample": 0, "completion": "5"}])
    with pytest.raises(SystemExit):
        traces.run_traces(cfg)   # row 1 missing: the teacher loads
    assert loads == ["default"]
    write_rows(out, [{"prompt_index": i, "sample": 0, "completion": "x"} for i in (0, 1)])
    assert traces.run_traces(cfg) == out and loads == ["default"]
    assert "all 2 completions already in" in capsys.readouterr().out


def test_conversation_text_without_a_chat_template_and_a_prompt_text_column_kept():
    from types import SimpleNamespace

    from hybridize.distill.traces import render_conversation

    plain = SimpleNamespace(chat_template=None)
    assert render_conversation(plain, "Q?", " A.") == "Q?\n A."
    assert render_conversation(plain, "Q?", " A.", system="S") == "S\nQ?\n A."


def test_traces_keep_a_prompt_rows_text_column_as_source_text(tmp_path, tok, monkeypatch):
    import hybridize.distill.traces as traces

    monkeypatch.setattr(traces, "generate", lambda model, tokenizer, prompts, *a, **k: ["4"] * len(prompts))
    prompts = write_rows(tmp_path / "p.jsonl", [{"problem": "2 + 2?", "text": "the row's own text"}])
    cfg = load_config(TracesConfig, None, {"prompts": str(prompts), "out": str(tmp_path / "tr.jsonl"), "num_prompts": 0})
    traces.write_traces(None, tok, cfg, "fake")
    row = json.loads((tmp_path / "tr.jsonl").read_text())
    assert row["source_text"] == "the row's own text" and "2 + 2?" in row["text"] and row["text"] != row["source_text"]


def test_traces_on_the_fast_engine_write_the_same_greedy_completions(tmp_path, tok, capsys):
    """`generation=fast` (what `auto` picks on a GPU) goes through our static-buffer engine: on CPU, forced, the
    greedy completions equal `model.generate`'s, row for row, for prompts of different lengths in one batch."""
    torch.manual_seed(0)
    model = tiny_llama_vocab(len(tok)).eval()
    prompts = write_rows(tmp_path / "p.jsonl", [{"problem": "What is 2+3?"}, {"problem": "Name a colour, please."},
                                               {"problem": "Hi"}])
    texts = {}
    for mode in ("hf", "fast"):
        cfg = load_config(TracesConfig, None, {"prompts": str(prompts), "out": str(tmp_path / f"{mode}.jsonl"),
                                               "num_prompts": 0, "max_new_tokens": 6, "batch_size": 3,
                                               "generation": mode})
        write_traces(model, tok, cfg, "tiny")
        texts[mode] = [json.loads(x)["completion"] for x in (tmp_path / f"{mode}.jsonl").read_text().splitlines()]
    assert len(texts["hf"]) == 3 and any(texts["hf"])
    assert texts["fast"] == texts["hf"]
    assert "fell back" not in capsys.readouterr().err   # the engine ran, not model.generate behind it


def test_traces_generation_mode_is_checked(tmp_path, tok):
    prompts = write_rows(tmp_path / "p.jsonl", [{"problem": "What is 2+3?"}])
    cfg = load_config(TracesConfig, None, {"prompts": str(prompts), "out": str(tmp_path / "t.jsonl"),
                                           "generation": "vllm"})
    from hybridize.errors import UserError
    with pytest.raises(UserError, match="generation='vllm': use one of auto, fast, hf"):
        write_traces(tiny_llama_vocab(len(tok)), tok, cfg, "tiny")
