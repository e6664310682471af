"""How many CPU threads to use, chosen so that a core busy with other work does not stall us.

PyTorch's OpenMP threads wait for each other at the end of every parallel op. When another process holds
one of the cores, a thread scheduled there arrives late at every barrier, and a model of many small ops
(a linear-attention mixer's chunked form) stalls at each of them: on 2 cores with one busy, a forward
of the embedded default's hybrid on 2 threads is an order of magnitude slower than on 1 thread
(`benchmarks/pipeline/cpu_threads.py` measures it). So we count the cores that are idle
now and use that many threads, at least one.
"""
from __future__ import annotations

import os
import time

import torch


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _cpu_times() -> list[tuple[int, int]] | None:
    """(busy, total) jiffies of each core from /proc/stat, None where there is no /proc."""
    try:
        lines = open("/proc/stat").read().splitlines()
    except OSError:
        return None
    out = []
    for line in lines:
        if line.startswith("cpu") and line[3:4].isdigit():
            v = [int(x) for x in line.split()[1:]]
            idle = v[3] + (v[4] if len(v) > 4 else 0)   # idle + iowait
            out.append((sum(v) - idle, sum(v)))
    return out


def busy_cores(sample_s: float = 0.3) -> float:
    """How many cores other processes keep busy, measured over `sample_s` seconds (while we sleep)."""
    a = _cpu_times()
    if a is None:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        return float(load)
    time.sleep(sample_s)
    b = _cpu_times() or a
    return sum((bb - ab) / max(bt - at, 1) for (ab, at), (bb, bt) in zip(a, b))


def pick_threads(requested: int = 0) -> int:
    """`requested` when > 0; else the number of idle usable cores (at least 1)."""
    if requested > 0:
        return requested
    cores = usable_cores()
    return max(1, min(cores, int(cores - busy_cores() + 0.3)))


class ThreadGuard:
    """Keeps the thread count right while a loop runs: after each step (`step_done`), a step more than
    `slack` times slower than the fastest one at the current count re-picks the count (someone took a
    core), and every `recheck` steps a count below the usable cores is re-picked too (the core is free
    again). Only the thread count changes, never the work, so a run's steps are the same; the last digits
    of its losses may differ (float sums in another order)."""

    def __init__(self, enabled: bool = True, slack: float = 3.0, recheck: int = 25):
        self.enabled, self.slack, self.recheck = enabled, slack, recheck
        self.best: dict[int, float] = {}
        self.steps = 0
        self.last = time.perf_counter()

    def step_done(self) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        dt, self.last = now - self.last, now
        self.steps += 1
        threads = torch.get_num_threads()
        best = self.best.get(threads)
        self.best[threads] = dt if best is None else min(best, dt)
        slow = best is not None and threads > 1 and dt > self.slack * best
        if slow or (self.steps % self.recheck == 0 and threads < usable_cores()):
            new = pick_threads()
            if new != threads:
                torch.set_num_threads(new)
                print(f"\n[threads] {threads} -> {new} ({'a step took ' + f'{dt:.1f} s' if slow else 'cores free again'})",
                      flush=True)
            self.last = time.perf_counter()   # the idle-core sample is not the next step's time
