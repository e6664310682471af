"""benchmarks/generation/profile_prefill.py on the CPU: each cell times both models and splits one prefill into the
plan's layer types, and the parts add up to the whole."""
import json

import pytest


def test_prefill_profile_splits_the_forward_by_layer_type(tmp_path):
    from benchmarks.generation import profile_prefill

    out = tmp_path / "pp.jsonl"
    rows = profile_prefill.main(["--shape", "tiny", "--plan", "5:1", "--prompt-lens", "48,33", "--batches", "2",
                                 "--warmup", "1", "--repeats", "2", "--jsonl", str(out), "--quiet"])
    saved = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["prompt_len"], r["batch"]) for r in saved] == [(48, 2), (33, 2)] == [
        (r["prompt_len"], r["batch"]) for r in rows]
    res = saved[0]
    assert res["pad"] is True   # the speed table's prompt by default
    teacher, hybrid = res["models"]["teacher"], res["models"]["hybrid"]
    layers = lambda r: {row["layer_type"]: row["layers"] for row in r["by_layer_type"]}  # noqa: E731
    assert layers(teacher) == {"softmax": 6, "other": "-"}
    assert layers(hybrid) == {"sse": 5, "softmax": 1, "other": "-"}
    for r in (teacher, hybrid):
        assert sum(row["ms_all"] for row in r["by_layer_type"]) == pytest.approx(r["profiled_total_ms"], rel=1e-6)
        assert all(row["ms_all"] > 0 for row in r["by_layer_type"])
        assert len(r["walls_s"]) == 2 and r["tokens_per_s"] == pytest.approx(2 * 48 / r["wall_s"])
    soft = lambda r: next(row for row in r["by_layer_type"] if row["layer_type"] == "softmax")  # noqa: E731
    assert soft(teacher)["kernels_per_layer"] == soft(hybrid)["kernels_per_layer"]   # the same module, counted alike
    assert {p["piece"] for p in hybrid["sse_pieces"]} >= {"sse.features", "sse.finish"}
    assert res["hybrid_speedup_wall"] == pytest.approx(teacher["wall_s"] / hybrid["wall_s"])


def test_prefill_profile_rejects_an_unknown_model():
    from benchmarks.generation import profile_prefill

    with pytest.raises(SystemExit):
        profile_prefill.main(["--shape", "tiny", "--models", "student"])


def test_cuda_profiles_place_each_device_event_in_the_scopes_around_it_on_the_device():
    """On CUDA a kernel belongs to the scopes whose GPU-side spans (user annotations, nested as the scopes) contain
    it: Triton launches too, which have no launching aten op, and each kernel once. The spans themselves are not
    kernels (counting them doubled every scoped layer's time), and a kernel outside every span is "other" (no path)."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from hybridize.generation.profile import SCOPE, device_items, work_items

    def ev(name, start, end, device=DeviceType.CUDA):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end),
                               device_time_total=end - start, is_async=False, cpu_parent=None, kernels=[])

    events = [ev("embedding", 0, 2),
              ev(SCOPE + "softmax", 5, 30), ev("gemm", 5, 15), ev("flash_fwd", 16, 30),
              ev(SCOPE + "sse", 40, 80), ev(SCOPE + "sse.features", 40, 55), ev("rms_norm", 40, 50),
              ev("softmax_map", 50, 55), ev("_output_kernel", 60, 78),          # a Triton launch: no aten op
              ev("mlp_gemm", 85, 95), ev("aten::mm", 5, 15, device=DeviceType.CPU)]
    items = work_items(list(reversed(events)), cuda=True)
    assert items == [("embedding", [], 2), ("gemm", ["softmax"], 10), ("flash_fwd", ["softmax"], 14),
                     ("rms_norm", ["sse", "sse.features"], 10), ("softmax_map", ["sse", "sse.features"], 5),
                     ("_output_kernel", ["sse"], 18), ("mlp_gemm", [], 10)]
    assert sum(t for *_, t in items) == sum(t for _, t in device_items(events)) == 69
