"""benchmarks/generation/profile_prefill.py on the CPU: the profile splits one prefill into the plan's layer types,
and its parts add up to the whole."""
import json

import pytest


def test_prefill_profile_splits_the_forward_by_layer_type(tmp_path):
    from benchmarks.generation import profile_prefill

    out = tmp_path / "pp.json"
    profile_prefill.main(["--shape", "tiny", "--plan", "5:1", "--prompt-len", "48", "--warmup", "1",
                          "--json", str(out)])
    res = json.loads(out.read_text())
    teacher, hybrid = res["models"]["teacher"], res["models"]["hybrid"]
    layers = lambda r: {row["layer_type"]: row["layers"] for row in r["by_layer_type"]}  # noqa: E731
    assert layers(teacher) == {"softmax": 6, "other": "-"}
    assert layers(hybrid) == {"sse": 5, "softmax": 1, "other": "-"}
    for r in (teacher, hybrid):
        assert sum(row["ms_all"] for row in r["by_layer_type"]) == pytest.approx(r["profiled_total_ms"], rel=1e-6)
        assert all(row["ms_all"] > 0 for row in r["by_layer_type"])
    soft = lambda r: next(row for row in r["by_layer_type"] if row["layer_type"] == "softmax")  # noqa: E731
    assert soft(teacher)["kernels_per_layer"] == soft(hybrid)["kernels_per_layer"]   # the same module, counted alike
    assert {p["piece"] for p in hybrid["sse_pieces"]} >= {"sse.features", "sse.finish"}
    assert res["hybrid_over_teacher_wall"] > 0 and res["pad"] is True   # the speed table's prompt by default


def test_prefill_profile_rejects_an_unknown_model():
    from benchmarks.generation import profile_prefill

    with pytest.raises(SystemExit):
        profile_prefill.main(["--shape", "tiny", "--models", "student"])
