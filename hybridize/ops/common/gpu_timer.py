"""GPU time of one small call with a cold L2, the host's launch cost kept out of it.

Why: the decode GEMM's per-shape choice (`hybridize.ops.decode_gemm.triton_gemm`) ranks candidates of a few
microseconds. `triton.testing.do_bench` records an event, launches the call and records an event, once per
repetition; when the host enqueues that more slowly than the GPU runs it (a 10 us GEMM after a 60 us L2 flush), the GPU
waits for the launch between the two events and the time measured is the host's, more so for a candidate of two
launches (split-K). A busy host then sent a whole process to cuBLAS (benchmarks/RESULTS.md, "the decode GEMM's choice
ranks GPU time"). The decode step runs from a CUDA graph, where no host launch is on its path, so the choice must rank
GPU time.

`time_cold(fn)` holds the GPU in a spin (`torch.cuda._sleep`) while the host enqueues every repetition (an L2
flush, an event, `fn`, an event), so each `fn` starts as soon as the flush before it ends. It checks that the spin
outlasted the enqueueing (an event after the spin still pending once the host is done) and, if not, spins longer
and measures again. Unlike do_bench it runs a fixed number of repetitions (30 by default, few enough for the launch
queue to hold them all); like do_bench's return_mode="median" it returns their median in ms.
"""
from __future__ import annotations

import functools
import statistics
import time

import torch

#: bytes written to evict L2 before each repetition, as triton.testing.do_bench (twice the largest L2 of today's GPUs)
FLUSH_BYTES = 256 * 2**20


@functools.lru_cache(maxsize=None)
def _spin_cycles_per_ms(device_index: int) -> float:
    """Clock cycles of `torch.cuda._sleep` per millisecond on this GPU, from one timed spin."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 2_000_000
    torch.cuda._sleep(cycles // 10)   # first use loads the spin kernel
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / max(start.elapsed_time(end), 1e-3)


def time_cold(fn, device: torch.device | str | None = None, reps: int = 30, attempts: int = 3,
              flush_bytes: int = FLUSH_BYTES) -> float:
    """Median GPU time in ms of `fn()` (work launched on `device`'s current stream; default the current CUDA device)
    after an L2 flush, over `reps` repetitions enqueued while the GPU spins. Raises torch.cuda.OutOfMemoryError when
    the flush buffer does not fit (the caller decides what to do without a timing)."""
    device = torch.device("cuda") if device is None else torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with torch.cuda.device(device):               # events, spin and fn on the device that holds fn's tensors
        flush = torch.empty(flush_bytes, dtype=torch.int8, device=device)
        fn()                                      # compiles, loads modules, allocates outside the timed reps
        torch.cuda.synchronize(device)
        host = time.perf_counter()
        for _ in range(3):                        # the host's cost of enqueueing one repetition, untimed run
            flush.zero_()
            fn()
        host = (time.perf_counter() - host) / 3
        torch.cuda.synchronize(device)
        cycles_per_ms = _spin_cycles_per_ms(device.index)
        times = []
        for _ in range(attempts):
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
            spun = torch.cuda.Event()
            torch.cuda._sleep(int(cycles_per_ms * (2e3 * host * reps + 0.2)))
            spun.record()
            for start, end in zip(starts, ends):
                flush.zero_()
                start.record()
                fn()
                end.record()
            host_was_ahead = not spun.query()     # the GPU still spun when the last repetition was queued
            torch.cuda.synchronize(device)
            times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
            if host_was_ahead:
                break
            host *= 4                             # a busy host: spin longer and measure again
    return statistics.median(times)
