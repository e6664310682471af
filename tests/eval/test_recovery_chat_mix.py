"""The recovery pipeline's chat mix (`benchmarks/pipeline/recovery_variants.py --chat-traces N`): the traces step is
run with the teacher and the GSM8K questions, and its output joins stage A's and B's training text. The commands
themselves are recorded, not run (they need the teacher and minutes of generation)."""
from pathlib import Path

import pytest

import benchmarks.pipeline.recovery_variants as rv


@pytest.fixture
def data(tmp_path):
    for rel in ("general_text/wiki_demo.jsonl", "general_text/c4_demo.jsonl", "wikitext2/valid.txt",
                "gsm8k/train.jsonl"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("{}\n")
    return tmp_path


def run(monkeypatch, tmp_path, data, *extra):
    calls = []
    monkeypatch.setattr(rv, "step", lambda work, env, name, done, args: calls.append((name, args)))
    a = rv.args_parser().parse_args(["train", "pattern", "--teacher", "T", "--data", str(data), *extra])
    rv.run_train(a, tmp_path / "work", {}, "pattern")
    return calls


def test_chat_traces_join_stage_a_and_b(monkeypatch, tmp_path, data):
    calls = run(monkeypatch, tmp_path, data, "--chat-traces", "500")
    name, args = calls[0]
    assert name == "chat-traces"
    assert {"teacher=T", f"prompts={data / 'gsm8k' / 'train.jsonl'}", "num_prompts=500"} <= set(args)
    out = next(x.split("=", 1)[1] for x in args if x.startswith("out="))
    trains = {n: next(x for x in args if x.startswith("data.train=")) for n, args in calls[1:] if "align" in n or "e2e" in n}
    assert set(trains) == {"pattern-align", "pattern-e2e"}
    assert all(t.endswith("," + out + "]") for t in trains.values())


def test_no_chat_traces_by_default_and_missing_questions_named(monkeypatch, tmp_path, data):
    calls = run(monkeypatch, tmp_path, data)
    assert [n for n, _ in calls] == ["pattern-convert", "pattern-align", "pattern-e2e"]
    assert not any("chat.jsonl" in x for _, args in calls for x in args)
    (data / "gsm8k" / "train.jsonl").unlink()
    with pytest.raises(SystemExit, match="gsm8k"):
        run(monkeypatch, tmp_path, data, "--chat-traces", "10")


def test_python_docs_join_stage_a_and_b_only_when_asked(monkeypatch, tmp_path, data):
    calls = run(monkeypatch, tmp_path, data, "--python-docs")
    trains = {n: next(x for x in args if x.startswith("data.train=")) for n, args in calls if "align" in n or "e2e" in n}
    assert set(trains) == {"pattern-align", "pattern-e2e"}
    assert all(",python-docs]" in t for t in trains.values())
    assert all("data.eval=python-reference" in args for n, args in calls if n in trains)   # the held-out text
    assert not any("python-docs" in x for _, args in run(monkeypatch, tmp_path, data) for x in args)


def test_attn_weight_reaches_stage_b_only(monkeypatch, tmp_path, data):
    calls = dict(run(monkeypatch, tmp_path, data, "--attn-weight", "0.5", "--attn-rows", "repeats"))
    assert {"attn_weight=0.5", "attn_rows=repeats"} <= set(calls["pattern-e2e"])
    assert not any(x.startswith("attn_weight") for x in calls["pattern-align"])
    assert "attn_weight=0.0" in dict(run(monkeypatch, tmp_path, data))["pattern-e2e"]


def test_recall_drills_reach_every_training_step(monkeypatch, tmp_path, data):
    calls = dict(run(monkeypatch, tmp_path, data, "--recall-drills", "0.5", "--recall-reach", "5000"))
    for name in ("pattern-align", "pattern-e2e"):
        assert {"data.recall_drills=0.5", "data.recall_reach=5000"} <= set(calls[name])
    assert not any(x.startswith("data.recall") for x in calls["pattern-convert"])
    assert not any(x.startswith("data.recall") for _, args in run(monkeypatch, tmp_path, data) for x in args)
    (tmp_path / "work" / "pattern" / "e2e" / "final").mkdir(parents=True)
    long = []
    monkeypatch.setattr(rv, "step", lambda work, env, name, done, args: long.append(args))
    a = rv.args_parser().parse_args(["long", "pattern", "--teacher", "T", "--data", str(data), "--recall-drills", "0.5",
                                     "--recall-reach", "5000"])
    rv.run_long(a, tmp_path / "work", {}, "pattern")
    assert {"data.recall_drills=0.5", "data.recall_reach=20000"} <= set(long[0])


def test_long_mix_gives_the_long_stage_the_chat_mix(monkeypatch, tmp_path, data):
    (tmp_path / "work" / "pattern" / "e2e" / "final").mkdir(parents=True)

    def long_train(*extra):
        calls = []
        monkeypatch.setattr(rv, "step", lambda work, env, name, done, args: calls.append((name, args)))
        a = rv.args_parser().parse_args(["long", "pattern", "--teacher", "T", "--data", str(data), *extra])
        rv.run_long(a, tmp_path / "work", {}, "pattern")
        return dict(calls)

    plain = long_train("--chat-traces", "10", "--python-docs")
    assert list(plain) == ["pattern_long"]   # no traces step: the long stage does not use them
    train = next(x for x in plain["pattern_long"] if x.startswith("data.train="))
    assert "python-docs" not in train and "chat.jsonl" not in train and "wiki_demo.jsonl" in train
    mixed = long_train("--chat-traces", "10", "--python-docs", "--long-mix")
    train = next(x for x in mixed["pattern_long"] if x.startswith("data.train="))
    assert "wiki_demo.jsonl" in train and ",python-docs," in train and train.endswith("chat.jsonl]")


def test_long_questions_give_the_long_stage_the_teachers_answers(monkeypatch, tmp_path, data):
    (tmp_path / "work" / "pattern" / "e2e" / "final").mkdir(parents=True)
    calls = []
    monkeypatch.setattr(rv, "step", lambda work, env, name, done, args: calls.append((name, done, args)))
    a = rv.args_parser().parse_args(["long", "pattern", "--teacher", "T", "--data", str(data), "--long-questions", "50"])
    rv.run_long(a, tmp_path / "work", {}, "pattern")
    assert [n for n, _, _ in calls] == ["long-questions", "long-answers", "pattern_long"]
    (_, done, q), (_, _, t), (_, _, long) = calls
    prompts = next(x.split("=", 1)[1] for x in q if x.startswith("out="))
    assert q[:2] == ["distill", "long-questions"] and str(done) == prompts and "num_prompts=50" in q
    texts = next(x for x in q if x.startswith("texts="))
    assert "wiki_demo.jsonl" in texts and "valid.txt" in texts and "c4_demo" not in texts   # the long stage's articles
    assert t[:2] == ["distill", "traces"] and f"prompts={prompts}" in t and "teacher=T" in t
    answers = next(x.split("=", 1)[1] for x in t if x.startswith("out="))
    assert next(x for x in long if x.startswith("data.train=")).endswith("," + answers + "]")
    calls.clear()
    rv.run_long(rv.args_parser().parse_args(["long", "pattern", "--teacher", "T", "--data", str(data)]),
                tmp_path / "work", {}, "pattern")
    assert [n for n, _, _ in calls] == ["pattern_long"]   # none by default


def test_python_source_joins_stages_a_and_b_and_the_long_mix(monkeypatch, tmp_path, data):
    calls = run(monkeypatch, tmp_path, data, "--python-docs", "--python-source")
    trains = [next(x for x in args if x.startswith("data.train=")) for n, args in calls if "align" in n or "e2e" in n]
    assert len(trains) == 2 and all(t.endswith(",python-docs,python-source]") for t in trains)
    assert not any("python-source" in x for _, args in run(monkeypatch, tmp_path, data, "--python-docs") for x in args)
    (tmp_path / "work" / "pattern" / "e2e" / "final").mkdir(parents=True)
    long = []
    monkeypatch.setattr(rv, "step", lambda work, env, name, done, args: long.append(args))
    a = rv.args_parser().parse_args(["long", "pattern", "--teacher", "T", "--data", str(data), "--python-source",
                                     "--long-mix"])
    rv.run_long(a, tmp_path / "work", {}, "pattern")
    assert next(x for x in long[0] if x.startswith("data.train=")).endswith(",python-source]")
    sized = run(monkeypatch, tmp_path, data, "--python-source", "4M")
    assert next(x for x in dict(sized)["pattern-e2e"] if x.startswith("data.train=")).endswith(",python-source:4M]")


def test_teacher_eval_runs_without_a_model_and_seeds_the_variants(monkeypatch, tmp_path):
    """`eval teacher` asks for no model and starts from an older recovery_base.json (its cheap rows kept); a
    variant's eval then starts from the teacher's new rows, ahead of that older base."""
    work = tmp_path / "work"
    (work / "pattern" / "e2e" / "final").mkdir(parents=True)
    (work / "pattern" / "e2e" / "final" / "config.json").write_text("{}")
    (work / "recovery_base.json").write_text('{"old": 1}')
    calls = []

    def fake_run_step(w, name, args, *rest, **kw):
        out = Path(args[args.index("--out") + 1])
        calls.append((name, args, (out / "recovery.json").read_text()))
        if name == "recovery_teacher":
            (out / "recovery.json").write_text('{"teacher": 1}')

    monkeypatch.setattr(rv, "run_step", fake_run_step)
    a = rv.args_parser().parse_args(["eval", "teacher", "--teacher", "T", "--work", str(work)])
    rv.run_eval_one(a, work, {}, "teacher")
    assert calls[0][0] == "recovery_teacher" and "--model" not in calls[0][1] and calls[0][2] == '{"old": 1}'
    rv.run_eval_one(a, work, {}, "pattern")
    assert calls[1][0] == "recovery_pattern" and "--model" in calls[1][1] and calls[1][2] == '{"teacher": 1}'


def test_preset_expands_before_the_command_line(monkeypatch, tmp_path, data):
    a = rv.parse_args(["train", "pattern", "--preset", "recovered", "--teacher", "T", "--data", str(data)])
    assert (a.e2e_steps, a.long_steps, a.chat_traces, a.python_source, a.long_questions) == (400, 150, 2000, "4M", 240)
    assert a.python_docs and a.long_mix and a.pattern.startswith("attn=16,17,18,20,21,22,23,24;swa=")
    assert rv.parse_args(["train", "pattern", "--preset", "recovered", "--e2e-steps", "7"]).e2e_steps == 7
    assert rv.parse_args(["train", "pattern"]).e2e_steps == 150   # no preset: the plain defaults
    monkeypatch.setattr(rv, "step", lambda work, env, name, done, args: calls.append((name, args)))
    calls = []
    rv.run_train(a, tmp_path / "work", {}, "pattern")
    convert = dict(calls)["pattern-convert"]
    assert convert[convert.index("--layers") + 1] == rv.PRESETS["recovered"][-1]
    assert "train.max_steps=400" in dict(calls)["pattern-e2e"]


def test_seed_reaches_every_training_step(monkeypatch, tmp_path, data):
    calls = dict(run(monkeypatch, tmp_path, data, "--seed", "3"))
    assert all("train.seed=3" in calls[n] for n in ("pattern-align", "pattern-e2e"))
    assert all("train.seed=0" in args for n, args in run(monkeypatch, tmp_path, data) if n != "pattern-convert")
    (tmp_path / "work" / "pattern" / "e2e" / "final").mkdir(parents=True)
    monkeypatch.setattr(rv, "step", lambda work, env, name, done, args: seen.append((name, args)))
    seen = []
    rv.run_long(rv.parse_args(["long", "pattern", "--teacher", "T", "--data", str(data), "--seed", "3"]),
                tmp_path / "work", {}, "pattern")
    assert "train.seed=3" in dict(seen)["pattern_long"]
