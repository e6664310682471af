"""benchmarks/generation/decode_pair.py: its rows and summary (the GPU runs are in RESULTS.md), and a CPU smoke run
whose failing variant is reported, not fatal."""
import json

import pytest

from benchmarks.generation.decode_pair import main, markdown, parse_variants, summarize


def test_variants_are_hybrid_rows_with_more_arguments():
    rows = parse_variants(['nogate=--mixer-settings "sse.output_gate=false"'])
    assert rows == {"teacher": ["--model", "teacher"], "hybrid": ["--model", "hybrid"],
                    "nogate": ["--model", "hybrid", "--mixer-settings", "sse.output_gate=false"]}
    # a variant naming the teacher is a teacher row: compile_auto takes the last --model
    from benchmarks.generation.compile_auto import args_parser

    extra = parse_variants(["tnopdl=--model teacher --kernel-options pdl=false"])["tnopdl"]
    assert args_parser().parse_args(extra).model == "teacher"
    for bad in ["no_equals_sign", "hybrid=--batch 2", "two words=--batch 2"]:
        with pytest.raises(SystemExit, match="NAME=ARGS"):
            parse_variants([bad])


def test_summary_medians_ratios_failures_and_pick_agreement():
    picks = lambda o: {"2048x2048 m=1 bfloat16": o, "4096x2048 m=1 bfloat16": "cublas"}  # noqa: E731
    rows = [{"name": "teacher", "ms": 1.6, "gemm_choices": picks("A")},
            {"name": "hybrid", "ms": 1.7, "gemm_choices": picks("A")},
            {"name": "teacher", "ms": 1.5, "gemm_choices": picks("B")},
            {"name": "hybrid", "error": "timed out after 180 s"},
            {"name": "hybrid", "ms": 1.9, "gemm_choices": {"6312x2048 m=1 bfloat16 bias": "A"}}]
    got = summarize(rows)
    assert got["models"]["teacher"]["median_ms"] == pytest.approx(1.55)
    assert got["models"]["hybrid"]["ms"] == [1.7, 1.9] and got["models"]["hybrid"]["median_ms"] == pytest.approx(1.8)
    assert got["models"]["hybrid"]["teacher_over_row"] == pytest.approx(round(1.55 / 1.8, 3))
    assert got["models"]["hybrid"]["failed"] == ["timed out after 180 s"]
    # a shape one process timed is left out; the others count processes and the most common pick
    assert got["gemm_agreement"] == {
        "2048x2048 m=1 bfloat16": {"processes": 3, "most_common": "A", "agree": 2},
        "4096x2048 m=1 bfloat16": {"processes": 3, "most_common": "cublas", "agree": 3}}
    table = markdown(got, "header", 2)
    assert "| hybrid | 1.700, 1.900, failed | 1.800 | 0.861x |" in table
    assert "| 2048x2048 m=1 bfloat16 | 3 | 2 | A |" in table


def test_cpu_smoke_run_writes_every_row_and_reports_a_failing_one(tmp_path):
    (tmp_path / "broken_1.json").write_text('{"stale": "an earlier run into this folder"}')
    summary = main(["--shape", "tiny", "--prompt-len", "8", "--new-tokens", "2", "--calls", "1", "--mode", "off",
                    "--dtype", "float32", "--rounds", "1", "--out", str(tmp_path),
                    "--variant", "broken=--plan not-a-plan"])
    models = summary["models"]
    assert models["teacher"]["median_ms"] > 0 and models["hybrid"]["median_ms"] > 0
    assert models["teacher"]["teacher_over_row"] == 1.0
    assert models["broken"]["ms"] == [] and models["broken"]["failed"][0].startswith("exit ")
    assert {p.name for p in tmp_path.iterdir()} == {"teacher_1.json", "hybrid_1.json", "pair.json", "pair.md"}
    saved = json.loads((tmp_path / "pair.json").read_text())
    assert [r["name"] for r in saved["rows"]] == ["teacher", "hybrid", "broken"]
    assert "| broken | failed | - | - |" in (tmp_path / "pair.md").read_text()
