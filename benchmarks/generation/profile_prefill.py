"""Where a prefill's time goes, the teacher beside its hybrid: device time per layer type and top kernels.

Issue 24 item 4 asks the hybrid to prefill at least as fast as its teacher from 8k; this says which part of the
forward costs the difference. Builds a (teacher, hybrid) pair with `rollouts.build_pair` (random weights), runs the
fast engine's prefill (`FastGenerator._prefill`: the model's own forward with the prompt mask, a fresh cache and
`logits_to_keep=1`, as HF generate's first call) `--warmup` times, times `--repeats` more (median wall, the two
models alternating per cell), then profiles one with `torch.profiler`. Each decoder layer's attention (softmax or
mixer) runs in a profiler scope (`hybridize.generation.profile.scopes`), so the profile splits the time into the
layer types and "other" (embedding, norms, MLPs, head). Each cell's row is appended to `--jsonl` as it finishes.

    python -m benchmarks.generation.profile_prefill                    # CPU smoke run: tiny shape, 256 tokens
    python -m benchmarks.generation.profile_prefill --shape qwen3-1.7b --prompt-lens 4096,8192,16384 \
        --batches 1,8 --jsonl out.jsonl
    python -m benchmarks.generation.profile_prefill --shape qwen3-1.7b --prompt-lens 8192,16384 --batches 32 \
        --prefill-tokens 131072                                     # batch 32: both models in row groups, as the engine

On the GPU the split is device time between CUDA events recorded around each layer's attention (and an SSE layer's
pieces: features or, without gradient, fused_inputs; route; finish), "other" the rest of the prefill; a profiled prefill gives the top kernels and the
device total (every kernel, memcpy and memset; it matched the wall time at batch 8 on an H100). On the CPU the
split is the CPU time of the outermost aten ops that do work in each profiler scope (a proxy). The prompt is the speed
table's (`rollouts.bench_model`): one row left-padded by an eighth, so the teacher's attention takes its masked path;
`--no-pad` gives every row all its tokens.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.generation import rollouts
from hybridize.generation.fast import FastGenConfig, FastGenerator
from hybridize.generation.profile import (SCOPE, device_items, layer_kind, scopes, summarize_eager, table,
                                          top_ops, work_items)
from hybridize.ops.common.options import current_kernel_options, use_kernel_options


def _prefill_fn(model, ids, mask, prefill_tokens: int = 0):
    """One prefill of the batch as the engine runs it: one forward, or with `prefill_tokens` the engine's row groups
    one after another (each group's cache dropped before the next, so large batches of long prompts fit)."""
    cuda = ids.device.type == "cuda"
    gen = FastGenerator(model, FastGenConfig(fallback=False, prefill_tokens=prefill_tokens))
    pos, am = gen._positions(ids, mask)
    groups = gen._row_groups(*ids.shape)

    def once():
        with torch.no_grad(), use_kernel_options(current_kernel_options()):   # read once per call, as the engine
            for rows in groups:
                gen._prefill(ids[rows], None if am is None else am[rows], pos[rows])
        if cuda:
            torch.cuda.synchronize()
    return once


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class EventSpan:
    """A scope timed by a pair of CUDA events, appended to `spans` as (name, start, end) on exit: events are recorded
    in stream order, so the pair times exactly the kernels launched between them."""

    def __init__(self, name: str, spans: list):
        self.name, self.spans = name, spans

    def __enter__(self):
        self.start = torch.cuda.Event(enable_timing=True)
        self.start.record()
        return self

    def __exit__(self, *exc):
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.spans.append((self.name[len(SCOPE):], self.start, end))


def _event_split(model, once) -> tuple[list[dict], list[dict], float]:
    """(per layer type rows, SSE piece rows, total ms) of one prefill, each layer's attention and SSE's pieces timed
    with CUDA events (`scopes` with `EventSpan`); "other" is the rest of the prefill."""
    spans: list = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with scopes(model, span=lambda name: EventSpan(name, spans)):
        start.record()
        once()
        end.record()
    torch.cuda.synchronize()
    total = start.elapsed_time(end)
    kinds = Counter(layer_kind(layer) for layer in model.model.layers)
    ms = Counter()
    for name, a, b in spans:
        ms[name] += a.elapsed_time(b)
    rows = [{"layer_type": k, "layers": n, "ms_per_layer": ms[k] / n, "ms_all": ms[k]} for k, n in kinds.items()]
    rest = total - sum(ms[k] for k in kinds)
    rows.append({"layer_type": "other", "layers": "-", "ms_per_layer": rest, "ms_all": rest})
    pieces = []
    if kinds.get("sse"):
        n = kinds["sse"]
        named = {p: t for p, t in sorted(ms.items()) if p.startswith("sse.")}
        pieces = [{"piece": p, "ms_per_layer": t / n} for p, t in named.items()]
        pieces.append({"piece": "sse.(rest)", "ms_per_layer": (ms["sse"] - sum(named.values())) / n})
    return rows, pieces, total


def prefill_profile(model, once, top: int) -> dict:
    """Where one prefill (`once`, from `_prefill_fn`) of `model` spends its time, the model already warm. On CUDA:
    device time per layer type from CUDA events around each layer (`EventSpan`; the profiler's tie of kernels to
    scopes by launching op listed the teacher's attention twice, and Triton launches nowhere), then one profiled
    prefill for the top kernels and the device total. On the CPU: CPU time of the outermost aten ops per scope."""
    cuda = next(model.parameters()).device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        rows, pieces, event_total = _event_split(model, once)
        with profile(activities=acts) as prof:
            once()
        dev = device_items(prof.events())
        return {"profiled_total_ms": sum(t for _, t in dev) / 1e3, "event_total_ms": event_total,
                "kernels": len(dev), "by_layer_type": rows, "sse_pieces": pieces,
                "top_by_time": [{"op": r["op"], "per_call": r["per_step"], "ms": r["time_us_per_step"] / 1e3}
                                for r in top_ops(dev, 1, top, "time")]}
    with scopes(model), profile(activities=acts) as prof:
        once()
    items = work_items(prof.events(), cuda)
    kinds = Counter(layer_kind(layer) for layer in model.model.layers)
    res = summarize_eager(items, 1, kinds)
    total = sum(t for *_, t in items)
    return {"profiled_total_ms": total / 1e3,
            "by_layer_type": [{"layer_type": r["layer_type"], "layers": r["layers"],
                               "ms_per_layer": r["time_us_per_layer"] / 1e3, "ms_all": r["time_us_per_step"] / 1e3,
                               "kernels_per_layer": r["kernels_per_layer"]} for r in res["by_layer_type"]],
            "sse_pieces": [{"piece": r["piece"], "ms_per_layer": r["time_us_per_layer"] / 1e3,
                            "kernels_per_layer": r["kernels_per_layer"]} for r in res["sse_pieces"]],
            "top_by_time": [{"op": r["op"], "per_call": r["per_step"], "ms": r["time_us_per_step"] / 1e3}
                            for r in top_ops(items, 1, top, "time")]}


def cell(pair: dict, T: int, B: int, pad: bool, warmup: int, repeats: int, top: int, prefill_tokens: int = 0) -> dict:
    """One (prompt length, batch) cell: every model's median wall prefill (models alternating), then a profile."""
    device = next(iter(pair.values())).device
    torch.manual_seed(1)
    vocab = next(iter(pair.values())).config.vocab_size
    ids = torch.randint(10, vocab - 10, (B, T), device=device)
    mask = torch.ones_like(ids)
    if pad:
        mask[0, :T // 8] = 0
    fns = {name: _prefill_fn(m, ids, mask, prefill_tokens) for name, m in pair.items()}
    for fn in fns.values():
        for _ in range(max(1, warmup)):
            fn()
    walls = {name: [] for name in fns}
    for _ in range(max(1, repeats)):
        for name, fn in fns.items():
            walls[name].append(_timed(fn))
    row = {"prompt_len": T, "batch": B, "pad": pad, "prefill_tokens": prefill_tokens, "models": {}}
    for name, m in pair.items():
        med = statistics.median(walls[name])
        row["models"][name] = {"wall_s": med, "walls_s": walls[name], "tokens_per_s": B * T / med,
                               **prefill_profile(m, fns[name], top)}
    if len(pair) == 2:
        t, h = row["models"]["teacher"], row["models"]["hybrid"]
        row["hybrid_speedup_wall"] = t["wall_s"] / h["wall_s"]
        row["hybrid_speedup_device"] = t["profiled_total_ms"] / h["profiled_total_ms"]
    return row


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v.strip()]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default=None, help="a rollouts.py shape (default: qwen3-1.7b on CUDA, tiny on CPU)")
    rollouts.add_plan_args(ap)
    ap.add_argument("--models", default="teacher,hybrid", help="which of the pair to run, in this order")
    ap.add_argument("--batches", default="1", help="comma-separated batch sizes")
    ap.add_argument("--prompt-lens", default=None, help="comma-separated prompt lengths (default 8192 on CUDA, 256 "
                                                        "on CPU)")
    ap.add_argument("--no-pad", dest="pad", action="store_false",
                    help="every row all its tokens (default: row 0 left-padded by T/8, as the speed table's prompts)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed prefills per model and cell")
    ap.add_argument("--prefill-tokens", type=int, default=0,
                    help="FastGenConfig.prefill_tokens for both models: prefill a few rows at a time, as the engine "
                         "does (fits batch 32 of long prompts); 0 = one forward")
    ap.add_argument("--repeats", type=int, default=3, help="timed prefills per model and cell (median)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="CUDA dtype (CPU: fp32)")
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                    help="auto: CUDA when there is one (the split from CUDA events), else the CPU (the profiler's)")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--jsonl", default="", help="also append each cell's row here")
    ap.add_argument("--quiet", action="store_true", help="print the summary table only, not each cell's profile")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    cuda = args.device != "cpu" and torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, args.dtype) if cuda else torch.float32
    shape = args.shape or ("qwen3-1.7b" if cuda else "tiny")
    lens = _ints(args.prompt_lens or ("8192" if cuda else "256"))
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in models if m not in ("teacher", "hybrid")]
    if bad:
        ap.error(f"--models takes teacher and/or hybrid, got {bad}")
    teacher, hybrid = rollouts.build_pair(shape, args.plan, args.mixer, dtype, device, rollouts.plan_settings(args))
    pair = {name: {"teacher": teacher, "hybrid": hybrid}[name] for name in models}
    meta = {"shape": shape, "plan": args.plan, "mixer": args.mixer, "dtype": str(dtype),
            "device": torch.cuda.get_device_name() if cuda else "cpu"}
    print(f"prefill: {shape}, {dtype}, {meta['device']}, plan {args.plan} ({args.mixer}), "
          f"{'row 0 left-padded by T/8' if args.pad else 'no padding'}, median of {args.repeats} after {args.warmup}")
    rows = []
    for B in _ints(args.batches):
        for T in lens:
            row = {**meta, **cell(pair, T, B, args.pad, args.warmup, args.repeats, args.top, args.prefill_tokens)}
            rows.append(row)
            if args.jsonl:
                Path(args.jsonl).parent.mkdir(parents=True, exist_ok=True)
                with open(args.jsonl, "a") as f:
                    f.write(json.dumps(row) + "\n")
            if not args.quiet:
                unit = "device" if cuda else "CPU"
                for name, r in row["models"].items():
                    print(f"\n## {T} x {B}, {name}: {r['tokens_per_s']:,.0f} tokens/s (wall), "
                          f"{r['profiled_total_ms']:.1f} ms profiled {unit} time")
                    print(table(r["by_layer_type"]))
                    if r["sse_pieces"]:
                        print(table(r["sse_pieces"]))
                    print(table(r["top_by_time"]))
    summary = [{"batch": r["batch"], "prompt": r["prompt_len"],
                **{f"{n} tok/s": round(m["tokens_per_s"]) for n, m in r["models"].items()},
                **({"hybrid / teacher (wall)": round(r["hybrid_speedup_wall"], 3),
                    "(profiled time)": round(r["hybrid_speedup_device"], 3)} if "hybrid_speedup_wall" in r else {})}
               for r in rows]
    print("\n" + table(summary))
    return rows


if __name__ == "__main__":
    main()
