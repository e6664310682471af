"""Needle-in-a-haystack in the style of RULER (Hsieh et al. 2024): single, multi-key, multi-value and
multi-query needles in repeated noise, in essays, or in a haystack made of other needles.

Tasks (RULER names in brackets):

| task      | haystack | needles in the text               | keys / values  |
|-----------|----------|-----------------------------------|----------------|
| s-niah-1  | noise    | 1                                 | words / numbers  [niah_single_1] |
| s-niah-2  | essays   | 1                                 | words / numbers  [niah_single_2] |
| s-niah-3  | essays   | 1                                 | words / uuids    [niah_single_3] |
| mk-niah-1 | essays   | 1 queried + 3 distractor keys     | words / numbers  [niah_multikey_1] |
| mk-niah-2 | needles  | every sentence is a needle        | words / numbers  [niah_multikey_2] |
| mk-niah-3 | needles  | every sentence is a needle        | uuids / uuids    [niah_multikey_3] |
| mv-niah   | essays   | 4 values for the queried key      | words / numbers  [niah_multivalue] |
| mq-niah   | essays   | 4 keys, all queried               | words / numbers  [niah_multiquery] |

Lengths are in tokens of the model's tokenizer and count the WHOLE prompt (chat template, instruction,
haystack, question, answer prefix), as RULER does: the haystack is grown (binary search over whole
haystack units: noise sentences, essay words, distractor needles) to the largest size whose prompt
fits in `length`. The first needle (the first value of the first queried key) goes to the sentence
sentence boundary whose token depth is nearest to `depth`: the share of the context tokens (the
first needle's own tokens left out) before it, so 0 = first sentence, 1 = last; other needles go to
random sentence boundaries. The measured token depth is stored with every sample (`depth_actual`).

Score (RULER string_match_all): the fraction of expected values that appear in the completion.
Running: prompts are built once (`build_samples`) and shared by every model with the same tokenizer;
the prompts of one length are generated together (their lengths differ by a few tokens, so the left
padding is small).

Departures from RULER: keys are adjective-noun pairs from a built-in word list (RULER uses the
`wonderwords` package), and essays are joined with single spaces after splitting on whitespace.
"""
from __future__ import annotations

import random
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from hybridize.builtin_text import builtin_texts
from hybridize.errors import read_jsonl, read_text
from .common import (
    build_prompt,
    data_file,
    default_batch_size,
    encode,
    generate,
    has_chat_template,
    model_device,
    plt,
    write_csv,
    write_json,
    write_jsonl,
)

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

_ADJ = ("abundant acid adorable aggressive alert ancient angry anxious bashful bitter blue brave bright broad "
        "calm careful cheap clever cloudy clumsy cold cool crazy crisp curious damp dark deep delightful dizzy "
        "dry eager early elegant empty fancy fierce filthy flat fluffy foolish fresh friendly gentle giant "
        "glossy golden grumpy handsome happy heavy helpful hollow huge humble icy jolly juicy kind large lazy "
        "lively lonely loud lucky mighty modern muddy narrow nervous noisy odd orange plain polite proud quick "
        "quiet rapid rare rich rough round rusty salty scary shaggy sharp shiny short shy silent silly slim "
        "slow smooth soft sour spicy steep sticky stormy strange strong sweet swift tall tame tender thick "
        "tiny tough ugly vast warm wet wide wild wise witty young zany zealous").split()
_NOUN = ("anchor apple arrow badge bakery balloon banana basket beacon bicycle blanket bottle bracelet bridge "
         "bucket button cabin camera candle canyon carpet castle cherry chimney circle cloud comet compass "
         "cookie copper cottage crayon crystal curtain daisy desert diamond dolphin dragon drum eagle engine "
         "falcon feather fiddle forest fountain garden gadget glacier guitar hammer harbor helmet honey island "
         "jacket jungle kettle kitten ladder lantern lemon magnet maple meadow mirror monkey mountain needle "
         "ocean orchard oven paddle parrot pebble pencil pepper piano pillow planet pocket puzzle quilt rabbit "
         "radio ribbon river rocket saddle sandal shadow shovel silver spider spoon statue sunset teapot "
         "thunder ticket tiger tomato tractor trumpet tunnel turtle umbrella valley violin wagon walnut wizard "
         "window zebra").split()

TASKS: dict[str, dict] = {
    "s-niah-1": dict(haystack="noise", key_type="words", value_type="numbers"),
    "s-niah-2": dict(haystack="essay", key_type="words", value_type="numbers"),
    "s-niah-3": dict(haystack="essay", key_type="words", value_type="uuids"),
    "mk-niah-1": dict(haystack="essay", key_type="words", value_type="numbers", num_keys=4),
    "mk-niah-2": dict(haystack="needle", key_type="words", value_type="numbers"),
    "mk-niah-3": dict(haystack="needle", key_type="uuids", value_type="uuids"),
    "mv-niah": dict(haystack="essay", key_type="words", value_type="numbers", num_values=4),
    "mq-niah": dict(haystack="essay", key_type="words", value_type="numbers", num_keys=4, num_queries=4),
}


@dataclass
class NiahTask:
    """One needle task; see the module table for the named presets."""

    haystack: str = field(default="noise", metadata={"help": "noise | essay | needle"})
    key_type: str = field(default="words", metadata={"help": "words | numbers | uuids"})
    value_type: str = field(default="numbers", metadata={"help": "words | numbers | uuids"})
    num_keys: int = field(default=1, metadata={"help": "keys written into the text (queried + distractors)"})
    num_values: int = field(default=1, metadata={"help": "values per key"})
    num_queries: int = field(default=1, metadata={"help": "keys asked about (<= num_keys)"})

    def __post_init__(self):
        if self.haystack not in ("noise", "essay", "needle"):
            raise ValueError(f"haystack must be noise, essay or needle, got {self.haystack!r}")
        for t in (self.key_type, self.value_type):
            if t not in ("words", "numbers", "uuids"):
                raise ValueError(f"key/value type must be words, numbers or uuids, got {t!r}")
        if not 1 <= self.num_queries <= self.num_keys:
            raise ValueError(f"need 1 <= num_queries ({self.num_queries}) <= num_keys ({self.num_keys})")


def get_task(name: str) -> NiahTask:
    if name not in TASKS:
        raise ValueError(f"unknown NIAH task {name!r}; choose one of {', '.join(TASKS)}")
    return NiahTask(**TASKS[name])


# ---- text pieces ------------------------------------------------------------------------------

def _rand(kind: str, rng: random.Random) -> str:
    if kind == "numbers":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    return f"{rng.choice(_ADJ)}-{rng.choice(_NOUN)}"


def needle_sentence(key: str, value: str, value_type: str) -> str:
    return f"One of the special magic {value_type} for {key} is: {value}."


def _template(value_type: str, query: str) -> tuple[str, str, str]:
    """(instruction before the context, question after it, answer prefix) as in RULER's niah template."""
    head = (f"Some special magic {value_type} are hidden within the following text. Make sure to memorize it. "
            f"I will quiz you about the {value_type} afterwards.\n")
    question = f"\nWhat are all the special magic {value_type} for {query} mentioned in the provided text?"
    prefix = f" The special magic {value_type} for {query} mentioned in the provided text are"
    return head, question, prefix


_ESSAY_CACHE: dict[str, list[str]] = {}


def load_essay_words(source: str | Path | None = None) -> list[str]:
    """Whitespace-split words of the haystack essays: a text file, a JSONL with a `text` field, or
    (default) `haystack/paul_graham_essays.txt` in the shared data dir, else the built-in
    `python-reference` text (Python's Language Reference, in every Python installation)."""
    if source is None:
        source = data_file("haystack/paul_graham_essays.txt") or "python-reference"
    builtin = builtin_texts(str(source))
    if builtin is not None:
        return _ESSAY_CACHE.setdefault(str(source), " ".join(builtin).split())
    key = str(source)
    if key not in _ESSAY_CACHE:
        p = Path(source)
        if p.is_file():
            if p.suffix == ".jsonl":
                text = "\n".join(r["text"] for r in read_jsonl(p))
            else:
                text = read_text(p)
        else:
            text = _hub_essays(key)
        words = text.split()
        if len(words) < 100:
            raise ValueError(f"{source}: only {len(words)} words; the haystack needs a longer text")
        _ESSAY_CACHE[key] = words
    return _ESSAY_CACHE[key]


def _hub_essays(name: str) -> str:
    try:
        # deferred: datasets (pyarrow) is slow to import and only hub or parquet data needs it
        import datasets

        ds = datasets.load_dataset(name, split="train")
    except Exception as e:
        raise ValueError(f"{name!r} is neither a file nor a loadable hub dataset ({type(e).__name__})") from e
    col = "text" if "text" in ds.column_names else ds.column_names[0]
    return "\n".join(ds[col])


# ---- building one sample ----------------------------------------------------------------------

@dataclass
class NiahSample:
    prompt: str                 # full prompt text (template included)
    input_ids: list[int]
    answers: list[str]          # values the completion must contain
    length: int                 # requested prompt length (tokens)
    depth: float                # requested depth of the first needle
    depth_actual: float         # measured token depth of the first needle in the haystack
    needle: str                 # the first needle sentence
    needle_token: int           # token index (in input_ids) where that needle starts
    context_tokens: tuple[int, int]  # [start, end) token span of the haystack in input_ids


def build_sample(tokenizer, task: NiahTask, length: int, depth: float, seed: int = 0,
                 essay_words: Sequence[str] | None = None, chat: bool | None = None) -> NiahSample:
    """One prompt of at most `length` tokens with the first needle at `depth` (0 = start, 1 = end)."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    chat = has_chat_template(tokenizer) if chat is None else chat
    rng = random.Random(f"{seed}-{length}-{depth}")
    keys: list[str] = []
    while len(keys) < task.num_keys:
        k = _rand(task.key_type, rng)
        if k not in keys:
            keys.append(k)
    values = [[_rand(task.value_type, rng) for _ in range(task.num_values)] for _ in keys]
    needles = [needle_sentence(k, v, task.value_type) for k, vs in zip(keys, values) for v in vs]
    queries = keys[:task.num_queries]
    answers = [v for vs in values[:task.num_queries] for v in vs]
    query = queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + " and " + queries[-1]
    head, question, prefix = _template(task.value_type, query)

    # haystack units and the indices after which a needle may go (sentence boundaries)
    if task.haystack == "essay":
        words = list(essay_words) if essay_words is not None else load_essay_words()
        def units(n):
            return [words[i % len(words)] for i in range(n)]
    elif task.haystack == "noise":
        def units(n):
            return [NOISE] * n
    else:
        hay_rng = random.Random(f"hay-{seed}-{length}")
        pool: list[str] = []

        def units(n):
            while len(pool) < n:
                k = _rand(task.key_type, hay_rng)
                if k not in keys:
                    pool.append(needle_sentence(k, _rand(task.value_type, hay_rng), task.value_type))
            return pool[:n]
    place_seed = f"place-{seed}-{length}-{depth}"

    def boundaries(us: list[str]) -> list[int]:
        b = [0] + [i + 1 for i, u in enumerate(us) if task.haystack != "essay" or u[-1:] in ".?!"]
        return b if b[-1] == len(us) else b + [len(us)]

    def assemble(n: int, first: int | None = None):
        """Prompt text with n haystack units, the first needle before unit `first` (default: the
        boundary nearest depth * n); returns (text, context char span, first-needle char span)."""
        us = units(n)
        bounds = boundaries(us)
        if first is None:
            first = min(bounds, key=lambda b: abs(b - depth * n))
        prng = random.Random(place_seed)
        slots = [first] + [prng.choice(bounds) for _ in needles[1:]]
        inserted: dict[int, list[int]] = {}
        for j, b in enumerate(slots):
            inserted.setdefault(b, []).append(j)
        pieces, pos, first_char = [], 0, 0
        for i in range(n + 1):
            for j in inserted.get(i, []):
                if j == 0:
                    first_char = pos
                pieces.append(needles[j])
                pos += len(needles[j]) + 1
            if i < n:
                pieces.append(us[i])
                pos += len(us[i]) + 1
        context = " ".join(pieces)
        text = build_prompt(tokenizer, head + context + question, prefix, chat=chat)
        c0 = text.index(head) + len(head)
        return text, (c0, c0 + len(context)), (c0 + first_char, c0 + first_char + len(needles[0]))

    def n_tokens(n: int, first: int | None = None) -> int:
        return len(encode(tokenizer, assemble(n, first)[0], chat))

    def measured(text: str, ctx: tuple[int, int], nd: tuple[int, int]):
        """(needle start token, context token span, token depth): the depth is the share of the
        context tokens, the first needle's own tokens left out, that come before the needle."""
        tok_at = lambda ch: len(encode(tokenizer, text[:ch], chat))  # noqa: E731 (tokens before a char)
        t0, t1, tn, te = tok_at(ctx[0]), tok_at(ctx[1]), tok_at(nd[0]), tok_at(nd[1])
        return tn, (t0, t1), (tn - t0) / max(t1 - t0 - (te - tn), 1)

    if n_tokens(0) > length:
        raise ValueError(f"length {length} is too short: the prompt without haystack already has {n_tokens(0)} tokens")
    lo, hi = 0, 1
    while n_tokens(hi) <= length:
        lo, hi = hi, hi * 2
    while hi - lo > 1:   # largest n with n_tokens(n) <= length
        mid = (lo + hi) // 2
        if n_tokens(mid) <= length:
            lo = mid
        else:
            hi = mid
    # move the first needle to the boundary whose TOKEN depth is nearest the request (the depth in
    # tokens grows with the boundary index, so a binary search finds it)
    while True:
        bounds = boundaries(units(lo))
        depth_of = lambda i: measured(*assemble(lo, bounds[i]))[2]  # noqa: E731
        a, b = 0, len(bounds) - 1
        while b - a > 1:
            mid = (a + b) // 2
            if depth_of(mid) < depth:
                a = mid
            else:
                b = mid
        best = min((a, b), key=lambda i: abs(depth_of(i) - depth))
        if n_tokens(lo, bounds[best]) <= length or lo == 0:   # merges at the new spot may cost a token
            break
        lo -= 1
    text, ctx, nd = assemble(lo, bounds[best])
    tn, span, depth_actual = measured(text, ctx, nd)
    return NiahSample(prompt=text, input_ids=encode(tokenizer, text, chat), answers=answers, length=length,
                      depth=depth, depth_actual=depth_actual, needle=needles[0], needle_token=tn,
                      context_tokens=span)


def score(completion: str, answers: Sequence[str]) -> float:
    """RULER string_match_all: fraction of `answers` found (case-insensitive) in the completion."""
    c = completion.lower()
    return sum(a.lower() in c for a in answers) / len(answers)


# ---- running a model --------------------------------------------------------------------------

@dataclass
class NiahConfig:
    task: str = field(default="s-niah-1", metadata={"help": "one of " + ", ".join(TASKS)})
    lengths: tuple[int, ...] = field(default=(1024, 2048, 4096), metadata={"help": "prompt lengths in tokens"})
    depths: tuple[float, ...] = field(default=(0.0, 0.25, 0.5, 0.75, 1.0), metadata={"help": "needle depths in [0, 1]"})
    samples: int = field(default=4, metadata={"help": "prompts per (length, depth) cell"})
    max_new_tokens: int | None = field(default=None, metadata={"help": "default: 48 per expected value, at least 64"})
    batch_size: int | None = field(default=None, metadata={
        "help": "prompts generated together (one length per batch); default 32 on a GPU, 4 on CPU"})
    generation: str = field(default="auto", metadata={
        "help": "fast (static buffers + CUDA graphs) | hf (model.generate) | auto (fast on CUDA)"})
    essays: str | None = field(default=None, metadata={"help": "haystack text file / JSONL / hub dataset"})
    chat: bool | None = field(default=None, metadata={"help": "use the chat template (default: when present)"})
    seed: int = field(default=0, metadata={"help": "random seed of keys/values"})


def answer_tokens(cfg: NiahConfig) -> int:
    """Tokens generated per prompt: `cfg.max_new_tokens`, else 48 per expected value and at least 64."""
    task = get_task(cfg.task)
    return cfg.max_new_tokens or max(64, 48 * task.num_values * task.num_queries)


def build_samples(tokenizer, cfg: NiahConfig) -> list[tuple[int, float, int, NiahSample]]:
    """`(length, depth, sample index, NiahSample)` for every cell of `cfg`, in length-major order.
    Built once and shared by every model with the same tokenizer (the prompts are model-independent)."""
    task = get_task(cfg.task)
    words = load_essay_words(cfg.essays) if task.haystack == "essay" else None
    return [(L, d, s, build_sample(tokenizer, task, L, d, seed=cfg.seed * 7919 + s, essay_words=words, chat=cfg.chat))
            for L in cfg.lengths for d in cfg.depths for s in range(cfg.samples)]


def evaluate_niah(model, tokenizer, cfg: NiahConfig, out_dir: str | Path | None = None,
                  progress: bool = True, samples: Sequence[tuple] | None = None, deadline: float | None = None,
                  log=None) -> dict:
    """Greedy answers for every (length, depth, sample); writes samples.jsonl, summary.json,
    accuracy.csv and heatmap.png under `out_dir`. Returns the summary (accuracy per cell).

    The prompts of one length are generated together (batches of `cfg.batch_size`, nearly no padding).
    `samples`: prebuilt `build_samples(tokenizer, cfg)` (else built here). `deadline` (a `time.time()`
    value): lengths not started by then are left out of the table (`lengths_done` lists the rest)."""
    from tqdm.auto import tqdm

    task = get_task(cfg.task)
    max_new = answer_tokens(cfg)
    bs = cfg.batch_size or default_batch_size(model_device(model), gpu=32, cpu=4)
    if samples is None:
        samples = build_samples(tokenizer, cfg)
    rows = []
    for L in tqdm(cfg.lengths, desc=f"niah {cfg.task}", disable=not progress):
        group = [x for x in samples if x[0] == L]
        gens = generate(model, tokenizer, [x[3].input_ids for x in group], max_new_tokens=max_new, batch_size=bs,
                        progress=False, generation=cfg.generation, deadline=deadline, desc=f"niah {L}", log=log)
        for (L_, d, s, x), g in zip(group, gens):
            if g[0] is None:   # past the deadline
                continue
            rows.append({"length": L_, "depth": d, "sample": s, "prompt_tokens": len(x.input_ids),
                         "depth_actual": round(x.depth_actual, 4), "answers": x.answers,
                         "completion": g[0]["text"], "score": score(g[0]["text"], x.answers)})
    done = [L for L in cfg.lengths if any(r["length"] == L for r in rows)]
    table = [_table_row(rows, L, cfg.depths) for L in done]
    summary = {"task": cfg.task, "accuracy": sum(r["score"] for r in rows) / len(rows) if rows else float("nan"),
               "table": table, "lengths": list(cfg.lengths), "lengths_done": done, "depths": list(cfg.depths),
               "samples": cfg.samples, "prompts": len(rows)}
    if out_dir is not None:
        out = Path(out_dir)
        write_jsonl(out / "samples.jsonl", rows)
        write_json(out / "summary.json", {**summary, "config": {**cfg.__dict__, "batch_size": bs}})
        write_csv(out / "accuracy.csv", table, ["length", *[f"d={d:g}" for d in cfg.depths], "mean"])
        if table:
            save_heatmap(out / "heatmap.png", table, done, cfg.depths, title=cfg.task)
    return summary


def _table_row(rows: list[dict], L: int, depths: Sequence[float]) -> dict:
    """Mean score per depth and overall at length L (NaN for a cell without samples)."""
    row: dict = {"length": L}
    for d in depths:
        sc = [r["score"] for r in rows if r["length"] == L and r["depth"] == d]
        row[f"d={d:g}"] = sum(sc) / len(sc) if sc else float("nan")
    sc = [r["score"] for r in rows if r["length"] == L]
    row["mean"] = sum(sc) / len(sc) if sc else float("nan")
    return row


def save_heatmap(path, table: list[dict], lengths: Sequence[int], depths: Sequence[float], title: str = ""):
    """Depth (rows) x length (columns) accuracy heatmap, green = found."""
    pyplot = plt()
    grid = [[row[f"d={d:g}"] for row in table] for d in depths]
    fig, ax = pyplot.subplots(figsize=(1.2 + 0.9 * len(lengths), 1.2 + 0.5 * len(depths)))
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(L) for L in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    for i, r in enumerate(grid):
        for j, v in enumerate(r):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(title)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    pyplot.close(fig)
    return path
