"""The one exception type the CLI turns into a one-line message (no stack trace), and the readers of user
files that raise it with the file (and line) named, for causes the libraries report badly: text that is
not UTF-8, an empty file, YAML that does not parse, a JSON-lines row that does not parse.

This module imports nothing of hybridize, so every layer (ops ... distill/eval/rl) may use its readers."""
from __future__ import annotations

import codecs
import json
from pathlib import Path


class UserError(Exception):
    """Bad input from the user: the message says what is wrong and what to do."""


def first_line(err: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message, or its type name when the message is empty (an
    `str(e).splitlines()[0]` on an empty message raised IndexError inside an error handler)."""
    text = str(err).strip()
    return text.splitlines()[0][:limit] if text else type(err).__name__


def not_utf8(path: str | Path, data: bytes, err: UnicodeDecodeError, offset: int = 0) -> UserError:
    """One line naming the file, line and column of the first byte that is not UTF-8.
    `data` holds the bytes after the file's first `offset` lines; `err.start` indexes `data`."""
    line = data[:err.start].count(b"\n") + 1
    col = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
    return UserError(f"{path}, line {line + offset}, column {col}: not UTF-8 text (byte 0x{data[err.start]:02x}); "
                     "save the file as UTF-8")


def check_utf8(path: str | Path, chunk: int = 1 << 20) -> None:
    """Raise `not_utf8` when the file is not valid UTF-8 (streamed, so a large file costs no memory)."""
    dec = codecs.getincrementaldecoder("utf-8")()
    lines_before = 0
    with open(path, "rb") as f:
        while True:
            data = f.read(chunk)
            try:
                dec.decode(data, final=not data)
            except UnicodeDecodeError as e:
                # e.object is the decoder's buffer: the undecoded tail of the last chunk (never a newline),
                # then this chunk; e.start indexes it
                raise not_utf8(path, e.object, e, lines_before) from None
            if not data:
                return
            lines_before += data.count(b"\n")


def read_text(path: str | Path) -> str:
    """A user's text file as str; not UTF-8 -> one line naming the file and line."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise not_utf8(path, data, e) from None


def read_jsonl(path: str | Path, partial: bool = False) -> list[dict]:
    """One dict per non-empty line of a JSON-lines file. Bytes that are not UTF-8 -> `UserError` naming the
    file, line and column.

    `partial=False` (a finished input: eval sets, RL prompts): a missing file raises FileNotFoundError and a
    line that is not JSON raises ValueError naming the file and line.
    `partial=True` (a file a run appends to and may have died while writing, read back to skip the rows
    already done): a missing file is `[]`, and a line that is not JSON (a cut-off last row) is skipped with a
    warning on the screen."""
    path = Path(path)
    if partial and not path.exists():
        return []
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
                if partial:
                    print(f"warning: {path}:{i + 1} is not valid JSON; skipped")
                    continue
                raise ValueError(f"{path}:{i + 1} is not valid JSON ({e}); expected one JSON object per line") from e
    return out


def read_yaml(path: str | Path, load=None):
    """Parse a YAML file (a recipe); bad bytes or bad YAML -> one line with the file, line and column.
    `load`: the parser (default `yaml.safe_load`; the recipes use a YAML 1.2 loader)."""
    import yaml

    text = read_text(path)
    try:
        return (load or yaml.safe_load)(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        why = getattr(e, "problem", None) or first_line(e)
        raise UserError(f"{path}{where}: not valid YAML ({why})") from None
