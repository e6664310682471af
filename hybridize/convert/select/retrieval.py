"""Retrieval-aware scores: how much each teacher layer's attention reads the needle.

The teacher runs with eager attention (which returns the attention probabilities) on the S-NIAH prompts of
`needle.py`, answer teacher-forced. For layer l, head h and prompt s the mass is

    m[s, l, h] = mean over answer positions q of  sum over value tokens k of  A_lh[q, k]

(A = softmax(QK^T / sqrt(d)) after the causal mask, `[T, T]`), i.e. the share of attention that the
positions copying the answer put on the needle's value tokens. A layer's score is max_h mean_s m[s, l, h]:
its most retrieving head, averaged over prompts (a head that finds the needle in every prompt, rather than
the best head of each prompt), in [0, 1]. This follows "Retrieval Head Mechanistically Explains
Long-Context Factuality" in spirit (heads whose attention lands on the needle while copying it), departing
from it by summing attention mass instead of counting top-1 hits per copied token.

Forward hooks reduce each layer's `[B, H, T, T]` probabilities to `[H]` at once and drop them, so only one
layer's matrix exists at a time.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from hybridize.distill.models import attention_implementation, decoder_layers

from .probe import amp


@contextlib.contextmanager
def reduced_attention(model: nn.Module, reduce, layers=None):
    """Within the block the model runs eager attention (which returns the probabilities) and each of `layers`
    (decoder layer indices; default all) passes its first row's probabilities `[H, T, T]` through `reduce` -> `[H]`
    at once and drops them, so only one layer's matrix exists at a time. The block gets {layer: [H]}, filled by
    each forward."""
    out: dict[int, torch.Tensor] = {}
    blocks = decoder_layers(model)

    def hook(i: int):
        def fn(module, args, output):
            out[i] = reduce(output[1][0])
            return (output[0], None)
        return fn

    with attention_implementation("eager", model):
        handles = [blocks[i].self_attn.register_forward_hook(hook(i))
                   for i in (range(len(blocks)) if layers is None else layers)]
        try:
            yield out
        finally:
            for h in handles:
                h.remove()


class NeedleMass:
    """The needle mass per head `[H]` of each hooked layer after a forward (`mass[layer]`); `aim(prompt)`
    before the forward says which positions count (a `needle.NeedlePrompt`)."""

    def __init__(self):
        self.mass: dict[int, torch.Tensor] = {}
        self.query: list[int] = []
        self.keys: list[int] = []

    def aim(self, prompt) -> None:
        self.query, self.keys = prompt.answer_positions, prompt.value_tokens

    def reduce(self, probs: torch.Tensor) -> torch.Tensor:
        """`[H, T, T]` -> `[H]`: the attention from the answer positions on the value tokens."""
        return probs[:, self.query][:, :, self.keys].float().sum(-1).mean(-1)


@contextlib.contextmanager
def needle_mass(model: nn.Module, layers):
    """Within the block each of `layers` (indices of its decoder layers) reduces its attention probabilities to
    the needle mass of a `NeedleMass`, which the block gets (`reduced_attention`)."""
    nm = NeedleMass()
    with reduced_attention(model, nm.reduce, layers) as mass:
        nm.mass = mass
        yield nm


@torch.no_grad()
def retrieval_scores(teacher: nn.Module, prompts, device: str, progress: bool = True) -> dict:
    """{"score": [L] max-head mass, "head": [L] that head, "mass": [L][H] mean mass per head}."""
    from tqdm.auto import tqdm

    L = len(decoder_layers(teacher))
    total = None
    with needle_mass(teacher, range(L)) as nm:
        for p in tqdm(prompts, desc="retrieval (teacher attention)", disable=not progress):
            nm.aim(p)
            with amp(device):
                teacher.model(input_ids=torch.tensor([p.input_ids], device=device), use_cache=False)
            mass = torch.stack([nm.mass[i] for i in range(L)])  # [L, H]
            total = mass if total is None else total + mass
    mean = total / len(prompts)
    best = mean.max(-1)
    return {"score": best.values.tolist(), "head": best.indices.tolist(), "mass": mean.tolist()}
