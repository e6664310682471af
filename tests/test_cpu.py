"""Thread choice: the idle-core count, and the guard that re-picks it when a step slows down."""
from __future__ import annotations

import torch

from hybridize import cpu


def test_pick_threads_counts_idle_cores(monkeypatch):
    monkeypatch.setattr(cpu, "usable_cores", lambda: 2)
    monkeypatch.setattr(cpu, "busy_cores", lambda sample_s=0.3: 1.0)
    assert cpu.pick_threads() == 1
    monkeypatch.setattr(cpu, "busy_cores", lambda sample_s=0.3: 0.05)
    assert cpu.pick_threads() == 2
    monkeypatch.setattr(cpu, "busy_cores", lambda sample_s=0.3: 5.0)
    assert cpu.pick_threads() == 1
    assert cpu.pick_threads(3) == 3


def test_busy_cores_reads_proc_stat():
    busy = cpu.busy_cores(0.05)
    assert 0.0 <= busy <= cpu.usable_cores() + 0.5


def test_guard_drops_threads_on_a_slow_step_and_raises_them_later(monkeypatch):
    before = torch.get_num_threads()
    clock = [0.0]
    monkeypatch.setattr(cpu.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(cpu, "usable_cores", lambda: 2)
    busy = [1.0]
    monkeypatch.setattr(cpu, "busy_cores", lambda sample_s=0.3: busy[0])
    try:
        torch.set_num_threads(2)
        guard = cpu.ThreadGuard(recheck=4)
        for dt in (1.0, 1.0, 5.0):          # the third step is 5x the best: someone took a core
            clock[0] += dt
            guard.step_done()
        assert torch.get_num_threads() == 1
        busy[0] = 0.0                       # the core is free again: the 4th step's recheck raises the count
        clock[0] += 1.0
        guard.step_done()
        assert torch.get_num_threads() == 2
        off = cpu.ThreadGuard(enabled=False)
        torch.set_num_threads(2)
        clock[0] += 100.0
        off.step_done()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
