"""Conversion of a pretrained decoder into a hybrid: sources (where the teacher comes from), plans
(which layers become which mixer), the converter, the conversion report, and the `convert` CLI.

Imports are lazy so `hybridize --help` stays fast."""
from __future__ import annotations

_EXPORTS = {
    "load_model": "hybridize.convert.sources",
    "parse_plan": "hybridize.convert.plan",
    "plan_table": "hybridize.convert.plan",
    "convert_model": "hybridize.convert.convert",
    "conversion_report": "hybridize.convert.report",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = list(_EXPORTS)
