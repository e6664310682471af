"""`hybridize eval recovery`: report files and rows, teacher-vs-itself parity (and a perturbed model that is
not at parity), the time budget + resume, and the one-line errors for bad input."""
from __future__ import annotations

import copy
import json
import math
import time

import pytest
import torch
from typer.testing import CliRunner

from hybridize.errors import UserError
from hybridize.eval.recovery import (RecoveryConfig, answer_logprobs, chat_logprobs, check_lengths, check_tokenizer,
                                     kl_agreement, merge_reports, parse_model_spec, row_ids, run_order, run_recovery,
                                     shared_prefix, teacher_answers)
from tests.eval.test_cli import app  # noqa: F401  (the fixture: `hybridize eval` as a group)


def _cfg(**kw):
    return RecoveryConfig(**{**dict(lengths=(512,), needle_samples=1, arith_samples=1, ppl_length=64, ppl_tokens=128,
                                    arith_max_new_tokens=4, generation="hf"), **kw})


@pytest.fixture(scope="module")
def noisy(tiny_model):
    m = copy.deepcopy(tiny_model)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.5 * torch.randn_like(p))
    return m


def test_report_rows_parity_and_perturbed(tmp_path, tiny_model, tiny_tokenizer, noisy):
    cfg = _cfg()
    rep = run_recovery({"teacher": tiny_model, "self": tiny_model, "noisy": noisy}, tiny_tokenizer, cfg, tmp_path,
                       log=lambda s: None)
    for f in ("recovery.json", "recovery.md", "recovery.png"):
        assert (tmp_path / f).is_file()
    rows = {r["row"]: r for r in json.loads((tmp_path / "recovery.json").read_text())["rows"]}
    assert list(rows) == row_ids(cfg) and not rep["not_run"]
    for rid, r in rows.items():
        if r.get("skipped"):
            assert rid == "ppl:wikitext2" and "no ../shared/data" in r["skipped"]
            continue
        assert r["capability"] == rid.split(":")[0]
        if r["values"]["teacher"] not in (0, 0.0) and not math.isnan(r["values"]["teacher"]):
            assert r["ratios"]["self"] == pytest.approx(1.0, abs=1e-5), rid
    assert rows["kl:chat"]["values"]["self"] == pytest.approx(0.0, abs=1e-6)
    assert rows["agree:chat"]["values"]["self"] == 1.0
    assert rows["kl:chat"]["values"]["noisy"] > 1e-3
    assert rows["kl:answers"]["values"]["self"] == pytest.approx(0.0, abs=1e-6)
    assert rows["agree:answers"]["values"]["self"] == 1.0
    assert rows["kl:answers"]["values"]["noisy"] > 1e-3
    assert rows["ppl:python-reference"]["ratios"]["noisy"] != pytest.approx(1.0, abs=1e-4)
    # every model's needle answers are kept beside the expected ones, one file per row and model
    for rid in (r for r in rows if r.startswith("niah:")):
        _, task, L = rid.split(":")
        for name in ("teacher", "self", "noisy"):
            got = [json.loads(l) for l in (tmp_path / "needles" / f"{task}_{L}" / name / "samples.jsonl").open()]
            assert len(got) == cfg.needle_samples and {"completion", "answers", "score"} <= set(got[0])
            assert sum(g["score"] for g in got) / len(got) == rows[rid]["values"][name]
    # pass/fail rows carry their prompt count and each model's Fisher test against the teacher
    for rid, r in rows.items():
        if rid.startswith("niah:"):
            assert r["samples"] == cfg.needle_samples
        if rid.startswith(("niah:", "arith:")):
            assert r["samples"] >= 1 and r["p"]["self"] == 1.0 and 0 < r["p"]["noisy"] <= 1
        elif rid.startswith(("kl:", "agree:")):
            assert "p" not in r and r["samples"] == 64 and r["tokens"] > 0
        else:
            assert "p" not in r and "samples" not in r
    assert rows["arith:test"]["samples"] == 6 * cfg.arith_samples   # every level's problems
    md = (tmp_path / "recovery.md").read_text()
    assert "teacher_ppl/model_ppl" in md and "| ppl | ppl:python-reference |" in md
    assert " (p 1)" in md and "Fisher's exact test" in md
    # and how those answers are formed, per task, length and model
    assert "## needle answers by form" in md
    assert all(f"| {t}_{L} | {n} |" in md for t, L in (r.split(":")[1:] for r in rows if r.startswith("niah:"))
               for n in ("teacher", "self", "noisy"))


def test_time_budget_then_resume(tmp_path, tiny_model, tiny_tokenizer):
    cfg = _cfg(time_budget=0.3)
    ids = row_ids(cfg)

    def slow_log(s):
        if s.endswith(" done"):
            time.sleep(0.4)   # the first row uses up the budget

    rep = run_recovery({"teacher": tiny_model, "m": tiny_model}, tiny_tokenizer, cfg, tmp_path, log=slow_log)
    saved = json.loads((tmp_path / "recovery.json").read_text())
    assert [r["row"] for r in saved["rows"]] == ids[:1]
    order = run_order(cfg)
    assert saved["not_run"] == order[1:] == rep["not_run"] and order != ids   # arith:test before S-NIAH-3
    assert "not run (time budget)" in (tmp_path / "recovery.md").read_text()
    first = saved["rows"][0]
    logs = []
    rep = run_recovery({"teacher": tiny_model, "m": tiny_model}, tiny_tokenizer, _cfg(), tmp_path, log=logs.append)
    assert [r["row"] for r in rep["rows"]] == ids and not rep["not_run"]
    assert rep["rows"][0] == first
    assert any(ids[0] in s and "skipped" in s for s in logs)
    assert sum(s.endswith(" done") for s in logs) == len(ids) - 1


def test_bad_input_lines(tiny_model, tiny_tokenizer):
    with pytest.raises(UserError, match="NAME=DIR"):
        parse_model_spec("runs/hybrid")
    assert parse_model_spec("h=runs/x") == ("h", "runs/x")
    other = copy.deepcopy(tiny_tokenizer)
    other.add_tokens(["<|extra|>"])
    with pytest.raises(UserError, match="tokenizer differs"):
        check_tokenizer("h", tiny_tokenizer, other)
    check_tokenizer("h", tiny_tokenizer, tiny_tokenizer)
    with pytest.raises(UserError, match="over the teacher's context"):
        check_lengths(tiny_model, _cfg(lengths=(1024, 100_000)))


def test_cli_end_to_end_and_bad_spelling(app, tmp_path, tiny_model_dir):
    base = ["eval", "recovery", "--teacher", str(tiny_model_dir), "--out", str(tmp_path), "--device", "cpu",
            "--dtype", "float32", "--lengths", "512", "--needle-samples", "1", "--arith-samples", "1",
            "--ppl-length", "64", "--ppl-tokens", "128", "--generation", "hf"]
    r = CliRunner().invoke(app, base + ["--model", f"copy={tiny_model_dir}"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert {"recovery.json", "recovery.md", "recovery.png"} <= {p.name for p in tmp_path.iterdir()}
    r = CliRunner().invoke(app, base + ["--model", str(tiny_model_dir)])
    assert isinstance(r.exception, UserError) and "NAME=DIR" in str(r.exception)
    r = CliRunner().invoke(app, base + ["--model", f"c={tiny_model_dir}", "--niah-tasks", "s-niah-1,s-niah-9"])
    assert isinstance(r.exception, UserError) and "--niah-tasks s-niah-9" in str(r.exception)
    long = [("100000" if a == "512" else a) for a in base]
    r = CliRunner().invoke(app, long + ["--model", f"c={tiny_model_dir}"])
    assert isinstance(r.exception, UserError) and "over the teacher's context" in str(r.exception)


def test_wikitext_row_skipped_without_shared_data(tmp_path, tiny_model, tiny_tokenizer, monkeypatch):
    monkeypatch.setattr("hybridize.eval.recovery.data_file", lambda rel: None)
    monkeypatch.setattr("hybridize.eval.perplexity.data_file", lambda rel: None)
    cfg = _cfg(lengths=(512,))
    cfg_rows = ["ppl:python-reference", "ppl:wikitext2"]
    monkeypatch.setattr("hybridize.eval.recovery.row_ids", lambda c: cfg_rows)
    rep = run_recovery({"teacher": tiny_model, "m": tiny_model}, tiny_tokenizer, cfg, tmp_path, log=lambda s: None)
    assert rep["rows"][1]["skipped"] == "skipped: no ../shared/data"
    assert "skipped: no ../shared/data" in (tmp_path / "recovery.md").read_text()


def test_length_shorter_than_the_prompt_is_one_line(tmp_path, tiny_model, tiny_tokenizer):
    cfg = _cfg(lengths=(16,))
    with pytest.raises(UserError, match="too short.*use longer --lengths"):
        run_recovery({"teacher": tiny_model, "self": tiny_model}, tiny_tokenizer, cfg, tmp_path, log=lambda s: None)


def test_a_model_added_later_runs_alone(tmp_path, tiny_model, tiny_tokenizer, noisy):
    """Resuming with one more --model computes only that model's values: the teacher's and the first model's
    are kept (a stand-in teacher in the second run would change them if they were recomputed)."""
    cfg = _cfg(niah_tasks=("s-niah-1",))
    assert [r for r in row_ids(cfg) if r.startswith("niah:")] == ["niah:s-niah-1:512"]
    first = run_recovery({"teacher": tiny_model, "a": tiny_model}, tiny_tokenizer, cfg, tmp_path, log=lambda s: None)
    logs = []
    second = run_recovery({"teacher": noisy, "a": noisy, "b": noisy}, tiny_tokenizer, cfg, tmp_path, log=logs.append)
    for r1, r2 in zip(first["rows"], second["rows"]):
        if r1.get("skipped"):
            continue
        assert {k: r2["values"][k] for k in ("teacher", "a")} == r1["values"], r1["row"]
        assert "b" in r2["values"] and "b" in r2["ratios"]
    assert second["rows"][0]["values"]["b"] != first["rows"][0]["values"]["a"]  # b (noisy) really ran


def test_niah_prompt_and_answer_fit_the_teachers_context(tmp_path, tiny_model, tiny_tokenizer):
    """An 8k prompt on an 8k teacher left no room for the answer (the default teacher then scored 0.025 on
    S-NIAH-2 at 8k): a prompt is shortened so that it and its answer fit, and the row says how long it was."""
    from hybridize.eval.niah import answer_tokens, build_samples
    from hybridize.eval.recovery import niah_config

    short = copy.deepcopy(tiny_model)
    short.config.max_position_embeddings = 560
    cfg = _cfg(lengths=(512,), niah_tasks=("s-niah-1",))
    nc = niah_config("s-niah-1", 512, short, cfg)
    assert nc.lengths == (560 - answer_tokens(nc),) == (496,)
    assert all(len(x[3].input_ids) <= 496 for x in build_samples(tiny_tokenizer, nc))
    assert niah_config("s-niah-1", 512, tiny_model, cfg).lengths == (512,)  # 8192 context: room to spare

    run_recovery({"teacher": short, "self": short}, tiny_tokenizer, cfg, tmp_path, log=lambda s: None)
    rows = {r["row"]: r for r in json.loads((tmp_path / "recovery.json").read_text())["rows"]}
    assert rows["niah:s-niah-1:512"]["prompt_tokens"] == 496


def test_reports_run_apart_merge_into_one(tmp_path, tiny_model, tiny_tokenizer, noisy):
    """Two models evaluated in separate runs (side by side on one GPU), merged: the run over all models then
    recomputes nothing (stand-in models would change every value) and carries each model's values and ratios."""

    cfg = _cfg(niah_tasks=("s-niah-1",))
    a = run_recovery({"teacher": tiny_model, "a": tiny_model}, tiny_tokenizer, cfg, tmp_path / "a", log=lambda s: None)
    b = run_recovery({"teacher": tiny_model, "b": noisy}, tiny_tokenizer, cfg, tmp_path / "b", log=lambda s: None)
    merge_reports([tmp_path / "a" / "recovery.json", tmp_path / "b" / "recovery.json"], tmp_path / "all" / "recovery.json")
    logs = []
    both = run_recovery({"teacher": noisy, "a": noisy, "b": tiny_model}, tiny_tokenizer, cfg, tmp_path / "all",
                        log=logs.append)
    assert not [x for x in logs if x.endswith(" done")], logs
    for ra, rb, r in zip(a["rows"], b["rows"], both["rows"]):
        assert r["row"] == ra["row"] == rb["row"]
        if ra.get("skipped"):
            assert r.get("skipped")
            continue
        assert r["values"] == {**ra["values"], "b": rb["values"]["b"]}, r["row"]
        assert set(r["ratios"]) == {"a", "b"}
    header = next(x for x in (tmp_path / "all" / "recovery.md").read_text().splitlines() if x.startswith("| capability"))
    assert [c.strip() for c in header.strip("|").split("|")][2:] == ["teacher", "a", "a ratio", "b", "b ratio"]


def test_answer_rows_score_the_teachers_answer_tokens_only(tiny_model, tiny_tokenizer, noisy):
    """kl/agree:answers: the teacher's greedy answer tokens (what HF generate gives), both models
    teacher-forced on prompt + answer, one prediction per answer token and none of the prompt's."""
    from hybridize.builtin_text import HELDOUT_CHAT_PROMPTS
    from hybridize.eval.common import build_prompt, encode, has_chat_template

    pairs = teacher_answers(tiny_model, tiny_tokenizer, 6, "hf")
    assert 0 < len(pairs) <= len(HELDOUT_CHAT_PROMPTS) and all(0 < len(a) for _, a in pairs)
    chat = has_chat_template(tiny_tokenizer)
    p0 = encode(tiny_tokenizer, build_prompt(tiny_tokenizer, HELDOUT_CHAT_PROMPTS[0], chat=chat), chat)
    assert pairs[0][0] == p0
    lp = answer_logprobs(tiny_model, pairs)
    assert [t.shape[0] for t in lp] == [len(a) for _, a in pairs]
    p, a = pairs[0]
    with torch.no_grad():
        full = torch.log_softmax(tiny_model(input_ids=torch.tensor([p + a])).logits[0].float(), -1)
    assert torch.allclose(lp[0], full[len(p) - 1:len(p) + len(a) - 1], atol=1e-5)
    # the teacher's own greedy answer: its top-1 at each answer position is that answer's next token
    for t, (_, a) in zip(lp, pairs):
        assert t.argmax(-1).tolist() == a
    kl, agree, n = kl_agreement(lp, answer_logprobs(noisy, pairs))
    assert kl > 1e-3 and 0.0 <= agree < 1.0 and n == sum(len(a) for _, a in pairs)
    assert kl_agreement([], []) != kl_agreement([], [])   # (nan, nan) for no answers, not a division by zero


def test_chat_rows_score_the_shared_prefix_once(tmp_path, tiny_model, tiny_tokenizer, noisy):
    """kl/agree:chat: every held-out prompt, the template prefix they all share scored on the first prompt only (it
    gives the same predictions in each), so the rows count each distinct prediction once; the rows say how many."""
    from hybridize.builtin_text import DEMO_CHAT_PROMPTS, HELDOUT_CHAT_PROMPTS
    from hybridize.eval.common import build_prompt, encode, has_chat_template

    assert shared_prefix([[5, 6, 7], [5, 6, 8], [5, 9]]) == 1 and shared_prefix([[1, 2], [1, 2]]) == 2
    assert shared_prefix([[1], [2]]) == 0
    assert len(HELDOUT_CHAT_PROMPTS) >= 64 and DEMO_CHAT_PROMPTS == HELDOUT_CHAT_PROMPTS[:3]
    chat = has_chat_template(tiny_tokenizer)
    ids = [encode(tiny_tokenizer, build_prompt(tiny_tokenizer, p, chat=chat), chat) for p in HELDOUT_CHAT_PROMPTS]
    k = shared_prefix(ids)
    assert k > 0   # the chat template's opening
    lp = chat_logprobs(tiny_model, tiny_tokenizer)
    assert not any(t.requires_grad for t in lp)   # no autograd graph kept over 64 prompts
    assert [t.shape[0] for t in lp] == [len(ids[0])] + [len(p) - k for p in ids[1:]]
    with torch.no_grad():
        full = torch.log_softmax(tiny_model(input_ids=torch.tensor([ids[5]])).logits[0].float(), -1)
    assert torch.allclose(lp[5], full[k:], atol=1e-5)
    rep = run_recovery({"teacher": tiny_model, "noisy": noisy}, tiny_tokenizer, _cfg(niah_tasks=()), tmp_path,
                       log=lambda s: None)
    rows = {r["row"]: r for r in rep["rows"]}
    for rid in ("kl:chat", "agree:chat"):
        assert rows[rid]["samples"] == len(HELDOUT_CHAT_PROMPTS) and "p" not in rows[rid]
        assert rows[rid]["tokens"] == len(ids[0]) + sum(len(p) - k for p in ids[1:])
    assert rows["agree:answers"]["tokens"] > 0
    assert f"agree:chat {rows['agree:chat']['tokens']:,}" in (tmp_path / "recovery.md").read_text()


def test_rows_outside_the_target_run_last():
    cfg = _cfg(lengths=(512, 1024), niah_tasks=("s-niah-1", "s-niah-3", "s-niah-2"))
    order = run_order(cfg)
    assert sorted(order) == sorted(row_ids(cfg))
    assert order[-3:] == ["arith:test", "niah:s-niah-3:512", "niah:s-niah-3:1024"]
    assert order.index("niah:s-niah-2:1024") < order.index("arith:test")


def test_fisher_p_known_values():
    from hybridize.eval.recovery import fisher_p

    assert fisher_p(1, 40, 5, 40) == pytest.approx(0.2007, abs=1e-4)    # (x)'s S-NIAH-2 at 8k against the teacher
    assert fisher_p(36, 40, 40, 40) == pytest.approx(0.1156, abs=1e-4)
    assert fisher_p(0, 20, 10, 20) == pytest.approx(2 * 30045015 / 137846528820)   # the two extreme tables
    assert fisher_p(3, 10, 3, 10) == 1.0 and fisher_p(0, 5, 0, 5) == 1.0
    assert fisher_p(2, 30, 9, 30) == fisher_p(9, 30, 2, 30)


def test_merge_recomputes_the_tests(tmp_path):
    def rep(name, v):
        return {"models": ["teacher", name], "rows": [{"row": "niah:s-niah-1:1024", "capability": "niah",
                                                        "samples": 40, "values": {"teacher": 1.0, name: v},
                                                        "ratios": {}, "p": {name: 0.5}}]}

    for i, (name, v) in enumerate((("a", 0.9), ("b", 1.0))):
        (tmp_path / f"{i}.json").write_text(json.dumps(rep(name, v)))
    row = merge_reports([tmp_path / "0.json", tmp_path / "1.json"], tmp_path / "m.json")["rows"][0]
    assert row["p"] == {"a": pytest.approx(0.1156, abs=1e-4), "b": 1.0}
    assert row["ratios"] == {"a": pytest.approx(0.9), "b": 1.0}
    other = rep("c", 0.5)
    other["rows"][0].update(samples=96, values={"teacher": 0.25, "c": 0.5})   # scored on other prompts: left out
    (tmp_path / "2.json").write_text(json.dumps(other))
    row = merge_reports([tmp_path / f"{i}.json" for i in range(3)], tmp_path / "m.json")["rows"][0]
    assert row["samples"] == 40 and set(row["values"]) == {"teacher", "a", "b"} and row["values"]["teacher"] == 1.0
    for i, (name, n) in enumerate((("a", 8192), ("b", 65536))):   # perplexity on another token budget: left out
        (tmp_path / f"p{i}.json").write_text(json.dumps({"models": ["teacher", name], "rows": [
            {"row": "ppl:wikitext2", "capability": "ppl", "context": 1024, "ppl_tokens": n,
             "values": {"teacher": 20.0 + i, name: 21.0}}]}))
    row = merge_reports([tmp_path / "p0.json", tmp_path / "p1.json"], tmp_path / "m.json")["rows"][0]
    assert row["ppl_tokens"] == 8192 and row["values"] == {"teacher": 20.0, "a": 21.0}


def test_teacher_rows_alone_then_a_model_reuses_them(tmp_path, tiny_model, tiny_tokenizer, noisy):
    """No model: only the teacher's rows (no bars). A later run with a model into the same folder keeps them: a
    stand-in teacher there would change them if they were recomputed."""
    cfg = _cfg(niah_tasks=("s-niah-1",))
    alone = run_recovery({"teacher": tiny_model}, tiny_tokenizer, cfg, tmp_path, log=lambda s: None)
    assert alone["models"] == ["teacher"] and not (tmp_path / "recovery.png").exists()
    assert all(set(r["values"]) == {"teacher"} for r in alone["rows"] if not r.get("skipped"))
    later = run_recovery({"teacher": noisy, "m": noisy}, tiny_tokenizer, cfg, tmp_path, log=lambda s: None)
    for r1, r2 in zip(alone["rows"], later["rows"]):
        if not r1.get("skipped"):
            assert r2["values"]["teacher"] == r1["values"]["teacher"] and "m" in r2["ratios"], r1["row"]
    assert (tmp_path / "recovery.png").exists()


def test_rows_scored_on_another_prompt_count_are_computed_again(tmp_path, tiny_model, tiny_tokenizer, noisy):
    """A needle row kept from a run with fewer prompts is redone for every model (teacher included), so that one
    row's values and its `samples` (and Fisher's p) always count the same prompts; the other rows are kept."""
    cfg = _cfg(niah_tasks=("s-niah-1",))
    run_recovery({"teacher": tiny_model, "m": tiny_model}, tiny_tokenizer, cfg, tmp_path, log=lambda s: None)
    old = json.loads((tmp_path / "recovery.json").read_text())
    niah = "niah:s-niah-1:512"
    for r in old["rows"]:   # a marker value the rerun must replace for the needle row, and keep for the others
        if not r.get("skipped"):
            r["values"]["teacher"] = 0.123
    (tmp_path / "recovery.json").write_text(json.dumps(old))
    logs = []
    rep = run_recovery({"teacher": noisy, "m": noisy}, tiny_tokenizer, _cfg(niah_tasks=("s-niah-1",), needle_samples=2),
                       tmp_path, log=logs.append)
    rows = {r["row"]: r for r in rep["rows"]}
    assert rows[niah]["samples"] == 2 and rows[niah]["values"]["teacher"] != 0.123
    assert all(r["values"]["teacher"] == 0.123 for k, r in rows.items() if k != niah and not r.get("skipped"))
    assert any(niah in s and "samples 1, not samples 2" in s for s in logs)
    old = json.loads((tmp_path / "recovery.json").read_text())
    for r in old["rows"]:
        r.pop("samples", None)   # a report from before rows carried their prompt count
    (tmp_path / "recovery.json").write_text(json.dumps(old))
    logs.clear()
    run_recovery({"teacher": noisy, "m": noisy}, tiny_tokenizer, _cfg(niah_tasks=("s-niah-1",), needle_samples=2),
                 tmp_path, log=logs.append)
    assert any(niah in s and "an unknown number of prompts" in s for s in logs)
    assert any("arith:test" in s and "unknown" in s for s in logs)
    assert any("agree:chat" in s and "unknown" in s for s in logs)   # a chat row from before it scored 64 prompts
    assert not any("ppl:" in s and "computed again" in s for s in logs)
    # a perplexity row scored on another token budget, or a report from before the rows carried theirs
    logs.clear()
    rep = run_recovery({"teacher": tiny_model, "m": tiny_model}, tiny_tokenizer,
                       _cfg(niah_tasks=("s-niah-1",), needle_samples=2, ppl_tokens=192), tmp_path, log=logs.append)
    row = next(r for r in rep["rows"] if r["row"] == "ppl:python-reference")
    assert row["ppl_tokens"] == 192 and row["context"] == 64 and row["values"]["teacher"] != 0.123
    assert any("ppl:python-reference" in s and "ppl_tokens 128" in s and "ppl_tokens 192" in s for s in logs)
    assert not any(niah in s and "computed again" in s for s in logs)


def test_cli_without_a_model_writes_the_teachers_rows(app, tmp_path, tiny_model_dir):
    r = CliRunner().invoke(app, ["eval", "recovery", "--teacher", str(tiny_model_dir), "--out", str(tmp_path),
                                 "--device", "cpu", "--dtype", "float32", "--lengths", "512", "--needle-samples", "1",
                                 "--arith-samples", "1", "--ppl-length", "64", "--ppl-tokens", "128",
                                 "--niah-tasks", "s-niah-1", "--generation", "hf"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    rep = json.loads((tmp_path / "recovery.json").read_text())
    assert rep["models"] == ["teacher"] and rep["rows"]
