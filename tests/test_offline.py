"""No network at run time unless asked (issue 29): with a local data file and a local model, `distill` and
`grpo` open no socket - `datasets` used to HEAD S3 to count a download, and TRL started the hub's
telemetry thread - while a command line naming hub data keeps `datasets` online.

The runs go through `hybridize.cli.main` (where the opt-outs are set) with every socket connection and
name lookup recorded and refused."""
from __future__ import annotations

import json
import os
import socket
import sys

import pytest
from transformers import PreTrainedTokenizerFast

from hybridize.offline import DATASETS_OFFLINE, TELEMETRY_OFF, configure

FLAGS = (*TELEMETRY_OFF, *DATASETS_OFFLINE)


@pytest.fixture
def online(monkeypatch):
    """As a user's shell with none of the flags set (CI unset too: TRL skips telemetry under CI), and the
    libraries' constants as their defaults; everything restored afterwards."""
    saved = dict(os.environ)
    for k in (*FLAGS, "CI"):
        os.environ.pop(k, None)
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_TELEMETRY", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    for name, value in (("HF_UPDATE_DOWNLOAD_COUNTS", True), ("HF_HUB_OFFLINE", False),
                        ("HF_DATASETS_OFFLINE", False)):
        monkeypatch.setattr(datasets.config, name, value)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def no_network(monkeypatch):
    """Record and refuse every name lookup and socket connection; yields the list of attempts."""
    attempts = []

    def refuse(what):
        def f(*args, **kwargs):
            attempts.append((what, args[:2]))
            raise OSError(f"network disabled in this test ({what})")
        return f

    monkeypatch.setattr(socket, "getaddrinfo", refuse("getaddrinfo"))
    monkeypatch.setattr(socket.socket, "connect", refuse("connect"))
    monkeypatch.setattr(socket.socket, "connect_ex", refuse("connect_ex"))
    yield attempts


def _run_cli(monkeypatch, *args: str) -> None:
    from hybridize.cli import main

    monkeypatch.setattr(sys, "argv", ["hybridize", *args])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code in (0, None)


# ---- which flags a command line gets ------------------------------------------------------------

def test_local_data_sets_telemetry_off_and_datasets_offline(online, tmp_path):
    import datasets.config
    import huggingface_hub.constants

    data = tmp_path / "t.jsonl"
    data.write_text('{"text": "a"}\n')
    set_now = configure(["distill", "e2e", f"data.train={data}", "train.run_dir=runs/new-run"])
    assert set_now == {**TELEMETRY_OFF, **DATASETS_OFFLINE}
    assert all(os.environ[k] == v for k, v in set_now.items())
    # modules imported before the CLI started read the environment too early: their constants follow
    assert huggingface_hub.constants.HF_HUB_DISABLE_TELEMETRY is True
    assert datasets.config.HF_UPDATE_DOWNLOAD_COUNTS is False and datasets.config.HF_HUB_OFFLINE is True


@pytest.mark.parametrize("args", [["grpo", "data.train=[openai/gsm8k@main:train]"],
                                  ["distill", "e2e", "data.train=HuggingFaceFW/fineweb-edu:sample-10BT"],
                                  ["eval", "niah", "--dataset", "someone/haystacks"]])
def test_hub_data_keeps_datasets_online(online, args):
    assert configure(args) == TELEMETRY_OFF
    assert "HF_DATASETS_OFFLINE" not in os.environ


def test_hub_data_named_in_a_recipe_keeps_datasets_online(online, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("data:\n  train: someone/corpus\ntrain:\n  run_dir: runs/x\n")
    assert "HF_DATASETS_OFFLINE" not in configure(["distill", "e2e", "-r", str(recipe)])
    recipe.write_text(f"data:\n  train: {tmp_path / 'local.jsonl'}\ntrain:\n  run_dir: runs/x\n")
    assert "HF_DATASETS_OFFLINE" in configure(["distill", "e2e", "-r", str(recipe)])


def test_a_flag_the_user_set_wins(online):
    os.environ["HF_DATASETS_OFFLINE"] = "0"
    assert "HF_DATASETS_OFFLINE" not in configure(["distill", "e2e", "data.train=python-docs"])
    assert os.environ["HF_DATASETS_OFFLINE"] == "0"


# ---- real runs: no socket ---------------------------------------------------------------------------

def _word_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(95)} | {"[UNK]": 95}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="w2", pad_token="w0")


def test_distill_with_a_local_data_file_opens_no_socket(online, no_network, monkeypatch, tmp_path):
    from hybridize.convert.convert import convert_model
    from tests.distill.helpers import tiny_llama

    teacher = tiny_llama(0)
    teacher.save_pretrained(tmp_path / "teacher")
    convert_model(teacher, "2:1", mixer="gla").save_pretrained(tmp_path / "student")
    for d in ("teacher", "student"):
        _word_tokenizer().save_pretrained(tmp_path / d)
    texts = tmp_path / "t.jsonl"
    texts.write_text("".join(json.dumps({"text": " ".join(f"w{3 + (i * 7 + j) % 90}" for j in range(9))}) + "\n"
                             for i in range(20)))
    _run_cli(monkeypatch, "distill", "align", f"student={tmp_path / 'student'}", f"teacher={tmp_path / 'teacher'}",
             f"data.train={texts}", "data.seq_len=16", "data.batch_tokens=32", "train.max_steps=1",
             "train.progress=false", f"train.run_dir={tmp_path / 'run'}")
    assert (tmp_path / "run" / "final" / "config.json").is_file()
    assert no_network == []


def test_grpo_opens_no_socket_and_starts_no_telemetry_thread(online, no_network, monkeypatch, tmp_path):
    from huggingface_hub.utils import _telemetry

    from tests.rl.helpers import tiny_hybrid, write_problems

    monkeypatch.setattr(_telemetry, "_TELEMETRY_THREAD", None)
    tiny_hybrid(tmp_path / "m", mixer="gla")
    write_problems(tmp_path / "p.jsonl")
    _run_cli(monkeypatch, "grpo", "--model", str(tmp_path / "m"), "--output-dir", str(tmp_path / "run"),
             f"data.train=[{tmp_path / 'p.jsonl'}]", "grpo.num_generations=4", "grpo.per_device_train_batch_size=4",
             "grpo.max_completion_length=8", "grpo.max_steps=1", "progress=false")
    assert (tmp_path / "run" / "final" / "config.json").is_file()
    assert _telemetry._TELEMETRY_THREAD is None
    assert no_network == []
