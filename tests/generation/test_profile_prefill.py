"""benchmarks/generation/profile_prefill.py: on the CPU (`--device cpu`, also on a machine with a GPU) each cell times
both models and splits one prefill into the plan's layer types, and the parts add up to the whole; on CUDA the split
comes from CUDA events (GPU test below)."""
import json

import pytest


def test_prefill_profile_splits_the_forward_by_layer_type(tmp_path):
    from benchmarks.generation import profile_prefill

    out = tmp_path / "pp.jsonl"
    rows = profile_prefill.main(["--shape", "tiny", "--plan", "5:1", "--prompt-lens", "48,33", "--batches", "2",
                                 "--warmup", "1", "--repeats", "2", "--jsonl", str(out), "--quiet", "--device", "cpu"])
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
    # no gradient: SSE's fused front end (`fused_inputs`) in place of `features`
    assert {p["piece"] for p in hybrid["sse_pieces"]} >= {"sse.fused_inputs", "sse.finish"}
    assert res["hybrid_speedup_wall"] == pytest.approx(teacher["wall_s"] / hybrid["wall_s"])


def test_prefill_in_row_groups_runs_each_group_as_the_engine_does(monkeypatch):
    """`--prefill-tokens`: the batch is prefilled in the engine's row groups, one forward per group, every row once,
    and the cell records the setting."""
    from benchmarks.generation import profile_prefill
    from hybridize.generation.fast import FastGenerator

    seen = []
    original = FastGenerator._prefill
    monkeypatch.setattr(FastGenerator, "_prefill", lambda self, ids, am, pos: seen.append(ids.shape[0])
                        or original(self, ids, am, pos))
    rows = profile_prefill.main(["--shape", "tiny", "--plan", "5:1", "--prompt-lens", "20", "--batches", "5",
                                 "--warmup", "1", "--repeats", "1", "--quiet", "--device", "cpu", "--models", "hybrid",
                                 "--prefill-tokens", "40"])
    assert rows[0]["prefill_tokens"] == 40
    per_call = seen[:3]
    assert per_call == [2, 2, 1] and len(seen) % 3 == 0 and all(n in (2, 1) for n in seen)


def test_prefill_profile_rejects_an_unknown_model():
    from benchmarks.generation import profile_prefill

    with pytest.raises(SystemExit):
        profile_prefill.main(["--shape", "tiny", "--models", "student"])


def test_cuda_profiles_count_kernels_not_the_scopes_gpu_spans():
    """On CUDA a profiler scope (`pd::...`) also appears as a GPU-side span covering the kernels launched inside it,
    linked to the scope as if it were a kernel and listed among the device events. Counting it doubled the time of
    every scoped layer (the prefill profile's first GPU run: the teacher's 8k x 8 attributed time exceeded its wall
    time). Only real kernels count."""
    from collections import namedtuple
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from hybridize.generation.profile import SCOPE, device_items, work_items

    Kernel = namedtuple("Kernel", "name device duration")
    scope = SimpleNamespace(name=SCOPE + "softmax", device_type=DeviceType.CPU, is_async=False, cpu_parent=None,
                            kernels=[Kernel(SCOPE + "softmax", 0, 30.0)], cpu_children=[])
    op = SimpleNamespace(name="aten::mm", device_type=DeviceType.CPU, is_async=False, cpu_parent=scope,
                         kernels=[Kernel("gemm", 0, 20.0), Kernel("splitk_reduce", 0, 5.0)], cpu_children=[])
    scope.cpu_children = [op]
    gpu = [SimpleNamespace(name=n, device_type=DeviceType.CUDA, device_time_total=t)
           for n, t in ((SCOPE + "softmax", 30.0), ("gemm", 20.0), ("splitk_reduce", 5.0))]
    items = work_items([scope, op] + gpu, cuda=True)
    assert items == [("gemm", ["softmax"], 20.0), ("splitk_reduce", ["softmax"], 5.0)]
    # a parent op that also lists its child's kernel (aten::linear over aten::addmm) does not count it again
    linear = SimpleNamespace(name="aten::linear", device_type=DeviceType.CPU, is_async=False, cpu_parent=scope,
                             kernels=[Kernel("gemm", 0, 20.0), Kernel("gemm", 0, 20.0)], cpu_children=[op])
    op.cpu_parent, scope.cpu_children = linear, [linear]
    assert work_items([scope, linear, op], cuda=True) == [("gemm", ["softmax"], 20.0), ("gemm", ["softmax"], 20.0),
                                                          ("splitk_reduce", ["softmax"], 5.0)]
    assert device_items([scope, op] + gpu) == [("gemm", 20.0), ("splitk_reduce", 5.0)]


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_prefill_split_is_timed_with_events_around_each_layer(tmp_path):
    """On CUDA the split comes from CUDA events around each layer's attention and SSE's pieces: every part is
    non-negative (the rest, "other", included), the pieces fit inside their layers, and the device total is there."""
    from benchmarks.generation import profile_prefill

    rows = profile_prefill.main(["--shape", "tiny", "--plan", "5:1", "--prompt-lens", "300", "--batches", "2",
                                 "--warmup", "1", "--repeats", "1", "--quiet", "--dtype", "float32"])
    hybrid = rows[0]["models"]["hybrid"]
    parts = {r["layer_type"]: r for r in hybrid["by_layer_type"]}
    assert set(parts) == {"sse", "softmax", "other"} and all(r["ms_all"] >= 0 for r in parts.values())
    assert sum(r["ms_all"] for r in parts.values()) == pytest.approx(hybrid["event_total_ms"], rel=1e-6)
    pieces = {p["piece"]: p["ms_per_layer"] for p in hybrid["sse_pieces"]}
    assert pieces["sse.fused_inputs"] > 0 and pieces["sse.finish"] > 0 and pieces["sse.(rest)"] >= 0
    assert hybrid["profiled_total_ms"] > 0 and hybrid["kernels"] > 0


def test_event_split_times_each_layer_and_sse_piece(monkeypatch):
    """The CUDA split's logic on the CPU, with a stand-in for `torch.cuda.Event` that reads a clock each layer
    advances: every layer type gets its layers' time, SSE's features / finish their own, "other" the rest, and the
    hooks and wrappers are gone afterwards."""
    import torch

    from benchmarks.generation import profile_prefill, rollouts

    clock = [0.0]

    class FakeEvent:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            clock[0] += 1.0            # each recorded event: one millisecond of "work" since the last
            self.t = clock[0]

        def elapsed_time(self, other):
            return other.t - self.t

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    _, hybrid = rollouts.build_pair("tiny", "5:1", "sse", torch.float32, "cpu")
    ids = torch.randint(10, 500, (1, 24))
    once = profile_prefill._prefill_fn(hybrid, ids, torch.ones_like(ids))
    rows, pieces, total = profile_prefill._event_split(hybrid, once)
    parts = {r["layer_type"]: r for r in rows}
    # per SSE layer: start, fused_inputs (the no-gradient front end), route and finish (2 events each), end -> 7 ms;
    # per softmax layer: 1 ms
    assert parts["sse"]["ms_per_layer"] == 7 and parts["softmax"]["ms_per_layer"] == 1
    assert {p["piece"]: p["ms_per_layer"] for p in pieces} == {"sse.fused_inputs": 1, "sse.finish": 1,
                                                               "sse.route": 1, "sse.(rest)": 4}
    # the clock steps before each layer's first event (6 layers) and before the closing event: 7 ms outside layers
    assert total == 5 * 7 + 1 * 1 + 7 and parts["other"]["ms_all"] == 7
    layer = hybrid.model.layers[0].self_attn
    assert not layer._forward_hooks and not layer._forward_pre_hooks and "fused_inputs" not in vars(layer)
