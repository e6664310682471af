"""`hybridize demo` (the README's main job) end to end on a tiny random teacher: convert + stage A +
stage B + perplexity table + chat check, with local text files and with the built-in texts (what a user's
machine without a data folder gets)."""
from __future__ import annotations

import json
import math

import pytest

from hybridize.builtin_text import CHAT_PROMPTS, DEMO_CHAT_PROMPTS
from hybridize.distill.demo import chat_answers, demo_config, run_demo
from hybridize.errors import read_jsonl
from tests.distill.helpers import write_texts
from tests.rl.helpers import byte_tokenizer, tiny_teacher


@pytest.fixture
def teacher_dir(tmp_path):
    path = tmp_path / "teacher"
    tiny_teacher().save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def _run(tmp_path, teacher_dir, **over):
    base = {"out": str(tmp_path / "demo"), "teacher": str(teacher_dir), "layers": "2:1", "mixer": "sse",
            "eval_tokens": 256, "eval_seq_len": 64, "align_steps": 2, "e2e_steps": 2, "seq_len": 32,
            "batch_tokens": 64, "chat_samples": 1, "chat_tokens": 4, "chat_batch": 64, "threads": 1,
            "device": "cpu"}
    return run_demo(demo_config([f"{k}={v}" for k, v in {**base, **over}.items()]))


def test_demo_with_local_text(tmp_path, teacher_dir):
    held = tmp_path / "held.txt"
    held.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    s = _run(tmp_path, teacher_dir, train_text=str(write_texts(tmp_path / "train.jsonl")), heldout_text=str(held))
    ppl = s["perplexity"]
    assert set(ppl) == {"teacher", "converted", "after_align", "after_e2e"}
    assert all(math.isfinite(v) and v > 1 for v in ppl.values()), ppl
    assert s["ratio_to_teacher"]["teacher"] == 1.0
    assert s["align"]["steps"] == 2 and s["e2e"]["steps"] == 2
    out = tmp_path / "demo"
    assert json.loads((out / "summary.json").read_text())["perplexity"] == ppl
    md = (out / "summary.md").read_text()
    assert "after stage B" in md and DEMO_CHAT_PROMPTS[0] in md
    assert len(s["chat"]["student"]) == len(DEMO_CHAT_PROMPTS)
    assert (out / "student" / "config.json").is_file()
    assert not (out / "align" / "checkpoints").exists()  # resume points are removed at the end


def test_demo_default_data_is_built_in(tmp_path, teacher_dir):
    """No data options: training on standard-library docstrings + teacher chat answers, held-out on the
    Language Reference topics (never in the training file)."""
    s = _run(tmp_path, teacher_dir)
    assert s["heldout"].startswith("Python Language Reference")
    train = [r["text"] for r in read_jsonl(tmp_path / "demo" / "data" / "train.jsonl")]
    assert len(read_jsonl(tmp_path / "demo" / "data" / "chat.jsonl")) == len(CHAT_PROMPTS)
    from hybridize.builtin_text import language_reference_topics
    held = set(language_reference_topics())
    assert train and not held & set(train)
    assert all(math.isfinite(v) for v in s["perplexity"].values())


def test_chat_answers_resume(tmp_path):
    """An interrupted answer file is completed, not rewritten: rows already there are kept as they are."""
    from tests.rl.helpers import byte_tokenizer, tiny_teacher

    teacher, tok = tiny_teacher(), byte_tokenizer()
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"prompt": 0, "sample": 0, "text": "KEPT"}) + "\n")
    docs = chat_answers(teacher, tok, path, samples=1, max_new_tokens=2, batch=64, seed=0)
    assert docs[0] == "KEPT" and len(docs) == len(CHAT_PROMPTS)
    assert len(read_jsonl(path)) == len(CHAT_PROMPTS)


def test_demo_config_rejects_stage_keys():
    from hybridize.errors import UserError

    with pytest.raises(UserError, match="unknown setting"):
        demo_config(["train.lr=3e-4"])


@pytest.mark.parametrize("override,needle", [
    ('mixer_settings={"use_rope": "false"}', 'sse.use_rope must be a JSON bool (true or false), got the string'),
    ("mixer_settings.chunk_size=0", "sse.chunk_size is a size or count and must be an integer >= 1, got 0"),
    ("mixer_settings.num_partitions=-1", "sse.num_partitions is a size or count"),
    ("mixer_settings.top_k=9", "mixer 'sse' rejects its settings"),
])
def test_demo_checks_mixer_settings_before_the_teacher_loads(tmp_path, teacher_dir, monkeypatch, override, needle):
    """`hybridize demo` runs the checks of `convert --mixer-settings` (issue 29) before it loads the teacher
    and writes its answers: one line, nothing written."""
    from typer.testing import CliRunner

    from hybridize.cli import app
    from hybridize.errors import UserError

    monkeypatch.setattr("hybridize.distill.demo.load_teacher", lambda *a, **k: pytest.fail("the teacher loaded"))
    out = tmp_path / "demo"
    r = CliRunner().invoke(app, ["demo", f"out={out}", f"teacher={teacher_dir}", "layers=2:1", "mixer=sse",
                                 "device=cpu", override])
    assert isinstance(r.exception, UserError), r.output
    assert needle in str(r.exception) and "\n" not in str(r.exception)
    assert not out.exists()


def test_demo_seed_reaches_the_conversion(tmp_path, teacher_dir, monkeypatch):
    """`hybridize demo seed=N` also draws the converted layers' new parameters from N (convert's `seed`),
    not always from 0."""
    seen = {}

    class Stop(Exception):
        pass

    def spy(*a, **k):
        seen.update(k)
        raise Stop

    monkeypatch.setattr("hybridize.distill.demo.convert_model", spy)
    held = tmp_path / "held.txt"
    held.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    with pytest.raises(Stop):
        _run(tmp_path, teacher_dir, seed=5, train_text=str(write_texts(tmp_path / "train.jsonl")),
             heldout_text=str(held))
    assert seen["seed"] == 5


@pytest.mark.parametrize("override,key", [
    ("align_steps=-5", "align_steps"), ("e2e_steps=0", "e2e_steps"), ("seq_len=0", "seq_len"),
    ("batch_tokens=-1", "batch_tokens"), ("align_lr=-1e-3", "align_lr"), ("chat_batch=0", "chat_batch"),
    ("eval_seq_len=0", "eval_seq_len"),
])
def test_demo_counts_fail_at_parse_time(override, key):
    """As the stages' train.max_steps=-5 (issue 29): a demo step count or size below its minimum is one line
    when the settings are read, not after the teacher wrote its answers and stage A ran."""
    from hybridize.errors import UserError

    with pytest.raises(UserError) as e:
        demo_config([override])
    assert str(e.value).startswith(f"{key} must be >=") and "\n" not in str(e.value)


def test_demo_non_utf8_heldout_text_names_file_and_line(tmp_path):
    """A held-out .txt that is not UTF-8 is one line naming the file and line (issue 29: a bare codec message
    from `Path.read_text`)."""
    from hybridize.distill.demo import heldout_text
    from hybridize.errors import UserError

    held = tmp_path / "held.txt"
    held.write_bytes(b"fine\ncaf\xe9\n")
    with pytest.raises(UserError) as e:
        heldout_text(demo_config([f"heldout_text={held}"]))
    assert str(e.value).startswith(f"{held}, line 2, column 4: not UTF-8 text (byte 0xe9)")
    held.write_text("caf\u00e9\n", encoding="utf-8")
    assert heldout_text(demo_config([f"heldout_text={held}"]))[0] == ["caf\u00e9\n"]
