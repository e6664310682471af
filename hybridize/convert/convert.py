"""Teacher -> hybrid: build the hybrid from the teacher's config, copy every teacher tensor, init the mixers.

Mapping: every teacher tensor is copied by name (embeddings, norms, MLPs or experts,
lm_head, the softmax layers), and each converted layer's attention tensors go through its family's entry
(`hybridize.families`: `Family.mixer_state`), which puts them under the mixer's names - q/k/v/o, biases,
q/k norms; a fused `qkv_proj` (Phi-3) split into q/k/v - GQA widths kept; then each converted layer's
`mixer.init_from_attention(those tensors)` applies the mixer's stated rule to its new parameters.
A teacher tensor with no place in the hybrid is an error (a mixer silently dropping a teacher weight
would be a bug), and so is a new parameter a mixer leaves unset (checked by filling new parameters with
NaN before the mixers initialise them).
"""
from __future__ import annotations

import copy
import hashlib
from typing import Any

import torch
import torch.nn as nn

from hybridize.modeling import (
    HybridConfig,
    HybridForCausalLM,
    check_family,
    resolve_mixer_settings,
)

from hybridize.convert.calibrate import calibrate_output_gain
from hybridize.convert.layout import attention_prefix, new_parameter_names  # noqa: F401  (re-exported)
from hybridize.convert.plan import parse_plan
from hybridize.convert.settings import check_settings, split_settings  # noqa: F401  (split_settings: re-exported)


def build_hybrid_config(teacher_config, plan: list[str], mixer_settings: dict[str, Any] | None = None,
                        aux_loss_weight: float = 1.0, teacher_source: str = "") -> HybridConfig:
    src = copy.deepcopy(teacher_config)
    check_family(src)
    if len(plan) != src.num_hidden_layers:
        raise ValueError(f"the plan has {len(plan)} entries but the teacher has {src.num_hidden_layers} layers")

    per_kind = split_settings(mixer_settings, plan)
    check_settings(per_kind)  # every route that converts (demo, library calls) type-checks the settings
    settings = resolve_mixer_settings(src, plan, per_kind)
    cfg = HybridConfig(source_config=src, layer_plan=list(plan), mixer_settings=settings,
                       aux_loss_weight=aux_loss_weight, teacher_source=teacher_source)
    cfg._attn_implementation = teacher_config._attn_implementation
    return cfg


@torch.no_grad()
def convert_model(teacher: nn.Module, plan: list[str] | str, mixer: str = "sse",
                  mixer_settings: dict[str, Any] | None = None, aux_loss_weight: float = 1.0,
                  teacher_source: str = "",
                  calibration_inputs: list[torch.Tensor] | None = None, seed: int = 0) -> HybridForCausalLM:
    """Convert a loaded teacher (a ForCausalLM of a family in `hybridize.families`) into a HybridForCausalLM.

    `plan`: a list (one kind per layer) or a spelling for `parse_plan` (with `mixer` as default).
    `mixer_settings`: see `split_settings`; `teacher_source`: recorded in the config (e.g. "default").
    `calibration_inputs`: `[1, T]` id tensors; when given, each converted layer's output gain is fitted to
    its teacher layer on them (`hybridize.convert.calibrate`).
    `seed`: new parameters are drawn from it and their own names (`seed_new_parameters`).
    The hybrid ends on the teacher's device and dtype, in the teacher's train/eval mode."""
    n = teacher.config.num_hidden_layers
    if isinstance(plan, str):
        plan = parse_plan(plan, n, mixer)
    cfg = build_hybrid_config(teacher.config, plan, mixer_settings, aux_loss_weight, teacher_source)
    # built in fp32 on CPU so the mixers' init rules run at full precision, cast at the end
    hybrid = HybridForCausalLM(cfg).float()
    _poison_new_parameters(hybrid)
    state = teacher_state_for(hybrid, teacher.state_dict())
    _copy_teacher(state, hybrid)
    for i in cfg.mixer_layers:
        prefix = attention_prefix(hybrid, i)
        slot = hybrid.get_submodule(prefix[:-1])
        slot.init_from_attention({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
        seed_new_parameters(slot, prefix[:-1], seed)
    _check_initialised(hybrid)
    if getattr(teacher, "generation_config", None) is not None:
        hybrid.generation_config = copy.deepcopy(teacher.generation_config)
    p = next(teacher.parameters())
    hybrid.to(device=p.device, dtype=p.dtype)
    if calibration_inputs:
        calibrate_output_gain(teacher, hybrid, calibration_inputs)
    hybrid.train(teacher.training)
    return hybrid


def teacher_state_for(hybrid: HybridForCausalLM, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The teacher's state dict with each converted layer's attention tensors under the mixer's names
    (`Family.mixer_state`); every other tensor as it is."""
    out = dict(state)
    for i in hybrid.config.mixer_layers:
        prefix = attention_prefix(hybrid, i)
        attn = {k[len(prefix):]: out.pop(k) for k in list(out) if k.startswith(prefix)}
        mapped = hybrid.family.mixer_state(attn, hybrid.config.source_config)
        out.update({prefix + k: v for k, v in mapped.items()})
    return out


def _copy_teacher(state: dict[str, torch.Tensor], hybrid: HybridForCausalLM) -> None:
    missing, unexpected = hybrid.load_state_dict(state, strict=False)
    if unexpected:
        raise ValueError(f"teacher tensors with no place in the hybrid: {unexpected[:6]}"
                         f"{' ...' if len(unexpected) > 6 else ''}; a mixer must keep the attention's names")
    new = set(new_parameter_names(hybrid))
    lost = [k for k in missing if k not in new]
    if lost:
        raise ValueError(f"hybrid tensors the teacher lacks (not mixer parameters): {lost[:6]}")


def parameter_seed(seed: int, name: str) -> int:
    """A 63-bit seed from (seed, full parameter name): sha256, so equal in every process and Python."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2 ** 63 - 1)


def seed_new_parameters(slot: nn.Module, prefix: str, seed: int) -> None:
    """Redraw each new parameter of `slot` by the mixer's own rule, with the RNG seeded from its name.

    Why: the global random stream at this point depends on every parameter the model built before
    (a Qwen2 teacher's q/k/v biases shift it), so the same weights loaded as Llama and as Qwen2 got
    different mixers. The rule (`reset_new_parameters`) sets all new parameters at once, so it runs
    once per parameter and keeps only that one; the caller's RNG state is left as it was."""
    params = dict(slot.named_parameters())
    drawn = {}
    for name in slot.new_parameter_names():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(parameter_seed(seed, f"{prefix}.{name}"))
            slot.reset_new_parameters()
            drawn[name] = params[name].detach().clone()
    for name, value in drawn.items():
        params[name].copy_(value)


def _poison_new_parameters(hybrid: HybridForCausalLM) -> None:
    params = dict(hybrid.named_parameters())
    for name in new_parameter_names(hybrid):
        params[name].fill_(float("nan"))


def _check_initialised(hybrid: HybridForCausalLM) -> None:
    params = dict(hybrid.named_parameters())
    bad = [n for n in new_parameter_names(hybrid) if not torch.isfinite(params[n]).all()]
    if bad:
        raise RuntimeError(f"the mixer's init_from_attention/reset_new_parameters left {bad[:4]} unset (NaN)")
