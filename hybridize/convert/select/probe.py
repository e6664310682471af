"""The teacher recorded once on fixed inputs, and the cost of the teacher with some layers converted.

`record_probe` runs the teacher on each batch and keeps the input of every decoder layer `[B, T, H]` and the
final normed hidden state `[B, T, H]`; the teacher's log-probabilities are one `lm_head` (and its family's
logit transform, `families.head_logits`) away from the latter, so they are cached at `H` instead of `V`
numbers a token (V = 49,152 on the default: 85x smaller) and recomputed per use, bit-identical.

`probe_cost(teacher, probe, slots)` swaps the given mixer slots into the teacher's layers and runs the
decoder from the FIRST converted layer only, starting from the cached input of that layer (the layers before
it are unchanged, so their output is the cache): converting layer i alone costs L - i layers, not L. It
returns, over the positions each batch counts, the mean KL(teacher || model) per token (nats) and the mean
increase of the negative log-likelihood of the batch's targets (the needle answer), model minus teacher.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn as nn

from hybridize.distill.models import decoder_layers
from hybridize.families import head_logits


def amp(device: str):
    """bf16 autocast on CUDA (fp32 weights stay fp32), nothing on CPU."""
    if str(device).startswith("cuda"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@dataclass
class Probe:
    """Per batch: `input_ids` `[B, T]`, `mask` `[B, T]` (positions that count), optional `targets` `[B, T]`
    (next-token ids for the NLL), `layer_inputs` (one `[B, T, H]` per layer), `final` `[B, T, H]`."""

    batches: list[dict]

    def head(self, tokens: int) -> "Probe":
        """The first batches holding at least `tokens` tokens (a cheaper probe for the greedy trials)."""
        out, n = [], 0
        for b in self.batches:
            if n >= tokens:
                break
            out.append(b)
            n += b["input_ids"].numel()
        return Probe(out)


@torch.no_grad()
def record_probe(teacher: nn.Module, batches: list[dict], device: str) -> Probe:
    """Run the teacher on every batch and keep what `probe_cost` needs (on `device`)."""
    layers = decoder_layers(teacher)
    seen: dict[int, torch.Tensor] = {}

    def keep(i):
        def hook(module, args, kwargs):
            seen[i] = args[0] if args else kwargs["hidden_states"]
        return hook

    handles = [layer.register_forward_pre_hook(keep(i), with_kwargs=True) for i, layer in enumerate(layers)]
    out = []
    try:
        for b in batches:
            b = {k: v.to(device) for k, v in b.items()}
            seen.clear()
            with amp(device):
                final = teacher.model(input_ids=b["input_ids"], use_cache=False).last_hidden_state
            out.append({**b, "layer_inputs": [seen[i] for i in range(len(layers))], "final": final})
    finally:
        for h in handles:
            h.remove()
    return Probe(out)


@contextlib.contextmanager
def converted(teacher: nn.Module, slots: dict[int, nn.Module]):
    """The teacher with `slots[i]` in place of layer i's attention and its decoder starting at the first
    converted layer (for `inputs_embeds` = that layer's cached input). Restored on exit."""
    base = teacher.model
    layers = base.layers
    start = min(slots)
    originals = {i: layers[i].self_attn for i in slots}
    types = getattr(base.config, "layer_types", None)
    try:
        for i, slot in slots.items():
            layers[i].self_attn = slot
        base.layers = nn.ModuleList(list(layers)[start:])
        if types:  # Qwen2/3 pick each layer's mask by its index into layer_types
            base.config.layer_types = list(types)[start:]
        yield start
    finally:
        base.layers = layers
        if types:
            base.config.layer_types = types
        for i, attn in originals.items():
            layers[i].self_attn = attn


@torch.no_grad()
def probe_cost(teacher: nn.Module, probe: Probe, slots: dict[int, nn.Module], device: str) -> dict:
    """{"kl": mean KL(teacher || model) per counted token, "nll": mean NLL increase of the targets (or None)}."""
    kl_sum, nll_sum, n = 0.0, 0.0, 0
    with converted(teacher, slots) as start:
        for b in probe.batches:
            with amp(device):
                h = teacher.model(inputs_embeds=b["layer_inputs"][start], use_cache=False).last_hidden_state
            for r in range(h.shape[0]):
                k, d, c = _row_cost(teacher, b["final"][r], h[r], b["mask"][r], _row(b.get("targets"), r), device)
                kl_sum, nll_sum, n = kl_sum + k, nll_sum + d, n + c
    has_targets = any("targets" in b for b in probe.batches)
    return {"kl": kl_sum / max(n, 1), "nll": nll_sum / max(n, 1) if has_targets else None}


def _row(t: torch.Tensor | None, r: int):
    return None if t is None else t[r]


def _row_cost(teacher, h_teacher, h_model, mask, targets, device) -> tuple[float, float, int]:
    """(summed KL, summed NLL increase, counted positions) of one row `[T, H]`."""
    idx = mask.nonzero().squeeze(-1)
    if idx.numel() == 0:
        return 0.0, 0.0, 0
    with amp(device):   # the teacher's real logits: lm_head, then its family's transform (Granite, Gemma)
        lt, lm = head_logits(teacher, h_teacher[idx]), head_logits(teacher, h_model[idx])
    lt, lm = torch.log_softmax(lt.float(), -1), torch.log_softmax(lm.float(), -1)
    kl = (lt.exp() * (lt - lm)).sum(-1).clamp_min(0).sum().item()
    nll = 0.0
    if targets is not None:
        t = targets[idx].unsqueeze(-1)
        nll = (lt.gather(-1, t) - lm.gather(-1, t)).sum().item()
    return kl, nll, int(idx.numel())
