"""What a converted layer keeps of its teacher's attention and what it drops, per feature and per mixer kind.

`family_traits(family, config, plan, settings)` lists the features the teacher (this config, not just its
family) has - projections, biases, q/k norm, query scale, soft-capping, multipliers, logit transforms,
sliding windows, RoPE, notes of the entry - each with what the teacher does and, for every mixer kind in
the plan, whether its layers reproduce it (and how) or drop it (and why). The conversion report records
the list and prints the dropped ones. Softmax layers kept in the plan are the teacher's own modules and
reproduce everything; this is about the mixer layers only.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

# the submodule, not the package root: hybridize/__init__ imports modeling, which imports this module
import hybridize.mixers as mixers
from .family import ALL_LAYERS, FULL_NORM, FUSED, LAYER_TYPES, NO_NORM, ROPE_PER_LAYER_TYPE, Family

ATTN = "attn"


@dataclass
class Trait:
    """One feature of the teacher's attention: `mixers` maps a mixer kind to (kept, how or why not)."""

    feature: str
    teacher: str
    mixers: dict[str, tuple[bool, str]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["mixers"] = {k: {"kept": kept, "how": how} for k, (kept, how) in self.mixers.items()}
        return d


def _mixer_config(kind: str, settings: dict):
    cls = mixers.mixer_class(kind)
    return cls.config_class.from_dict(settings)


def _same(kinds, kept: bool, how: str) -> dict[str, tuple[bool, str]]:
    return {k: (kept, how) for k in kinds}


def keeps_teacher_scale(cfg) -> bool:
    """Whether a mixer config reads with the teacher's logit scale (`attn_scale`): SWA's softmax when no
    `softmax_scale` overrides it, a linear read with an identity q map and no `scale` override."""
    if hasattr(cfg, "softmax_scale"):
        return cfg.softmax_scale is None
    if hasattr(cfg, "read_scale") and hasattr(cfg, "scale"):
        return cfg.scale is None and getattr(cfg, "q_map", None) == "identity"
    return False


def window_layers(family: Family, config) -> dict[int, int]:
    """{layer: window} of the teacher's sliding-window layers (the rule of the family's mask code)."""
    window = getattr(config, "sliding_window", None)
    if not window or family.sliding not in (ALL_LAYERS, LAYER_TYPES):
        return {}
    n = config.num_hidden_layers
    if family.sliding == ALL_LAYERS:
        return {i: window for i in range(n)}
    types = getattr(config, "layer_types", None) or []
    return {i: window for i, t in enumerate(types) if t == "sliding_attention"}


def _ranges(layers) -> str:
    """`[0, 1, 2, 4, 6, 7]` -> `"0-2, 4, 6-7"`."""
    out, run = [], []
    for i in sorted(layers):
        if run and i != run[-1] + 1:
            out.append(run)
            run = []
        run.append(i)
    out += [run] if run else []
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in out)


def _rotary(family: Family, config) -> str:
    text = "RoPE on q/k"
    if family.rope == ROPE_PER_LAYER_TYPE:
        rp = getattr(config, "rope_parameters", None) or {}
        bases = {t: p.get("rope_theta") for t, p in rp.items() if isinstance(p, dict)}
        text += " with a base per layer type (" + ", ".join(f"{t} {b:g}" for t, b in sorted(bases.items()) if b) + ")"
    if family.partial_rotary:
        rp = getattr(config, "rope_parameters", None) or {}
        factor = rp.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0
        if factor < 1.0:
            text += f" on the first {factor:g} of each head's channels (partial rotary)"
    return text


def _projection_traits(family: Family, config, kinds) -> list[Trait]:
    if family.qkv == FUSED:
        out = [Trait("q/k/v/o", "one fused qkv_proj (rows [q | k | v]) and o_proj",
                     _same(kinds, True, "qkv_proj split into q_proj/k_proj/v_proj, copied"))]
    else:
        out = [Trait("q/k/v/o", "q_proj, k_proj, v_proj, o_proj", _same(kinds, True, "copied by name"))]
    if family.has_qkv_bias(config):
        out.append(Trait("q/k/v biases", "biases on q/k/v", _same(kinds, True, "copied")))
    if family.has_o_bias(config):
        out.append(Trait("o_proj bias", "a bias on o_proj", _same(kinds, True, "copied (the output-gain "
                                                                           "calibration fits around it)")))
    if family.qk_norm != NO_NORM:
        scope = "over all heads at once" if family.qk_norm == FULL_NORM else "per head"
        gain = ", gain 1 + weight" if family.qk_norm_offset else ""
        out.append(Trait("q/k norm", f"RMSNorm on q and k {scope}{gain}",
                         _same(kinds, True, "same norm and weights, before the feature maps")))
    return out


def _math_traits(family: Family, config, kinds, cfgs) -> list[Trait]:
    out = []
    scale = family.attn_scale(config)
    if scale is not None and not math.isclose(scale, family.shapes(config)[2] ** -0.5):  # else nothing to keep
        attr = family.query_scale[0]
        t = Trait("query scale", f"logits scaled by {scale:.6g} ({attr}={getattr(config, attr)!r}; "
                                 f"head_dim**-0.5 = {family.shapes(config)[2] ** -0.5:.6g})")
        for k in kinds:
            t.mixers[k] = ((True, "the teacher's scale (attn_scale)") if keeps_teacher_scale(cfgs[k]) else
                           (False, "its feature maps / normalised keys set the q.k scale, not the teacher's"))
        out.append(t)
    cap = getattr(config, family.attn_softcap, None) if family.attn_softcap else None
    if cap:
        out.append(Trait("attention soft-capping", f"logits -> tanh(s / {cap:g}) * {cap:g}",
                         _same(kinds, False, "a linear state (and swa) has no capped q.k logits")))
    for attr, why in family.ignored:
        if getattr(config, attr, None):
            out.append(Trait(attr, f"{attr}={getattr(config, attr)!r}, not applied: {why}",
                             _same(kinds, True, "nothing to reproduce")))
    return out


def _around_traits(family: Family, config, kinds) -> list[Trait]:
    out = []
    for attr in family.multipliers:
        value = getattr(config, attr, None)
        if value is not None and value != 1:
            out.append(Trait(attr, f"{attr}={value!r} in the decoder code",
                             _same(kinds, True, "applied by the family's decoder around the slot")))
    for attr, what in ((family.logits_divisor, "logits divided by"), (family.logits_softcap, "logits soft-capped at")):
        value = getattr(config, attr, None) if attr else None
        if value and value != 1:
            out.append(Trait(attr, f"{what} {value!r} ({attr}) in the LM head",
                             _same(kinds, True, "applied by HybridForCausalLM after lm_head")))
    for note in family.notes:
        out.append(Trait("decoder", note, _same(kinds, True, "outside the attention: unchanged")))
    return out


def _position_traits(family: Family, config, plan, cfgs) -> list[Trait]:
    kinds = list(cfgs)
    rope = Trait("RoPE", _rotary(family, config))
    for k in kinds:
        rope.mixers[k] = ((True, "applied to q/k with the layer's own cos/sin (use_rope)") if cfgs[k].use_rope else
                          (False, "use_rope=False: the mixer is position-free, its decay orders the tokens"))
    out = [rope]
    windows = window_layers(family, config)
    converted = {i: windows[i] for i, k in enumerate(plan) if k != ATTN and i in windows}
    if converted:
        w = sorted(set(converted.values()))
        t = Trait("sliding window", f"window {', '.join(map(str, w))} on layers {_ranges(windows)}, converted: "
                                    f"{_ranges(converted)}")
        for k in kinds:
            layers = [i for i in converted if plan[i] == k]
            if not layers:
                continue
            own = getattr(cfgs[k], "window", None)
            if own is not None and {own} == {converted[i] for i in layers}:
                t.mixers[k] = (True, f"window {own} (its own setting, equal to the teacher's)")
            elif own is not None:
                t.mixers[k] = (False, f"its window is {own}, not the teacher's {', '.join(map(str, w))}")
            else:
                t.mixers[k] = (False, "its state carries every earlier token (decayed), not the last window")
        out.append(t)
    return out


def family_traits(family: Family, config, plan: list[str], settings: dict[str, dict]) -> list[Trait]:
    """The teacher's attention features and, per mixer kind of `plan`, kept (how) or dropped (why)."""
    kinds = [k for k in dict.fromkeys(plan) if k != ATTN]
    cfgs = {k: _mixer_config(k, settings[k]) for k in kinds}
    return (_projection_traits(family, config, kinds) + _math_traits(family, config, kinds, cfgs)
            + _around_traits(family, config, kinds) + _position_traits(family, config, plan, cfgs))


def dropped_lines(traits: list[Trait]) -> list[str]:
    """`"<kind>: <feature> (<teacher>): <why>"` for every feature a mixer kind drops."""
    return [f"{k}: {t.feature} ({t.teacher}): {how}" for t in traits for k, (kept, how) in t.mixers.items()
            if not kept]
