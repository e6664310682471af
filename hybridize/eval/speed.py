"""Prefill and decode throughput (tokens/s), cache size and peak memory of several models side by
side (typically a hybrid vs its teacher), at several context lengths and batch sizes, CPU or GPU.

For each (length L, batch B) the models are measured one after another in the same process, so the
ratio between them is fair even on a noisy machine (DESIGN.md sec. 6):
- prefill: one forward pass over `[B, L]` random token ids with `use_cache=True` (only the last
  position's logits), timed after a warm-up pass on a short input;
- decode: `decode_tokens` greedy steps, one token per step through the model's own cache (a plain
  `model(input_ids=[B, 1], past_key_values=cache)` loop: no sampling/stopping overhead of `generate`);
- cache_MB: bytes of all tensors held by the cache after prefill + decode (KV for softmax layers,
  fixed-size states for mixer layers);
- peak_MB: `torch.cuda.max_memory_allocated` during the run (GPU only; on CPU the process RSS
  growth is not a per-model figure, so it is left empty).
Each number is the median of `repeats` runs.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch


@dataclass
class SpeedConfig:
    lengths: tuple[int, ...] = field(default=(1024, 2048, 4096, 8192), metadata={"help": "prompt lengths (tokens)"})
    batch_sizes: tuple[int, ...] = field(default=(1,), metadata={"help": "batch sizes"})
    decode_tokens: int = field(default=32, metadata={"help": "decode steps timed after the prefill"})
    repeats: int = field(default=1, metadata={"help": "runs per cell (median reported)"})
    seed: int = field(default=0, metadata={"help": "seed of the random prompts"})


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


@torch.no_grad()
def measure(model, L: int, B: int, decode_tokens: int, seed: int = 0) -> dict:
    """One prefill of `[B, L]` + `decode_tokens` steps; seconds, tokens/s and cache size."""
    from .common import Timer, model_device

    dev = model_device(model)
    vocab = model.get_input_embeddings().num_embeddings
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, L), generator=gen).to(dev)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    with Timer(dev) as tp:
        out = _forward(model, ids)
    cache = out.past_key_values
    if cache is None:
        raise ValueError(f"{type(model).__name__} returned no cache with use_cache=True; cannot time decoding")
    nxt = out.logits[:, -1:].argmax(-1)
    with Timer(dev) as td:
        for _ in range(decode_tokens):
            out = _forward(model, nxt, cache)
            cache = out.past_key_values
            nxt = out.logits[:, -1:].argmax(-1)
    res = {"prefill_s": tp.seconds, "prefill_tok_s": B * L / tp.seconds,
           "decode_s": td.seconds, "decode_tok_s": B * decode_tokens / td.seconds if decode_tokens else float("nan"),
           "ms_per_step": 1000 * td.seconds / decode_tokens if decode_tokens else float("nan"),
           "cache_MB": cache_bytes(cache) / 2 ** 20,
           "peak_MB": torch.cuda.max_memory_allocated(dev) / 2 ** 20 if dev.type == "cuda" else None}
    del out, cache
    return res


def run_speed(models: dict[str, object], cfg: SpeedConfig, out_dir: str | Path | None = None,
              progress: bool = True) -> list[dict]:
    """`models`: name -> loaded model. Rows `{model, length, batch, prefill_tok_s, decode_tok_s,
    ms_per_step, cache_MB, peak_MB}`; with `out_dir`: speed.csv, speed.json, speed.png."""
    from tqdm.auto import tqdm

    from .common import model_device, write_csv, write_json

    for m in models.values():   # warm-up: kernels, allocator, lazy init
        measure(m, 16, 1, 2, cfg.seed)
    cells = [(L, B) for L in cfg.lengths for B in cfg.batch_sizes]
    rows = []
    for L, B in tqdm(cells, desc="speed", disable=not progress):
        for name, m in models.items():
            runs = []
            for r in range(cfg.repeats):
                try:
                    runs.append(measure(m, L, B, cfg.decode_tokens, cfg.seed + r))
                except torch.OutOfMemoryError:
                    runs = []
                    break
            row = {"model": name, "length": L, "batch": B, "device": str(model_device(m))}
            if runs:
                for k in runs[0]:
                    vals = [x[k] for x in runs if x[k] is not None]
                    row[k] = statistics.median(vals) if vals else None
            else:
                row["error"] = "out of memory"
            rows.append(row)
            if model_device(m).type == "cuda":
                torch.cuda.empty_cache()
    _add_ratios(rows, list(models))
    if out_dir is not None:
        out = Path(out_dir)
        write_csv(out / "speed.csv", rows, COLUMNS + ["error"])
        write_json(out / "speed.json", {"config": cfg.__dict__, "rows": rows})
        save_speed_plot(out / "speed.png", rows, list(models), cfg.batch_sizes)
    return rows


COLUMNS = ["model", "length", "batch", "prefill_tok_s", "decode_tok_s", "ms_per_step", "decode_speedup",
           "cache_MB", "peak_MB", "device"]


def _add_ratios(rows: list[dict], names: Sequence[str]) -> None:
    """decode_speedup: each model's decode tokens/s over the FIRST model's at the same cell."""
    base = {(r["length"], r["batch"]): r.get("decode_tok_s") for r in rows if r["model"] == names[0]}
    for r in rows:
        b = base.get((r["length"], r["batch"]))
        r["decode_speedup"] = (r["decode_tok_s"] / b) if b and r.get("decode_tok_s") else None


def save_speed_plot(path, rows: list[dict], names: Sequence[str], batch_sizes: Sequence[int]) -> Path:
    """Prefill and decode tokens/s vs length, one line per (model, batch)."""
    from .common import plt

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
