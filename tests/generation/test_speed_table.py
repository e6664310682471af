"""The speed table's bookkeeping (benchmarks/generation/speed_table.py): which paths a rerun skips, how an
out-of-memory group is shown, and that the hybrid's speed-up is taken best engine path against best engine
path (the teacher's compiled engine included). The measurement itself needs a GPU and is not run here."""
import json

import pytest

from benchmarks.generation.speed_table import COLUMNS, done_paths, markdown, path_groups, split_invalid


def row(model, path, decode_ms, T=1024, B=8, **kw):
    r = {"shape": "s", "prompt_len": T, "batch": B, "model": model, "table_path": path, "decode_ms": decode_ms,
         "prefill_s": 0.5, "prefill_tok_s": B * T / 0.5, "peak_gib": 1.0, "of_floor": 2.0, "warmup_s": 1.0,
         "device": "d", "torch": "t", "dtype": "bfloat16", "new_tokens": 32, "plan": "5:1", "mixer": "sse"}
    r.update(kw)
    return r


def test_every_column_is_a_path_some_group_measures():
    measured = {(m, p) for m in ("teacher", "hybrid") for paths, _ in path_groups(m) for p in paths}
    assert measured == set(COLUMNS)


def test_done_paths_counts_an_oom_row_for_the_paths_it_names(tmp_path):
    f = tmp_path / "speed.jsonl"
    rows = [row("teacher", "engine", 5.0),
            row("teacher", "OOM", None, T=2048, oom_paths=["HF warmed", "HF static compiled"])]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"cut off')   # a row cut by a killed call
    done = done_paths(f)
    assert done == {("s", 1024, 8, "teacher", "engine"), ("s", 2048, 8, "teacher", "HF warmed"),
                    ("s", 2048, 8, "teacher", "HF static compiled")}
    # a rerun with row-group prefill retries what ran out of memory without it, and keeps what was measured
    assert done_paths(f, prefill_tokens=65536) == {("s", 1024, 8, "teacher", "engine")}


def test_speedup_is_best_engine_against_best_engine():
    rows = [row("teacher", "HF static compiled", 30.0), row("teacher", "engine", 11.0),
            row("teacher", "engine compiled", 8.0), row("hybrid", "engine", 6.0),
            row("hybrid", "engine compiled", 4.0)]
    decode = markdown(rows).split("**decode ms per step**")[1].split("**")[0]
    line = next(l for l in decode.splitlines() if l.startswith("| s |"))
    assert line.endswith("| 2.00x | 7.50x |")   # 8 / 4 (not 11 / 4) and 30 / 4


def test_oom_paths_show_as_oom_and_missing_ones_as_dash():
    rows = [row("teacher", "OOM", None, oom_paths=["HF warmed", "HF static compiled"]),
            row("teacher", "engine", 11.0), row("teacher", "OOM", None, oom_paths=["engine compiled"]),
            row("hybrid", "engine", 6.0), row("hybrid", "engine compiled", 7.0)]
    decode = markdown(rows).split("**decode ms per step**")[1].split("**")[0]
    line = next(l for l in decode.splitlines() if l.startswith("| s |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[3:9] == ["OOM", "OOM", "11.00", "OOM", "6.00", "7.00"]
    assert cells[9:] == ["1.83x", "-"]   # an OOM path counts as measured: the best of the teacher's is 11


def test_header_names_the_prefill_setting_of_measured_rows():
    rows = [row("teacher", "engine", 11.0), row("hybrid", "engine", 6.0, prefill_tokens=65536),
            row("teacher", "OOM", None, oom_paths=["engine compiled"], prefill_tokens=4096)]
    head = markdown(rows).splitlines()[0]
    assert "--prefill-tokens 65536" in head and "4096" not in head


def test_no_speedup_while_an_engine_path_is_unmeasured():
    rows = [row("teacher", "engine", 11.0), row("hybrid", "engine", 6.0), row("hybrid", "engine compiled", 4.0)]
    decode = markdown(rows).split("**decode ms per step**")[1].split("**")[0]
    line = next(l for l in decode.splitlines() if l.startswith("| s |"))
    assert line.endswith("| - | - |")


def test_rows_timed_before_the_prefill_sync_are_marked_and_remeasured(tmp_path):
    """An engine row prefilled in several row groups before the engine synced at the end of its prefill timed the
    last group's forward in the decode: its cells are marked *, no ratio uses it, and a rerun measures it again.
    One group (B * T within prefill_tokens), HF paths, and rows with `prefill_synced` stand."""
    several = dict(T=8192, B=32, prefill_tokens=131072)   # 16 rows a group: 2 groups
    bad = row("teacher", "engine", 38.8, **several)
    assert split_invalid(bad)
    assert not split_invalid(row("teacher", "engine", 5.0, T=8192, B=16, prefill_tokens=131072))   # one group
    assert not split_invalid(row("teacher", "HF warmed", 70.0, **several))
    assert not split_invalid(row("teacher", "engine", 11.0, prefill_synced=True, **several))
    rows = [bad, row("teacher", "engine compiled", 36.0, **several), row("teacher", "HF static compiled", 55.0, **several),
            row("hybrid", "engine", 8.8, **several, prefill_synced=True),
            row("hybrid", "engine compiled", 6.6, **several, prefill_synced=True)]
    md = markdown(rows)
    assert "marked *" in md.splitlines()[0] and "prefill_synced" in md.splitlines()[0]
    decode = md.split("**decode ms per step**")[1].split("**")[0]
    cells = [c.strip() for c in next(l for l in decode.splitlines() if l.startswith("| s |")).strip("|").split("|")]
    assert cells[3:9] == ["-", "55.00", "38.80 *", "36.00 *", "8.80", "6.60"]
    assert cells[9:] == ["-", "8.33x"]   # no engine ratio from the invalid rows; HF's static cache stands
    peak = md.split("**peak memory GiB**")[1].split("**")[0]
    assert "*" not in peak   # the split decides time, not memory
    f = tmp_path / "speed.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = done_paths(f, prefill_tokens=131072)
    assert {path for *_, model, path in done if model == "teacher"} == {"HF static compiled"}


def test_remeasure_unsynced_reruns_every_engine_row_without_the_sync_mark(tmp_path):
    """`--remeasure-unsynced`: a one-group engine row taken before the prefill sync (valid but for a small
    spill-over) is measured again; synced engine rows and HF rows are kept. Without the flag it stands."""
    rows = [row("teacher", "engine", 11.1, T=16384), row("teacher", "engine compiled", 8.7, T=16384),
            row("hybrid", "engine", 6.6, T=16384, prefill_synced=True), row("teacher", "HF warmed", 70.0, T=16384)]
    f = tmp_path / "speed.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert {p for *_, p in done_paths(f)} == {"engine", "engine compiled", "HF warmed"}
    kept = done_paths(f, remeasure_unsynced=True)
    assert kept == {("s", 16384, 8, "hybrid", "engine"), ("s", 16384, 8, "teacher", "HF warmed")}


def test_remeasure_engine_reruns_engine_rows_of_other_code_and_keeps_hf_rows(tmp_path):
    """`--code B --remeasure-engine`: engine rows (both models, OOM ones too) not labelled B are measured again, HF's
    rows kept; rows labelled B count as done, so the campaign resumes across calls. The report lists the labels."""
    rows = [row("teacher", "engine", 11.1, prefill_synced=True, code="A"),
            row("hybrid", "engine compiled", 4.0, prefill_synced=True),
            row("teacher", "HF warmed", 70.0, code="A"),
            row("teacher", "OOM", None, T=2048, oom_paths=["engine", "engine compiled"], code="A"),
            row("hybrid", "engine", 5.0, prefill_synced=True, code="B")]
    f = tmp_path / "speed.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert len(done_paths(f)) == 6
    assert done_paths(f, remeasure_engine="B") == {("s", 1024, 8, "teacher", "HF warmed"),
                                                   ("s", 1024, 8, "hybrid", "engine")}
    head = markdown(rows).splitlines()[0]
    assert "Engine rows by code (`--code`): A 3, B 1, unlabelled 1." in head   # the OOM row: two paths
    assert "by code" not in markdown([row("teacher", "engine", 11.1, prefill_synced=True)]).splitlines()[0]


def test_remeasure_engine_needs_a_code_label(tmp_path):
    import pytest

    from benchmarks.generation.speed_table import main

    with pytest.raises(SystemExit, match="needs --code"):
        main(["--remeasure-engine", "--out", str(tmp_path / "s.jsonl"), "--shapes", "tiny"])


def test_hf_warmup_calls_generate_as_many_tokens_as_the_timed_call():
    """HF's static cache is sized prompt + new tokens and compiled for it: a warm-up with fewer new tokens left
    the timed call to compile again (SmolLM2-135M, batch 32, 1k: 62 ms a step against 7 at 2k)."""
    import torch
    from benchmarks.generation.rollouts import hf_row

    class Fake:
        def __init__(self):
            self.calls = []

        def generate(self, input_ids, attention_mask, max_new_tokens, logits_processor=None, **kw):
            self.calls.append(max_new_tokens)
            for _ in range(max_new_tokens):
                for p in logits_processor or []:
                    p(input_ids, None)
            return torch.zeros(input_ids.shape[0], input_ids.shape[1] + max_new_tokens, dtype=torch.long)

    m = Fake()
    ids = torch.zeros(2, 5, dtype=torch.long)
    hf_row(m, "teacher", "HF generate", ids, torch.ones_like(ids), 32, {}, 3, torch.device("cpu"))
    assert m.calls == [32, 32, 32, 32]


def test_prefill_ratio_is_best_of_each_models_two_engine_prefills():
    """Each engine row times one prefill of the same forward: the ratio takes each model's higher rate (a slow
    outlier on one side does not decide it), and none while an engine path is unmeasured."""
    rows = [row("teacher", "engine", 11.0, prefill_s=0.5), row("teacher", "engine compiled", 8.0, prefill_s=0.25),
            row("hybrid", "engine", 6.0, prefill_s=1.0), row("hybrid", "engine compiled", 4.0, prefill_s=0.2),
            row("teacher", "engine", 11.0, T=2048), row("hybrid", "engine", 6.0, T=2048),
            row("hybrid", "engine compiled", 4.0, T=2048)]
    for r in rows:
        r["prefill_tok_s"] = r["batch"] * r["prompt_len"] / r["prefill_s"]
    prefill = markdown(rows).split("**prefill tokens/s**")[1].split("**")[0]
    lines = [l for l in prefill.splitlines() if l.startswith("| s |")]
    assert lines[0].endswith("| 1.25x |")   # (8192 / 0.2) / (8192 / 0.25), not 0.5 / 1.0
    assert lines[1].endswith("| - |")       # the teacher's compiled path unmeasured


def test_a_cell_names_the_code_of_its_engine_rows_once_rows_are_labelled():
    """A table filled over several calls mixes code: each decode and prefill line names its engine rows' labels
    (HF rows run none of our code and are left out); without any label the column is not there."""
    rows = [row("teacher", "HF static compiled", 30.0, code="hf"), row("teacher", "engine", 11.0, code="new"),
            row("teacher", "engine compiled", 8.0, code="new"), row("hybrid", "engine", 6.0, code="new"),
            row("hybrid", "engine compiled", 4.0, code="old"), row("hybrid", "engine", 6.0, T=2048, code="new")]
    md = markdown(rows)
    for table in ("**decode ms per step**", "**prefill tokens/s**"):
        lines = [l for l in md.split(table)[1].split("**")[0].splitlines() if l.startswith("| s |")]
        assert lines[0].endswith("| new, old |") and lines[1].endswith("| new |")
    peak = md.split("**peak memory GiB**")[1].split("**")[0]
    assert "new" not in peak
    unlabelled = markdown([{k: v for k, v in r.items() if k != "code"} for r in rows])
    assert "engine rows' code" not in unlabelled.split("**decode ms per step**")[1]


def test_bytes_floor_bandwidth_is_the_named_gpus_unless_given():
    from benchmarks.generation.speed_table import hbm_gbs
    assert hbm_gbs("NVIDIA H100 80GB HBM3") == 3350.0 and hbm_gbs("NVIDIA H200") == 4800.0
    assert hbm_gbs("NVIDIA H200", 4000.0) == 4000.0
    with pytest.raises(SystemExit, match="--hbm-gbs"):
        hbm_gbs("NVIDIA A10G")


def test_header_notes_speak_of_the_shown_rows_not_the_ones_a_rerun_replaced():
    old = row("teacher", "engine", 11.0)                       # before the prefill sync (no `prefill_synced`)
    new = row("teacher", "engine", 10.0, prefill_synced=True)  # its rerun
    assert "before the engine synced" in markdown([old]).splitlines()[0]
    assert "before the engine synced" not in markdown([old, new]).splitlines()[0]


def test_speedups_are_the_tables_ratios_per_context():
    from benchmarks.generation.speed_table import cell_rows, speedups
    rows = [row("teacher", "engine", 11.0, prefill_s=0.5), row("teacher", "engine compiled", 8.0, prefill_s=0.25),
            row("hybrid", "engine", 6.0, prefill_s=1.0), row("hybrid", "engine compiled", 4.0, prefill_s=0.2),
            row("teacher", "engine", 11.0, T=2048), row("hybrid", "engine", 6.0, T=2048)]   # 2048: unmeasured paths
    for r in rows:
        r["prefill_tok_s"] = r["batch"] * r["prompt_len"] / r["prefill_s"]
    got = speedups(cell_rows(rows), "s", 8)
    assert got["decode"] == [(1024, 2.0)] and [(T, round(v, 6)) for T, v in got["prefill"]] == [(1024, 1.25)]
    assert speedups(cell_rows(rows), "s", 1) == {"decode": [], "prefill": []}


def test_a_path_that_raises_is_recorded_as_failed_and_measured_again(tmp_path, monkeypatch, capsys):
    """A path group that raises something other than out-of-memory (on 4 x H200, torch's CUDA-graph trees asserted
    inside HF's compiled generate and ended that worker, its later cells unmeasured) becomes a `failed` row with its
    error, the worker goes on with the next cell, the report names it, and a rerun measures it again."""
    import benchmarks.generation.speed_table as st
    from hybridize.errors import read_jsonl

    crash = {"on": True}

    def fake_bench(model, m, T, B, n, device, budget, hf=True, compiles=(), **kw):
        if hf:
            if crash["on"]:
                raise AssertionError("cudagraph_trees: tensor_weakrefs and stack_traces differ\nsecond line")
            return [dict(model=m, path=p, decode_ms=50.0, prefill_s=0.1, peak_gib=1.0) for p in st.TEACHER_PATHS]
        return [dict(model=m, path="fast (graphs)", compile=c, decode_ms=2.0, prefill_s=0.1, peak_gib=1.0,
                     prefill_synced=True) for c in compiles]

    monkeypatch.setattr(st, "bench_model", fake_bench)
    out = tmp_path / "speed.jsonl"
    argv = ["--shapes", "tiny", "--lens", "64,128", "--batches", "1", "--new-tokens", "2", "--dtype", "float32",
            "--out", str(out), "--budget", "600"]
    st.main(argv)
    assert "going on with the next cell" in capsys.readouterr().err
    rows = read_jsonl(out)
    failed = [r for r in rows if r["table_path"] == "failed"]
    assert [(r["prompt_len"], r["failed_paths"]) for r in failed] == [(64, list(st.HF_PATHS)), (128, list(st.HF_PATHS))]
    assert failed[0]["error"] == "AssertionError: cudagraph_trees: tensor_weakrefs and stack_traces differ"
    assert len([r for r in rows if r["table_path"] in st.ENGINE_PATHS.values()]) == 8   # both cells, both models
    done = done_paths(out)
    assert len(done) == 8 and not any(p in st.HF_PATHS for *_, p in done)
    md = markdown(rows)
    assert "Failed, not measured: tiny 64 x 1 teacher HF static compiled (AssertionError" in md
    crash["on"] = False
    st.main(argv)                                        # the rerun measures only what failed
    rows = read_jsonl(out)
    assert len(rows) == len(failed) + 8 + 4 and len(done_paths(out)) == 12
    assert "Failed" not in markdown(rows)
