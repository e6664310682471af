"""Weights derived from parameters for decode steps (stacked projections), cached and refreshed in place.

SSE's fused projections (`mixers/sse.py`, `SSE._fused_weights`) and the gated MLPs' stacked gate/up
(`stacked.py`) both keep a concatenation of parameters beside the model. `derived_weights` is their one cache:

- keyed on the parameters' `data_ptr` and `_version`, so an in-place update (an optimizer step between GRPO
  rollouts, `load_state_dict`) or a swapped parameter rebuilds it;
- `build(old)` gets the previous tensors, to write into the same buffers when the shapes allow: a captured CUDA
  graph keeps reading the current weights after a refresh;
- built as normal tensors even inside `torch.inference_mode` (an evaluation's prefill), since a later refresh
  outside it writes in place, which an inference tensor refuses;
- inside a compiled region the storage check cannot be traced: the cache is returned as it is, and the decode loop
  refreshes it before a compiled step runs.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn


def derived_weights(owner: nn.Module, name: str, params: Sequence[torch.Tensor],
                    build: Callable[[tuple | None], tuple]) -> tuple:
    """The tuple `build(old)` made from `params`, cached on `owner.__dict__[name]` as `(key, *tensors)`; `old`: the
    previous tuple, or None on the first build."""
    cache = owner.__dict__.get(name)
    if cache is not None and torch.compiler.is_compiling():
        return cache[1:]
    key = tuple((p.data_ptr(), p._version) for p in params)
    if cache is not None and cache[0] == key:
        return cache[1:]
    with torch.inference_mode(False), torch.no_grad():
        out = tuple(build(None if cache is None else cache[1:]))
    owner.__dict__[name] = (key, *out)
    return out
