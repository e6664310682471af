"""Data-dependent part of the initialisation: the output gain of each converted layer.

A mixer's read `o = S^T q` has no reason to share the scale of softmax attention's output (a convex
mix of values): at plain init the converted layers' outputs were 2-20x the teacher's (relative
error up to 20 on the embedded default), which swamps the residual stream. Every mixer that ends in
`o_proj(RMSNorm(o) * gate)` has a per-channel gain `o_norm.weight` `[D]` (shared by the heads), and the
layer output is linear in it. So on a few sample sequences we set it to the least-squares fit of the
teacher attention's output, clamped at >= 0:

    min_w || sum_d w_d c_d - attn(x) ||^2,   c_d = o_proj(RMSNorm(o)[..., d] * gate)  (channel d only)

with every mixer fed exactly the teacher attention's input (hidden states, RoPE). A layer whose read
is uncorrelated with the teacher's gets a small gain (it starts close to "attention switched off",
relative error <= 1) instead of injecting noise; stage A (attention transfer) then trains the read.
Measured on the embedded default (5:1 SSE, 3 samples): per-layer relative error 0.75-20.3 -> 0.43-0.99,
KL(teacher || hybrid) 9.2 -> 6.1 nats/token, top-1 agreement 1.4% -> 9.0% (the mixer defaults of then);
with today's SSE conversion defaults and the fp64 solve (`hybridize convert --src default --layers 5:1
--mixer sse`): relative error 0.30-0.96, KL 3.69 nats/token, top-1 agreement 21.5%, the same every run.
"""
from __future__ import annotations

import torch

from hybridize.convert.report import capture_attention_io, right_pad
from hybridize.modeling import ATTN

CALIBRATION_PROMPTS = ("Once upon a time", "The main idea of the theory is", "To solve the equation, we")


@torch.no_grad()
def calibration_inputs(teacher, tokenizer=None, new_tokens: int = 64, seed: int = 1) -> list[torch.Tensor]:
    """Text the teacher writes itself (greedy continuations of short prompts), so calibration needs no
    data files and does not reuse the report's samples; random ids for tokenizer-less test models."""
    if tokenizer is None:
        g = torch.Generator().manual_seed(seed)
        return [torch.randint(0, teacher.config.vocab_size, (1, new_tokens), generator=g) for _ in range(3)]
    device = next(teacher.parameters()).device
    out = []
    for prompt in CALIBRATION_PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
        gen = teacher.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                               do_sample=False, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        out.append(gen.cpu())
    return out


@torch.no_grad()
def calibrate_output_gain(teacher, hybrid, inputs: list[torch.Tensor]) -> dict[int, float]:
    """Fit `o_norm.weight` of every converted layer that has one; returns {layer: mean gain}."""
    layers = [i for i, kind in enumerate(hybrid.config.layer_plan)
              if kind != ATTN and hasattr(hybrid.model.layers[i].self_attn, "o_norm")]
    if not layers:
        return {}
    ids, valid = right_pad(inputs)
    ids, valid = ids.to(teacher.device), valid.to(teacher.device)
    records, handles = capture_attention_io(teacher, layers)
    try:
        teacher(input_ids=ids, attention_mask=valid.long())
    finally:
        for h in handles:
            h.remove()
    gains = {}
    for i in layers:
        x, position_embeddings, target = records[i][0]
        gains[i] = _fit_layer(hybrid.model.layers[i].self_attn, x, position_embeddings, target, valid)
    return gains


def _fit_layer(mixer, x, position_embeddings, target, valid) -> float:
    norm = mixer.o_norm
    captured = {}
    hook = mixer.o_proj.register_forward_hook(lambda m, args, out: captured.setdefault("y", args[0]))
    original = norm.weight.detach().clone()
    try:
        norm.weight.fill_(1.0)          # so the captured o_proj input is RMSNorm(o) * gate per channel
        mixer.mixer_forward(x.to(original.dtype), position_embeddings, attention_mask=valid)
    finally:
        hook.remove()
        norm.weight.copy_(original)
    D = norm.weight.numel()
    y = captured["y"][valid].float()                              # [N, H*D]
    y = y.view(y.shape[0], -1, D)                                 # [N, H, D]
    w_o = mixer.o_proj.weight.float().view(-1, y.shape[1], D)     # [hidden, H, D]
    contrib = torch.einsum("nhd,ohd->nod", y, w_o).reshape(-1, D)  # column d: output of channel d alone
    goal = target[valid].float()                                  # [N, hidden]
    if mixer.o_proj.bias is not None:   # o_proj(y) = W y + b: the gains fit W y to the target less b
        goal = goal - mixer.o_proj.bias.float()
    gain = fit_gains(contrib, goal.reshape(-1))
    norm.weight.copy_(gain.to(norm.weight.dtype))
    return float(gain.mean())


def fit_gains(contrib: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """argmin_w ||contrib w - target||, clamped at >= 0: contrib `[N, D]`, target `[N]` -> `[D]` fp64.

    Solved in fp64: the fit has ~10^5 rows and a residual far larger than the fitted part (the reads start
    nearly uncorrelated with the teacher's), so an fp32 solve was off by up to 0.4 per gain on the embedded
    default (condition number ~170) and changed between processes: the converted model's perplexity ranged
    1,185-1,823 over runs of one command. In fp64 it is the same every run."""
    return torch.linalg.lstsq(contrib.double(), target.double()[:, None]).solution.squeeze(1).clamp_min(0.0)
