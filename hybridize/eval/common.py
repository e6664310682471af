"""Helpers shared by every eval task: prompt encoding, result files (JSONL / JSON / CSV), printed tables
and matplotlib plots (Agg backend, no display needed).

Model loading (`load_model`, `resolve_device`, `model_device`) is `hybridize.generation.loading` and
batched generation (`generate`: prompts sorted by length, left-padded into batches, each row cut at its own
EOS; the static-buffer CUDA-graph decode loop on CUDA) is `hybridize.generation.batched`; both are imported
here, where the tasks look them up. Every task also accepts an already-loaded `(model, tokenizer)` pair,
which is what the tests use.

Local data (`../shared/data` next to the repository) is found by `data_dir()`; the environment
variable `HYBRIDIZE_DATA_DIR` overrides it.
"""
from __future__ import annotations

import csv
import json
import os
import re
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

# the eval tasks import these from here (and tests patch `load_model` here)
from hybridize.generation.batched import default_batch_size, generate, resolve_generation  # noqa: F401
from hybridize.generation.loading import load_model, model_device, resolve_device  # noqa: F401

# ---- paths and files ----------------------------------------------------------------------------

REPO_ROOT = Path(__file__).resolve().parents[2]


def data_dir() -> Path | None:
    """The shared data folder (`$HYBRIDIZE_DATA_DIR`, else `<repo>/../shared/data`), or None."""
    env = os.environ.get("HYBRIDIZE_DATA_DIR")
    cands = [Path(env)] if env else []
    cands.append(REPO_ROOT.parent / "shared" / "data")
    for c in cands:
        if c.is_dir():
            return c
    return None


def data_file(rel: str) -> Path | None:
    """`data_dir() / rel` when it exists, else None."""
    d = data_dir()
    if d is None:
        return None
    p = d / rel
    return p if p.exists() else None


def write_jsonl(path: str | Path, rows: Iterable[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False, default=_json_default) + "\n")
    return path


def write_json(path: str | Path, obj: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False, default=_json_default) + "\n", encoding="utf-8")
    return path


def write_csv(path: str | Path, rows: Sequence[dict], columns: Sequence[str] | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = list(columns or (rows[0].keys() if rows else []))
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)
    return path


def _json_default(o):
    if isinstance(o, torch.Tensor):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "item"):
        return o.item()
    return str(o)


def slug(text: str) -> str:
    """A file-name-safe short form of a model source or dataset name."""
    s = re.sub(r"[^A-Za-z0-9._-]+", "_", str(text).strip("/")).strip("_")
    return s[-80:] or "model"


def parse_int_list(text: str | Sequence[int]) -> list[int]:
    """'1k,2k,4096' -> [1024, 2048, 4096] (k = 1024)."""
    if not isinstance(text, str):
        return [int(x) for x in text]
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        mult = 1024 if part.endswith("k") else 1
        try:
            out.append(int(float(part.rstrip("k")) * mult))
        except ValueError:
            raise ValueError(f"cannot read {part!r} as an integer (use e.g. '512,1k,4k')") from None
    if not out:
        raise ValueError(f"empty list {text!r}; give comma-separated integers such as '1k,2k'")
    if min(out) < 1:  # lengths and batch sizes: a 0 ended in a ZeroDivisionError
        raise ValueError(f"{text!r}: every value must be a positive integer, got {min(out)}")
    return out


def parse_float_list(text: str | Sequence[float]) -> list[float]:
    """'0,0.5,1' -> [0.0, 0.5, 1.0]."""
    if not isinstance(text, str):
        return [float(x) for x in text]
    try:
        out = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"cannot read {text!r} as comma-separated numbers (e.g. '0,0.25,0.5')") from None
    if not out:
        raise ValueError(f"empty list {text!r}")
    return out


# ---- prompts ------------------------------------------------------------------------------------------

def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def build_prompt(tokenizer, user: str, assistant_prefix: str = "", chat: bool | None = None,
                 system: str | None = None) -> str:
    """The full prompt text: the chat template (when the tokenizer has one and `chat` is not False)
    with a generation prompt, followed by `assistant_prefix`; plain `user + assistant_prefix` otherwise."""
    chat = has_chat_template(tokenizer) if chat is None else chat
    if not chat:
        return user + assistant_prefix
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return text + assistant_prefix


def encode(tokenizer, text: str, chat: bool) -> list[int]:
    """Token ids of a prompt from `build_prompt`. A chat template already holds its special tokens,
    so they are added only to plain prompts (the BOS of Llama-style tokenizers)."""
    return list(tokenizer(text, add_special_tokens=not chat)["input_ids"])


# ---- printing and plotting ----------------------------------------------------------------------

def fmt(v: Any, digits: int = 4) -> str:
    if isinstance(v, float):
        if v != v:
            return "nan"
        if v != 0 and (abs(v) < 10 ** -(digits - 1) or abs(v) >= 1e6):
            return f"{v:.{max(digits - 2, 1)}e}"
        return f"{v:.{digits}g}" if abs(v) >= 1 else f"{v:.{digits}f}".rstrip("0").rstrip(".") or "0"
    return str(v)


def print_table(rows: Sequence[dict], columns: Sequence[str] | None = None, title: str | None = None) -> None:
    """A rich table on stdout (plain text when stdout is not a terminal)."""
    from rich.console import Console
    from rich.table import Table

    columns = list(columns or (rows[0].keys() if rows else []))
    t = Table(title=title)
    for c in columns:
        t.add_column(str(c))
    for r in rows:
        t.add_row(*[fmt(r.get(c, "")) for c in columns])
    Console(width=max(100, 14 * len(columns))).print(t)


def markdown_table(rows: Sequence[dict], columns: Sequence[str] | None = None) -> str:
    columns = list(columns or (rows[0].keys() if rows else []))
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)


def plt():
    """matplotlib.pyplot on the Agg backend (files only, works without a display)."""
    # deferred: matplotlib is slow to import and only the plots need it
    import matplotlib

    matplotlib.use("Agg", force=True)
    # deferred: matplotlib is slow to import and only the plots need it
    import matplotlib.pyplot as pyplot

    return pyplot


def save_line_plot(path: str | Path, series: dict[str, tuple[Sequence[float], Sequence[float]]], *,
                   xlabel: str, ylabel: str, title: str = "", logx: bool = False, logy: bool = False) -> Path:
    """One line per entry of `series` (name -> (xs, ys)) into a PNG."""
    pyplot = plt()
    fig, ax = pyplot.subplots(figsize=(6, 4))
    for name, (xs, ys) in series.items():
        ax.plot(list(xs), list(ys), marker="o", label=name)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    pyplot.close(fig)
    return path


class Timer:
    """Wall time of a block, synchronising CUDA first so GPU work is counted."""

    def __init__(self, device: torch.device | str | None = None):
        self.cuda = torch.device(device).type == "cuda" if device is not None else False
        self.seconds = 0.0

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self._t0
