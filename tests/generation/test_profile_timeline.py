"""`hybridize.generation.profile.timeline`: the graph replays' idle and overlapped device time, from kernel spans."""
import pytest

from hybridize.generation.profile import timeline


def test_idle_is_charged_to_the_kernel_that_ends_it_and_overlap_is_counted_once():
    spans = [("a", 0.0, 10.0),      # busy 0-10
             ("b", 8.0, 12.0),      # 2 us alongside a, 2 us new
             ("c", 15.0, 20.0),     # 3 us idle before it
             ("d", 16.0, 18.0),     # wholly inside c
             ("c", 25.0, 26.0)]     # 5 us idle before it
    t = timeline(spans, steps=1, k=5)
    assert t["span_us_per_step"] == pytest.approx(26.0)
    assert t["busy_us_per_step"] == pytest.approx(18.0)
    assert t["idle_us_per_step"] == pytest.approx(8.0)
    assert t["overlap_us_per_step"] == pytest.approx(4.0)
    assert t["busy_us_per_step"] + t["idle_us_per_step"] == pytest.approx(t["span_us_per_step"])
    assert t["top_idle_before"] == [{"op": "c", "gaps_per_step": 2.0, "idle_us_per_step": 8.0}]


def test_per_step_figures_divide_by_the_steps_and_an_empty_trace_is_zero():
    t = timeline([("a", 0.0, 4.0), ("a", 6.0, 10.0)], steps=2, k=3)
    assert (t["span_us_per_step"], t["busy_us_per_step"], t["idle_us_per_step"]) == (5.0, 4.0, 1.0)
    assert timeline([], steps=3, k=3)["top_idle_before"] == []


def test_device_spans_keep_device_events_in_start_order_without_cpu_ops_or_scopes():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from hybridize.generation.profile import SCOPE, device_items, device_spans

    def event(name, start, end, device=DeviceType.CUDA):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end),
                               device_time_total=end - start)

    events = [event("late", 5.0, 6.0), event("aten::mm", 0.0, 9.0, DeviceType.CPU), event("early", 1.0, 3.0),
              event(SCOPE + "sse", 0.5, 7.0)]
    assert device_spans(events) == [("early", 1.0, 3.0), ("late", 5.0, 6.0)]
    assert sorted(device_items(events)) == [("early", 2.0), ("late", 1.0)]
