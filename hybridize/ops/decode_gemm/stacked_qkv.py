"""Attention's q, k and v projections in a decode step: one GEMM over their stacked weights.

A decode step multiplies a few rows by every weight, and at these sizes a GEMM launch costs about as much as its
bytes (`stacked.py` measured the same for the MLPs' gate and up). HF's attention modules project the same hidden
states three times, `q_proj(x)`, `k_proj(x)`, `v_proj(x)`. During a decode step the three run as one GEMM over
`[W_q; W_k; W_v]` `[(H + 2 Hkv) D, hidden]`: two launches fewer per softmax layer. Each of a teacher's layers gains
this, and each of its hybrid's kept softmax layers; SSE's layers already fuse their projections.

How, without rewriting HF's attention forward: within `qkv_stacked(model)` the three projections of each
stackable attention module get instance forwards sharing one `_Front`.
- `q_proj(x)` runs the stacked GEMM, returns the q columns and leaves k and v on the front, tagged with `x`.
- `k_proj(x)` and `v_proj(x)` take their part from the front when called with that same tensor. Otherwise (another
  input, another order, a part already taken) they run their own product.

So the outputs never depend on the order HF calls them in, only the number of launches does.

The stacked weight is cached on the attention module and refreshed in place after an in-place update
(`stacked.stacked_weight`); `refresh(model)` brings every cache up to date before a captured graph replays. Rows past
`MAX_ROWS` (a prefill), CPU tensors under mode "auto", and the exact path keep the three products. The cost is
q, k and v once more in memory: 470 MB in bf16 at the Qwen3-1.7B shape, 28 layers. On by default
(`FastGenConfig.stack_qkv`): on one H100 the compiled 1.7B teacher's step went from 2.11-2.14 to 1.95 ms at 2k x 1
(benchmarks/RESULTS.md, "q, k and v as one GEMM").
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from hybridize.ops.decode_gemm.route import decode_linear, kept_forward
from hybridize.ops.decode_gemm.stacked import MAX_ROWS, _plain, _runs_stacked, stacked_weight

PARTS = ("q_proj", "k_proj", "v_proj")


class _Front:
    """k and v of the stacked product, kept from `q_proj(x)` until `k_proj(x)` / `v_proj(x)` take them."""

    def __init__(self):
        self.x = self.k = self.v = None

    def take(self, part: str, x: torch.Tensor) -> torch.Tensor | None:
        """The part for input x if the stacked product left it here (then forgotten), else None."""
        if self.x is not x:
            return None
        out = getattr(self, part)
        setattr(self, part, None)
        if self.k is None and self.v is None:
            self.x = None
        return out


def stackable(attn: nn.Module) -> bool:
    """A transformers attention module (class name ending in "Attention") whose q/k/v projections are plain
    `nn.Linear`s (no hooks, no forward of their own: a PEFT-wrapped projection is not one) of one input size and
    dtype, and that has no forward of its own either."""
    cls = type(attn)
    if not cls.__name__.endswith("Attention") or not cls.__module__.startswith("transformers.") or not _plain(attn):
        return False
    projs = [getattr(attn, n, None) for n in PARTS]
    if any(type(p) is not nn.Linear or not _plain(p) for p in projs):
        return False
    return len({(p.in_features, p.weight.dtype, p.weight.device) for p in projs}) == 1


def _forwards(attn: nn.Module, mode: str) -> dict:
    """The three projections' forwards within `qkv_stacked`, made once per (module, mode) and kept on the attention
    module (`route.kept_forward`): the same function objects at every call, so a compiled step is not recompiled."""
    def make():
        front = _Front()
        q, k, v = (getattr(attn, n) for n in PARTS)
        sizes = [q.out_features, k.out_features, v.out_features]

        def q_forward(x):
            if not _runs_stacked(x, mode):
                return decode_linear(x, q.weight, q.bias, mode)
            W, b = stacked_weight(attn, (q, k, v))
            front.x = x
            out_q, front.k, front.v = decode_linear(x, W, b, mode).split(sizes, dim=-1)
            return out_q

        def part_forward(proj: nn.Linear, part: str):
            def forward(x):
                out = front.take(part, x)
                return decode_linear(x, proj.weight, proj.bias, mode) if out is None else out
            return forward

        fns = {"q_proj": q_forward, "k_proj": part_forward(k, "k"), "v_proj": part_forward(v, "v")}
        for fn in fns.values():
            fn.stacked_qkv_mode = mode   # tells `refresh` the forwards are ours and where they run stacked
        return fns
    return kept_forward(attn, "_stacked_qkv_forwards", mode, make)


@contextmanager
def qkv_stacked(model: nn.Module, mode: str = "auto", on: bool = True):
    """Within the block every stackable attention module of `model` runs q, k and v as one GEMM on decode rows
    (see the module docstring); restored after. Yields how many modules it changed; `on=False` changes nothing.
    Mode is `decode_linear`'s. Enter it before `route.linears_routed`, which leaves linears with a forward of
    their own alone (these forwards route their products themselves)."""
    changed = []
    if on:
        for mod in model.modules():
            if stackable(mod):
                for name, fn in _forwards(mod, mode).items():
                    getattr(mod, name).forward = fn
                changed.append(mod)
    try:
        yield len(changed)
    finally:
        for mod in changed:
            for name in PARTS:
                getattr(mod, name).__dict__.pop("forward", None)


def refresh(model: nn.Module) -> None:
    """Within `qkv_stacked`: build or bring up to date the stacked weight of every attention module that will run
    stacked (on CUDA, or under mode "triton"), in place where it can. A compiled step reads the cache unchecked."""
    for mod in model.modules():
        q = getattr(mod, "q_proj", None)
        mode = getattr(q.__dict__.get("forward") if isinstance(q, nn.Module) else None, "stacked_qkv_mode", None)
        if mode is not None and (mode == "triton" or q.weight.is_cuda):
            stacked_weight(mod, tuple(getattr(mod, n) for n in PARTS))
