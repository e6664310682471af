"""Gated MLPs in a decode step: gate and up as one GEMM over their stacked weights.

A decode step multiplies a few rows by every weight, and at small shapes a GEMM launch costs more than its
bytes (one H200: a 4-25 MB weight takes 5-11 us whichever kernel runs it, benchmarks/RESULTS.md, "Decode: the
window layer's token"). The gated MLP of Llama-layout decoders, `down(act(gate(x)) * up(x))`, reads gate and up
from the same x, so during a decode step they run as one GEMM over `[W_gate; W_up]` `[2 I, hidden]`: one launch
fewer per layer, for a teacher and its hybrid alike (the MLPs are the teacher's in both).

- `stacked_weight(owner, linears)`: the linears' weights (and biases) concatenated along the output rows,
  cached on `owner` by `derived.derived_weights` (refreshed in place after an in-place update, as an optimizer step
  between GRPO rollouts makes, so a captured CUDA graph keeps reading the current weights). Parameters and
  checkpoints are unchanged.
- `mlps_stacked(model, mode)`: within the block every gated MLP of `model` (a class in `GATED_MLPS`, its three
  projections plain `nn.Linear`s without hooks: a PEFT-wrapped MLP keeps its own forward) runs the stacked
  GEMM through `decode_linear` for inputs of at most 16 rows on CUDA (or anywhere with mode "triton", to test
  the wiring on CPU); prefill calls and CPU calls run the MLP's own forward, so the CPU's exact path keeps HF's
  bits. `refresh(model)` brings every cache up to date (the decode loop calls it before replaying a graph).

Measured on one H100 (`python3 -m benchmarks.generation.compile_auto --new-tokens 64 --calls 2 --modes off,on
[--stack-mlp off]`; benchmarks/RESULTS.md, "The speed table"): the compiled step at the Qwen3-1.7B shape, 16k x 8,
unchanged for the teacher and 2% shorter for the 5:1 SSE hybrid; at the SmolLM2-135M shape, 2k x 1, 3% and 8% shorter.
Cost: the cache holds gate and up once more (the Qwen3-1.7B shape: 1.41 GB in bf16); `FastGenConfig.stack_mlp=False`
keeps the two GEMMs.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Sequence

import torch
from torch import nn

from hybridize.ops.decode_gemm.derived import derived_weights
from hybridize.ops.decode_gemm.route import decode_linear, kept_forward

#: transformers classes whose forward is `down_proj(act_fn(gate_proj(x)) * up_proj(x))` (checked against each
#: class's own forward in tests/ops/decode_gemm/test_stacked.py)
GATED_MLPS = frozenset({
    "LlamaMLP", "MistralMLP", "MinistralMLP", "Qwen2MLP", "Qwen3MLP", "Qwen3MoeMLP", "GemmaMLP", "Gemma2MLP",
    "Gemma3MLP", "Olmo2MLP", "Olmo3MLP", "SmolLM3MLP", "GraniteMLP", "HeliumMLP", "CohereMLP", "Exaone4MLP",
})
#: at most this many rows run stacked (the decode GEMM's limit); more rows (a prefill) keep the MLP's forward
MAX_ROWS = 16
_CACHE = "_stacked_decode_weight"


def stacked_weight(owner: nn.Module, linears: Sequence[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(W `[sum N_i, K]`, b `[sum N_i]` or None): the linears' weights stacked along the rows, cached on `owner` and
    refreshed in place (`derived.derived_weights`)."""
    params = [p for m in linears for p in (m.weight, m.bias) if p is not None]

    def build(old):
        w = linears[0].weight
        shape = (sum(m.out_features for m in linears), w.shape[1])
        old_w, old_b = old if old is not None else (None, None)
        fits = old_w is not None and old_w.shape == shape and old_w.dtype == w.dtype and old_w.device == w.device
        W = old_w if fits else w.new_empty(shape)
        torch.cat([m.weight for m in linears], out=W)
        b = None
        if any(m.bias is not None for m in linears):
            b = old_b if fits and old_b is not None else w.new_empty(shape[0])
            torch.cat([m.bias if m.bias is not None else w.new_zeros(m.out_features) for m in linears], out=b)
        return W, b
    return derived_weights(owner, _CACHE, params, build)


def _plain(mod: nn.Module) -> bool:
    return not (mod._forward_hooks or mod._forward_pre_hooks or "forward" in mod.__dict__)


def stackable(mlp: nn.Module) -> bool:
    """A gated MLP whose gate/up/down are plain `nn.Linear`s of one dtype, with no hooks or forward of its own."""
    if type(mlp).__name__ not in GATED_MLPS or not _plain(mlp):
        return False
    projs = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if any(type(p) is not nn.Linear or not _plain(p) for p in projs[:2]) or not isinstance(projs[2], nn.Module):
        return False
    return projs[0].weight.dtype == projs[1].weight.dtype and projs[0].in_features == projs[1].in_features


def _runs_stacked(x: torch.Tensor, mode: str) -> bool:
    return x.numel() // max(x.shape[-1], 1) <= MAX_ROWS and (x.is_cuda or mode == "triton")


def _stacked_forward(mlp: nn.Module, mode: str):
    """The MLP's forward within `mlps_stacked`, made once per (module, mode) and kept on it (`route.kept_forward`):
    the same function object at every call, so a compiled decode step that traced it is not recompiled."""
    def make():
        own = type(mlp).forward
        split = mlp.gate_proj.out_features

        def forward(x):
            if not _runs_stacked(x, mode):
                return own(mlp, x)
            W, b = stacked_weight(mlp, (mlp.gate_proj, mlp.up_proj))
            gate, up = decode_linear(x, W, b, mode).split([split, W.shape[0] - split], dim=-1)
            return mlp.down_proj(mlp.act_fn(gate) * up)
        forward.stacked_mode = mode   # tells `refresh` the forward is ours and where it will run stacked
        return forward
    return kept_forward(mlp, "_stacked_forwards", mode, make)


@contextmanager
def mlps_stacked(model: nn.Module, mode: str = "auto", on: bool = True):
    """Within the block every stackable MLP of `model` runs gate and up as one GEMM on decode rows (see the
    module docstring); restored after. Yields how many MLPs it changed; `on=False` changes nothing. Mode is
    `decode_linear`'s ("torch": the stacked GEMM through `F.linear`)."""
    changed = []
    if on:
        for mod in model.modules():
            if stackable(mod):
                mod.forward = _stacked_forward(mod, mode)
                changed.append(mod)
    try:
        yield len(changed)
    finally:
        for mod in changed:
            mod.__dict__.pop("forward", None)


def refresh(model: nn.Module) -> None:
    """Within `mlps_stacked`: build or bring up to date the stacked weight of every MLP that will run stacked (on
    CUDA, or under mode "triton"), in place where it can. A compiled step reads the cache without checking it."""
    for mod in model.modules():
        mode = getattr(mod.__dict__.get("forward"), "stacked_mode", None)
        if mode is not None and (mode == "triton" or mod.gate_proj.weight.is_cuda):
            stacked_weight(mod, (mod.gate_proj, mod.up_proj))
