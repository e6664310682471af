"""Shared timing for the benchmark scripts: one way to warm up, synchronise, repeat and take the median,
and one way to print the table (device, shapes, dtype in the header; ratios side by side).

- `gpu_stack(script)`: the device / versions line a GPU table starts with (exits unless CUDA + fla-core);
- `bench(fn)`: wall ms of one call, median of `triton.testing.do_bench` (GPU; warm-up and sync inside);
- `profile(fn)`: wall ms (CUDA-synchronised mean after 3 warm-ups) and device ms (torch.profiler: the sum
  of kernel times), kernel count, host syncs and the top kernels of one call;
- `median_time(fn)`: seconds of one call, median of `repeats` after `warmup` calls, CUDA-synchronised
  around each call when CUDA is there (CPU scripts);
- `timed_call(fn)`: (result, seconds) of one CUDA-synchronised call;
- `free_memory(device)`: garbage collection and the CUDA cache emptied between models or shapes;
- `graphed(fn)` / `graph_time_us(fns)`: a CUDA-graph replay of `fn`, and the mean time per call of a graph;
- `md_header(columns, align)` / `md_table(columns, rows)`: markdown tables.

Every script that times things imports these (`from benchmarks.timing import ...`); run scripts from the repo
root as `python -m benchmarks.<folder>.<script>`.
"""
from __future__ import annotations

import gc
import statistics
import time
from collections import defaultdict

import torch


def sync() -> None:
    """Wait for the GPU (no-op without CUDA)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_memory(device) -> None:
    """Collect garbage and hand cached CUDA blocks back, between the models or shapes of a benchmark."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def gpu_stack(script: str) -> str:
    """For the side-by-side GPU scripts: exit with one line unless CUDA and fla-core are there; activate fla
    with its full autotuning (the baseline at its strongest; `HYBRIDIZE_AUTOTUNE_TOP=n` caps fla's config
    lists for a quicker look, and the tables print the cap: a capped fla against our tuned kernels is not a
    fair ratio). Returns the device / versions line their tables start with."""
    if not torch.cuda.is_available():
        raise SystemExit(f"benchmarks/{script} needs a CUDA device")
    import triton

    from hybridize.ops import gpu
    if not gpu.activate():
        raise SystemExit("fla-core is not importable: pip install fla-core==0.6.0")
    return f"device: {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}"


def bench(fn, grad_to_none=None) -> float:
    """Milliseconds per call: the median of `triton.testing.do_bench` (25 ms warm-up, 100 ms of repeats)."""
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median")


def profile(fn, reps: int = 5, top: int = 12) -> dict:
    """Wall ms per call (3 warm-ups, then the mean of `reps` CUDA-synchronised calls, host included), device
    ms per call (torch.profiler: the sum of kernel times), kernels and `.item()` calls per call, top kernels."""
    from torch.profiler import ProfilerActivity, profile as prof_ctx

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / reps
    with prof_ctx(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    per = defaultdict(lambda: [0, 0.0])
    syncs = 0
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
            per[e.name][0] += 1
            per[e.name][1] += e.device_time_total
        elif e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "aten::item",
                        "aten::_local_scalar_dense"):
            syncs += e.name in ("aten::item", "aten::_local_scalar_dense")
    dev = sum(t for _, t in per.values()) / reps / 1e3
    n = sum(c for c, _ in per.values()) / reps
    tops = sorted(per.items(), key=lambda kv: -kv[1][1])[:top]
    return {"wall_ms": 1e3 * wall, "device_ms": dev, "kernels": n, "item_calls": syncs / reps,
            "top": [{"kernel": k[:90], "per_call": c / reps, "ms": t / reps / 1e3} for k, (c, t) in tops]}


def median_time(fn, repeats: int, warmup: int = 2) -> float:
    """Seconds per call: `warmup` untimed calls, then the median of `repeats` timed ones (each synchronised
    with the GPU when there is one)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        times.append(timed_call(fn)[1])
    return statistics.median(times)


def timed_call(fn):
    """(fn(), seconds) of one call, synchronised with the GPU before and after."""
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t0


def graphed(fn):
    """`fn` captured in a CUDA graph (warmed up on a side stream first); returns graph.replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def graph_time_us(fns, reps: int = 10) -> float:
    """Mean microseconds per call of a CUDA graph calling each of `fns` once, in order (CUDA events)."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in fns:
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / (reps * len(fns))


def md_header(columns: list[str], align: str = "") -> str:
    """The two header lines of a markdown table (the rows follow as the script measures them). `align`: one
    letter per column, "l" (---) or "r" (---:); default: the first column left, the others right."""
    align = align or "l" + "r" * (len(columns) - 1)
    assert len(align) == len(columns), (align, columns)
    return "\n".join(["| " + " | ".join(columns) + " |",
                      "| " + " | ".join("---:" if a == "r" else "---" for a in align) + " |"])


def md_table(columns: list[str], rows: list[list], align: str = "") -> str:
    """A whole markdown table: `md_header(columns, align)`, then one line per row."""
    return "\n".join([md_header(columns, align)] + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])

