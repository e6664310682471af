"""`hybridize.ops.common.gpu_timer.time_cold`: GPU time, whatever the host's launch cost (CUDA), and its retry logic
(CPU, the CUDA calls faked)."""
from __future__ import annotations

import contextlib
import time

import pytest
import torch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="times CUDA kernels; needs a GPU")


@needs_cuda
def test_a_slow_host_does_not_count():
    """A tiny copy whose launch the host delays by 300 us reads as its GPU time (a few us), not as the host's."""
    from hybridize.ops.common.gpu_timer import time_cold

    x = torch.randn(1024, device="cuda")
    y = torch.empty_like(x)

    def slow_launch():
        time.sleep(3e-4)
        y.copy_(x)

    assert time_cold(slow_launch) < 0.05


@needs_cuda
def test_gpu_work_is_timed_whole():
    """A spin of about 1 ms reads as about 1 ms, and a longer spin as proportionally longer."""
    from hybridize.ops.common.gpu_timer import _spin_cycles_per_ms, time_cold

    per_ms = _spin_cycles_per_ms(torch.cuda.current_device())
    one = time_cold(lambda: torch.cuda._sleep(int(per_ms)), reps=10)
    three = time_cold(lambda: torch.cuda._sleep(int(3 * per_ms)), reps=10)
    assert 0.8 < one < 1.25
    assert 2.6 < three / one < 3.4


def _fake_cuda(monkeypatch, behind: int, ms_per_attempt: list[float]) -> list[int]:
    """Stand-ins for the CUDA calls `time_cold` makes, so its logic runs on the CPU. The event recorded after the spin
    reports done (the GPU caught up with the host) in the first `behind` attempts; every start / end pair of attempt
    i times `ms_per_attempt[i]`. Returns the list the spins' cycle counts are appended to."""
    from hybridize.ops.common import gpu_timer

    spins: list[int] = []

    class Event:
        def __init__(self, enable_timing=False):
            pass

        def record(self):
            pass

        def query(self):
            return len(spins) <= behind

        def elapsed_time(self, end):
            return ms_per_attempt[len(spins) - 1]

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "_sleep", spins.append)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(gpu_timer, "_spin_cycles_per_ms", lambda index: 1000.0)
    return spins


@pytest.mark.parametrize("behind, attempts_run", [(0, 1), (1, 2), (2, 3), (5, 3)])
def test_a_host_behind_the_spin_measures_again_with_a_longer_spin(monkeypatch, behind, attempts_run):
    """While the host falls behind the spin, the repetitions run again with a spin 4x longer, at most `attempts`
    times; the result is the last attempt's median, and `fn` runs once per repetition plus its warm-up."""
    from hybridize.ops.common.gpu_timer import time_cold

    spins = _fake_cuda(monkeypatch, behind, ms_per_attempt=[3.0, 2.0, 1.0])
    calls = []
    got = time_cold(lambda: calls.append(1), device="cpu", reps=5, attempts=3, flush_bytes=64)
    assert len(spins) == attempts_run
    assert got == [3.0, 2.0, 1.0][attempts_run - 1]
    assert len(calls) == 1 + 3 + 5 * attempts_run
    host_part = [s - 200 for s in spins]               # cycles beyond the fixed 0.2 ms, at 1000 cycles a ms
    for before, after in zip(host_part, host_part[1:]):
        assert after == pytest.approx(4 * before, rel=0.01, abs=4)
