"""Training text for distillation: load documents through `datasets`, tokenize, pack, and serve
micro-batches as a pure function of the step number (so `--resume` sees exactly the same data).

Packing: documents (each + EOS) are concatenated and cut into rows of `seq_len` tokens; `position_ids`
restart at 0 at every document start AND at every row start (a document cut by a row boundary continues
as a new document). A micro-batch of R rows is flattened into ONE row `[1, R * seq_len]`: the mixers'
varlen path needs batch 1 (`cu_seqlens`), and HF's mask builder turns restarting `position_ids` (with
`attention_mask=None` and no cache) into a block-diagonal causal mask for eager/sdpa attention, so no
token ever sees another document - in softmax or in linear-attention layers.

Order: for a given row length the rows are shuffled by `seed`, `epoch` and schedule phase; micro-batch
`j` of a phase takes rows `[j*R*world + rank*R, ... + R)` of the concatenated epoch permutations.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hybridize.errors import UserError, check_utf8, first_line

from hybridize.builtin_text import builtin_texts
from hybridize.distill.recall_drills import add_recall_drills

TEXT_SUFFIXES = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "json", ".json": "json",
                 ".parquet": "parquet", ".csv": "csv"}


# ---- locating data ------------------------------------------------------------------------------

def shared_data(rel: str) -> Path | None:
    """`../shared/data/<rel>` (relative to the working directory or to the repository) when it exists.

    Only used for defaults: everything runs without it."""
    for root in (Path.cwd() / ".." / "shared" / "data", Path(__file__).resolve().parents[3] / "shared" / "data"):
        p = root / rel
        if p.exists():
            return p.resolve()
    return None


def load_rows(source: str, split: str = "train", max_rows: int = 0, sample_by: str = "line"):
    """Rows of a local file/folder or a hub dataset, as a `datasets.Dataset`. `sample_by` (text files only):
    one row per "line", "paragraph" (blank-line separated) or "document" (the whole file)."""
    # deferred: datasets (pyarrow) is slow to import and only hub or parquet data needs it
    import datasets

    if not source:
        raise UserError("no data source given (a local .jsonl/.txt/.parquet file or a hub dataset name)")
    path = Path(source).expanduser()
    if path.exists():
        if path.is_dir():
            files = sorted(f for f in path.rglob("*") if f.suffix in TEXT_SUFFIXES)
            if not files:
                raise UserError(f"{path} holds no {'/'.join(TEXT_SUFFIXES)} files")
            kind = TEXT_SUFFIXES[files[0].suffix]
            files = [str(f) for f in files if TEXT_SUFFIXES[f.suffix] == kind]
        else:
            if path.suffix not in TEXT_SUFFIXES:
                raise UserError(f"{path}: unknown data format {path.suffix!r}; use one of {sorted(TEXT_SUFFIXES)}")
            kind, files = TEXT_SUFFIXES[path.suffix], [str(path)]
        files = check_local_files(path, files, kind)
        try:
            extra = {"sample_by": sample_by} if kind == "text" else {}
            ds = datasets.load_dataset(kind, data_files=files, split="train", **extra)
        except Exception as e:  # datasets raises many types for malformed files
            raise UserError(f"cannot read {path}: {type(e).__name__}: {first_line(e)}") from None
    else:
        name, _, config = source.partition(":")
        try:
            ds = datasets.load_dataset(name, config or None, split=split)
        except Exception as e:
            raise UserError(f"{source!r} is neither a local file nor a loadable hub dataset "
                            f"({type(e).__name__}: {first_line(e, 160)})") from None
    if max_rows and len(ds) > max_rows:
        ds = ds.select(range(max_rows))
    return ds


def _blank(path: Path) -> bool:
    """Empty, or a small file of whitespace only (a large file is never read here)."""
    size = path.stat().st_size
    return size == 0 or (size < 4096 and not path.read_bytes().strip())


def check_local_files(source: Path, files: list[str], kind: str) -> list[str]:
    """The non-empty files of a local source, each checked to be UTF-8 text (parquet excepted), so an empty
    file or a stray Latin-1 byte is one line naming the file (and line), not a `datasets` stack trace or
    an IndexError in the error handler. Empty files in a folder are skipped."""
    kept = [f for f in files if not _blank(Path(f))]
    if not kept:
        raise UserError(f"{source} is empty: no rows to read" if len(files) == 1 else
                        f"{source}: all {len(files)} data files are empty")
    if kind != "parquet":
        for f in kept:
            check_utf8(f)
    return kept


def row_texts(ds, text_field: str = "text", template: str = "") -> list[str]:
    """Extract one string per row; malformed rows are skipped and reported in one line."""
    texts, bad = [], []
    for i, row in enumerate(ds):
        try:
            t = template.format(**row) if template else row[text_field]
        except (KeyError, IndexError, ValueError):
            t = None
        if not isinstance(t, str):
            bad.append(i)
            continue
        if t.strip():
            texts.append(t)
    if bad:
        cols = list(ds.column_names)
        msg = (f"{len(bad)} of {len(ds)} rows lack a usable "
               f"{'template ' + repr(template) if template else 'text field ' + repr(text_field)} "
               f"(first: row {bad[0]}; columns: {cols})")
        if not texts:
            raise UserError(msg)
        print(f"warning: skipped {msg}")
    if not texts:
        raise UserError("the data source holds no non-empty text")
    return texts


TXT_DOCUMENTS = ("line", "paragraph", "file", "wikitext")
# a wikitext article starts at a top-level heading line " = Title = " (sections are " = = Section = = ")
_WIKITEXT_ARTICLE = re.compile(r"\n(?= = [^=].* = \n)")


def wikitext_articles(text: str) -> list[str]:
    """Split a raw wikitext-2/103 file into whole articles (one document per top-level heading)."""
    return [a.strip("\n") for a in _WIKITEXT_ARTICLE.split("\n" + text) if a.strip()]


def load_texts(source: str | list, text_field: str = "text", template: str = "", split: str = "train",
               max_docs: int = 0, txt_document: str = "line") -> list[str]:
    """Documents of a built-in text (`python-docs`, `python-source`, `python-reference`: see
    hybridize.builtin_text), a local file or folder, or a hub dataset; a list of sources is read in turn
    (`max_docs` applies to each).

    `txt_document` says what one document of a local text file is: a "line" (the `datasets` default), a
    "paragraph", the whole "file", or a "wikitext" article (whole articles keep long-range structure for a
    long-context stage; lines would cut them into paragraphs)."""
    if isinstance(source, (list, tuple)):
        if not source:
            raise UserError("data.train is an empty list: name at least one source")
        return [t for s in source for t in load_texts(s, text_field, template, split, max_docs, txt_document)]
    builtin = builtin_texts(source)
    if builtin is not None:
        return builtin[:max_docs] if max_docs else builtin
    if txt_document not in TXT_DOCUMENTS:
        raise UserError(f"data.txt_document={txt_document!r}: use one of {', '.join(TXT_DOCUMENTS)}")
    sample_by = {"line": "line", "paragraph": "paragraph"}.get(txt_document, "document")
    texts = row_texts(load_rows(source, split, 0 if txt_document == "wikitext" else max_docs, sample_by),
                      text_field, template)
    if txt_document == "wikitext" and _lines_or_whole_file(source):  # join, then split at the titles
        texts = wikitext_articles("".join(t if t.endswith("\n") else t + "\n" for t in texts))
        texts = texts[:max_docs] if max_docs else texts
    return texts


def _lines_or_whole_file(source: str) -> bool:
    """A local text file (read whole) or a hub dataset (wikitext's rows are lines); a local .jsonl / .parquet
    row is a document already."""
    path = Path(source).expanduser()
    if not path.exists():
        return True
    files = sorted(f for f in path.rglob("*") if f.suffix in TEXT_SUFFIXES) if path.is_dir() else [path]
    return bool(files) and TEXT_SUFFIXES.get(files[0].suffix) == "text"


def special_prefix(tokenizer) -> list[int]:
    """The ids a tokenizer puts before every text it encodes with special tokens: `[bos]` for Llama 3, Gemma and
    others that expect it at the start of every sequence (Gemma 3 270M's wikitext-2 perplexity is about 2x worse
    without it), `[]` for SmolLM2 and Qwen."""
    with_, without = (tokenizer("a", add_special_tokens=b)["input_ids"] for b in (True, False))
    n = len(with_) - len(without)
    return list(with_[:n]) if n > 0 and list(with_[n:n + len(without)]) == list(without) else []


def tokenize_docs(tokenizer, texts: list[str], add_eos: bool = True) -> list[list[int]]:
    """Each text as token ids: the tokenizer's `special_prefix` (BOS where the model expects one), the text,
    then EOS (`add_eos`)."""
    eos = tokenizer.eos_token_id
    prefix = special_prefix(tokenizer)
    out = []
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        if not ids:
            continue
        ids = prefix + ids
        if add_eos and eos is not None:
            ids = ids + [eos]
        out.append(ids)
    return out


# ---- packing ------------------------------------------------------------------------------------

def pack_rows(docs: list[list[int]], seq_len: int, prefix: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate documents and cut rows of `seq_len`; the incomplete tail is dropped.

    Returns input_ids `[N, seq_len]` and position_ids `[N, seq_len]`: positions count from the last
    document start or row start, whichever is later (a row is independent of its neighbours). `prefix` (the
    tokenizer's `special_prefix`, which `tokenize_docs` puts before every document): a row that starts inside a
    document starts with it too, so every sequence the model sees begins as the model expects."""
    if seq_len < 2 + len(prefix):
        raise UserError(f"seq_len must be >= {2 + len(prefix)}, got {seq_len}")
    ids = torch.tensor([t for d in docs for t in d], dtype=torch.long)
    starts = torch.zeros(ids.numel(), dtype=torch.bool)
    offsets = torch.tensor([0] + [len(d) for d in docs[:-1]], dtype=torch.long).cumsum(0)
    starts[offsets[offsets < ids.numel()]] = True
    if prefix:
        return _pack_rows_prefixed(ids, starts, seq_len, torch.tensor(list(prefix), dtype=torch.long))
    n = ids.numel() // seq_len
    if n == 0:
        raise UserError(f"only {ids.numel()} tokens of data: not one row of seq_len={seq_len}; "
                        "add data or lower data.seq_len")
    ids = ids[: n * seq_len].view(n, seq_len)
    starts = starts[: n * seq_len].view(n, seq_len).clone()
    starts[:, 0] = True
    return ids, positions_from_starts(starts)


def _pack_rows_prefixed(ids: torch.Tensor, starts: torch.Tensor, seq_len: int, prefix: torch.Tensor):
    """`pack_rows` where a row cut inside a document begins with `prefix` (then seq_len - len(prefix) tokens of
    the stream); a row at a document start already begins with it."""
    rows, flags = [], []
    i, n, p = 0, ids.numel(), prefix.numel()
    while i < n:
        take = seq_len if starts[i] else seq_len - p
        if i + take > n:
            break
        row, st = ids[i:i + take], starts[i:i + take].clone()
        if take < seq_len:
            row = torch.cat([prefix, row])
            st = torch.cat([torch.ones(1, dtype=torch.bool), torch.zeros(p - 1, dtype=torch.bool), st])
        st[0] = True
        rows.append(row)
        flags.append(st)
        i += take
    if not rows:
        raise UserError(f"only {n} tokens of data: not one row of seq_len={seq_len}; add data or lower data.seq_len")
    starts = torch.stack(flags)
    return torch.stack(rows), positions_from_starts(starts)


def positions_from_starts(starts: torch.Tensor) -> torch.Tensor:
    """`[N, L]` bool document-start flags -> position ids counting from the latest start."""
    idx = torch.arange(starts.shape[1]).expand_as(starts)
    last = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=1).values
    return idx - last


def flatten_rows(input_ids: torch.Tensor, position_ids: torch.Tensor) -> dict:
    """`[R, L]` rows -> one packed row `[1, R*L]` (positions already restart at every row)."""
    return {"input_ids": input_ids.reshape(1, -1), "position_ids": position_ids.reshape(1, -1)}


def pad_docs(docs: list[list[int]], pad_id: int = 0) -> dict:
    """The unpacked equivalent of a packed batch: one right-padded row per document with an
    attention mask (used by tests and by evaluation)."""
    T = max(len(d) for d in docs)
    ids = torch.full((len(docs), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(docs), T, dtype=torch.long)
    for i, d in enumerate(docs):
        ids[i, : len(d)] = torch.tensor(d)
        mask[i, : len(d)] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": pos}


def pack_docs_exact(docs: list[list[int]]) -> dict:
    """Documents packed without cutting: one row `[1, sum(len)]`, positions restarting per document."""
    ids = torch.tensor([t for d in docs for t in d], dtype=torch.long).unsqueeze(0)
    pos = torch.cat([torch.arange(len(d)) for d in docs]).unsqueeze(0)
    return {"input_ids": ids, "position_ids": pos}


# ---- the step -> batch map ----------------------------------------------------------------------

def parse_schedule(seq_len: int, schedule: list) -> list[tuple[int, int]]:
    """[[step, seq_len], ...] sorted, starting at step 0."""
    if not schedule:
        return [(0, int(seq_len))]
    try:
        phases = sorted((int(s), int(n)) for s, n in schedule)
    except (TypeError, ValueError):
        raise UserError(f"seq_len_schedule must be [[step, seq_len], ...], got {schedule!r}") from None
    if phases[0][0] != 0:
        phases.insert(0, (0, int(seq_len)))
    return phases


@dataclass
class PackedData:
    """Serves micro-batches as a pure function of (optimizer step, micro index): resumable by step."""

    docs: list[list[int]]
    seq_len: int = 256
    schedule: list | None = None
    batch_tokens: int = 1024
    grad_accum: int = 1
    seed: int = 0
    rank: int = 0
    world: int = 1

    prefix: tuple[int, ...] = ()   # the tokenizer's special_prefix: rows cut inside a document start with it
    #: what each data.train source gave: [{"source", "docs", "tokens"}] (build_data), written to <run_dir>/data.json
    sources: list = field(default_factory=list)

    def __post_init__(self):
        self.phases = parse_schedule(self.seq_len, self.schedule or [])
        self._rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def phase_of(self, step: int) -> tuple[int, int, int]:
        """(phase index, phase start step, seq_len) of an optimizer step."""
        k = max(i for i, (s, _) in enumerate(self.phases) if s <= step)
        return k, self.phases[k][0], self.phases[k][1]

    def rows_for(self, seq_len: int):
        if seq_len not in self._rows:
            self._rows[seq_len] = pack_rows(self.docs, seq_len, self.prefix)
        return self._rows[seq_len]

    def rows_per_micro(self, seq_len: int) -> int:
        return max(1, self.batch_tokens // seq_len)

    def batch(self, step: int, micro: int) -> dict:
        """The packed micro-batch `[1, R*L]` of this process for optimizer `step`, micro-batch `micro`."""
        phase, start, L = self.phase_of(step)
        ids, pos = self.rows_for(L)
        R = self.rows_per_micro(L)
        j = (step - start) * self.grad_accum + micro
        first = (j * self.world + self.rank) * R
        picks = [self._row_index(phase, L, first + i, ids.shape[0]) for i in range(R)]
        return flatten_rows(ids[picks], pos[picks])

    def _row_index(self, phase: int, L: int, k: int, n: int) -> int:
        epoch, i = divmod(k, n)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + phase * 10_007 + epoch)
        return int(torch.randperm(n, generator=g)[i])

    def tokens_per_step(self, step: int) -> int:
        _, _, L = self.phase_of(step)
        return self.rows_per_micro(L) * L * self.grad_accum * self.world


# ---- held-out text --------------------------------------------------------------------------------

def heldout_ids(tokenizer, texts: list[str], max_tokens: int) -> torch.Tensor:
    """One token stream `[N]` of held-out text (documents joined by EOS), at most `max_tokens` long."""
    out: list[int] = []
    for d in tokenize_docs(tokenizer, texts, add_eos=True):
        out.extend(d)
        if len(out) >= max_tokens:
            break
    return torch.tensor(out[:max_tokens], dtype=torch.long)


__all__ = ["shared_data", "load_rows", "load_texts", "row_texts", "special_prefix", "tokenize_docs", "pack_rows", "flatten_rows",
           "pad_docs", "pack_docs_exact", "PackedData", "parse_schedule", "heldout_ids", "build_data",
           "build_heldout", "default_train_source"]


def default_train_source() -> str:
    """../shared/data/general_text where it exists, else the built-in `python-docs` (said on the screen)."""
    p = shared_data("general_text")
    if p is None:
        print("data.train is empty and ../shared/data/general_text is not here: training on the built-in "
              "python-docs text (set data.train=<file, folder or hub dataset> for your own)")
        return "python-docs"
    return str(p)


def build_data(args, tokenizer, seed: int, grad_accum: int = 1) -> PackedData:
    """PackedData from a DataArgs section, with the tokens each source gave (`PackedData.sources`: a mix's
    shares are in tokens, not files or rows)."""
    train = args.train or default_train_source()
    names = list(train) if isinstance(train, (list, tuple)) and train else [train]
    per = [load_texts(n, args.text_field, args.text_template, args.split, args.max_docs, args.txt_document)
           for n in names]
    texts = add_recall_drills([t for p in per for t in p], args.recall_drills, args.recall_reach, seed)
    docs = tokenize_docs(tokenizer, texts, args.add_eos)
    sources, i = [], 0
    for n, p in zip(names, per):   # drills change documents in place, so each source keeps its range
        sources.append({"source": str(n), "docs": len(p), "tokens": sum(map(len, docs[i:i + len(p)]))})
        i += len(p)
    return PackedData(docs, seq_len=args.seq_len, schedule=args.seq_len_schedule, batch_tokens=args.batch_tokens,
                      grad_accum=grad_accum, seed=seed, prefix=tuple(special_prefix(tokenizer)), sources=sources)


def sources_line(sources: list[dict]) -> str:
    """One line: the mix's tokens and each source's share, e.g. `data: 1,234 tokens; a.jsonl 60.0%, python-docs
    40.0%`."""
    total = sum(s["tokens"] for s in sources)
    shares = ", ".join(f"{Path(s['source']).name or s['source']} {100 * s['tokens'] / max(total, 1):.1f}%"
                       for s in sources)
    return f"data: {total:,} tokens; {shares}"


def build_heldout(args, tokenizer) -> torch.Tensor | None:
    if not args.eval:
        return None
    return heldout_ids(tokenizer, load_texts(args.eval, args.text_field, args.text_template, args.split),
                       args.eval_tokens)
