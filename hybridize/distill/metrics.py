"""Run bookkeeping: metrics JSONL (one line per logged step), the loss-curve PNG, held-out perplexity.

`metrics.jsonl` is append-only; on `--resume` lines past the checkpoint's step are dropped first, so the
file always describes one consistent run.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from .losses import perplexity_nll


class MetricsLog:
    def __init__(self, path: str | Path, enabled: bool = True):
        self.path = Path(path)
        self.enabled = enabled
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def truncate_after(self, step: int) -> None:
        """Keep only lines with `step <= step` (used when resuming from a checkpoint)."""
        if not (self.enabled and self.path.exists()):
            return
        keep = [ln for ln in self.path.read_text().splitlines()
                if ln.strip() and json.loads(ln).get("step", 0) <= step]
        self.path.write_text("".join(ln + "\n" for ln in keep))

    def write(self, **record) -> None:
        if not self.enabled:
            return
        record.setdefault("time", round(time.time(), 3))
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(ln) for ln in self.path.read_text().splitlines() if ln.strip()]


def plot_losses(jsonl: str | Path, png: str | Path, keys: tuple[str, ...] = ("loss",), title: str = "") -> Path | None:
    """Loss curve(s) against step from a metrics JSONL; returns the PNG path (None when nothing to plot)."""
    # deferred: matplotlib is slow to import and only the plots need it
    import matplotlib
    matplotlib.use("Agg")
    # deferred: matplotlib is slow to import and only the plots need it
    import matplotlib.pyplot as plt

    rows = MetricsLog(jsonl).read()
    fig, ax = plt.subplots(figsize=(7, 4))
    drawn = False
    for key in keys:
        pts = [(r["step"], r[key]) for r in rows if key in r and r[key] is not None and math.isfinite(r[key])]
        if pts:
            ax.plot(*zip(*pts), label=key)
            drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    if all(r.get(k, 1) > 0 for r in rows for k in keys if k in r):
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title or Path(jsonl).parent.name)
    fig.tight_layout()
    Path(png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return Path(png)


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, seq_len: int = 512, batch_rows: int = 1, device=None) -> float:
    """Perplexity of a token stream `[N]` in non-overlapping windows of `seq_len` (each window starts
    fresh; the first token of a window is not predicted)."""
    device = device or next(model.parameters()).device
    was_training = model.training
    model.eval()
    n = (ids.numel() // seq_len) * seq_len
    if n == 0:
        raise ValueError(f"held-out text has {ids.numel()} tokens, fewer than one window of {seq_len}")
    rows = ids[:n].view(-1, seq_len)
    total, count = 0.0, 0
    for i in range(0, rows.shape[0], batch_rows):
        x = rows[i:i + batch_rows].to(device)
        out = model(input_ids=x, use_cache=False)
        nll, k = perplexity_nll(out.logits, x)
        total += nll
        count += k
    model.train(was_training)
    return math.exp(total / count)


class Throughput:
    """Tokens/s over a sliding window of steps (for the progress bar)."""

    def __init__(self, window: int = 10):
        self.window = window
        self.events: list[tuple[float, int]] = []

    def add(self, tokens: int) -> float:
        self.events.append((time.perf_counter(), tokens))
        self.events = self.events[-(self.window + 1):]
        if len(self.events) < 2:
            return 0.0
        dt = self.events[-1][0] - self.events[0][0]
        return sum(t for _, t in self.events[1:]) / dt if dt > 0 else 0.0
