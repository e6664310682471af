"""Fast decoding: a static-buffer decode loop for hybrid (and plain) decoders, with CUDA graphs on GPU.

Why: evaluation and GRPO rollouts spend most of their time generating, and `model.generate` is host-bound
for small batches (a fixed Python cost per decode step whatever the model size). vLLM does not know our
mixers, so this module is a gpt-fast-style loop for the model classes we have:

- prefill once with the model's own forward (the same call HF generate makes: HybridCache, 2-D mask,
  position ids from the mask, `logits_to_keep=1`), or with `prefill_tokens` a few rows at a time, each
  group's cache copied into its rows of the buffers below and freed before the next (peak memory: one
  group's activations and cache beside the buffers, not the whole batch's twice);
- copy the prefill cache into static buffers: `[B, Hkv, L_buf, D]` keys/values per softmax layer
  (`L_buf` = prompt + new tokens rounded up to `bucket`), the fixed-size `MixerState` per mixer layer;
- decode one token per step by calling the decoder layers directly on those buffers (softmax layers
  see a `StaticKV` cache written with `index_copy_` at a device-side position; mixer slots run their
  recurrent step and write their state back in place), sample on the device, write the token into a
  static output buffer `[B, L_buf]` - no host synchronisation except one finished-check every
  `check_every` steps;
- on CUDA, capture one decode step as a CUDA graph and replay it (one graph per batch size / buffer
  length / parameter storage, kept for reuse across calls - the rollouts of a GRPO run share shapes);
- once a generator has decoded `compile_after_s` seconds (`compile="auto"`, the default; `"on"` at once), run
  the step's model part through `torch.compile` first, inside the same graph: inductor fuses the norms, gates
  and casts into few kernels; our Triton launchers and fla's kernels stay opaque to it, and sampling stays
  eager (inductor's RNG would not reproduce HF's draws).

Same tokens as HF generate: sampling uses HF's own logits processors (temperature, top-k, top-p,
min-p; anything else falls back to `model.generate`) and draws with `argmax(p / Exp(1))`, which is
exactly what `torch.multinomial(p, 1)` computes internally (same generator calls) minus its host-side
validity check. Finished rows emit the pad token as in HF; the output is cut where HF stops (all rows
finished or the budget reached). Without CUDA graphs the attention reads keys `[:L]` (the exact length,
a host-side count, no sync), so prefill and decode run the same operations on the same values as the
HF cached path: tokens and logits `[B, V]` are identical (tested on CPU, greedy and seeded sampling).
With CUDA graphs the attention reads the whole buffer with future slots masked, which can change logits
in the last bits (different reduction lengths); tokens still agree except at near-ties (the graph
replays give exactly the tokens of the same masked layout run eagerly, sampling included). With the
Triton attention on the GPU, bf16 logits differ from HF's in the last bit as well, and random-weight bf16
models with large vocabularies often have top-2 logits within one bf16 step, so such rows can part ways
(HF's own eager and sdpa attentions disagree as often there); compare in fp32 to check the wiring. One
difference that does not change the returned tokens: the loop may run up to `check_every - 1` steps past
the point where every row finished, so the global RNG ends in a different state than after HF generate.

Softmax attention in the decode step (`FastGenConfig.attention`): HF's masked sdpa with q_len = 1
cannot split the key length across programs, so on CUDA the graph path and the eager masked path call
our split-KV Triton kernel (`hybridize.ops.attn_decode.triton_split_kv`, after "Flash-Decoding for
long-context inference") instead, with the same visible keys (left padding, future slots, sliding
windows): the softmax layers' attention modules run unchanged, only their attention function is swapped
for the duration of each step (a per-module config view naming a registered attention function; the
shared config is not touched). The eager exact path keeps HF's attention under `auto`, as it exists to
give HF's bits. The kernel needs a left-padded prompt mask (padding, then real tokens); other masks keep
HF's attention. On CPU, `attention=triton` runs the kernel's PyTorch reference (or the kernel itself
under `TRITON_INTERPRET=1`), to test the wiring.

Linear layers in the decode step (`FastGenConfig.gemm`): with a few rows cuBLAS streams the weights well
below HBM bandwidth, and the weights are most of a step's bytes; on CUDA every plain `nn.Linear` of the
model (and SSE's fused decode projections) goes through `hybridize.ops.decode_gemm.route` while
`generate` runs: per weight shape the faster of cuBLAS and a weight-streaming Triton GEMM, timed on first
use (prefill calls have more rows and keep F.linear). Gated MLPs (Llama layout) run gate and up as one
GEMM over their stacked weights in those steps (`FastGenConfig.stack_mlp`, `ops.decode_gemm.stacked`):
one launch fewer per layer, for the teacher and the hybrid alike (not on the exact path, which keeps HF's ops).
Attention's q, k and v run as one GEMM the same way (`FastGenConfig.stack_qkv`, `ops.decode_gemm.stacked_qkv`):
two launches fewer per softmax layer, which speeds the teacher baseline up more than the hybrid (28 softmax layers to
its 4 at the Qwen3-1.7B shape).

Sliding windows: per layer as HF's masks apply them (`layer_types` "sliding_attention" layers with the
config's `sliding_window`; without `layer_types`, as in Mistral, every layer when `sliding_window` is
set). A prompt longer than the window leaves only the last `window - 1` keys in HF's sliding cache layers:
they are copied to their own buffer slots (the earlier slots stay zero, outside every window).

Not supported (falls back to `model.generate`, with the reason in `last_fallback_reason`): beams,
several return sequences, repetition penalties and other input-dependent processors, streamers,
`return_dict_in_generate`, attention implementations other than sdpa/eager, models whose decoder
layers do not follow the Llama layout.

How it plugs in: callers call a `FastGenerator` directly (eval, `generation.batched`), or, where a library
calls `model.generate` itself (TRL's GRPO rollouts), `fast_generate_installed` sets the generator as the
HF model's instance `generate` for the duration of a block. Each run-time change is a context manager that
restores what it changed, and each stands where the library offers no hook: TRL generates through
`model.generate` (its `rollout_func` is marked experimental and would take over TRL's prompt tokenisation);
HF attention modules pick their attention function from their config, so the decode kernel is registered
with `AttentionInterface` and named in a per-module config view; `nn.Linear` has no hook that replaces its
product, so the decode GEMM is an instance `forward` on plain linears; and HF decoders drop the cache
while gradient checkpointing is on in training mode, so the flags are switched off for the call.
"""
from __future__ import annotations

import logging
import os
import time
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from transformers import AttentionInterface, DynamicCache

from hybridize.families import known_family
from hybridize.ops.common.options import current_kernel_options, use_kernel_options
from hybridize.ops.decode_gemm import route as decode_linear
from hybridize.ops.decode_gemm import stacked as stacked_mlp
from hybridize.ops.decode_gemm import stacked_qkv
from hybridize.modeling import AttentionSlot, HybridCache, HybridConfig, MixerCacheLayer

log = logging.getLogger(__name__)


@dataclass
class FastGenConfig:
    cuda_graphs: str = field(default="auto", metadata={"help": "auto (on for CUDA) | on | off"})
    bucket: int = field(default=256, metadata={"help": "round the KV buffer length up to a multiple of this "
                                                       "(graphs are reused across prompt lengths)"})
    check_every: int = field(default=32, metadata={"help": "decode steps between finished-checks (host syncs)"})
    max_sessions: int = field(default=2, metadata={"help": "captured graphs (and their buffers) kept for reuse"})
    exact_lengths: bool = field(default=True, metadata={
        "help": "eager decode reads keys [:length] (bitwise HF); False reads the whole buffer with a mask, "
                "as a CUDA graph does (to test that path on CPU)"})
    record_logits: bool = field(default=False, metadata={
        "help": "keep every step's fp32 logits [B, V] in `FastGenerator.last_logits` (eager decode only; tests)"})
    fallback: bool = field(default=True, metadata={"help": "use model.generate when a setting is unsupported "
                                                           "(else raise)"})
    compile: str = field(default="auto", metadata={
        "help": "torch.compile the decode step (norms, gates and elementwise ops fused into few kernels) for the "
                "masked / CUDA-graph path: auto (default) | on | off. auto compiles once this generator has decoded "
                "compile_after_s seconds uncompiled on that path, so a short job never compiles and a long job of "
                "one shape pays at most about twice the better of the two choices (ski rental), then decodes at "
                "the compiled speed. On an H100 (Qwen3-1.7B shape, 16k x 8, 16 calls of 512 tokens) auto took "
                "1.26x / 1.07x the time of on for the hybrid / teacher in a process's first compile, 1.10x with "
                "inductor's disk cache warm, and its later steps ran at the compiled 3.9 / 7.9 ms, not 5.9 / 10.0 "
                "(benchmarks/RESULTS.md, 'compile=auto'). Each new batch size or buffer length compiles again "
                "(the teacher 13-27 s, the hybrid 0.3-2.3 s after its first), which the rule does not count, so "
                "auto suits jobs of few shapes. On the CPU's exact path nothing compiles. Under auto a compile that "
                "fails warns once and the call is redone uncompiled (compile_failed says why). Each decoder layer is "
                "compiled on its own (our kernels are graph breaks), so dynamo's recompile limits are raised to 8 "
                "entries per layer (32 in all) during the call; shapes past that run uncompiled"})
    compile_after_s: float = field(default=20.0, metadata={
        "help": "compile=auto: seconds of uncompiled decode on the masked / CUDA-graph path after which the next "
                "session compiles; about the compile's own cost (8-27 s for a first compile on an H100, "
                "benchmarks/RESULTS.md, the speed table's warm-up)"})
    gemm: str = field(default="auto", metadata={
        "help": "linear layers in decode steps: auto (<= 16 rows of bf16/fp16 on CUDA: per weight shape the faster "
                "of cuBLAS and the Triton weight-streaming GEMM, timed on first use) | triton (also on CPU under "
                "TRITON_INTERPRET=1) | torch (F.linear, cuBLAS)"})
    stack_mlp: bool = field(default=True, metadata={
        "help": "decode steps on CUDA run each gated MLP's gate and up projections as one GEMM over their stacked "
                "weights (one launch fewer per layer, teacher and hybrid alike); the stacked copy costs gate + up "
                "once more in memory (Qwen3-1.7B shape: 1.41 GB bf16), kept for reuse across calls. False keeps "
                "two GEMMs"})
    stack_qkv: bool = field(default=True, metadata={
        "help": "decode steps on CUDA run each attention module's q, k and v projections as one GEMM over their "
                "stacked weights (two launches fewer per softmax layer: the teacher's 28 at the Qwen3-1.7B shape, "
                "its hybrid's kept ones); the stacked copy costs q + k + v once more in memory (470 MB bf16 at that "
                "shape). One H100, compiled: the 1.7B teacher's step 2.11-2.14 -> 1.95 ms at 2k x 1 and 7.09 -> "
                "6.91 ms at 16k x 8 (benchmarks/RESULTS.md, 'q, k and v as one GEMM'). False keeps three GEMMs"})
    prefill_tokens: int = field(default=0, metadata={
        "help": "at most this many prompt tokens (rows x prompt length, at least one row) per prefill forward: the "
                "batch is prefilled a few rows at a time, each straight into the static buffers, so neither the "
                "whole batch's activations nor a second copy of its keys/values is held at once (rows are "
                "independent: the same computation per row, though GEMMs of other shapes may round differently). "
                "0 = the whole batch in one forward, as HF generate"})
    attention: str = field(default="auto", metadata={
        "help": "softmax attention in decode steps: auto (the Triton split-KV kernel on CUDA for the graph and "
                "masked paths when triton imports, else HF's) | triton (also on the exact path; on CPU the "
                "kernel's PyTorch reference) | sdpa (always the model's own attention)"})


#: FastGenConfig.compile values (inductor's max-autotune was measured: no faster than "on", see RESULTS)
COMPILE_MODES = ("off", "on", "auto")
#: FastGenConfig.cuda_graphs values
CUDA_GRAPH_MODES = ("auto", "on", "off")
_ALLOWED_PROCESSORS = ("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper")
_ATTN_IMPLS = ("sdpa", "eager")
# generate() arguments that change nothing in the sampled tokens
_IGNORED_KWARGS = {"use_cache", "logits_to_keep", "synced_gpus"}


# ---------------------------------------------------------------------------------------------
# model anatomy
# ---------------------------------------------------------------------------------------------
def _text_config(model):
    cfg = model.config
    return getattr(cfg, "source_config", None) or cfg


def _unsupported_model(model) -> str | None:
    base = getattr(model, "model", None)
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if base is None or not hasattr(base, name):
            return f"the model has no model.{name} (not a Llama-layout decoder)"
    if getattr(model, "lm_head", None) is None:
        return "the model has no lm_head"
    family = known_family(_text_config(model))
    blocker = family.hand_loop_blocker(_text_config(model)) if family is not None else None
    if blocker:  # the decode step below runs embed -> layers -> norm -> lm_head by hand, so a family whose layer
        # loop is not that sequence cannot use it
        return blocker
    impl = getattr(_text_config(model), "_attn_implementation", None) or "eager"
    if impl not in _ATTN_IMPLS:
        return f"attention implementation {impl!r} (fast path supports {', '.join(_ATTN_IMPLS)})"
    return None


def _inductor_options(use_graphs: bool) -> dict | None:
    """inductor's options for a compiled step: kernel option `pdl` turns on its programmatic dependent launch (on
    Hopper or later, where this torch has the option), beside the decode GEMM's. Only for a step replayed from a CUDA
    graph: inductor launches its PDL kernels through Triton's launcher instead of its faster static one, which
    a host-bound step without graphs would pay for at every launch."""
    import torch._inductor.config as inductor_config

    if use_graphs and current_kernel_options().pdl and hasattr(inductor_config.triton, "enable_pdl"):
        return {"triton.enable_pdl": True}
    return None


def _is_mixer_layer(layer) -> bool:
    return isinstance(layer.self_attn, AttentionSlot)


def _layer_windows(model) -> list[int | None]:
    """Per decoder layer, the sliding window of HF's attention mask there (None: full causal), by the rule
    of the families' mask code: with `layer_types` (Qwen2/3) the config's `sliding_window` applies to the
    "sliding_attention" layers only (Qwen configs already drop it when `use_sliding_window` is off);
    without `layer_types` (Mistral) a set `sliding_window` applies to every layer."""
    tc = _text_config(model)
    n = len(model.model.layers)
    window = getattr(tc, "sliding_window", None)
    if not window:
        return [None] * n
    types = getattr(tc, "layer_types", None)
    if not types:
        return [int(window)] * n
    return [int(window) if i < len(types) and types[i] == "sliding_attention" else None for i in range(n)]


# ---------------------------------------------------------------------------------------------
# decode attention (the Triton split-KV kernel through HF's attention-function registry)
# ---------------------------------------------------------------------------------------------
_ATTN_NAME = "hybridize_decode"
_ATTN_MODES = ("auto", "triton", "sdpa")


@dataclass
class _DecodeAttention:
    """What a softmax layer's attention needs in a decode step; travels as its `attention_mask`.
    Row b sees buffer positions `start[b] <= j < length` (and `j >= length - window` when sliding)."""
    fn: object                      # attn_decode or attn_decode_reference
    start: torch.Tensor             # [B] first real prompt position (left padding)
    length: torch.Tensor            # [1] slot of the current token + 1
    window: int | None


def _decode_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                              scaling: float | None = None, **kwargs):
    """HF attention-function signature: query `[B, Hq, 1, D]`, key/value `[B, Hkv, L, D]` (the static
    buffer) -> (`[B, 1, Hq, D]`, None). The visible keys come from the `_DecodeAttention` mask."""
    d = attention_mask
    if not isinstance(d, _DecodeAttention) or query.shape[2] != 1:
        raise RuntimeError(f"the {_ATTN_NAME!r} attention only runs inside a fast-generation decode step")
    o = d.fn(query[:, :, 0], key, value, d.length, d.start, window=d.window, scale=scaling)
    return o[:, None], None


class _ConfigView:
    """A module's config with another `_attn_implementation`; every other attribute is the original's."""

    def __init__(self, base, impl: str):
        self._base, self._attn_implementation = base, impl

    def __getattr__(self, name):
        return getattr(self._base, name)


@contextmanager
def _attention_swapped(modules: list):
    """Within the block the given attention modules call `_decode_attention_forward`; restored after."""
    old = [mod.config for mod in modules]
    try:
        for mod, cfg in zip(modules, old):
            mod.config = _ConfigView(cfg, _ATTN_NAME)
        yield
    finally:
        for mod, cfg in zip(modules, old):
            mod.config = cfg


def _decode_attention_fn(device, mode: str):
    """The kernel for `device` (None when it cannot run): the Triton kernel on CUDA (and on CPU under
    TRITON_INTERPRET=1), its PyTorch reference on CPU when `mode` asks for triton explicitly."""
    if _ATTN_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(_ATTN_NAME, _decode_attention_forward)
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    if device.type == "cuda" or (interp and mode == "triton"):
        # deferred on purpose: imports triton (optional, slow to import) only where the kernel can run
        from hybridize.ops.attn_decode import triton_split_kv as mod

        if mod.triton is not None:
            return mod.attn_decode
        if mode == "triton" and device.type == "cuda":
            raise ValueError("attention='triton' needs triton on CUDA; install it or use attention='sdpa'")
        if device.type == "cuda":
            return None
    if mode == "triton":
        from hybridize.ops.attn_decode.triton_split_kv import attn_decode_reference   # deferred as above
        return attn_decode_reference
    return None


def _holds_visible_keys(kept: int, T: int, window: int | None) -> bool:
    """Whether a prefill cache layer holding the last `kept` of `T` prompt keys has every key the decode
    steps see: all of them, or with a sliding window the last `window - 1` (HF's sliding layers keep
    exactly those; the first decode step at slot T sees slots > T - window)."""
    return kept == T or (window is not None and min(T, window - 1) <= kept <= T)


def rows_per_prefill(B: int, T: int, prefill_tokens: int) -> int:
    """Rows of a `[B, T]` prompt batch per prefill forward under `FastGenConfig.prefill_tokens` (0: all B; else as
    many as fit, at least one)."""
    return B if prefill_tokens == 0 else max(1, min(B, prefill_tokens // max(T, 1)))


def _device_clock(device: torch.device) -> float:
    """`time.perf_counter()` once the device's queued kernels have run: the stats split a call into prefill and
    decode, and without the sync the prefill's last kernels (a row group's forward, the copies into the static
    buffers) would run, and be counted, in the decode."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _left_padded(am: torch.Tensor) -> bool:
    """True when every row of the prompt mask `[B, T]` is zeros then ones (one host sync)."""
    return bool((am[:, 1:] >= am[:, :-1]).all())


# ---------------------------------------------------------------------------------------------
# static cache
# ---------------------------------------------------------------------------------------------
class StaticKV:
    """Keys/values of one softmax layer in a preallocated `[B, Hkv, L_buf, D]` buffer.

    `update` writes the new token at the device-side slot `pos` `[1]` and returns the keys the
    attention reads: `[:, :, :length]` when `length` (a host int) is set, else the whole buffer."""

    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor):
        self.keys, self.values, self.pos = keys, values, pos
        self.length: int | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor):
        self.keys.index_copy_(2, self.pos, k.to(self.keys.dtype))
        self.values.index_copy_(2, self.pos, v.to(self.values.dtype))
        if self.length is None:
            return self.keys, self.values
        return self.keys[:, :, :self.length], self.values[:, :, :self.length]


class StaticMixerLayer(MixerCacheLayer):
    """A mixer's decode state; with `static` set the new state is copied into the held tensors
    (what a CUDA graph needs), otherwise the layer just keeps the returned state (like HF).

    The layer owns the state it holds (the session's own copies), so it marks that state object
    writable (`MixerState.writable`): a mixer that honours the mark updates the tensors in
    place and returns them, and the static copy below finds nothing to copy."""

    def __init__(self, state):
        super().__init__()
        self.static = False
        self.state = state
        self.is_initialized = True

    @property
    def state(self):
        return self.__dict__.get("_state")

    @state.setter
    def state(self, value):
        if value is not None:
            value.writable = True
        self.__dict__["_state"] = value

    def update_state(self, state, num_new_tokens: int) -> None:
        if state is None:
            raise RuntimeError("the mixer returned no state in a decode step")
        if not self.static:
            self.state = state
            return
        dst, src = self.state.tensors(), state.tensors()
        if len(dst) != len(src) or any(d.shape != s.shape for d, s in zip(dst, src)):
            raise RuntimeError("a mixer's decode state changed layout between steps")
        compiling = torch.compiler.is_compiling()   # a compiled step cannot trace data_ptr
        for d, s in zip(dst, src):
            if (d is not s) if compiling else (d.data_ptr() != s.data_ptr()):
                d.copy_(s)


class StaticCache:
    """Duck-typed cache handed to the decoder layers: `update` for softmax layers (HF attention API),
    `layers[i]` a MixerCacheLayer for mixer slots (what `AttentionSlot` reads)."""

    def __init__(self, layers: list):
        self.layers = layers

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        return self.layers[layer_idx].update(key_states, value_states)

    def set_length(self, length: int | None) -> None:
        for layer in self.layers:
            if isinstance(layer, StaticKV):
                layer.length = length

    def set_static(self, static: bool) -> None:
        """Static: mixer layers copy each new state into the tensors they hold (fresh, contiguous
        copies of the current state, so kernels see the same alignment in warm-up and capture)."""
        for layer in self.layers:
            if not isinstance(layer, StaticKV):
                if static and not layer.static:
                    layer.state = layer.state.map(lambda t: t.clone())
                layer.static = static


# ---------------------------------------------------------------------------------------------
# one decode session: static buffers (+ a CUDA graph)
# ---------------------------------------------------------------------------------------------
@dataclass
class _Sampling:
    do_sample: bool
    processors: list
    eos: torch.Tensor | None   # [E] long
    pad: int


class _Session:
    """Buffers for one (batch, buffer length) shape. `load` fills them from a prefill, `step` decodes one
    token (eager), `capture` records `step` as a CUDA graph, `run` replays it."""

    def __init__(self, model, cache, batch: int, length: int, device, mask_dtype, sliding: list[int | None]):
        self.model, self.cache, self.B, self.L = model, cache, batch, length
        self.device = device
        z = dict(device=device, dtype=torch.long)
        self.tok = torch.zeros(batch, 1, **z)          # last sampled token
        self.pos = torch.zeros(batch, 1, **z)          # its position id
        self.slot = torch.zeros(1, **z)                # buffer index the next token is written to
        self.step_idx = torch.zeros(1, **z)            # output column of the next sampled token
        self.valid = torch.zeros(batch, length, device=device, dtype=torch.bool)   # prompt mask + ones
        self.unfinished = torch.ones(batch, **z)
        self.arange = torch.arange(length, device=device)
        self.out = torch.zeros(batch, length, **z)     # sampled tokens (column j = j-th new token)
        self.mask_dtype = mask_dtype                   # None: bool mask (sdpa); else additive (eager)
        self.sliding = sliding                         # per layer: window or None
        self.attn_fn = None                            # decode attention kernel (None: the model's own)
        self.start = torch.zeros(batch, **z)           # first real prompt position per row (kernel path)
        self.attn_modules = [layer.self_attn for layer, c in zip(model.model.layers, cache.layers)
                             if isinstance(c, StaticKV)]
        self.graph = None
        self.exact_length: int | None = None           # host-side length in eager mode
        self.use_mask = True
        self.sampling: _Sampling | None = None
        self.recorded: list | None = None              # per-step logits when recording
        self.compiled = None                           # torch.compile(logits) when FastGenConfig.compile is on

    # -- masks --------------------------------------------------------------------------------
    def _mask(self, window: int | None):
        if self.exact_length is not None and not self.use_mask and window is None:
            return None
        allowed = self.valid & (self.arange <= self.slot)
        if window is not None:
            allowed = allowed & (self.arange > self.slot - window)
        if self.exact_length is not None:
            allowed = allowed[:, :self.exact_length]
        allowed = allowed[:, None, None, :]
        if self.mask_dtype is None:
            return allowed
        zero = torch.zeros((), dtype=self.mask_dtype, device=self.device)
        return torch.where(allowed, zero, torch.finfo(self.mask_dtype).min)

    # -- the decode step ----------------------------------------------------------------------
    def step(self) -> None:
        """One decode step: logits of the last token (compiled when `compiled` is set, except on the exact
        path, whose host-side length changes every step and would recompile it), then HF's token choice,
        eager (inductor draws random numbers from its own generator: a compiled sampler would not give
        HF's tokens for a seed)."""
        use_compiled = self.compiled is not None and self.exact_length is None
        logits = self.compiled() if use_compiled else self.logits()
        nxt = self.select(logits)
        self.out.index_copy_(1, self.step_idx, nxt[:, None])
        self.tok.copy_(nxt[:, None])
        self.pos.add_(1)
        self.slot.add_(1)
        self.step_idx.add_(1)

    def logits(self) -> torch.Tensor:
        """The model on the last token, states and KV buffers updated in place -> fp32 logits `[B, V]`."""
        m = self.model
        base = m.model
        h = base.embed_tokens(self.tok)
        pe = base.rotary_emb(h, self.pos)
        masks: dict = {}
        fn = self.attn_fn
        length = self.slot + 1 if fn is not None else None
        with _attention_swapped(self.attn_modules) if fn is not None else nullcontext():
            for i, layer in enumerate(base.layers):
                w = self.sliding[i]
                if w not in masks:   # mixer slots ignore the decoder's mask
                    masks[w] = self._mask(w) if fn is None else _DecodeAttention(fn, self.start, length, w)
                h = layer(h, attention_mask=masks[w], position_embeddings=pe, position_ids=self.pos,
                          past_key_values=self.cache, use_cache=True)
        h = base.norm(h)
        return m.lm_head(h[:, -1:, :])[:, -1].to(dtype=torch.float32)

    def select(self, logits: torch.Tensor) -> torch.Tensor:
        """HF's token choice: processors, then multinomial (as argmax(p / Exp(1))) or argmax; pad
        for finished rows; EOS marks rows finished. `logits` `[B, V]` fp32 -> tokens `[B]`."""
        s = self.sampling
        if self.recorded is not None:
            self.recorded.append(logits.clone())
        scores = logits
        for proc in s.processors:
            scores = proc(self.tok, scores)
        if s.do_sample:
            probs = torch.softmax(scores, dim=-1)
            nxt = torch.argmax(probs / torch.empty_like(probs).exponential_(1), dim=-1)
        else:
            nxt = torch.argmax(scores, dim=-1)
        if s.eos is not None:
            nxt = nxt * self.unfinished + s.pad * (1 - self.unfinished)
            # not torch.isin: for larger id lists it sorts with data-dependent sizes (a host sync)
            self.unfinished.mul_((nxt[:, None] != s.eos[None, :]).all(dim=1).long())
        return nxt

    # -- CUDA graph -----------------------------------------------------------------------------
    def capture(self) -> None:
        """Record one `step`. The step before must have run eagerly in static mode on the same tensors,
        so nothing is compiled or autotuned (a host sync) while capturing."""
        g = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            self.step()
        self.graph = g

    def run(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.step()


class FastGenerator:
    """`FastGenerator(model)(input_ids, attention_mask, generation_config=..., **kw)` -> `[B, T + n]`
    token ids like `model.generate`, through the static decode loop when the settings allow it.

    `input_ids` `[B, T]` left-padded, `attention_mask` `[B, T]` (1 = real token). Holds CUDA graphs
    (and their buffers) between calls; `reset()` drops them. `stats` has the last call's timings."""

    def __init__(self, model: nn.Module, config: FastGenConfig | None = None):
        self.model = model
        self.config = config or FastGenConfig()
        if self.config.compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {' | '.join(COMPILE_MODES)}, got {self.config.compile!r}")
        decode_linear.check_mode(self.config.gemm)
        if not isinstance(self.config.prefill_tokens, int) or self.config.prefill_tokens < 0:
            raise ValueError(f"prefill_tokens must be a whole number >= 0 (0 = one forward), "
                             f"got {self.config.prefill_tokens!r}")
        if not self.config.compile_after_s >= 0:
            raise ValueError(f"compile_after_s must be >= 0 seconds, got {self.config.compile_after_s!r}")
        self._sessions: dict = {}
        self.last_fallback_reason: str | None = None
        self.last_logits: list | None = None
        self.stats: dict = {}
        self.uncompiled_decode_s = 0.0   # compile=auto: decode seconds on the masked / graph path, uncompiled
        self.compile_failed: str | None = None   # compile=auto: why compiling failed (then it is not tried again)
        self._compiling = False                  # the running call's session is compiled

    def reset(self) -> None:
        self._sessions.clear()

    def _compile_now(self, exact: bool) -> bool:
        """Whether a new session compiles its step: always with compile=on; with auto once the uncompiled decode
        time on the path a compiled step serves (not the exact one) has reached compile_after_s."""
        c = self.config
        return c.compile == "on" or (c.compile == "auto" and not exact and self.compile_failed is None
                                     and self.uncompiled_decode_s >= c.compile_after_s)

    # -- settings -------------------------------------------------------------------------------
    def _resolve(self, input_ids, generation_config, kwargs):
        """(generation config, sampling, max_new) or a string saying why the fast path cannot run."""
        m = self.model
        kwargs = {k: v for k, v in kwargs.items() if k not in _IGNORED_KWARGS}
        if "streamer" in kwargs or "logits_processor" in kwargs or "stopping_criteria" in kwargs:
            return "streamer / custom logits processors / stopping criteria"
        extra = set(kwargs) - {f for f in dir(generation_config or m.generation_config) if not f.startswith("_")}
        if extra:
            return f"model kwargs {sorted(extra)}"
        try:
            gc, model_kwargs = m._prepare_generation_config(generation_config, **kwargs)
        except Exception as e:  # API drift across transformers versions
            return f"cannot resolve the generation config ({type(e).__name__}: {e})"
        if model_kwargs:
            return f"model kwargs {sorted(model_kwargs)}"
        if (gc.num_beams or 1) > 1 or (gc.num_return_sequences or 1) > 1:
            return "beam search / several return sequences"
        if gc.return_dict_in_generate or gc.output_scores or gc.output_logits:
            return "return_dict_in_generate / output_scores"
        if getattr(gc, "assistant_model", None) is not None or gc.prompt_lookup_num_tokens:
            return "assisted decoding"
        if gc.cache_implementation not in (None, "dynamic"):
            return f"cache_implementation={gc.cache_implementation!r}"
        T = input_ids.shape[1]
        max_new = gc.max_new_tokens if gc.max_new_tokens is not None else (gc.max_length or 20) - T
        if max_new < 1:
            return f"nothing to generate (max_new_tokens={max_new})"
        try:
            procs = m._get_logits_processor(generation_config=gc, input_ids_seq_length=T,
                                            device=str(input_ids.device))
        except Exception as e:
            return f"cannot build HF's logits processors ({type(e).__name__}: {e})"
        bad = [type(p).__name__ for p in procs if type(p).__name__ not in _ALLOWED_PROCESSORS]
        if bad:
            return f"logits processors {bad} (supported: {', '.join(_ALLOWED_PROCESSORS)})"
        eos = gc.eos_token_id
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        pad = gc.pad_token_id if gc.pad_token_id is not None else (eos[0] if eos else 0)
        eos_t = torch.tensor(eos, device=input_ids.device, dtype=torch.long) if eos else None
        return gc, _Sampling(bool(gc.do_sample), list(procs), eos_t, int(pad)), int(max_new)

    def _use_graphs(self, device) -> bool:
        mode = self.config.cuda_graphs
        if mode not in CUDA_GRAPH_MODES:
            raise ValueError(f"cuda_graphs must be auto, on or off, got {mode!r}")
        return device.type == "cuda" and mode != "off"

    def _exact(self, device) -> bool:
        """Whether decode takes the exact path (keys [:length], HF's ops and bits): no CUDA graphs, exact lengths."""
        return self.config.exact_lengths and not self._use_graphs(device)

    def _attention(self, device, exact: bool, attention_mask) -> object | None:
        """The decode attention kernel for this call, or None for the model's own attention."""
        mode = self.config.attention
        if mode not in _ATTN_MODES:
            raise ValueError(f"attention must be one of {', '.join(_ATTN_MODES)}, got {mode!r}")
        if mode == "sdpa" or (mode == "auto" and (device.type != "cuda" or exact)):
            return None
        if self.model.training and getattr(_text_config(self.model), "attention_dropout", 0.0):
            return None   # the kernel has no attention dropout; HF applies it in training mode
        fn = _decode_attention_fn(device, mode)
        if fn is not None and attention_mask is not None and not _left_padded(attention_mask):
            log.info("the prompt mask is not left padding: decode attention stays the model's own")
            return None
        return fn

    # -- entry point ----------------------------------------------------------------------------
    def __call__(self, input_ids=None, attention_mask=None, generation_config=None, **kwargs):
        m = self.model
        reason = _unsupported_model(m) if input_ids is not None else "no input_ids (inputs_embeds?)"
        resolved = None
        if reason is None:
            resolved = self._resolve(input_ids, generation_config, kwargs)
            if isinstance(resolved, str):
                reason, resolved = resolved, None
        self.last_fallback_reason = reason
        if reason is not None:
            if not self.config.fallback:
                raise ValueError(f"fast generation cannot run: {reason}; set fallback=True to use model.generate")
            log.info("fast generation falls back to model.generate: %s", reason)
            return type(m).generate(m, input_ids=input_ids, attention_mask=attention_mask,
                                    generation_config=generation_config, **kwargs)
        self._gc, sampling, max_new = resolved
        # the exact path runs HF's own ops (its bits); the MLPs and q/k/v are stacked before linears_routed, whose
        # forwards on gate/up and q/k/v would make them look overridden
        exact = self._exact(input_ids.device)
        # the kernel options read once for the call (the environment's read per op was ~100 reads of every
        # HYBRIDIZE_* variable per prefill at the 135M shape)
        with torch.no_grad(), use_kernel_options(current_kernel_options()), _no_checkpointing(m), \
                stacked_mlp.mlps_stacked(m, self.config.gemm, self.config.stack_mlp and not exact), \
                stacked_qkv.qkv_stacked(m, self.config.gemm, self.config.stack_qkv and not exact), \
                decode_linear.linears_routed(m, self.config.gemm), \
                _compile_limits(m, self.config.compile != "off"):
            try:
                return self._generate(input_ids, attention_mask, sampling, max_new)
            except Exception as e:
                if not (self._compiling and self.config.compile == "auto"):
                    raise
                # compiling is the default, not the user's request: a compile that fails (no working inductor,
                # an op dynamo cannot trace) costs one prefill again and a warning, not the call
                self.compile_failed = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                self._sessions = {k: v for k, v in self._sessions.items() if v.compiled is None}
                warnings.warn(f"fast generation: compiling the decode step failed ({self.compile_failed}); this "
                              f"generator decodes uncompiled from now on (FastGenConfig(compile='off') skips the "
                              f"attempt)", RuntimeWarning, stacklevel=2)
                return self._generate(input_ids, attention_mask, sampling, max_new)

    # -- prefill + decode -------------------------------------------------------------------------
    @staticmethod
    def _positions(input_ids, attention_mask):
        """Position ids `[B, T]` from the prompt mask, and the mask the prefill passes (None when every token is
        real), decided for the whole batch so that every row group is prefilled alike."""
        am = attention_mask
        if am is not None:
            pos = am.long().cumsum(-1) - 1
            pos = pos.masked_fill(am == 0, 0)
            if bool((am == 1).all()):
                am = None
        else:
            pos = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand(input_ids.shape[0], -1)
        return pos, am

    def _row_groups(self, B: int, T: int) -> list[slice]:
        """The batch's rows in prefill groups of at most `prefill_tokens` tokens (one group when it is 0)."""
        per = rows_per_prefill(B, T, self.config.prefill_tokens)
        return [slice(i, min(i + per, B)) for i in range(0, B, per)]

    def _prefill(self, input_ids, am, pos):
        """The model's own forward on the prompt rows, as HF generate calls it. Returns (logits `[b, V]` fp32,
        cache)."""
        m = self.model
        cache = HybridCache(m.config) if isinstance(m.config, HybridConfig) else None
        if cache is None:
            cache = DynamicCache(config=m.config)
        out = m(input_ids=input_ids, attention_mask=am, position_ids=pos, past_key_values=cache,
                use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].to(dtype=torch.float32), out.past_key_values

    def _session(self, cache, B, T, L, device, dtype, use_graphs, sampling: _Sampling, windows: list[int | None],
                 attn_fn=None, rows: slice | None = None, compiled: bool = False):
        """A session whose buffers hold the prefill `cache` of the batch's `rows` (all of them by default; the
        other groups are loaded after), its step compiled when `compiled`. With graphs, sessions are kept and
        reused when the shapes, the sampling settings (baked into the graph), the parameters' storage and the kernel
        options (which kernels the graph launches) match; once steps compile, the uncompiled ones are dropped (their
        buffers freed, not kept beside)."""
        m = self.model
        tc = _text_config(m)
        key = None
        if compiled:
            self._sessions = {k: v for k, v in self._sessions.items() if v.compiled is not None}
        if use_graphs:
            key = (B, L, dtype, device, _sampling_key(sampling), getattr(attn_fn, "__name__", None),
                   tuple(p.data_ptr() for p in m.parameters()), compiled, current_kernel_options())
            if key in self._sessions:
                sess = self._sessions.pop(key)
                self._sessions[key] = sess   # most recently used last
                self._load(sess, cache, T, rows)
                return sess
        pos_slot = torch.zeros(1, device=device, dtype=torch.long)
        layers = []
        for i, layer in enumerate(m.model.layers):
            src = cache.layers[i]
            if _is_mixer_layer(layer):   # zeros of the whole batch's shape (dim 0: rows), filled by _load
                layers.append(StaticMixerLayer(src.state.map(lambda t: t.new_zeros((B, *t.shape[1:])))))
            else:
                k, v = src.keys, src.values
                keys = k.new_zeros(B, k.shape[1], L, k.shape[3])
                values = v.new_zeros(B, v.shape[1], L, v.shape[3])
                layers.append(StaticKV(keys, values, pos_slot))
        impl = getattr(tc, "_attn_implementation", None) or "eager"
        # HF's sdpa takes a bool mask, its eager attention an additive float mask
        sess = _Session(m, StaticCache(layers), B, L, device, None if impl == "sdpa" else dtype, windows)
        sess.slot = pos_slot   # the KV layers and the mask share the slot counter
        sess.sampling = sampling
        sess.attn_fn = attn_fn
        if compiled:
            sess.compiled = torch.compile(sess.logits, dynamic=False, options=_inductor_options(use_graphs))
        self._load(sess, cache, T, rows)
        if key is not None:
            self._sessions[key] = sess
            while len(self._sessions) > self.config.max_sessions:
                self._sessions.pop(next(iter(self._sessions)))
        return sess

    @staticmethod
    def _load(sess: _Session, cache, T: int, rows: slice | None = None) -> None:
        """Copy a prefill cache of the batch's `rows` (all by default) into the session's buffers."""
        rows = slice(None) if rows is None else rows
        for dst, src in zip(sess.cache.layers, cache.layers):
            if isinstance(dst, StaticKV):
                # a sliding-window cache layer keeps only the last keys: they go to their own slots, the
                # slots before them stay zero (outside the window of every decode step, hence masked)
                n = src.keys.shape[2]
                dst.keys[rows, :, T - n:T].copy_(src.keys)
                dst.values[rows, :, T - n:T].copy_(src.values)
                dst.keys[rows, :, :T - n].zero_()   # slots never read must not hold NaN (0 * NaN = NaN)
                dst.values[rows, :, :T - n].zero_()
                dst.keys[rows, :, T:].zero_()
                dst.values[rows, :, T:].zero_()
            else:
                # the session's own state tensors (whole batch), in place: a captured graph reads these
                for d, s in zip(dst.state.tensors(), src.state.tensors()):
                    d[rows].copy_(s)

    def _generate(self, input_ids, attention_mask, sampling: _Sampling, max_new: int) -> torch.Tensor:
        m = self.model
        device = input_ids.device
        B, T = input_ids.shape
        self._compiling = False
        t0 = _device_clock(device)
        pos, am = self._positions(input_ids, attention_mask)
        groups = self._row_groups(B, T)

        def prefill(rows: slice):
            return self._prefill(input_ids[rows], None if am is None else am[rows], pos[rows])

        logits, cache = prefill(groups[0])
        use_graphs = self._use_graphs(device)
        bucket = max(1, int(self.config.bucket))
        L = -(-(T + max_new) // bucket) * bucket
        dtype = m.lm_head.weight.dtype
        windows = _layer_windows(m)
        bad = [i for i, layer in enumerate(cache.layers)
               if hasattr(layer, "keys") and not _is_mixer_layer(m.model.layers[i])
               and not _holds_visible_keys(layer.keys.shape[2], T, windows[i])]
        if bad:  # e.g. a sliding-window cache layer that dropped keys a decode step still sees
            self.last_fallback_reason = f"cache layers {bad} do not hold the whole prompt"
            log.info("fast generation falls back to model.generate: %s", self.last_fallback_reason)
            return type(m).generate(m, input_ids=input_ids, attention_mask=attention_mask,
                                    generation_config=self._gc)
        exact = self._exact(device)
        attn_fn = self._attention(device, exact, attention_mask)
        sess = self._session(cache, B, T, L, device, dtype, use_graphs, sampling, windows, attn_fn, groups[0],
                             compiled=self._compile_now(exact))
        self._compiling = sess.compiled is not None
        del cache
        if len(groups) > 1:   # the other row groups, each prefilled straight into the buffers
            parts = [logits]
            for rows in groups[1:]:
                lg, cache = prefill(rows)
                self._load(sess, cache, T, rows)
                parts.append(lg)
                del cache
            logits = torch.cat(parts)
        sampling = sess.sampling
        sess.out.fill_(sampling.pad)
        sess.valid.fill_(True)
        sess.start.zero_()
        if attention_mask is not None:
            sess.valid[:, :T].copy_(attention_mask.bool())
            sess.start.copy_(T - attention_mask.long().sum(dim=1))   # left padding (checked if used)
        sess.use_mask = am is not None
        sess.unfinished.fill_(1)
        sess.pos.copy_(pos[:, -1:] + 1)   # position of the first generated token
        sess.slot.fill_(T)
        sess.step_idx.fill_(0)
        sess.recorded = [] if self.config.record_logits and not use_graphs else None
        # the first token comes from the prefill logits
        first = sess.select(logits)
        sess.out[:, 0].copy_(first)
        sess.tok.copy_(first[:, None])
        sess.step_idx.fill_(1)
        t_prefill = _device_clock(device) - t0   # the prefill's kernels and the buffer loads finished
        n_done, check = 1, max(1, int(self.config.check_every))
        if sampling.eos is not None and not bool(sess.unfinished.any()):
            check = 0
        # after the prefill caches are freed: the derived decode weights (SSE's fused projections, the stacked MLPs)
        # do not add to the prefill's peak
        _refresh_decode_weights(m)
        n_done = self._decode(sess, sampling, T, max_new, n_done, check, use_graphs, exact)
        sess.exact_length = None
        sess.cache.set_length(None)
        out = sess.out[:, :n_done]
        if sampling.eos is not None:
            # HF stops after the step at which the last row finished: cut there
            fin = (out[:, :, None] == sampling.eos).any(dim=-1)
            col = torch.arange(n_done, device=device)
            first_eos = torch.where(fin, col, n_done).min(dim=1).values   # [B]
            stop = int(first_eos.max().item()) + 1
            out = out[:, :min(stop, n_done)]
        total = _device_clock(device) - t0
        self.last_logits = sess.recorded
        sess.recorded = None
        if sess.compiled is None and not exact:
            self.uncompiled_decode_s += total - t_prefill
        self.stats = {"prefill_s": t_prefill, "decode_s": total - t_prefill, "new_tokens": out.shape[1],
                      "steps": n_done, "graphs": sess.graph is not None, "batch": B, "prompt_len": T,
                      "attention": getattr(sess.attn_fn, "__name__", "model"), "gemm": self.config.gemm,
                      "compiled": sess.compiled is not None}
        return torch.cat([input_ids, out.clone()], dim=1)

    @staticmethod
    def _decode(sess: _Session, sampling: _Sampling, T: int, max_new: int, n_done: int, check: int,
                use_graphs: bool, exact: bool, warmup: int = 2) -> int:
        """Decode until `max_new` tokens or every row finished (checked every `check` steps); the first
        `warmup` steps of a new graph session run eagerly (compilation, autotuning; the last of them on
        the static state tensors), then one step is captured and replayed. Returns the number of tokens in `sess.out`."""
        while check and n_done < max_new:
            if use_graphs and sess.graph is None and n_done == warmup:
                sess.cache.set_static(True)   # the last eager step runs exactly what gets captured
            if use_graphs and sess.graph is None and n_done > warmup:
                try:
                    sess.capture()
                except Exception as e:  # a mixer op that cannot be captured: stay eager
                    log.warning("CUDA graph capture failed (%s: %s); decoding eagerly", type(e).__name__, e)
                    use_graphs = False
                    sess.graph = None
                    sess.cache.set_static(False)
                    torch.cuda.synchronize()
            if sess.graph is not None:
                sess.graph.replay()
            else:
                if exact:
                    sess.exact_length = T + n_done
                    sess.cache.set_length(T + n_done)
                sess.step()
            n_done += 1
            if sampling.eos is not None and (n_done % check == 0 or n_done == max_new):
                if not bool(sess.unfinished.any()):
                    break
        return n_done


def _compile_limits(model, on: bool):
    """torch._dynamo's recompile limits raised for the call. Our Triton launchers are graph breaks, so
    dynamo compiles each decoder layer's frames on their own, guarded on the layer (`layer_idx` is a static
    int): one cache entry per layer and session shape. Under the default limit (8 per code object) every
    layer past the 8th silently ran uncompiled (a process's second compiled session decoded slower than
    its first). Scoped to the call, so
    the user's own compiled code keeps its limits."""
    if not on:
        return nullcontext()
    import torch._dynamo   # deferred on purpose: slow to import, needed only with compile="on"

    n = len(model.model.layers)
    cfg = torch._dynamo.config
    return cfg.patch(cache_size_limit=max(cfg.cache_size_limit, 8 * n),
                     accumulated_cache_size_limit=max(cfg.accumulated_cache_size_limit, 32 * n))


def _refresh_decode_weights(model) -> None:
    """Derived decode weights (SSE's fused projections, the MLPs' stacked gate/up, attention's stacked q/k/v) brought
    up to date with the parameters, in place: a replayed graph reads the cache, and GRPO updates the parameters in
    place."""
    for layer in model.model.layers:
        fn = getattr(layer.self_attn, "refresh_decode_weights", None)
        if fn is not None:
            fn()
    stacked_mlp.refresh(model)
    stacked_qkv.refresh(model)


def _sampling_key(s: _Sampling) -> tuple:
    procs = tuple((type(p).__name__, tuple(sorted((k, repr(v)) for k, v in vars(p).items()))) for p in s.processors)
    eos = tuple(s.eos.tolist()) if s.eos is not None else None
    return (s.do_sample, procs, eos, s.pad)


@contextmanager
def _no_checkpointing(model: nn.Module):
    """Gradient checkpointing drops the cache in training mode: switch it off for the call."""
    flagged = [mod for mod in model.modules() if getattr(mod, "gradient_checkpointing", False)]
    for mod in flagged:
        mod.gradient_checkpointing = False
    try:
        yield
    finally:
        for mod in flagged:
            mod.gradient_checkpointing = True


# ---------------------------------------------------------------------------------------------
# plugging it in
# ---------------------------------------------------------------------------------------------
def find_generator_model(model: nn.Module) -> nn.Module | None:
    """The HF model inside `model` (through PEFT / DDP wrappers) that owns `lm_head` and `model.layers`:
    the first such module in `model.modules()` order, i.e. the outermost."""
    for mod in model.modules():
        inner = mod._modules.get("model")
        if "lm_head" in mod._modules and inner is not None and hasattr(inner, "layers") and hasattr(mod, "generate"):
            return mod
    return None


@contextmanager
def fast_generate_installed(model: nn.Module, generator: FastGenerator | None = None):
    """Within the block `target.generate` (the HF model inside `model`) is the fast path; callers that
    go through `model.generate` (TRL, PEFT) use it unchanged. Yields the generator (or None)."""
    target = find_generator_model(model)
    if target is None:
        yield None
        return
    gen = generator if generator is not None and generator.model is target else FastGenerator(target)
    had = "generate" in vars(target)
    old = vars(target).get("generate")
    target.generate = gen
    try:
        yield gen
    finally:
        if had:
            target.generate = old
        else:
            del target.generate


def fast_generate(model, input_ids, attention_mask=None, generation_config=None, config: FastGenConfig | None = None,
                  **kwargs) -> torch.Tensor:
    """One-shot helper: `model.generate`-compatible output through the fast path (no graph reuse)."""
    return FastGenerator(model, config)(input_ids=input_ids, attention_mask=attention_mask,
                                        generation_config=generation_config, **kwargs)


__all__ = ["FastGenConfig", "FastGenerator", "fast_generate", "fast_generate_installed", "find_generator_model"]
