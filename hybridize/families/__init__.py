"""The teacher families hybridize converts: one declarative table (`table.py`) and what reads it.

Why a package beside `modeling.py` and not under `convert/`: the table is needed wherever a hybrid is
*built or run*, not only when one is converted - `HybridConfig` validates its teacher family and derives
the mixers' teacher fields from it, and `HybridForCausalLM` applies the family's LM-head transform
(Granite's logits_scaling, Gemma's final soft-capping) on every forward, also in processes that load a
checkpoint through `trust_remote_code` and never import `hybridize.convert`. `convert` (weight mapping),
`convert.sources` (family check, `--src <family name>`) and `convert.report` (features kept / dropped)
read the same table, so adding a family is adding one `Family` entry to `table.py`.

    family_of(config) -> Family         # the entry, or UnsupportedFamily naming what is missing
    supported() -> ["llama", ...]       # model types in the table
    FAMILY_NAMES["qwen"] -> Family      # `--src` family names
"""
from __future__ import annotations

from .family import Family, Refusal, UnsupportedFamily
from .table import FAMILIES, FAMILY_NAMES
from .traits import Trait, dropped_lines, family_traits
from .diagnose import unsupported_line


def supported() -> list[str]:
    """The model types the table has entries for, in table order."""
    return list(FAMILIES)


def teacher_config(config):
    """The teacher config of `config` (a hybrid's `source_config`, else the config itself)."""
    if getattr(config, "model_type", None) == "hybridize":
        return config.source_config
    return config


def family_of(config) -> Family:
    """The table entry of a teacher (or hybrid) config; `UnsupportedFamily` with one line naming what is
    missing when the table has none, or when the entry refuses one of the config's settings."""
    config = teacher_config(config)
    family = FAMILIES.get(getattr(config, "model_type", None))
    if family is None:
        raise UnsupportedFamily(unsupported_line(config, supported()))
    family.check(config)
    return family


def known_family(config) -> Family | None:
    """The table entry of a (teacher or hybrid) config, or None - never raises (for code that also runs
    models outside the table, e.g. evaluation)."""
    return FAMILIES.get(getattr(teacher_config(config), "model_type", None))


def head_logits(model, hidden):
    """The logits `model`'s CausalLM gives for final normed hidden states `[..., H]` -> `[..., V]`: its
    `lm_head`, then the family's transform where it has one (Granite's logits_scaling, Gemma's soft-cap).
    For code that runs the head by hand on cached states (layer selection's probe)."""
    logits = model.get_output_embeddings()(hidden)
    family = known_family(model.config)
    return family.finish_logits(teacher_config(model.config), logits) if family is not None else logits


def family_default(name: str) -> Family | None:
    """The entry a `--src` family name (any case) stands for, or None."""
    return FAMILY_NAMES.get(str(name).strip().lower())


__all__ = ["FAMILIES", "FAMILY_NAMES", "Family", "Refusal", "Trait", "UnsupportedFamily", "dropped_lines",
           "family_default", "family_of", "family_traits", "head_logits", "known_family", "supported", "teacher_config"]
