"""Which teacher a converted checkpoint came from: the resolved source and a fingerprint of its weight files.

Why: a student converted with a relative `--src` recorded that relative path; distilled from
another folder holding a different model of that name, it learned from the wrong teacher, silently. So
`hybridize convert` records an absolute path (a hub id or "default" stays a name) and a fingerprint of
the teacher's weight files, and distillation checks the fingerprint before it loads a teacher from that
record (`check_recorded_teacher`).

The fingerprint hashes the weight files, not loaded tensors, so it does not depend on the dtype a stage
loads the teacher in and costs no model load: each file's name and size, and 16 chunks of 64 KiB spread
evenly over it (safetensors headers, with every tensor name and shape, sit in the first chunk). A hub
teacher is fingerprinted from its local snapshot in the Hugging Face cache (never the network); without
one, nothing is recorded and nothing is checked.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from hybridize.convert.sources import resolve_source
from hybridize.errors import UserError

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
CHUNKS = 16
CHUNK_BYTES = 64 * 1024


def recorded_source(src: str) -> str:
    """The teacher name to record: an absolute path for a folder or .gguf file, the name itself for
    'default', an alias or a hub id (so the record means the same thing from any working directory)."""
    kind, target = resolve_source(src)
    if kind in ("local", "gguf"):
        return str(Path(target).expanduser().resolve())
    return str(src).strip()


def weight_files(src: str) -> list[Path]:
    """The files holding the weights of `src` ([] for a hub model with no local snapshot)."""
    kind, target = resolve_source(src)
    if kind in ("default", "gguf"):
        return [Path(target)]
    folder = Path(target) if kind == "local" else _hub_snapshot(target)
    if folder is None:
        return []
    return sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))


def _hub_snapshot(hub_id: str) -> Path | None:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(hub_id, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached (or no huggingface_hub): nothing to fingerprint
        return None


def _hash_file(h, path: Path) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}\0{size}\0".encode())
    step = max(0, size - CHUNK_BYTES) // max(1, CHUNKS - 1)
    with open(path, "rb") as f:
        for i in range(CHUNKS):
            f.seek(min(i * step, max(0, size - CHUNK_BYTES)))
            h.update(f.read(CHUNK_BYTES))


def fingerprint(src: str) -> str | None:
    """`sha256:<hex>` of the weight files of `src` (see the module docstring), or None when it has none."""
    files = weight_files(src)
    if not files:
        return None
    h = hashlib.sha256()
    for p in files:
        _hash_file(h, p)
    return "sha256:" + h.hexdigest()


def check_recorded_teacher(src: str, expected: str | None, student: str = "the student") -> None:
    """Stop with one line when the teacher recorded by a converted checkpoint no longer resolves, or when
    its weights differ from those it was converted from (`expected`: the recorded fingerprint)."""
    try:
        got = fingerprint(src)
    except UserError as e:
        raise UserError(f"{student} records teacher {src!r}, which does not resolve here ({e}); "
                        "pass teacher=<source> explicitly") from None
    if expected and got and got != expected:
        raise UserError(f"teacher {src!r} recorded by {student} holds different weights than the model it was "
                        f"converted from (fingerprint {got[:19]}... != recorded {expected[:19]}...); "
                        "pass teacher=<the original teacher> explicitly")
