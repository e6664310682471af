"""Prefill and decode throughput (tokens/s), cache size and peak memory of several models side by
side (typically a hybrid vs its teacher), at several context lengths and batch sizes, CPU or GPU.

For each (length L, batch B) the models are measured one after another in the same process, so the
ratio between them is fair even on a noisy machine:
- prefill: one forward pass over `[B, L]` random token ids with `use_cache=True` (only the last
  position's logits);
- decode, `decode="loop"`: `decode_tokens` greedy steps, one token per step through the model's own
  cache (a plain `model(input_ids=[B, 1], past_key_values=cache)` loop: no sampling/stopping overhead
  of `generate`, but every step pays HF's Python overhead, which on a GPU dominates for small models);
- decode, `decode="fast"` (default on CUDA): the static-buffer CUDA-graph decode loop of
  `hybridize.generation.fast` (what rollouts use), EOS off; its decode time is the wall time of a
  `decode_tokens + 1`-token call minus that of a 1-token call with the same prompt and buffer shape
  (both after a warm-up call that captures the graph), so prefill and buffer set-up cancel out;
- cache_MB: bytes of all tensors held by the cache (loop: after prefill + decode; fast: after the
  prefill of L tokens - the static buffers are sized to a 256-token bucket, not to the content);
- peak_MB: the model's weights plus the peak of `torch.cuda.max_memory_allocated` above what was
  allocated when the run started, i.e. what the model would need alone even when the other models
  compared are held on the same GPU (GPU only; on CPU the process RSS growth is not a per-model
  figure, so it is left empty).
With `warmup` (default on CUDA) each cell first runs once untimed at its own shape, so kernel
compilation/autotuning for that shape is not timed. Each number is the median of `repeats` runs.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
from tqdm.auto import tqdm

from hybridize.generation.fast import FastGenerator

from .common import Timer, model_device, plt, write_csv, write_json


@dataclass
class SpeedConfig:
    lengths: tuple[int, ...] = field(default=(1024, 2048, 4096, 8192), metadata={"help": "prompt lengths (tokens)"})
    batch_sizes: tuple[int, ...] = field(default=(1,), metadata={"help": "batch sizes"})
    decode_tokens: int = field(default=32, metadata={"help": "decode steps timed after the prefill"})
    repeats: int = field(default=1, metadata={"help": "runs per cell (median reported)"})
    seed: int = field(default=0, metadata={"help": "seed of the random prompts"})
    decode: str = field(default="auto", metadata={"help": "loop (HF forward per step) | fast (CUDA-graph loop of "
                                                           "generation.fast) | auto (fast on CUDA)"})
    warmup: bool | None = field(default=None, metadata={"help": "one untimed run per cell first (default: on CUDA)"})


def cache_bytes(obj, _seen: set | None = None, _depth: int = 0) -> int:
    """Bytes of every distinct tensor reachable from a cache object (lists, dicts, attributes)."""
    seen = set() if _seen is None else _seen
    if _depth > 6 or id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple, set)):
        return sum(cache_bytes(x, seen, _depth + 1) for x in obj)
    if isinstance(obj, dict):
        return sum(cache_bytes(x, seen, _depth + 1) for x in obj.values())
    if hasattr(obj, "__dict__") and not isinstance(obj, (torch.nn.Module, type)):
        return sum(cache_bytes(x, seen, _depth + 1) for x in vars(obj).values())
    return 0


def _forward(model, ids, cache=None):
    kw = {"input_ids": ids, "use_cache": True}
    if cache is not None:
        kw["past_key_values"] = cache
    try:
        return model(**kw, logits_to_keep=1)
    except TypeError:  # older / custom models without logits_to_keep
        return model(**kw)


DECODE_MODES = ("auto", "fast", "loop")


def resolve_decode(mode: str, device) -> str:
    if mode not in DECODE_MODES:
        raise ValueError(f"decode must be one of {', '.join(DECODE_MODES)}, got {mode!r}")
    if mode == "auto":
        return "fast" if torch.device(device).type == "cuda" else "loop"
    return mode


@torch.no_grad()
def measure(model, L: int, B: int, decode_tokens: int, seed: int = 0, decode: str = "loop", fast=None) -> dict:
    """One prefill of `[B, L]` + `decode_tokens` steps; seconds, tokens/s and cache size.
    `decode`: 'loop' or 'fast' (`fast`: a `FastGenerator` of `model`, kept to reuse its graphs)."""
    dev = model_device(model)
    decode = resolve_decode(decode, dev)
    vocab = model.get_input_embeddings().num_embeddings
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, L), generator=gen).to(dev)
    base = 0
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)   # every model's weights (others may share the GPU)
    with Timer(dev) as tp:
        out = _forward(model, ids)
    cache = out.past_key_values
    if cache is None:
        raise ValueError(f"{type(model).__name__} returned no cache with use_cache=True; cannot time decoding")
    if decode == "fast":
        cache_mb = cache_bytes(cache) / 2 ** 20
        del out, cache
        decode_s, decode = _fast_decode_seconds(model, ids, decode_tokens, fast) if decode_tokens else (0.0, decode)
    else:
        nxt = out.logits[:, -1:].argmax(-1)
        with Timer(dev) as td:
            for _ in range(decode_tokens):
                out = _forward(model, nxt, cache)
                cache = out.past_key_values
                nxt = out.logits[:, -1:].argmax(-1)
        decode_s = td.seconds
        cache_mb = cache_bytes(cache) / 2 ** 20
        del out, cache
    return {"prefill_s": tp.seconds, "prefill_tok_s": B * L / tp.seconds,
            "decode_s": decode_s, "decode_tok_s": B * decode_tokens / decode_s if decode_tokens else float("nan"),
            "ms_per_step": 1000 * decode_s / decode_tokens if decode_tokens else float("nan"),
            "cache_MB": cache_mb, "decode": decode,
            "peak_MB": (torch.cuda.max_memory_allocated(dev) - base + _weight_bytes(model)) / 2 ** 20
            if dev.type == "cuda" else None}


def _weight_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def _fast_decode_seconds(model, ids: torch.Tensor, n: int, fast=None) -> tuple[float, str]:
    """(seconds, label): decode time of `n` greedy steps on the fast path: (n + 1 new tokens) - (1 new
    token), same prompt and buffer bucket, after one warm-up call of n + 1 (graph capture). EOS is off:
    every row runs n steps. Where the fast path falls back to `model.generate`, that is what gets timed
    (label 'hf-generate')."""
    fast = fast if fast is not None else FastGenerator(model)
    kw = dict(attention_mask=None, do_sample=False, eos_token_id=None, pad_token_id=0, temperature=None,
              top_p=None, top_k=None)
    fast(input_ids=ids, max_new_tokens=n + 1, **kw)   # warm-up: session, graph capture
    label = "fast" if not fast.last_fallback_reason else "hf-generate"
    with Timer(ids.device) as t1:
        fast(input_ids=ids, max_new_tokens=1, **kw)
    with Timer(ids.device) as tn:
        fast(input_ids=ids, max_new_tokens=n + 1, **kw)
    return max(tn.seconds - t1.seconds, 1e-9), label


def run_speed(models: dict[str, object], cfg: SpeedConfig, out_dir: str | Path | None = None,
              progress: bool = True, deadline: float | None = None, log=None) -> list[dict]:
    """`models`: name -> loaded model. Rows `{model, length, batch, prefill_tok_s, decode_tok_s,
    ms_per_step, cache_MB, peak_MB, decode}`; with `out_dir`: speed.csv, speed.json, speed.png.
    `deadline` (a `time.time()` value): cells not started by then are left out. `log(msg)`: one line per cell."""
    fast = {}
    for name, m in models.items():
        dev = model_device(m)
        if resolve_decode(cfg.decode, dev) == "fast":
            fast[name] = FastGenerator(m)   # one per model: its graphs are reused across repeats
        measure(m, 16, 1, 2, cfg.seed, cfg.decode, fast.get(name))   # warm-up: kernels, allocator, lazy init
    cells = [(L, B) for L in cfg.lengths for B in cfg.batch_sizes]
    rows, last_s = [], 0.0
    for L, B in tqdm(cells, desc="speed", disable=not progress):
        # a cell takes longer than the one before (longer context): start it only if that much time is left
        if deadline is not None and time.time() + last_s > deadline:
            if log:
                log(f"speed: time is up, {len(cells) - cells.index((L, B))} of {len(cells)} cells not measured")
            break
        t0 = time.perf_counter()
        for name, m in models.items():
            rows.append(_measure_cell(name, m, L, B, cfg, fast.get(name)))
            if log:
                r = rows[-1]
                log(f"speed {name} L={L} B={B}: " + (r["error"] if "error" in r else
                    f"prefill {r['prefill_tok_s']:.0f} tok/s, decode {r['decode_tok_s']:.1f} tok/s ({r['decode']})"))
        last_s = time.perf_counter() - t0
    _add_ratios(rows, list(models))
    if out_dir is not None:
        out = Path(out_dir)
        write_csv(out / "speed.csv", rows, COLUMNS + ["error"])
        write_json(out / "speed.json", {"config": cfg.__dict__, "rows": rows})
        if rows:
            save_speed_plot(out / "speed.png", rows, list(models), cfg.batch_sizes)
    return rows


def _measure_cell(name: str, m, L: int, B: int, cfg: SpeedConfig, fast) -> dict:
    """Median over `cfg.repeats` runs of one model at one (L, B); an 'error' entry on OOM."""
    dev = model_device(m)
    warm = cfg.warmup if cfg.warmup is not None else dev.type == "cuda"
    runs = []
    if fast is not None:
        fast.reset()   # drop the previous cell's graphs and buffers: they would count in this cell's memory
    try:
        if warm:
            measure(m, L, B, min(cfg.decode_tokens, 2), cfg.seed, cfg.decode, fast)
        for r in range(cfg.repeats):
            runs.append(measure(m, L, B, cfg.decode_tokens, cfg.seed + r, cfg.decode, fast))
    except torch.OutOfMemoryError:
        runs = []
    row = {"model": name, "length": L, "batch": B, "device": str(dev)}
    if runs:
        for k in runs[0]:
            vals = [x[k] for x in runs if x[k] is not None]
            row[k] = (statistics.median(vals) if not isinstance(vals[0], str) else vals[0]) if vals else None
    else:
        row["error"] = "out of memory"
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return row


COLUMNS = ["model", "length", "batch", "prefill_tok_s", "decode_tok_s", "ms_per_step", "decode_speedup",
           "cache_MB", "peak_MB", "decode", "device"]


def _add_ratios(rows: list[dict], names: Sequence[str]) -> None:
    """decode_speedup: each model's decode tokens/s over the FIRST model's at the same cell."""
    base = {(r["length"], r["batch"]): r.get("decode_tok_s") for r in rows if r["model"] == names[0]}
    for r in rows:
        b = base.get((r["length"], r["batch"]))
        r["decode_speedup"] = (r["decode_tok_s"] / b) if b and r.get("decode_tok_s") else None


def save_speed_plot(path, rows: list[dict], names: Sequence[str], batch_sizes: Sequence[int]) -> Path:
    """Prefill and decode tokens/s vs length, one line per (model, batch)."""
    pyplot = plt()
    fig, axes = pyplot.subplots(1, 3, figsize=(15, 4))
    for ax, key, label in zip(axes, ("prefill_tok_s", "decode_tok_s", "cache_MB"),
                              ("prefill tokens/s", "decode tokens/s", "cache MB")):
        for n in names:
            for B in batch_sizes:
                rs = [r for r in rows if r["model"] == n and r["batch"] == B and r.get(key) is not None]
                if rs:
                    ax.plot([r["length"] for r in rs], [r[key] for r in rs], marker="o", label=f"{n} (B={B})")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    pyplot.close(fig)
    return Path(path)
