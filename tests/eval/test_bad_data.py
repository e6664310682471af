"""Empty and non-UTF-8 data files end in one line naming the file (and line) (issue 29: an empty data file
crashed the error handler itself with IndexError; a Latin-1 byte gave a bare codec message)."""
from __future__ import annotations

import json

import pytest

from hybridize.errors import UserError, check_utf8, first_line, read_text

LATIN1_JSONL = b'{"text": "fine"}\n{"text": "caf\xe9"}\n'


def test_first_line_of_an_empty_message_is_the_type_name():
    assert first_line(ValueError("")) == "ValueError" and first_line(ValueError("a\nb")) == "a"


@pytest.mark.parametrize("name", ["empty.jsonl", "empty.txt", "blank.jsonl"])
def test_distill_empty_data_file_is_one_line(tmp_path, name):
    from hybridize.distill.data import load_texts

    p = tmp_path / name
    p.write_text("" if name.startswith("empty") else "\n \n")
    with pytest.raises(UserError) as e:   # IndexError inside the handler before
        load_texts(str(p))
    assert str(e.value) == f"{p} is empty: no rows to read"


@pytest.mark.parametrize("name,data,where", [
    ("latin.jsonl", LATIN1_JSONL, "line 2, column 14"),
    ("latin.txt", b"hello\nworld\ncaf\xe9\n", "line 3, column 4"),
])
def test_distill_non_utf8_data_names_file_and_line(tmp_path, name, data, where):
    from hybridize.distill.data import load_texts

    p = tmp_path / name
    p.write_bytes(data)
    with pytest.raises(UserError) as e:
        load_texts(str(p))
    assert str(e.value).startswith(f"{p}, {where}: not UTF-8 text (byte 0xe9)")


def test_check_utf8_finds_the_line_across_chunks(tmp_path):
    p = tmp_path / "t.txt"
    p.write_bytes(("é" * 10 + "\n").encode() * 5 + b"ab\xffcd\n")
    for chunk in (3, 7, 1 << 20):
        with pytest.raises(UserError, match=r"line 6, column 3: not UTF-8 text \(byte 0xff\)"):
            check_utf8(p, chunk=chunk)
    p.write_bytes(("é" * 10 + "\n").encode() * 50)
    check_utf8(p, chunk=7)  # multi-byte characters split across chunks are fine
    assert read_text(p).count("\n") == 50


def test_eval_and_grpo_non_utf8_jsonl_names_file_and_line(tmp_path):
    from hybridize.eval.math import load_math_dataset
    from hybridize.rl.data import load_problems

    p = tmp_path / "m.jsonl"
    p.write_bytes(b'{"problem": "1+1", "answer": "2"}\n{"problem": "caf\xe9", "answer": "1"}\n')
    for load in (load_math_dataset, load_problems):
        with pytest.raises(UserError, match=rf"{p.name}, line 2, column 17: not UTF-8 text"):
            load(str(p))


def test_eval_math_empty_file_is_one_line(tmp_path):
    from hybridize.eval.math import load_math_dataset

    p = tmp_path / "empty.jsonl"
    p.write_text("")
    with pytest.raises(UserError, match="holds no rows"):
        load_math_dataset(str(p))


def test_eval_ppl_non_utf8_text_names_file_and_line(tmp_path):
    from hybridize.eval.perplexity import load_text

    p = tmp_path / "t.txt"
    p.write_bytes(b"ok\n\xff\n")
    with pytest.raises(UserError, match="line 2, column 1: not UTF-8"):
        load_text(str(p))
    q = tmp_path / "t.jsonl"
    q.write_bytes(json.dumps({"text": "ok"}).encode() + b"\n\xfe\n")
    with pytest.raises(UserError, match="t.jsonl, line 2, column 1"):
        load_text(str(q))


@pytest.mark.parametrize("text", ["0", "1k,0", "-512"])
def test_a_length_or_batch_size_below_one_is_one_line(text):
    """`eval ppl --lengths 0` (and every other length / batch-size list) ended in a ZeroDivisionError."""
    from hybridize.eval.common import parse_int_list

    with pytest.raises(ValueError, match="every value must be a positive integer") as e:
        parse_int_list(text)
    assert "\n" not in str(e.value)


def test_eval_ppl_length_zero_is_one_line(tmp_path, monkeypatch, capsys):
    from tests.convert.test_bad_files import run_main

    line = run_main(monkeypatch, capsys, ["eval", "ppl", "--model", str(tmp_path / "none"), "--lengths", "0",
                                          "--text", "python-reference", "--out", str(tmp_path / "p")])
    assert "every value must be a positive integer" in line


@pytest.mark.parametrize("args,needle", [
    (["kv-probe", "--trials", "0"], "--trials must be >= 1, got 0"),        # a reshape RuntimeError before
    (["kv-probe", "--dim", "0"], "--dim must be >= 1, got 0"),
    (["niah", "--samples", "0"], "--samples must be >= 1, got 0"),          # an empty table with exit 0 before
    (["niah", "--batch-size", "-1"], "--batch-size must be >= 1, got -1"),
    (["math", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["speed", "--repeats", "0"], "--repeats must be >= 1, got 0"),
])
def test_eval_counts_below_one_are_one_line_before_any_model_loads(tmp_path, monkeypatch, capsys, args, needle):
    import hybridize.eval.common as common
    from tests.convert.test_bad_files import run_main

    monkeypatch.setattr(common, "load_model", lambda *a, **k: pytest.fail("a model loaded"))
    line = run_main(monkeypatch, capsys, ["eval", *args, "--out", str(tmp_path / "o")])
    assert needle in line
