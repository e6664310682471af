"""The hybrid Hugging Face model: a teacher family's decoder with some attention layers swapped for mixers.

`HybridConfig` (model_type "hybridize") carries the teacher's config (`source_config`, the full config of
a family in `hybridize.families`' table: Llama, Qwen2, Qwen3, Mistral, Gemma 2, Gemma 3, Phi-3, OLMo 2,
Granite, Qwen3-MoE), the per-layer plan ("attn" or a mixer name)
and the resolved settings of every mixer in the plan. `HybridForCausalLM` builds the teacher family's
base model (`AutoModel.from_config(source_config)`, so `model.embed_tokens`, `model.layers.N...`,
`model.norm`) plus `lm_head`, and replaces `model.layers[i].self_attn` by an *attention slot* for each
converted layer. A slot is the mixer itself (a dynamic subclass `<Mixer>Slot` of the mixer class)
given the teacher attention's call signature, so parameter names stay the teacher's
(`model.layers.3.self_attn.q_proj.weight`) plus the mixer's new ones; a checkpoint is the teacher's
state dict plus new tensors, and PEFT/LoRA sees plain `q_proj`/`v_proj` Linears.

Why a wrapper and not a dynamic subclass of e.g. LlamaForCausalLM: one registered class serves every
family (AutoModelForCausalLM maps one config class to one model class), and the family's base model
stays untouched except for the swapped `self_attn` modules.

What the mixers need that the decoder does not pass to attention - the 2-D padding mask of the
current tokens and `cu_seqlens` of packed rows - is computed once per forward by a forward pre-hook
on the base model (so it also runs when TRL calls `model.base_model(...)` directly) and travels to
every slot through the decoder's `**kwargs` as `mixer_attention_mask` / `mixer_cu_seqlens`.
Packed rows are detected exactly when transformers' own mask code detects them (no 2-D mask, no
cache, `position_ids` not increasing by 1), with the same rule (a new document wherever the position
does not grow by one), so softmax and mixer layers always agree on document boundaries. Rows of a
packed batch with B > 1 are flattened into one row for the mixers.

Cache: `HybridCache` (a DynamicCache) holds KV layers for softmax layers (the source family's layer
types, so sliding-window layers stay sliding) and a `MixerCacheLayer` per mixer layer holding the
mixer's fixed-size `MixerState` plus a token count, so `get_seq_length` / `get_mask_sizes` are right
even when layer 0 is a mixer. Any other cache handed to the model (a bare DynamicCache, or one built
from the config by generate/TRL) is adopted: its still-empty layers at mixer positions are replaced.

Kernel options (`hybridize.ops.common.options`): `HybridConfig.kernel_options` is a dict of the kernel
options this model sets explicitly (e.g. `{"kernels": "torch"}`; empty by default, saved in config.json; a
config.json without it loads as empty). While the model's mixers run, the options in force are the
current ones (an enclosing `use_kernel_options` block, else the `HYBRIDIZE_*` environment, else the
defaults) with these fields replaced: explicit config > environment > defaults. The pre-hook passes
them to every slot as `mixer_kernel_options`, so gradient-checkpoint recomputation uses them too; an
empty dict passes nothing and changes nothing. Why not the environment's values at construction: they
would freeze the converting machine's switches (e.g. `HYBRIDIZE_KERNELS=torch` of a CPU conversion)
into every checkpoint, above the environment of the machine that runs it.

Outside the package: every saved config.json carries an `auto_map` naming `modeling_hybridize.py`, a
two-line module written beside it that imports these classes from hybridize, so tools that never
`import hybridize` (lm-evaluation-harness, TRL scripts) load a checkpoint with
`AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from transformers import AutoConfig, AutoModel, GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    Cache,
    CacheLayerMixin,
    DynamicCache,
    get_layer_types_and_kwargs,
)
from transformers.configuration_utils import SubConfigSpec
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils.generic import can_return_tuple

# the submodules, not the package root (hybridize/__init__ imports this module)
import hybridize.families as families
import hybridize.mixers as mixers
from hybridize.ops.common.options import check_overrides, resolve_kernel_options, use_kernel_options
from hybridize.mixers.base import Mixer, MixerState

MODEL_TYPE = "hybridize"
ATTN = "attn"
MIXER_LAYER_TYPE = "hybridize_mixer"
# MixerConfig fields that come from the teacher's shapes; a user setting may not change them
TEACHER_FIELDS = ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "qkv_bias", "o_bias", "qk_norm", "qk_norm_scope",
                  "qk_norm_offset", "attn_scale", "rms_norm_eps")


# ---------------------------------------------------------------------------------------------
# settings derived from the teacher config
# ---------------------------------------------------------------------------------------------
def check_family(source_config: PreTrainedConfig) -> str:
    """The teacher's model type when the family table converts it; else `families.UnsupportedFamily` (a
    UserError and ValueError) with one line naming what is missing."""
    return families.family_of(source_config).model_type


def mixer_common_settings(source_config: PreTrainedConfig) -> dict[str, Any]:
    """MixerConfig fields fixed by the teacher: widths, GQA, q/k/v biases, q/k norm kind, logit scale
    (`hybridize.families.Family.mixer_fields`)."""
    return families.family_of(source_config).mixer_fields(source_config)


#: Mixer settings that differ when a mixer *replaces a teacher's attention* rather than being trained from
#: scratch (the mixer classes keep the papers' defaults). Measured on the embedded default (5:1 SSE, output
#: gains calibrated, 3 samples): SSE with the paper's q=silu / v=silu maps starts at KL 6.57 nats/token and
#: 5.6% top-1 agreement; q=softmax (a similarity in [0, 1] like the teacher's attention weights) and v=identity
#: (the teacher's values unchanged) start at KL 3.67 and 20.8%. User settings override these.
CONVERSION_DEFAULTS: dict[str, dict] = {
    "sse": {"q_map": "softmax", "v_map": "identity"},
    "sse_gdn": {"v_map": "identity"},
}


def resolve_mixer_settings(source_config: PreTrainedConfig, plan: list[str],
                           overrides: dict[str, dict] | None = None) -> dict[str, dict]:
    """Full settings dict of every mixer kind in `plan`: teacher fields + defaults + `overrides[kind]`.

    Stored in full in the config so a checkpoint rebuilds the same mixers even if defaults change."""
    common = mixer_common_settings(source_config)
    overrides = overrides or {}
    out = {}
    for kind in dict.fromkeys(k for k in plan if k != ATTN):
        user = dict(overrides.get(kind) or {})
        fixed = sorted(set(user) & set(TEACHER_FIELDS))
        if fixed:
            raise ValueError(f"mixer setting(s) {fixed} of {kind!r} are set from the teacher and cannot be changed")
        cls = mixers.mixer_class(kind)
        out[kind] = cls.config_class.from_dict({**common, **CONVERSION_DEFAULTS.get(kind, {}), **user}).to_dict()
    return out


# ---------------------------------------------------------------------------------------------
# loading without `import hybridize`: auto_map + a module that imports it
# ---------------------------------------------------------------------------------------------
REMOTE_CODE_FILE = "modeling_hybridize.py"
AUTO_MAP = {"AutoConfig": "modeling_hybridize.HybridConfig",
            "AutoModelForCausalLM": "modeling_hybridize.HybridForCausalLM"}
REMOTE_CODE = '''"""Loads this hybridize checkpoint in tools that only use transformers' Auto classes.

    AutoModelForCausalLM.from_pretrained(this_folder, trust_remote_code=True)

The model code is the `hybridize` package (`pip install hybridize`); this file only imports it, which
also registers model_type "hybridize" with AutoConfig / AutoModelForCausalLM.
"""
from hybridize.modeling import HybridConfig, HybridForCausalLM

__all__ = ["HybridConfig", "HybridForCausalLM"]
'''


def write_remote_code(save_directory: str | os.PathLike) -> None:
    """Write `modeling_hybridize.py` (what `AUTO_MAP` names) into a checkpoint folder."""
    os.makedirs(save_directory, exist_ok=True)
    with open(os.path.join(save_directory, REMOTE_CODE_FILE), "w", encoding="utf-8") as f:
        f.write(REMOTE_CODE)


# ---------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------
_MIRRORED = ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads", "num_key_value_heads",
             "head_dim", "intermediate_size", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
             "sliding_window", "layer_types", "initializer_range", "hidden_act", "tie_word_embeddings",
             "bos_token_id", "eos_token_id", "pad_token_id")


def _mirror(name: str) -> property:
    """A config attribute read from (and written to) the teacher config, so there is one truth."""
    def get(self):
        return getattr(self.source_config, name, None)

    def set_(self, value):
        setattr(self.source_config, name, value)

    return property(get, set_, doc=f"`source_config.{name}`")


class HybridConfig(PreTrainedConfig):
    """Config of a converted model.

    source_config: the teacher's config (any supported family); layer_plan: one entry per layer,
    "attn" or a mixer name; mixer_settings: {mixer name: full MixerConfig dict};
    aux_loss_weight: weight of the summed mixer aux losses (SSE balance loss) added to `loss`
    (the balance coefficient alpha already lives inside the mixer, hence 1.0);
    teacher_source: the `--src` the model was converted from (for distillation against it);
    kernel_options: the kernel options this model sets explicitly ({field: value}; `hybridize.ops.common.options`,
    module docstring): they override the environment's while the model runs."""

    model_type = MODEL_TYPE
    sub_configs_defaults = {"source_config": SubConfigSpec(config_class=AutoConfig, model_type="llama")}

    source_config: dict | PreTrainedConfig | None = None
    layer_plan: list[str] | None = None
    mixer_settings: dict | None = None
    aux_loss_weight: float = 1.0
    use_cache: bool = True
    teacher_source: str = ""
    kernel_options: dict | None = None

    def __post_init__(self, **kwargs):
        # the teacher attributes are mirrors: when present in old/edited json they go to the source
        mirrored = {k: kwargs.pop(k) for k in list(kwargs) if k in _MIRRORED}
        super().__post_init__(**kwargs)
        check_family(self.source_config)
        for k, v in mirrored.items():
            setattr(self.source_config, k, v)
        n = self.source_config.num_hidden_layers
        if self.layer_plan is None:
            self.layer_plan = [ATTN] * n
        self.layer_plan = list(self.layer_plan)
        if len(self.layer_plan) != n:
            raise ValueError(f"layer_plan has {len(self.layer_plan)} entries for a model with {n} layers")
        settings = dict(self.mixer_settings or {})
        missing = [k for k in dict.fromkeys(self.layer_plan) if k != ATTN and k not in settings]
        if missing:
            settings.update(resolve_mixer_settings(self.source_config, missing))
        self.mixer_settings = settings
        self.kernel_options = check_overrides(self.kernel_options, "config.json kernel_options")

    @property
    def mixer_layers(self) -> list[int]:
        return [i for i, k in enumerate(self.layer_plan) if k != ATTN]

    @property
    def softmax_layers(self) -> list[int]:
        """The layers kept as the teacher's softmax attention."""
        return [i for i, k in enumerate(self.layer_plan) if k == ATTN]

    def save_pretrained(self, save_directory: str | os.PathLike, push_to_hub: bool = False, **kwargs):
        """config.json with `auto_map`, and the module it names beside it (the model's save calls this).

        Why here: convert, distill export, GRPO and TRL checkpoints all save through it, so every
        checkpoint loads with `trust_remote_code=True` in a process that never imported hybridize."""
        write_remote_code(save_directory)
        self.auto_map = dict(AUTO_MAP)
        super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoConfig"):
        """No-op. transformers calls it after loading through `auto_map`; a class so marked makes the next
        save copy hybridize/modeling.py into the folder (it cannot run there) and rewrite `auto_map`."""


for _name in _MIRRORED:
    setattr(HybridConfig, _name, _mirror(_name))


# ---------------------------------------------------------------------------------------------
# cache
# ---------------------------------------------------------------------------------------------
class MixerCacheLayer(CacheLayerMixin):
    """Decode state of one mixer layer: a fixed-size `MixerState` and the number of tokens seen.

    Holds no keys/values; `state` is present (not None) from the first forward on, so decode steps
    always continue from it."""

    _layer_type = MIXER_LAYER_TYPE
    is_sliding = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, **kwargs):
        super().__init__()
        self.state: MixerState | None = None
        self.seen_tokens = 0

    def lazy_initialization(self, key_states=None, value_states=None) -> None:  # nothing to preallocate
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError("a mixer layer's cache holds a recurrent state, not keys/values")

    def update_state(self, state: MixerState | None, num_new_tokens: int) -> None:
        if state is None:
            raise RuntimeError("the mixer returned no state although a cache was given (output_state=True)")
        self.state = state
        self.seen_tokens += num_new_tokens
        self.is_initialized = True

    def get_seq_length(self) -> int:
        return self.seen_tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen_tokens + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def nbytes(self) -> int:
        return self.state.nbytes() if self.state is not None else 0

    def _map(self, fn) -> None:
        if self.state is not None:
            self.state = self.state.map(fn)

    def reset(self) -> None:
        self.state, self.seen_tokens, self.is_initialized = None, 0, False

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0:
            raise RuntimeError("a recurrent mixer state cannot be cropped (no assisted/speculative decoding)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t[indices])

    def offload(self):
        self._map(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self):
        device = getattr(self, "device", None)
        if device is not None:
            self._map(lambda t: t.to(device, non_blocking=True))


def _attention_layer_types(config: HybridConfig) -> tuple[list[str], list[dict]]:
    return get_layer_types_and_kwargs(config.source_config)


class HybridCache(DynamicCache):
    """One cache for a hybrid: the source family's KV layers for softmax layers, `MixerCacheLayer` else."""

    def __init__(self, config: HybridConfig, offloading: bool = False, offload_only_non_sliding: bool = False):
        types, kwargs = _attention_layer_types(config)
        layers = [MixerCacheLayer() if kind != ATTN else DYNAMIC_LAYER_TYPE_MAPPING[t](**kw)
                  for kind, t, kw in zip(config.layer_plan, types, kwargs)]
        Cache.__init__(self, layers=layers, offloading=offloading, offload_only_non_sliding=offload_only_non_sliding)

    def mixer_nbytes(self) -> int:
        """Bytes held by mixer layers (constant in sequence length)."""
        return sum(l.nbytes() for l in self.layers if isinstance(l, MixerCacheLayer))


def adopt_cache(cache: Cache, config: HybridConfig) -> Cache:
    """Make any transformers Cache usable by a hybrid: put a MixerCacheLayer at every mixer layer.

    A lazily built DynamicCache (no layers yet) gets the full hybrid layout; an empty non-mixer
    layer at a mixer position is swapped; a filled one is an error (it came from another model)."""
    if getattr(cache, "layer_class_to_replicate", None) is not None and len(cache.layers) == 0:
        cache.layers = HybridCache(config).layers
        return cache
    for i in config.mixer_layers:
        if i >= len(cache.layers):
            raise ValueError(f"the cache has {len(cache.layers)} layers, the model {len(config.layer_plan)}")
        layer = cache.layers[i]
        if isinstance(layer, MixerCacheLayer):
            continue
        if getattr(layer, "is_initialized", False) and getattr(layer, "keys", None) is not None \
                and layer.keys.numel() > 0:
            raise ValueError(f"cache layer {i} holds keys/values but layer {i} is a mixer; "
                             "pass a HybridCache(model.config) or no cache")
        cache.layers[i] = MixerCacheLayer()
    return cache


# ---------------------------------------------------------------------------------------------
# the attention slot
# ---------------------------------------------------------------------------------------------
class AttentionSlot:
    """Mixin that gives a mixer the call signature of the teacher's attention module.

    `forward(hidden_states, position_embeddings, attention_mask, past_key_values, ...)` -> `(out, None)`,
    `out` `[B, T, hidden]`. The decoder's 4-D mask is ignored; the 2-D padding mask and `cu_seqlens`
    arrive as `mixer_attention_mask` `[B, T]` / `mixer_cu_seqlens` (see the module docstring);
    `mixer_mode` forces "chunk" or "recurrent"; `mixer_kernel_options` (a KernelOptions, or None) is put in
    force for the mixer's call (the model config's `kernel_options`). Outputs at padding positions are zeroed so nothing
    undefined (NaN) reaches the residual stream."""

    def __init__(self, config, layer_idx: int | None = None):
        super().__init__(config)
        self.layer_idx = layer_idx
        self.last_aux_loss: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                past_key_values: Cache | None = None, mixer_attention_mask: torch.Tensor | None = None,
                mixer_cu_seqlens: torch.Tensor | None = None, mixer_mode: str | None = None,
                mixer_kernel_options=None, **kwargs):
        if mixer_kernel_options is not None:
            with use_kernel_options(mixer_kernel_options):
                return self.forward(hidden_states, position_embeddings, attention_mask, past_key_values,
                                    mixer_attention_mask, mixer_cu_seqlens, mixer_mode, **kwargs)
        B, T, H = hidden_states.shape
        layer = None
        if past_key_values is not None:
            layer = past_key_values.layers[self.layer_idx]
            if not isinstance(layer, MixerCacheLayer):
                raise RuntimeError(f"cache layer {self.layer_idx} is {type(layer).__name__}, not a MixerCacheLayer")
        x, pe = hidden_states, position_embeddings
        packed = mixer_cu_seqlens is not None
        if packed and B > 1:  # several packed rows -> one row, documents never cross a row end
            x = x.reshape(1, B * T, H)
            if pe is not None:
                pe = tuple(t.expand(B, *t.shape[1:]).reshape(1, B * T, t.shape[-1]) for t in pe)
        out = super().forward(x, state=layer.state if layer is not None else None,
                              attention_mask=mixer_attention_mask, cu_seqlens=mixer_cu_seqlens,
                              position_embeddings=pe, output_state=layer is not None, mode=mixer_mode)
        y = out.hidden.reshape(B, T, -1)
        if mixer_attention_mask is not None:
            y = torch.where(mixer_attention_mask[..., None], y, torch.zeros((), dtype=y.dtype, device=y.device))
        if layer is not None:
            layer.update_state(out.state, T)
            layer.device = y.device
        self.last_aux_loss = out.aux_loss
        return y, None

    @property
    def mixer(self) -> nn.Module:
        """The slot is its own mixer; kept for code that looks for `self_attn.mixer`."""
        return self

    def mixer_forward(self, x: torch.Tensor, position_embeddings=None, attention_mask=None, cu_seqlens=None,
                      mode: str | None = None) -> torch.Tensor:
        """The bare mixer on a normalised input `[B, T, hidden]` -> `[B, T, hidden]` (no cache);
        what layer-local comparisons and attention transfer call."""
        return super().forward(x, attention_mask=attention_mask, cu_seqlens=cu_seqlens,
                               position_embeddings=position_embeddings, mode=mode).hidden


_SLOT_CLASSES: dict[type, type] = {}


def slot_class(mixer_cls: type[Mixer]) -> type:
    """`<Mixer>Slot`: the mixer class with the attention call signature (cached, picklable by name)."""
    if mixer_cls not in _SLOT_CLASSES:
        name = f"{mixer_cls.__name__}Slot"
        cls = type(name, (AttentionSlot, mixer_cls), {"__module__": __name__, "__qualname__": name})
        _SLOT_CLASSES[mixer_cls] = cls
        globals()[name] = cls
    return _SLOT_CLASSES[mixer_cls]


def __getattr__(name: str):
    # unpickling a `<Mixer>Slot` in a fresh process: build the class on first lookup
    if name.endswith("Slot"):
        for kind in mixers.mixer_names():
            try:
                cls = mixers.mixer_class(kind)
            except Exception:  # a broken mixer must not break lookups of the others
                continue
            if f"{cls.__name__}Slot" == name:
                return slot_class(cls)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_slot(kind: str, settings: dict, layer_idx: int) -> nn.Module:
    cls = mixers.mixer_class(kind)
    return slot_class(cls)(cls.config_class.from_dict(settings), layer_idx)


# ---------------------------------------------------------------------------------------------
# mixer inputs: computed once per forward, before the decoder runs
# ---------------------------------------------------------------------------------------------
def packed_cu_seqlens(position_ids: torch.Tensor, batch_size: int) -> torch.Tensor | None:
    """Document starts of packed rows, flattened over the batch: `[N+1]`, or None if no row is packed.

    Same rule as transformers' `find_packed_sequence_indices`: a document starts at every row start
    and wherever the position does not grow by exactly one."""
    pos = position_ids if position_ids.shape[0] == batch_size else position_ids.expand(batch_size, -1)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = (pos[:, 1:] - pos[:, :-1]) != 1
    if not bool(starts[:, 1:].any()):
        return None
    idx = torch.nonzero(starts.flatten()).flatten()
    return torch.cat([idx, idx.new_tensor([pos.numel()])]).to(torch.int64)


_BASE_ARGS = ("input_ids", "attention_mask", "position_ids", "past_key_values", "inputs_embeds", "use_cache")


class _MixerInputs:
    """Forward pre-hook on the family base model (with_kwargs): cache, 2-D mask and cu_seqlens for the slots."""

    def __init__(self, config: HybridConfig):
        self.config = config

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        if not self.config.mixer_layers:
            return None  # nothing converted: run exactly the teacher
        kwargs = dict(kwargs)
        for name, value in zip(_BASE_ARGS, args):  # positional call: name the arguments
            kwargs[name] = value
        ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
        B, T = (ids.shape[:2] if ids is not None else embeds.shape[:2])
        use_cache = kwargs.get("use_cache")
        if use_cache is None:
            use_cache = self.config.use_cache
        if getattr(module, "gradient_checkpointing", False) and module.training:
            use_cache = False
        cache = kwargs.get("past_key_values")
        if cache is None and use_cache:
            cache = HybridCache(self.config)
        elif cache is not None:
            adopt_cache(cache, self.config)
        kwargs["past_key_values"], kwargs["use_cache"] = cache, bool(use_cache)
        am = kwargs.get("attention_mask")
        mask2d = None
        if isinstance(am, torch.Tensor) and am.dim() == 2:
            m = am[:, -T:].to(torch.bool)
            if not bool(m.all()):
                mask2d = m
        cu = None
        pos = kwargs.get("position_ids")
        if am is None and cache is None and pos is not None and T > 1:
            cu = packed_cu_seqlens(pos, B)
        kwargs["mixer_attention_mask"], kwargs["mixer_cu_seqlens"] = mask2d, cu
        if self.config.kernel_options:   # explicit options of this model over the current ones
            kwargs["mixer_kernel_options"] = resolve_kernel_options(self.config.kernel_options)
        return (), kwargs


# ---------------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------------
@dataclass
class HybridCausalLMOutput(CausalLMOutputWithPast):
    """CausalLMOutputWithPast plus `aux_loss`: the sum of the mixers' auxiliary losses (unweighted)."""

    aux_loss: torch.Tensor | None = None


class HybridPreTrainedModel(PreTrainedModel):
    config_class = HybridConfig
    config: HybridConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _skip_keys_device_placement = ["past_key_values"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _is_stateful = True

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoModel"):
        """No-op, as `HybridConfig.register_for_auto_class`: the saved `auto_map` is the config's."""

    def initialize_weights(self):
        super().initialize_weights()
        # The family's generic init (Linear ~ N(0, 0.02)) also reaches mixer modules; restore each
        # mixer's stated rule for its new parameters unless they were loaded.
        for slot in self.modules():
            if isinstance(slot, AttentionSlot) and not _any_loaded(slot):
                with torch.no_grad():
                    slot.reset_new_parameters()


def _any_loaded(slot: nn.Module) -> bool:
    params = dict(slot.named_parameters())
    new = [params[n] for n in slot.new_parameter_names()]
    return any(getattr(p, "_is_hf_initialized", False) or p.device.type == "meta" for p in new)


class HybridForCausalLM(HybridPreTrainedModel, GenerationMixin):
    """A converted decoder. Parameter names are the teacher's (`model.*`, `lm_head`) plus mixer parameters
    (a fused `qkv_proj` of a converted layer is held split, as the mixer's q/k/v_proj). The family's entry
    (`self.family`) places the slots and gives the LM head's logits transform (Granite, Gemma)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: HybridConfig):
        super().__init__(config)
        self.model = AutoModel.from_config(config.source_config)
        # one config object for the outer and inner model: attn_implementation etc. stay in sync
        config.source_config = self.model.config
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.family = families.family_of(config.source_config)
        layers = getattr(self.model, self.family.layers)
        for i in config.mixer_layers:
            kind = config.layer_plan[i]
            setattr(layers[i], self.family.attention, build_slot(kind, config.mixer_settings[kind], i))
        self.model.register_forward_pre_hook(_MixerInputs(config), with_kwargs=True)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def get_decoder(self):
        return self.model

    def slots(self) -> list[nn.Module]:
        """The attention slots (mixers) in layer order: each decoder layer's attention module where it is a slot
        (the forward asks every call; a walk of every module cost about 3 ms of host time per prefill at the
        135M shape, `benchmarks/generation/prefill_host.py`)."""
        layers = getattr(self.model, self.family.layers, None)
        if layers is None:   # a family whose layers moved: the full walk
            return [m for m in self.modules() if isinstance(m, AttentionSlot)]
        attn = self.family.attention
        return [a for layer in layers if isinstance(a := getattr(layer, attn, None), AttentionSlot)]

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        cache = model_kwargs.get("past_key_values")
        if isinstance(cache, Cache) and not getattr(cache, "_is_user_defined", False) \
                and not isinstance(cache, HybridCache) and len(cache.layers) and self.config.mixer_layers:
            model_kwargs["past_key_values"] = HybridCache(self.config)

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep: int | torch.Tensor = 0,
                **kwargs) -> HybridCausalLMOutput:
        slots = self.slots()
        for s in slots:
            s.last_aux_loss = None
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                             **kwargs)
        hidden = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.family.finish_logits(self.config.source_config, self.lm_head(hidden[:, keep, :]))
        aux = [s.last_aux_loss for s in slots if s.last_aux_loss is not None]
        aux_loss = torch.stack([a.float() for a in aux]).sum() if aux else None
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
            if aux_loss is not None and self.config.aux_loss_weight:
                loss = loss + self.config.aux_loss_weight * aux_loss.to(loss.device)
        return HybridCausalLMOutput(loss=loss, logits=logits, past_key_values=outputs.past_key_values,
                                    hidden_states=outputs.hidden_states, attentions=outputs.attentions,
                                    aux_loss=aux_loss)


def register() -> None:
    """Make AutoConfig / AutoModelForCausalLM know model_type "hybridize" (idempotent)."""
    from transformers import AutoModelForCausalLM

    AutoConfig.register(MODEL_TYPE, HybridConfig, exist_ok=True)
    AutoModelForCausalLM.register(HybridConfig, HybridForCausalLM, exist_ok=True)


register()
