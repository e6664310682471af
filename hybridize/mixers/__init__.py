"""Linear-attention mixers that replace softmax attention layers.

`MIXERS` maps a mixer name (as used in layer plans and `--mixer`) to its class; `build_mixer` makes
one from a name and a settings dict. Each mixer file holds the module, its state, its recurrent and
chunked forms (through `hybridize.ops`) and its initialisation rule.
"""
from __future__ import annotations

import importlib

from .base import Mixer, MixerConfig, MixerOutput, MixerState

# name -> "module:Class"; imported lazily so one broken mixer never breaks the others' import
_REGISTRY = {
    "linear_attn": "linear_attn:LinearAttention",
    "gla": "gla:GLA",
    "deltanet": "deltanet:DeltaNet",
    "gdn": "deltanet:GatedDeltaNet",
    "sse": "sse:SSE",
    "sse_gdn": "sse:SSEGDN",
    "ccq_gla": "ccq:CCQGLA",
    "ccq_gdn": "ccq:CCQGDN",
    "qdelta": "qdelta:QDelta",
    "log_linear": "log_linear:LogLinearAttention",
    "swa": "swa:SlidingWindowAttention",
}


def mixer_names() -> list[str]:
    return list(_REGISTRY)


def mixer_class(name: str) -> type[Mixer]:
    if name not in _REGISTRY:
        raise ValueError(f"unknown mixer {name!r}; choose one of: {', '.join(_REGISTRY)}")
    module, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def build_mixer(name: str, settings: dict | None = None, **common) -> Mixer:
    """`build_mixer("sse", {"num_partitions": 4}, hidden_size=576, num_heads=9, ...)`."""
    cls = mixer_class(name)
    return cls(cls.config_class.from_dict({**common, **(settings or {})}))


__all__ = ["Mixer", "MixerConfig", "MixerOutput", "MixerState", "build_mixer", "mixer_class", "mixer_names"]
