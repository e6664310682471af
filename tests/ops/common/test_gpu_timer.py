"""`hybridize.ops.common.gpu_timer.time_cold`: GPU time, whatever the host's launch cost (CUDA only)."""
from __future__ import annotations

import time

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="times CUDA kernels; needs a GPU")


def test_a_slow_host_does_not_count():
    """A tiny copy whose launch the host delays by 300 us reads as its GPU time (a few us), not as the host's."""
    from hybridize.ops.common.gpu_timer import time_cold

    x = torch.randn(1024, device="cuda")
    y = torch.empty_like(x)

    def slow_launch():
        time.sleep(3e-4)
        y.copy_(x)

    assert time_cold(slow_launch) < 0.05


def test_gpu_work_is_timed_whole():
    """A spin of about 1 ms reads as about 1 ms, and a longer spin as proportionally longer."""
    from hybridize.ops.common.gpu_timer import _spin_cycles_per_ms, time_cold

    per_ms = _spin_cycles_per_ms(torch.cuda.current_device())
    one = time_cold(lambda: torch.cuda._sleep(int(per_ms)), reps=10)
    three = time_cold(lambda: torch.cuda._sleep(int(3 * per_ms)), reps=10)
    assert 0.8 < one < 1.25
    assert 2.6 < three / one < 3.4
