"""What every mixer shares: its config, its state, the projections it inherits from attention.

A mixer replaces one softmax-attention layer. It owns `q_proj/k_proj/v_proj/o_proj` with exactly the
teacher attention's names and shapes (GQA kept: k/v at KV-head width), plus `q_norm/k_norm` when the
teacher had them (per head as Qwen3 / Gemma 3, or over the whole projection as OLMo 2; Gemma's norms scale
by 1 + weight), so initialising from the teacher is a plain state-dict copy of those names
(`init_from_attention`; a family with a fused `qkv_proj` is split into these names first, see
`hybridize.families`); every other parameter is new and set by `reset_new_parameters`.

Call contract (all mixers):

    out = mixer(x, state=None, attention_mask=None, cu_seqlens=None,
                position_embeddings=None, output_state=False, mode=None)
    out.hidden  [B, T, hidden]   out.state  MixerState | None   out.aux_loss  scalar | None

- `attention_mask` `[B, T]` bool, True on real tokens (left-padded batches): padded tokens leave the
  state untouched (zero key/value, zero log-decay) and their outputs are unspecified.
- `cu_seqlens` `[N+1]` with B == 1: packed documents; no state crosses a boundary; the returned
  state has one row per document.
- `mode`: "chunk" (parallel / chunkwise: training and prefill) or "recurrent" (per-token loop:
  decode and ground truth). Default: recurrent for T == 1 with a state, else chunk.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from hybridize.ops.common.varlen import pack_to_padded, padded_to_pack, seq_lengths


@dataclass
class MixerConfig:
    """Settings every mixer shares (filled from the teacher's config by the converter)."""

    hidden_size: int = field(default=576, metadata={"help": "model width"})
    num_heads: int = field(default=9, metadata={"help": "query heads (= mixer heads)"})
    num_kv_heads: int = field(default=3, metadata={"help": "key/value heads of the teacher (GQA)"})
    head_dim: int = field(default=64, metadata={"help": "per-head width of q/k/v"})
    qkv_bias: bool = field(default=False, metadata={"help": "q/k/v projections have biases (Qwen2)"})
    o_bias: bool = field(default=False, metadata={
        "help": "o_proj has a bias (Llama-style attention_bias=True, which biases q/k/v as well)"})
    qk_norm: bool = field(default=False, metadata={"help": "RMSNorm on q and k (Qwen3, Gemma 3, OLMo 2)"})
    qk_norm_scope: str = field(default="head", metadata={
        "help": "what the q/k norm normalises: 'head' (each head's head_dim channels: Qwen3, Gemma 3) or "
                "'full' (all heads' channels at once, weight [heads * head_dim]: OLMo 2)"})
    qk_norm_offset: float = field(default=0.0, metadata={
        "help": "the q/k norm scales by weight + this (Gemma: 1.0)"})
    attn_scale: float | None = field(default=None, metadata={
        "help": "the teacher's attention logit scale (Gemma 3 query_pre_attn_scalar**-0.5, Granite "
                "attention_multiplier); None = head_dim**-0.5. Used where a mixer reads with the teacher's "
                "scale (swa, identity feature maps)"})
    rms_norm_eps: float = field(default=1e-6, metadata={"help": "eps of the q/k/output norms"})
    use_rope: bool = field(default=False, metadata={"help": "apply the teacher's RoPE to q/k before the feature map"})
    short_conv: bool = field(default=False, metadata={"help": "causal depthwise conv on q/k/v"})
    conv_size: int = field(default=4, metadata={"help": "short-conv kernel width"})
    chunk_size: int = field(default=32, metadata={"help": "chunk length of the chunkwise form"})

    @property
    def teacher_scale(self) -> float:
        """The teacher's attention logit scale: `attn_scale` where its family sets one, else head_dim**-0.5."""
        return self.attn_scale if self.attn_scale is not None else self.head_dim ** -0.5

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "MixerConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"{cls.__name__} got unknown settings {sorted(unknown)}; known: {sorted(names)}")
        return cls(**d)


@dataclass
class MixerState:
    """Base of every mixer's decode state: a dataclass of tensors whose dim 0 is the batch/sequence.

    Subclasses add tensor fields (None allowed). `map` applies a function to every tensor, which is
    all the cache needs for beam reordering, batch selection and device moves."""

    # The owner of a state (e.g. the fast rollout cache) may set `writable = True` on the instance it
    # holds: a decode step may then update its tensors in place instead of returning copies. Not a
    # dataclass field, so `map`/`replace` copies are never writable.
    writable = False

    def map(self, fn) -> "MixerState":
        def apply(v):
            if isinstance(v, torch.Tensor):
                return fn(v)
            if isinstance(v, MixerState):
                return v.map(fn)
            return v
        return dataclasses.replace(self, **{f.name: apply(getattr(self, f.name)) for f in dataclasses.fields(self)})

    def tensors(self) -> list[torch.Tensor]:
        out = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                out.append(v)
            elif isinstance(v, MixerState):
                out.extend(v.tensors())
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


@dataclass
class MixerOutput:
    hidden: torch.Tensor
    state: MixerState | None = None
    aux_loss: torch.Tensor | None = None


class RMSNorm(nn.Module):
    """Same math and parameter name (`weight`) as the HF Llama/Qwen RMSNorm, so teacher weights load.

    `offset`: the gain is `weight + offset` (Gemma's norms scale by 1 + weight, weight 0 at init)."""

    def __init__(self, dim: int, eps: float = 1e-6, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def gain(self) -> torch.Tensor:
        """The per-channel factor `[dim]` the normalised input is multiplied by."""
        return self.weight + self.offset if self.offset else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's rms_norm: one fused kernel each way on CUDA, where the HF form's cast / pow / mean / rsqrt / mul /
        # cast / mul were seven passes over the tensor (with the one-pass softmax feature map, SSE's prefill at 8k x 8
        # on an H100 went from 61k to 75k tokens/s; benchmarks/RESULTS.md, "Prefill: the mixers' norms in one pass").
        # Same math, accumulated in fp32: identical in fp32; in 16 bits the gain multiplies before the one rounding,
        # not after (within one ulp of HF's). The gain in the input's dtype and the result cast back: an fp32 gain
        # beside a bf16 input (autocast training) would otherwise give fp32 q/k beside bf16 v, which the fused
        # kernels refuse
        dtype = x.dtype
        return F.rms_norm(x, (x.shape[-1],), self.gain().to(dtype), self.eps).to(dtype)


class FlatRMSNorm(RMSNorm):
    """RMSNorm over all heads' channels at once (OLMo 2's q/k norms): `[..., H, D]` is normalised as
    `[..., H * D]` with a weight `[H * D]`, so it applies to head-split q/k as the teacher applied it to
    the projection's output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.flatten(-2)).view(x.shape)


QK_NORM_SCOPES = ("head", "full")


def qk_norm_module(config: "MixerConfig", heads: int) -> RMSNorm:
    """The q (heads = num_heads) or k (num_kv_heads) norm the teacher's attention has: per head over
    `head_dim` channels, or over `heads * head_dim` (scope 'full'); with Gemma's offset."""
    if config.qk_norm_scope not in QK_NORM_SCOPES:
        raise ValueError(f"qk_norm_scope must be one of {QK_NORM_SCOPES}, got {config.qk_norm_scope!r}")
    if config.qk_norm_scope == "full":
        return FlatRMSNorm(heads * config.head_dim, config.rms_norm_eps, config.qk_norm_offset)
    return RMSNorm(config.head_dim, config.rms_norm_eps, config.qk_norm_offset)


class ShortConv(nn.Module):
    """Causal depthwise conv over time on `[B, T, C]`; state = the last `size - 1` inputs `[B, C, size-1]`.

    Identity at init (last tap 1, others 0) so a converted layer starts where the teacher was."""

    def __init__(self, channels: int, size: int = 4):
        super().__init__()
        self.size = size
        self.weight = nn.Parameter(torch.zeros(channels, size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.zero_()
            self.weight[:, -1] = 1.0

    def forward(self, x, state=None, cu_seqlens=None, mask=None):
        """x `[B, T, C]` -> (y `[B, T, C]`, new state `[B or N, C, size-1]`).

        `mask` `[B, T]` (False = padding): the new state holds the last `size-1` *real* inputs, so a
        padded step leaves the conv window where it was (padded inputs must already be zero)."""
        if cu_seqlens is not None:
            lens = torch.tensor(seq_lengths(cu_seqlens), device=x.device)
            xp = pack_to_padded(x, cu_seqlens)
            real = torch.arange(xp.shape[1], device=x.device)[None] < lens[:, None]
            if mask is not None:
                real = real & pack_to_padded(mask, cu_seqlens, value=False)
            y, st = self(xp, state, mask=real)
            return padded_to_pack(y, cu_seqlens), st
        B, T, C = x.shape
        xt = x.transpose(1, 2)
        prev = state.to(xt.dtype) if state is not None else xt.new_zeros(B, C, self.size - 1)
        full = torch.cat([prev, xt], dim=-1)
        y = F.conv1d(full, self.weight.to(xt.dtype).unsqueeze(1), groups=C).transpose(1, 2)
        if mask is None:
            return y, full[:, :, -(self.size - 1):]
        # positions of the last size-1 real entries (the previous state always counts as real)
        keep = torch.cat([mask.new_ones(B, self.size - 1), mask.bool()], dim=1)
        pos = torch.arange(keep.shape[1], device=x.device).expand(B, -1)
        idx = torch.where(keep, pos, -1).topk(self.size - 1, dim=1).indices.sort(dim=1).values
        return y, full.gather(2, idx.unsqueeze(1).expand(B, C, -1))


@dataclass
class ConvState(MixerState):
    q: torch.Tensor | None = None
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[B, T, H, D]`, cos/sin `[B, T, R]` (the HF rotary embedding output). R < D is partial rotary
    (Phi-3 with partial_rotary_factor < 1): the first R channels rotate, the rest pass through."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)
    cos, sin = cos.unsqueeze(2).to(x.dtype), sin.unsqueeze(2).to(x.dtype)
    return x * cos + rotate_half(x) * sin


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """`[..., Hkv, D]` -> `[..., Hkv * n_rep, D]`, each KV head shared by its query group (one copy:
    expand + reshape; `repeat_interleave` builds an index tensor first, a kernel more per call)."""
    if n_rep == 1:
        return x
    *lead, h, d = x.shape
    return x.unsqueeze(-2).expand(*lead, h, n_rep, d).reshape(*lead, h * n_rep, d)


def mask_tokens(x: torch.Tensor | None, mask: torch.Tensor | None) -> torch.Tensor | None:
    """Zero `x` `[B, T, ...]` where `mask` `[B, T]` is False (padding)."""
    if x is None or mask is None:
        return x
    return x * mask.view(*mask.shape, *([1] * (x.dim() - 2))).to(x.dtype)


class Mixer(nn.Module):
    """Base class: projections inherited from attention, optional q/k norm, short conv and RoPE.

    Subclasses set `name`, `config_class`, `state_class`, implement `forward` and, if they add
    parameters, `reset_new_parameters`."""

    name: ClassVar[str] = "mixer"
    config_class: ClassVar[type[MixerConfig]] = MixerConfig
    #: names copied from the teacher's attention module by `init_from_attention`
    inherited: ClassVar[tuple[str, ...]] = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")

    def __init__(self, config: MixerConfig):
        super().__init__()
        c = self.config = config
        if c.num_heads % c.num_kv_heads:
            raise ValueError(f"num_heads {c.num_heads} is not a multiple of num_kv_heads {c.num_kv_heads}")
        self.n_rep = c.num_heads // c.num_kv_heads
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.o_bias)
        if c.qk_norm:
            self.q_norm = qk_norm_module(c, c.num_heads)
            self.k_norm = qk_norm_module(c, c.num_kv_heads)
        if c.short_conv:
            self.q_conv = ShortConv(c.num_heads * c.head_dim, c.conv_size)
            self.k_conv = ShortConv(c.num_kv_heads * c.head_dim, c.conv_size)
            self.v_conv = ShortConv(c.num_kv_heads * c.head_dim, c.conv_size)

    # ---- initialisation -------------------------------------------------------------------
    def init_from_attention(self, attention: nn.Module | dict[str, torch.Tensor]) -> None:
        """Copy q/k/v/o (+ biases, q/k norms) from a teacher attention module, or from its tensors already
        under the mixer's names (`hybridize.families.Family.mixer_state`: a fused qkv_proj split), then
        init the rest."""
        src = attention.state_dict() if isinstance(attention, nn.Module) else dict(attention)
        own = self.state_dict()
        copied = {k: v for k, v in src.items() if k.split(".")[0] in self.inherited and k in own}
        missing = [k for k in own if k.split(".")[0] in ("q_proj", "k_proj", "v_proj", "o_proj") and k not in copied]
        if missing:
            raise ValueError(f"teacher attention lacks {missing}; it has {sorted(src)}")
        for k, v in copied.items():
            if own[k].shape != v.shape:
                raise ValueError(f"shape mismatch for {k}: mixer {tuple(own[k].shape)} vs teacher {tuple(v.shape)}")
        self.load_state_dict(copied, strict=False)
        self.reset_new_parameters()

    def init_new_parameters(self) -> None:
        """`reset_new_parameters`, as each mixer's `__init__` calls it, except when DeepSpeed's zero.Init has
        already partitioned the parameters (transformers builds models that way while a ZeRO-3 trainer
        config is live, e.g. TRL's reference model): their values then come from the checkpoint being
        loaded, and the shards are empty."""
        if any(hasattr(p, "ds_id") for p in self.parameters()):
            return
        self.reset_new_parameters()

    def reset_new_parameters(self) -> None:
        """Initialise parameters the teacher does not have (the stated rule of each mixer)."""
        for name in ("q_conv", "k_conv", "v_conv"):
            if hasattr(self, name):
                getattr(self, name).reset_parameters()

    def new_parameter_names(self) -> list[str]:
        return [n for n, _ in self.named_parameters() if n.split(".")[0] not in self.inherited]

    # ---- shared front end -----------------------------------------------------------------
    def project_qkv(self, x, attention_mask=None, cu_seqlens=None, position_embeddings=None,
                    conv_state: ConvState | None = None):
        """x `[B, T, hidden]` -> q `[B, T, H, D]`, k, v `[B, T, Hkv, D]`, new ConvState or None.

        Padding tokens get zero q/k/v inputs before the conv so they never leak into real tokens."""
        c = self.config
        B, T, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        new_conv = None
        if c.short_conv:
            q, k, v = (mask_tokens(t, attention_mask) for t in (q, k, v))
            cs = conv_state or ConvState()
            q, sq = self.q_conv(q, cs.q, cu_seqlens, attention_mask)
            k, sk = self.k_conv(k, cs.k, cu_seqlens, attention_mask)
            v, sv = self.v_conv(v, cs.v, cu_seqlens, attention_mask)
            new_conv = ConvState(q=sq, k=sk, v=sv)
        q = q.view(B, T, c.num_heads, c.head_dim)
        k = k.view(B, T, c.num_kv_heads, c.head_dim)
        v = v.view(B, T, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if c.use_rope:
            if position_embeddings is None:
                raise ValueError("use_rope=True needs position_embeddings (cos, sin) from the model")
            cos, sin = position_embeddings
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q, k, v, new_conv

    @staticmethod
    def pick_mode(mode: str | None, T: int, state) -> str:
        if mode is not None:
            return mode
        return "recurrent" if (T == 1 and state is not None) else "chunk"
