"""`hybridize convert --layers FILE`: a plan written by `hybridize select` (OUT/plan.txt, OUT/select.json, or
the folder OUT itself).

The file's plan is used only for the model it was measured on: select.json records the teacher's layer
count and weight fingerprint (`hybridize.convert.fingerprint`), and a plan.txt is checked against the
select.json beside it (a lone plan.txt is only checked by `parse_plan`'s index range). A mismatch is one line.
"""
from __future__ import annotations

import json
from pathlib import Path

from hybridize.errors import UserError, read_text

SUFFIXES = (".txt", ".json")


def is_plan_file(layers: str) -> bool:
    """A path ending in .txt or .json, or a folder holding a plan.txt (no plan spelling is either)."""
    p = Path(layers.strip()).expanduser()
    return p.suffix.lower() in SUFFIXES or (p / "plan.txt").is_file()


def plan_from_file(layers: str, num_layers: int, fingerprint: str | None, src: str) -> str:
    """The plan spelling in FILE (`layers`), after checking it was measured on this teacher."""
    path = Path(layers.strip()).expanduser()
    if path.is_dir():  # the --out folder of `hybridize select`
        path = path / "plan.txt"
    if not path.is_file():
        raise UserError(f"--layers {layers}: no such plan file (write a plan like attn=5,11,17 or the path of a "
                        "`hybridize select` plan.txt / select.json)")
    meta = _record(path)
    if meta is not None:
        _check_teacher(path, meta, num_layers, fingerprint, src)
    spec = meta.get("plan") if path.suffix.lower() == ".json" else read_text(path).strip()
    if not spec:
        raise UserError(f"--layers {layers}: the file holds no plan (did `hybridize select` finish? rerun it)")
    return spec


def _record(path: Path) -> dict | None:
    """select.json itself, or the one beside a plan.txt (None when there is none)."""
    rec = path if path.suffix.lower() == ".json" else path.with_name("select.json")
    if not rec.is_file():
        return None
    try:
        data = json.loads(read_text(rec))
    except json.JSONDecodeError as e:
        raise UserError(f"{rec}: not valid JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(data, dict) or "teacher" not in data:
        raise UserError(f"{rec} is not a `hybridize select` record (no 'teacher')")
    return data


def _check_teacher(path: Path, meta: dict, num_layers: int, fingerprint: str | None, src: str) -> None:
    t = meta["teacher"]
    if t.get("num_layers") != num_layers:
        raise UserError(f"--layers {path}: measured on {t.get('src')!r} with {t.get('num_layers')} layers, but {src!r} "
                        f"has {num_layers}; run `hybridize select --src {src}` for this model")
    want = t.get("fingerprint")
    if want and fingerprint and want != fingerprint:
        raise UserError(f"--layers {path}: measured on teacher {t.get('src')!r} (weights {want[:19]}...), not on "
                        f"{src!r} ({fingerprint[:19]}...); run `hybridize select --src {src}` for this model")
