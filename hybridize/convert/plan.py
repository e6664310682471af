"""Layer plans: which decoder layers keep softmax attention and which become which mixer.

A plan is a list with one entry per layer: "attn" (keep the teacher's softmax attention) or a mixer
name from `hybridize.mixers.mixer_names()`. `parse_plan` accepts these spellings (see PLAN_FORMS):

- ratio "5:1": five mixer layers, then one softmax layer, repeating (SSE-H); both parts must be
  positive ("0:5" and "5:0" are refused: write "none" or "all");
- repeating pattern "sse,swa,sse,swa,attn" (the SSE paper's 12B recipe); a single name "gla" means
  every layer;
- explicit "attn=5,11,17": the listed layers keep softmax, every other layer gets the default mixer
  (several groups separated by ";" may name mixers too: "attn=5,11;swa=3"); ranges "0-3" and negative
  indices ("-1" = last layer) are allowed;
- per layer "0-3:gla,4:attn,5-29:sse": each listed layer gets its kind, unlisted layers keep softmax;
- "all" (every layer the default mixer) and "none" (nothing converted: only for identity checks through
  the Python API; `hybridize convert` refuses it, `parse_plan(..., allow_none=False)`).

A plan that converts no layer is refused unless it is spelled "none" (a spelling such as "0:5" that selects
no layer is more likely a mistake than a wish).

A fifth way (a measured choice: keep softmax where replacement hurts most) needs
a model and data: `hybridize select` (`hybridize.convert.select`) measures it and writes the explicit
spelling ("attn=3,9,15,21,27") to a plan.txt, which `hybridize convert --layers` also takes as a path.
"""
from __future__ import annotations

import re

from hybridize import mixers

ATTN = "attn"
# other spellings users type for "keep the softmax layer"
_ATTN_ALIASES = {"attn", "attention", "softmax", "full", "full_attention"}

PLAN_FORMS = ("'5:1' (ratio mixer:softmax, repeating), 'sse,swa,attn' (repeating pattern), "
              "'attn=5,11,17' (these layers softmax, the rest --mixer), "
              "'0-3:gla,4:attn,5-29:sse' (per layer; unlisted layers stay softmax), 'all' (every layer --mixer)")


def _known_kinds() -> list[str]:
    return [ATTN, *mixers.mixer_names()]


def _kind(name: str, spec: str) -> str:
    name = name.strip().lower()
    if name in _ATTN_ALIASES:
        return ATTN
    if name not in _known_kinds():
        raise _bad(spec, f"unknown layer kind {name!r} (known: {', '.join(_known_kinds())})")
    return name


def _bad(spec: str, why: str) -> ValueError:
    return ValueError(f"bad layer plan {spec!r}: {why}. Accepted forms: {PLAN_FORMS}")


def _indices(text: str, num_layers: int, spec: str) -> list[int]:
    """'5,11,17' / '0-3,7' / '-1' -> sorted layer indices, each checked against num_layers."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        m = re.fullmatch(r"(-?\d+)(?:-(\d+))?", part)
        if not m:
            raise _bad(spec, f"{part!r} is not a layer index or range like 0-3")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if lo < 0 and m.group(2) is None:
            lo = hi = num_layers + lo
        if lo > hi:
            raise _bad(spec, f"empty range {part!r}")
        if lo < 0 or hi >= num_layers:
            raise _bad(spec, f"layer {part!r} is out of range for a model with {num_layers} layers")
        out.extend(range(lo, hi + 1))
    return out


def _ratio(spec: str, n_mix: int, n_attn: int, num_layers: int, mixer: str) -> list[str]:
    if n_mix == 0:
        raise _bad(spec, "a ratio mixer:softmax with 0 mixer layers converts nothing; both parts must be positive")
    if n_attn == 0:
        raise _bad(spec, "both parts of a ratio mixer:softmax must be positive; write 'all' to convert every layer")
    period = [mixer] * n_mix + [ATTN] * n_attn
    return [period[i % len(period)] for i in range(num_layers)]


def _explicit(spec: str, num_layers: int, mixer: str) -> list[str]:
    plan = [mixer] * num_layers
    seen: set[int] = set()
    for group in re.split(r"[;\s]+", spec.strip()):
        if not group:
            continue
        if "=" not in group:
            raise _bad(spec, f"group {group!r} lacks '=' (write kind=indices, e.g. attn=5,11)")
        name, idx = group.split("=", 1)
        _assign(plan, seen, _indices(idx, num_layers, spec), _kind(name, spec), spec)
    return plan


def _assign(plan: list[str], seen: set[int], indices, kind: str, spec: str) -> None:
    """Set `plan[i] = kind` for each index, refusing a layer named twice in one spec."""
    for i in indices:
        if i in seen:
            raise _bad(spec, f"layer {i} is listed twice")
        seen.add(i)
        plan[i] = kind


def _per_layer(spec: str, num_layers: int) -> list[str]:
    plan = [ATTN] * num_layers
    seen: set[int] = set()
    for entry in spec.split(","):
        entry = entry.strip()
        if ":" not in entry:
            raise _bad(spec, f"entry {entry!r} lacks ':' (write layers:kind, e.g. 0-3:gla)")
        idx, name = entry.rsplit(":", 1)
        _assign(plan, seen, _indices(idx, num_layers, spec), _kind(name, spec), spec)
    return plan


def parse_plan(spec: str, num_layers: int, default_mixer: str = "sse", allow_none: bool = True) -> list[str]:
    """Turn a plan spelling into one kind per layer ("attn" or a mixer name).

    Raises a one-line ValueError naming the accepted forms when `spec` is malformed or converts no layer
    (the spelling "none" excepted, unless `allow_none` is False: the CLI's case)."""
    plan = _parse(spec, num_layers, default_mixer)
    explicit_none = (spec or "").strip().lower() == "none"
    if all(k == ATTN for k in plan) and not (explicit_none and allow_none):
        raise _bad(spec, f"it converts none of the {num_layers} layers (every layer stays softmax); name at "
                         "least one mixer layer")
    return plan


def _parse(spec: str, num_layers: int, default_mixer: str) -> list[str]:
    """`parse_plan` without the converts-something check."""
    if num_layers <= 0:
        raise ValueError(f"num_layers must be positive, got {num_layers}")
    mixer = default_mixer.strip().lower()
    if mixer in _ATTN_ALIASES or mixer not in _known_kinds():
        raise ValueError(f"unknown mixer {default_mixer!r}; choose one of: {', '.join(_known_kinds()[1:])}")
    s = (spec or "").strip()
    low = s.lower()
    if not s:
        raise _bad(spec, "it is empty")
    if low == "none":
        return [ATTN] * num_layers
    if low == "all":
        return [mixer] * num_layers
    if m := re.fullmatch(r"(\d+)\s*:\s*(\d+)", s):
        return _ratio(spec, int(m.group(1)), int(m.group(2)), num_layers, mixer)
    if "=" in s:
        return _explicit(s, num_layers, mixer)
    if ":" in s:
        return _per_layer(s, num_layers)
    names = [p for p in s.split(",")]
    if any(not p.strip() for p in names):
        raise _bad(spec, "it has an empty entry between commas")
    pattern = [_kind(p, spec) for p in names]
    return [pattern[i % len(pattern)] for i in range(num_layers)]


def plan_runs(plan: list[str]) -> list[tuple[int, int, str]]:
    """Collapse a plan into runs `(first, last, kind)` of equal consecutive kinds."""
    runs: list[tuple[int, int, str]] = []
    for i, kind in enumerate(plan):
        if runs and runs[-1][2] == kind and runs[-1][1] == i - 1:
            runs[-1] = (runs[-1][0], i, kind)
        else:
            runs.append((i, i, kind))
    return runs


def plan_table(plan: list[str], title: str | None = None):
    """A rich Table of the plan, one row per run of equal layers, plus a summary caption."""
    from rich.table import Table

    n_conv = sum(k != ATTN for k in plan)
    title = title or "layer plan"
    caption = f"{n_conv} of {len(plan)} layers converted, {len(plan) - n_conv} softmax"
    # wide enough that title and caption do not wrap
    table = Table(title=title, caption=caption, min_width=min(max(len(title), len(caption)) + 4, 100))
    table.add_column("layers", justify="right")
    table.add_column("kind")
    for lo, hi, kind in plan_runs(plan):
        table.add_row(str(lo) if lo == hi else f"{lo}-{hi}", "softmax (kept)" if kind == ATTN else kind)
    return table


def plan_summary(plan: list[str]) -> str:
    """'0-4:sse,5:attn,...' - the per-layer spelling that `parse_plan` reads back to the same plan."""
    return ",".join(f"{lo}:{k}" if lo == hi else f"{lo}-{hi}:{k}" for lo, hi, k in plan_runs(plan))
