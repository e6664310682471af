"""Checks of user mixer settings (`--mixer-settings`) against each mixer's config dataclass, run before the
teacher loads, so a typo costs one line and no minutes of loading.

Why: settings arrive as JSON or `key=value` text; a value of the wrong type used to pass straight into the
dataclass (`use_rope: "false"` is a truthy string: RoPE silently on), and a zero size or count failed deep
inside a forward pass (ZeroDivisionError for `chunk_size=0`). Here every value must have its field's type
(a JSON bool for bool, an integer for int, a number for float, a string for str; `null` where the field
allows None), every integer must be positive (sizes and counts), every float finite, and the mixer must
build from the full settings (its own range checks, e.g. `top_k <= num_partitions`), on the meta device so
nothing is allocated.
"""
from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from typing import Any

import torch

from hybridize import mixers
from hybridize.errors import UserError
from hybridize.modeling import ATTN, resolve_mixer_settings

#: integer settings where 0 means something (the rest are sizes or counts and must be >= 1)
ZERO_OK = frozenset({"varlen_min_len", "sinks"})

_TYPE_WORDS = {bool: "a JSON bool (true or false)", int: "an integer", float: "a number", str: "a string",
               dict: "a JSON object", list: "a JSON list", type(None): "null"}


def field_types(config_class) -> dict[str, tuple[type, ...]]:
    """{field name: the accepted Python types} of a mixer config dataclass (`float | None` -> (float, NoneType))."""
    hints = typing.get_type_hints(config_class)
    out = {}
    for f in dataclasses.fields(config_class):
        tp = hints.get(f.name, object)
        args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
        out[f.name] = tuple(typing.get_origin(a) or a for a in args)
    return out


def _describe(value) -> str:
    if isinstance(value, str):
        return f"the string {json.dumps(value)}"
    return f"{json.dumps(value) if _jsonable(value) else repr(value)} ({type(value).__name__})"


def _jsonable(value) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def _matches(value, accepted: tuple[type, ...]) -> bool:
    for tp in accepted:
        if tp is bool and isinstance(value, bool):
            return True
        if tp is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if tp not in (bool, int, float) and isinstance(tp, type) and isinstance(value, tp):
            return True
    return object in accepted


def check_value(kind: str, key: str, value, accepted: tuple[type, ...]) -> None:
    """One setting: its type against `accepted`, then its range (positive integers, finite floats)."""
    where = f"mixer setting {kind}.{key}"
    if not _matches(value, accepted):
        want = " or ".join(_TYPE_WORDS.get(t, getattr(t, "__name__", str(t))) for t in accepted)
        raise UserError(f"{where} must be {want}, got {_describe(value)}")
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, int) and int in accepted and value < (0 if key in ZERO_OK else 1):
        least = 0 if key in ZERO_OK else 1
        raise UserError(f"{where} is a size or count and must be an integer >= {least}, got {value}")
    if isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"{where} must be a finite number, got {value}")


def split_settings(settings: dict[str, Any] | None, plan: list[str]) -> dict[str, dict]:
    """User settings -> {mixer kind: settings}.

    Accepts {kind: {...}} (per mixer), {"kind.key": v} (qualified) and {key: v} (applied to every
    mixer kind in the plan whose config has that field; an error if none has it)."""
    kinds = [k for k in dict.fromkeys(plan) if k != ATTN]
    out: dict[str, dict] = {k: {} for k in kinds}
    for key, value in (settings or {}).items():
        if key in mixers.mixer_names() and isinstance(value, dict):
            if key not in out:
                raise ValueError(f"settings for mixer {key!r}, which the plan does not use (plan uses {kinds})")
            out[key].update(value)
            continue
        if "." in key:
            kind, field = key.split(".", 1)
            if kind not in out:
                raise ValueError(f"setting {key!r} names mixer {kind!r}, which the plan does not use (plan uses {kinds})")
            out[kind][field] = value
            continue
        takers = [k for k in kinds if key in {f.name for f in dataclasses.fields(mixers.mixer_class(k).config_class)}]
        if not takers:
            raise ValueError(f"no mixer in the plan ({', '.join(kinds) or 'none'}) has a setting {key!r}")
        for k in takers:
            out[k][key] = value
    return out


def check_settings(per_kind: dict[str, dict]) -> None:
    """Type- and range-check `{mixer kind: {key: value}}` (the output of `split_settings`).

    Raises a one-line UserError naming the key, the expected type and the value; unknown keys are named
    with the list of known ones."""
    for kind, settings in per_kind.items():
        types_ = field_types(mixers.mixer_class(kind).config_class)
        for key, value in settings.items():
            if key not in types_:
                raise UserError(f"mixer {kind!r} has no setting {key!r}; known: {', '.join(sorted(types_))}")
            check_value(kind, key, value, types_[key])


def check_user_settings(config, plan: list[str], settings: dict | None) -> None:
    """Type-, range- and build-check user `settings` (as `split_settings` takes them) for `plan` on a
    teacher `config`: needs no weights, so every command that converts (convert, demo) runs it before the
    teacher loads."""
    per_kind = split_settings(settings, plan)
    check_settings(per_kind)
    check_buildable(resolve_mixer_settings(config, plan, per_kind))


def check_mixer_settings(kind: str, settings: dict | None, **common) -> None:
    """The same checks for a mixer built without a teacher (`eval mqar`: `build_mixer(kind, settings,
    **common)`)."""
    check_settings({kind: dict(settings or {})})
    check_buildable({kind: {**common, **(settings or {})}})


def check_buildable(resolved: dict[str, dict]) -> None:
    """Build one mixer of each kind from its full settings on the meta device (no memory, no teacher), so
    the mixer's own checks (e.g. `top_k <= num_partitions`) fail before the teacher loads."""
    for kind, settings in resolved.items():
        cls = mixers.mixer_class(kind)
        try:
            with torch.device("meta"):
                cls(cls.config_class.from_dict(settings))
        except (ValueError, TypeError, ZeroDivisionError, AssertionError) as e:
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"mixer {kind!r} rejects its settings: {why}") from None
        except Exception:  # noqa: BLE001 - an op the meta device lacks: the real build will tell
            pass
