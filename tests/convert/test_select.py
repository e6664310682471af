"""`hybridize select` on tiny CPU teachers: planted layers the criteria must find (a layer whose attention is
the only one that matters for kl / greedy; a head built to read the needle's digits for retrieval), the
teacher-activation cache against plain forwards, the outputs, resume after a crash, the one-line errors, and
`hybridize convert --layers FILE` with its teacher checks."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from hybridize.convert.select import SelectConfig, run_select
from hybridize.errors import UserError
from tests.convert.common import tiny_teacher, tiny_tokenizer

LAYERS = 4
KL_LAYER = 2        # planted: the only attention that matters
RETRIEVAL_LAYER = 1  # planted: head 0 reads the needle's digits
FAST = dict(steps=6, tokens=512, seq_len=128, align_seq_len=128, align_batch_tokens=256, needle_length=512,
            needle_samples=2, device="cpu")
FAST_ARGS = ["--steps", "6", "--tokens", "512", "--seq-len", "128", "--align-seq-len", "128",
             "--align-batch-tokens", "256", "--needle-length", "512", "--needle-samples", "2", "--device", "cpu"]


def _app():
    from hybridize.cli import app

    return app


def kl_planted_teacher(seed: int = 0):
    """Attention of every layer but KL_LAYER scaled down to almost nothing; KL_LAYER's made sharp and strong
    (what a mixer cannot copy), and a sharper lm_head so distributions are not near uniform."""
    t = tiny_teacher("llama", seed=seed, layers=LAYERS, max_position_embeddings=1024)
    with torch.no_grad():
        t.lm_head.weight.mul_(20)
        for i, layer in enumerate(t.model.layers):
            a = layer.self_attn
            if i == KL_LAYER:
                a.o_proj.weight.mul_(10)
                a.q_proj.weight.mul_(6)
                a.k_proj.weight.mul_(6)
            else:
                a.o_proj.weight.mul_(0.05)
    return t


def retrieval_planted_teacher():
    """Embedding dim 0 is 1 for digit tokens (the needle's value is the prompt's only number), 0 otherwise;
    RETRIEVAL_LAYER's head 0 has a constant query and a key reading dim 0, in the slowest RoPE pair (theta
    1e6: no rotation to speak of over 512 tokens), so it attends to digits wherever they are."""
    tok = tiny_tokenizer()
    t = tiny_teacher("qwen2", layers=LAYERS, max_position_embeddings=1024, rope_theta=1e6)  # q/k biases
    digits = tok.convert_tokens_to_ids(list("0123456789"))
    with torch.no_grad():
        emb = t.model.embed_tokens.weight
        emb[:, 0] = 0.0
        emb[digits, 0] = 1.0
        a = t.model.layers[RETRIEVAL_LAYER].self_attn
        d = a.head_dim
        for w in (a.q_proj.weight, a.q_proj.bias, a.k_proj.weight, a.k_proj.bias):
            w[:d].zero_()
        a.q_proj.bias[d - 1] = 10.0
        a.k_proj.weight[d - 1, 0] = 2.0
    return t


def _save(model, path):
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def kl_dir(tmp_path_factory):
    return _save(kl_planted_teacher(), tmp_path_factory.mktemp("kl_teacher"))


@pytest.fixture(scope="module")
def kl_run(kl_dir, tmp_path_factory):
    """`hybridize select --criterion kl --keep 1` through the command line, once for the module."""
    out = tmp_path_factory.mktemp("kl_select")
    r = CliRunner().invoke(_app(), ["select", "--src", str(kl_dir), "--keep", "1", "--out", str(out), *FAST_ARGS])
    assert r.exit_code == 0, r.output + repr(r.exception)
    return out, r.output


def _scores(out, crit):
    return {int(k): v for k, v in json.loads((out / "select.json").read_text())["scores"][crit].items()}


# ---- the criteria find what was planted -------------------------------------------------------------

def test_kl_keeps_the_planted_layer_and_writes_every_output(kl_run, kl_dir):
    out, printed = kl_run
    rec = json.loads((out / "select.json").read_text())
    kl = _scores(out, "kl")
    assert sorted(kl) == list(range(LAYERS)) and sorted(_scores(out, "needle")) == list(range(LAYERS))
    assert sorted(_scores(out, "align_nmse")) == list(range(LAYERS))
    assert rec["chosen"] == [KL_LAYER] and (out / "plan.txt").read_text().strip() == f"attn={KL_LAYER}"
    assert kl[KL_LAYER] > 2 * max(v for i, v in kl.items() if i != KL_LAYER)
    assert rec["teacher"]["num_layers"] == LAYERS and rec["teacher"]["fingerprint"].startswith("sha256:")
    assert rec["measure"]["steps"] == 6 and rec["criterion"] == "kl"
    assert (out / "select.png").stat().st_size > 0 and "**kept**" in (out / "select.md").read_text()
    assert f"--layers attn={KL_LAYER} --mixer sse" in " ".join(printed.split())


def test_the_plan_parses_and_converts(kl_run):
    from hybridize.convert.convert import convert_model
    from hybridize.convert.plan import parse_plan

    plan = parse_plan((kl_run[0] / "plan.txt").read_text().strip(), LAYERS, "sse", allow_none=False)
    assert plan == ["sse", "sse", "attn", "sse"]
    hybrid = convert_model(kl_planted_teacher(), plan, mixer="sse")
    assert hybrid.config.layer_plan == plan


def test_greedy_keeps_the_planted_layer_first(kl_dir, tmp_path):
    rec = run_select(str(kl_dir), SelectConfig(keep=2, greedy=True, greedy_candidates=3,
                                               **{**FAST, "needle_samples": 0}), tmp_path, log=lambda s: None,
                     progress=False)
    steps = rec["greedy"]
    assert [s["step"] for s in steps] == [1, 2] and steps[0]["layer"] == KL_LAYER
    assert len(steps[0]["tried"]) == 3 and steps[1]["kl"] <= steps[0]["kl"] + 1e-9
    assert KL_LAYER in rec["chosen"] and rec["use_greedy"]


def test_retrieval_peaks_on_the_planted_head(tmp_path):
    src = _save(retrieval_planted_teacher(), tmp_path / "t")
    rec = run_select(str(src), SelectConfig(keep=1, criterion="retrieval", **FAST), tmp_path / "o",
                     log=lambda s: None, progress=False)
    score = _scores(tmp_path / "o", "retrieval")
    assert score[RETRIEVAL_LAYER] > 0.5 and max(v for i, v in score.items() if i != RETRIEVAL_LAYER) < 0.1
    assert rec["retrieval_heads"][RETRIEVAL_LAYER] == 0 and rec["chosen"] == [RETRIEVAL_LAYER]
    assert "kl" not in rec["scores"] and not (tmp_path / "o" / "aligned.safetensors").exists()  # no conversion


def test_teacher_cache_matches_plain_forwards():
    """probe_cost starts the decoder at the first converted layer from the cached input: the teacher's own
    attention swapped in costs exactly 0, and a perturbed copy costs what a whole forward says."""
    import copy

    from hybridize.convert.select.data import kl_batches
    from hybridize.convert.select.probe import probe_cost, record_probe

    for family in ("llama", "qwen3"):
        t = tiny_teacher(family, layers=LAYERS)
        probe = record_probe(t, kl_batches(torch.randint(4, 97, (256,)), 64, 128), "cpu")
        assert probe_cost(t, probe, {2: t.model.layers[2].self_attn}, "cpu")["kl"] == 0.0
        noisy = copy.deepcopy(t.model.layers[2].self_attn)
        with torch.no_grad():
            noisy.o_proj.weight.mul_(3)
        got = probe_cost(t, probe, {2: noisy}, "cpu")["kl"]
        ids = torch.cat([b["input_ids"] for b in probe.batches])
        with torch.no_grad():
            want_lp = torch.log_softmax(t(ids).logits, -1)
            orig, t.model.layers[2].self_attn = t.model.layers[2].self_attn, noisy
            got_lp = torch.log_softmax(t(ids).logits, -1)
            t.model.layers[2].self_attn = orig
        want = (want_lp.exp() * (want_lp - got_lp)).sum(-1).mean().item()
        assert got > 0 and abs(got - want) < 1e-4 * max(want, 1e-3), (family, got, want)


# ---- resume ------------------------------------------------------------------------------------------

def test_a_crash_keeps_scored_layers_and_the_rerun_skips_them(kl_dir, kl_run, tmp_path, monkeypatch):
    import hybridize.convert.select.align as align_mod
    import hybridize.convert.select.probe as probe_mod
    import hybridize.convert.select.run as run_mod

    real, calls = probe_mod.probe_cost, []

    def crash_at_third(*a, **k):
        calls.append(1)
        if len(calls) == 5:  # kl + needle of layers 0 and 1 done, layer 2 under way
            raise RuntimeError("power cut")
        return real(*a, **k)

    monkeypatch.setattr(run_mod, "probe_cost", crash_at_third)
    with pytest.raises(RuntimeError, match="power cut"):
        run_select(str(kl_dir), SelectConfig(keep=1, **FAST), tmp_path, log=lambda s: None, progress=False)
    assert sorted(_scores(tmp_path, "kl")) == [0, 1] and not (tmp_path / "plan.txt").exists()
    assert (tmp_path / "aligned.safetensors").is_file()

    calls.clear()
    monkeypatch.setattr(run_mod, "probe_cost", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    monkeypatch.setattr(align_mod, "align_slots", lambda *a, **k: pytest.fail("aligned again"))
    rec = run_select(str(kl_dir), SelectConfig(keep=1, **FAST), tmp_path, log=lambda s: None, progress=False)
    assert len(calls) == 4 and rec["chosen"] == [KL_LAYER]  # layers 2 and 3, kl + needle each
    full = _scores(kl_run[0], "kl")  # the uninterrupted run: the reloaded mixers score the same
    assert all(abs(rec["scores"]["kl"][str(i)] - full[i]) <= 1e-6 * max(full[i], 1e-6) for i in range(LAYERS))

    calls.clear()  # another --keep re-chooses from the record: nothing measured
    rec = run_select(str(kl_dir), SelectConfig(keep=2, **FAST), tmp_path, log=lambda s: None, progress=False)
    assert not calls and len(rec["chosen"]) == 2 and KL_LAYER in rec["chosen"]
    assert (tmp_path / "plan.txt").read_text().strip() == rec["plan"]


def test_a_rerun_with_other_settings_is_refused(kl_dir, kl_run, tmp_path):
    out = tmp_path / "o"
    shutil.copytree(kl_run[0], out)
    with pytest.raises(UserError, match=r"measured with other settings \(steps: 6 -> 7\); pass --overwrite"):
        run_select(str(kl_dir), SelectConfig(keep=1, **{**FAST, "steps": 7}), out, log=lambda s: None)


# ---- bad input: one line -------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,needle", [
    (dict(keep=0), "--keep 0: choose 1 to 3 softmax layers"),
    (dict(keep=LAYERS), f"--keep {LAYERS}: choose 1 to 3 softmax layers (the teacher has {LAYERS} layers"),
    (dict(needle_length=2048), "--needle-length 2048 does not fit the teacher's context (1024 tokens)"),
    (dict(seq_len=4096, tokens=4096), "--seq-len 4096 is longer than the teacher's context (1024 tokens)"),
    (dict(criterion="best"), "--criterion 'best': choose one of kl, needle, retrieval, combined, copying"),
    (dict(windows=1), "--windows picks layers by their previous-token heads"),
    (dict(criterion="copying", windows=LAYERS), f"--windows {LAYERS}: choose 0 to {LAYERS - 1}"),
    (dict(text="python-reference"), "evaluation text"),
    (dict(greedy=True, criterion="retrieval"), "--greedy refines the kl choice"),
    (dict(criterion="retrieval", needle_samples=0), "--needle-samples must be >= 1"),
])
def test_bad_input_is_one_line_before_the_teacher_loads(kl_dir, tmp_path, monkeypatch, kw, needle):
    import hybridize.convert.sources as sources

    monkeypatch.setattr(sources, "load_model", lambda *a, **k: pytest.fail("the teacher loaded"))
    with pytest.raises(UserError) as e:
        run_select(str(kl_dir), SelectConfig(**{**FAST, "keep": 1, **kw}), tmp_path / "o", log=lambda s: None)
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "o").exists()


def test_a_needle_length_too_short_for_the_prompt_is_one_line(kl_dir, tmp_path):
    with pytest.raises(UserError, match=r"--needle-length 64: length 64 is too short"):
        run_select(str(kl_dir), SelectConfig(**{**FAST, "keep": 1, "needle_length": 64, "criterion": "retrieval"}),
                   tmp_path, log=lambda s: None, progress=False)


def test_the_command_line_turns_bad_input_into_exit_status_2(kl_dir, tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "hybridize.cli", "select", "--src", str(kl_dir), "--keep", "9",
                        "--out", str(tmp_path / "o")], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().startswith("error: --keep 9: choose 1 to 3"), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


# ---- convert --layers FILE -----------------------------------------------------------------------------

def _convert(src, layers, out):
    return CliRunner().invoke(_app(), ["convert", "--src", str(src), "--layers", str(layers), "--out", str(out),
                                       "--no-calibrate", "--prompt", "", "--samples", "1"])


@pytest.mark.parametrize("name", ["plan.txt", "select.json", ""])
def test_convert_takes_the_selection_file(kl_run, kl_dir, tmp_path, name):
    r = _convert(kl_dir, kl_run[0] / name if name else kl_run[0], tmp_path / "h")
    assert r.exit_code == 0, r.output + repr(r.exception)
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    assert cfg["layer_plan"] == ["sse", "sse", "attn", "sse"]


def test_convert_refuses_a_selection_of_another_model(kl_run, tmp_path):
    three = _save(tiny_teacher("llama", layers=3, max_position_embeddings=1024), tmp_path / "three")
    other = _save(kl_planted_teacher(seed=5), tmp_path / "other")  # same shape, other weights
    for src, needle in ((three, "with 4 layers, but"), (other, "not on")):
        for name in ("plan.txt", "select.json"):
            r = _convert(src, kl_run[0] / name, tmp_path / "h")
            assert isinstance(r.exception, UserError) and needle in str(r.exception), r.output
            assert "hybridize select --src" in str(r.exception) and not (tmp_path / "h").exists()
    r = _convert(other, tmp_path / "missing.txt", tmp_path / "h")
    assert isinstance(r.exception, UserError) and "no such plan file" in str(r.exception)
    lone = tmp_path / "lone" / "plan.txt"  # no select.json beside it: only parse_plan's range check
    lone.parent.mkdir()
    shutil.copy(kl_run[0] / "plan.txt", lone)
    assert _convert(other, lone, tmp_path / "h").exit_code == 0
    assert _convert(three, lone.parent, tmp_path / "h2").exit_code == 0  # attn=2 exists in 3 layers too
    lone.write_text("attn=3\n")
    r = _convert(three, lone, tmp_path / "h3")
    assert isinstance(r.exception, ValueError) and "out of range for a model with 3 layers" in str(r.exception)


# ---- copying: induction heads kept, previous-token heads windowed --------------------------------------

def _previous_token_map(T: int) -> torch.Tensor:
    m = torch.zeros(T, T)
    m[0, 0] = 1
    m[torch.arange(1, T), torch.arange(T - 1)] = 1
    return m


def test_previous_token_mass_is_one_on_the_diagonal_below_and_small_when_uniform():
    from hybridize.convert.select.copying import previous_token_mass

    T = 40
    uniform = torch.tril(torch.ones(T, T))
    uniform = uniform / uniform.sum(-1, keepdim=True)
    m = previous_token_mass(torch.stack([_previous_token_map(T), uniform]), skip=4)
    assert m[0] == 1 and m[1] < 0.1


def test_induction_mass_reads_the_token_after_the_earlier_occurrence():
    from hybridize.convert.select.copying import induction_mass

    start, period = 1, 10
    T = start + 2 * period
    ind = torch.zeros(T, T)
    for t in range(T):
        ind[t, t - period + 1 if t >= start + period else t] = 1
    m = induction_mass(torch.stack([ind, _previous_token_map(T)]), start, period)
    assert m[0] == 1 and m[1] == 0


def test_copying_keeps_induction_layers_and_windows_previous_token_layers(kl_dir, tmp_path):
    from hybridize.convert.plan import parse_plan
    from hybridize.convert.select.choose import rank_choice

    rec = run_select(str(kl_dir), SelectConfig(keep=1, criterion="copying", windows=2, **FAST), tmp_path,
                     log=lambda s: None, progress=False)
    ind, prev = _scores(tmp_path, "induction"), _scores(tmp_path, "previous_token")
    assert sorted(ind) == sorted(prev) == list(range(LAYERS))
    assert all(0 <= v <= 1 for v in [*ind.values(), *prev.values()])
    kept = rank_choice(ind, 1)
    windows = rank_choice({i: v for i, v in prev.items() if i not in kept}, 2)
    assert rec["chosen"] == kept and rec["window_layers"] == windows
    plan = f"attn={kept[0]};swa={','.join(map(str, windows))}"
    assert rec["plan"] == plan and (tmp_path / "plan.txt").read_text().strip() == plan
    parsed = parse_plan(plan, LAYERS, "sse", allow_none=False)
    assert parsed.count("attn") == 1 and parsed.count("swa") == 2 and parsed.count("sse") == 1
    assert "kl" not in rec["scores"] and not (tmp_path / "aligned.safetensors").exists()   # no conversion
    assert "previous_token" in (tmp_path / "select.md").read_text()


def test_copying_from_the_command_line(kl_dir, tmp_path):
    r = CliRunner().invoke(_app(), ["select", "--src", str(kl_dir), "--keep", "2", "--criterion", "copying",
                                    "--windows", "1", "--out", str(tmp_path), *FAST_ARGS])
    assert r.exit_code == 0, r.output + repr(r.exception)
    plan = (tmp_path / "plan.txt").read_text().strip()
    assert ";swa=" in plan
    assert f"--layers '{plan}' --mixer sse --mixer-settings swa.sinks=4" in " ".join(r.output.split())  # quoted
