"""Sparse State Expansion mixers ("Scaling Linear Attention with Sparse State Expansion", sec. 4 and
appendix 11): `SSE` on GLA, `SSEGDN` on Gated DeltaNet.

Per head there are N sparse state partitions and one always-selected shared partition. For token t:

    e_t = softmax(x_t W_e)                     router over the N partitions, T_t = top-K(e_t)
    shared path:  q = phi_q(x W_q),        k = phi_k(x W_k)                 (teacher projections)
    sparse path:  q = phi_q(x (W_q + A_q B_q)) * e_t^i,  k = phi_k(x (W_k + A_k B_k)) * e_t^i
    v = phi_v(x W_v)                                                        (shared by every partition)
    S^i_t = Lambda_t S^i_{t-1} + k_t v_t^T  for i in T_t;  S^i_t = S^i_{t-1} otherwise (no decay)
    o_t = q_t^T S^shared_t + sum_{i in T_t} q_t^T S^i_t,   out = o_proj(RMSNorm(o) * silu(x W_g))

which reading this is: the resolution of fla's unmerged PR #882
(`fla/layers/sse.py`, `fla/ops/sse/`), re-derived here, not copied:
- the shared partition reads and writes with the teacher's q/k projections; the N sparse partitions
  use base + one LoRA (rank `lora_rank`, B = 0 at init, the same LoRA for all N: partitions differ
  only by the tokens routed to them); v is shared; shared and sparse paths have separate gates;
- the router is trained by the main loss because the selected partition's router probability
  multiplies the sparse query (`emulq`) and/or key (`emulk`) (both on by default). The paper's
  eq. 11 instead adds the router logit inside the key softmax, which cancels in the softmax at
  K = 1, and its 1/K factor is dropped (the probabilities of the K selected partitions already sum
  to at most 1);
- feature maps: key softmax over the head dim (the row "classification"), query and value SiLU
  (`q_map`, `k_map`, `v_map` switch them); GLA diagonal gate logsigmoid(x W_g1 W_g2 + b) / 16;
- balance loss alpha * (N / K) * sum_i f_i P_i (alpha = 0.01, partitions, real tokens only),
  returned as `MixerOutput.aux_loss` in training mode; in eval mode aux_loss is None (nothing
  trains on it, and decode steps would make it per-token noise); `ops.sse.reference.balance_loss` gives
  it on demand for logging;
- reads go to the written partitions only (the paper's T' = T); no separate top-K' read.

SSEGDN (the PR's SSE-on-GDN variant): each partition is a Gated DeltaNet state
S = exp(g) (I - beta k k^T) S + beta k v^T with a scalar decay and beta per head, separate gates
(A_log, dt_bias, a_proj, b_proj rows) for the shared and the sparse path, and q/k L2-normalised.
Departure from the PR: the PR scales q/k by the router probability *before* the kernel's L2 norm,
which cancels the scaling (the router then gets no gradient from the main loss); here the L2 norm
comes first and the router probability scales the normalised sparse q/k, so the sparse write is
beta e k v^T, the erase beta e^2 k k^T (still a contraction) and the read e q^T S. Keys default to
SiLU + L2 norm as in the PR (`k_map`).

Front end: q_proj/k_proj/v_proj/o_proj (+ q/k norms) are the teacher's; the optional short conv is
applied to the base projections and the LoRA delta is added after it (LoRA sees the raw input),
then q/k norm, RoPE (if `use_rope`) and the feature maps act on both paths. GQA: k/v (and the k LoRA)
are at KV-head width and repeated to the query heads, so every query head owns its own partitions.

Initialisation rules (`reset_new_parameters`): LoRA A default Linear init, B = 0 (sparse = shared
projections at init); router N(0, `router_init_std`^2) (or `init_router_from_keys`, below);
decays data-independent at init (gate up-projection / a_proj weight 0) and spread log-uniformly in
1 - alpha over [1 - decay_max, 1 - decay_min] across key channels (SSE) or heads (SSEGDN): long
memory; SSEGDN beta = `beta_init`; output gate exactly 1 (weight 0, bias silu^-1(1)); norm weight 1.

Layouts (`layout`, ops/sse/reference.py): "masking" (partitions folded into heads, one op call),
"varlen" (tokens reordered by partition, new cu_seqlens, one op call) or "auto" (varlen once the
mean sequence length reaches `varlen_min_len`). `mode="recurrent"` gathers only the selected
partitions per token (decode); unselected partitions stay bit-identical. On the GPU a decode token of SSE (GLA
backbone, top-1, shared partition) with a writable state (the fast engine's cache) runs everything between the
two fused projection matmuls and o_proj as one kernel (`ops/sse/triton_fused_step.py`, `fused_step`), the output
norm and gate included (kernel option `sse_step_finish`); at small shapes the two matmuls are one, the low-rank
up-projections merged into stage 1 (`merged_lowrank`); otherwise the step kernel can apply those up-projections
itself (kernel option `sse_step_lowrank`, `step_ups`), so stage 1 is the one matmul without added weight.
Without gradient (prefill, evaluation, decode) the front end is `fused_inputs`: every projection of x in one
cached matmul, the LoRA and gate up-projections in a second, the shared and sparse q/k normed, rotated and
feature-mapped together (`ops/sse/qk_front.py`; on CUDA one kernel, `triton_qk_front.py`). The same values as
`features` + the router + g_proj, in fewer ops: at a tiny Qwen3-like layer on the CPU a whole no-gradient SSE layer
forward went from 164 to 136 aten ops; kernel option `sse_fused_prefill` switches it off for calls over several
tokens.

State: `SSEState(sparse [N_seq, P, H, K, V], shared [N_seq, H, K, V] | None, conv)`.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from hybridize.ops.common.options import current_kernel_options
from hybridize.ops.decode_gemm.derived import derived_weights
from hybridize.ops.decode_gemm.route import decode_linear
from hybridize.ops.sse import reference as sse_ops
from hybridize.ops.sse.fused_step import StepLayout, StepUps
from hybridize.ops.sse.qk_front import feature_map, qk_front
from hybridize.ops.sse.reference import LAYOUTS, PathInputs, balance_loss, naive_recurrent_sse, pick_layout, route

from .base import (ConvState, Mixer, MixerConfig, MixerOutput, MixerState, RMSNorm, apply_rope, mask_tokens,
                   repeat_kv)

#: silu(SILU_ONE) == 1: an output gate with zero weight and this bias is the identity
SILU_ONE = 1.278464542761074
FEATURE_MAPS = ("silu", "softmax", "identity")
#: kernel option sse_step_lowrank="auto" applies the up-projections in the step kernel up to this many rows (timed at
#: 1 and 8 on an H100: benchmarks/RESULTS.md, "q, k and v as one GEMM")
STEP_LOWRANK_MAX_ROWS = 8
#: kernel option sse_merged_lowrank="auto" merges the low-rank up-projections into the decode step's stage-1 matmul
#: when that adds at most this many weight bytes per layer (about 1.2 us of an H100's bandwidth, under a launch)
MERGE_MAX_EXTRA_BYTES = 4 << 20


@dataclass
class SSECommonConfig(MixerConfig):
    """Settings of both SSE backbones."""

    num_partitions: int = field(default=4, metadata={"help": "N sparse state partitions per head"})
    top_k: int = field(default=1, metadata={"help": "K partitions written (and read) per token"})
    lora_rank: int = field(default=64, metadata={"help": "rank of the sparse-path q/k LoRA (paper: 64)"})
    shared_partition: bool = field(default=True, metadata={
        "help": "one always-selected partition on the base q/k projections"})
    emulq: bool = field(default=True, metadata={"help": "scale the sparse query by the router probability"})
    emulk: bool = field(default=True, metadata={"help": "scale the sparse key by the router probability"})
    layout: str = field(default="auto", metadata={"help": "training layout: 'masking', 'varlen' or 'auto'"})
    varlen_min_len: int = field(default=1024, metadata={
        "help": "'auto' uses varlen when the mean sequence length is at least this"})
    balance_alpha: float = field(default=0.01, metadata={"help": "coefficient of the partition balance loss"})
    router_init_std: float = field(default=0.02, metadata={"help": "std of the random router init"})
    q_map: str = field(default="silu", metadata={"help": "query feature map: silu | softmax | identity"})
    k_map: str = field(default="softmax", metadata={
        "help": "key feature map: softmax (over the head dim) | silu | identity"})
    v_map: str = field(default="silu", metadata={"help": "value feature map: silu | identity"})
    decay_min: float = field(default=0.9, metadata={"help": "smallest initial decay alpha"})
    decay_max: float = field(default=0.999, metadata={"help": "largest initial decay alpha"})
    output_gate: bool = field(default=True, metadata={"help": "multiply the normed output by silu(x W_g)"})


@dataclass
class SSEConfig(SSECommonConfig):
    gate_rank: int = field(default=16, metadata={"help": "low-rank width of the GLA gate projections"})
    gate_normalizer: float = field(default=16.0, metadata={"help": "GLA gate: logsigmoid(.) / this"})


@dataclass
class SSEGDNConfig(SSECommonConfig):
    k_map: str = field(default="silu", metadata={
        "help": "key feature map before the L2 norm: silu | softmax | identity"})
    beta_init: float = field(default=0.5, metadata={"help": "initial beta = sigmoid(b) for every token"})


@dataclass
class SSEState(MixerState):
    """sparse `[N_seq, P, H, K, V]`, shared `[N_seq, H, K, V]` (None without a shared partition), both
    fp32; conv: the short-conv tails (None when `short_conv` is off)."""

    sparse: torch.Tensor | None = None
    shared: torch.Tensor | None = None
    conv: ConvState | None = None


class LowRank(nn.Module):
    """x -> up(down(x)): `[*, d_in]` -> `[*, d_out]` through rank r."""

    def __init__(self, d_in: int, rank: int, d_out: int, bias: bool = False):
        super().__init__()
        self.down = nn.Linear(d_in, rank, bias=False)
        self.up = nn.Linear(rank, d_out, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))


def _spread_decays(n: int, lo: float, hi: float) -> torch.Tensor:
    """n decays alpha with 1 - alpha log-uniform over [1 - hi, 1 - lo] (fp64)."""
    return 1 - torch.logspace(math.log10(1 - hi), math.log10(1 - lo), n, dtype=torch.float64)


class SSE(Mixer):
    """SSE on the GLA backbone (per-key-channel decay)."""

    name: ClassVar[str] = "sse"
    config_class: ClassVar[type[MixerConfig]] = SSEConfig
    state_class: ClassVar[type[MixerState]] = SSEState
    op: ClassVar[str] = "gla"
    #: calls without gradient (prefill, decode) run every projection of x as one cached, concatenated matmul
    fuse_decode: ClassVar[bool] = True
    #: ... and, on the GPU, everything after those matmuls up to the output norm as one kernel (GLA backbone)
    fused_step_kernel: ClassVar[bool] = True

    def __init__(self, config: SSECommonConfig):
        super().__init__(config)
        c = config
        self._validate()
        H, D = c.num_heads, c.head_dim
        self.router = nn.Linear(c.hidden_size, c.num_partitions, bias=False)
        self.lora_q = LowRank(c.hidden_size, c.lora_rank, H * D)
        self.lora_k = LowRank(c.hidden_size, c.lora_rank, c.num_kv_heads * D)
        self.build_gates()
        self.o_norm = RMSNorm(D, c.rms_norm_eps)
        if c.output_gate:
            self.g_proj = nn.Linear(c.hidden_size, H * D, bias=True)
        self.init_new_parameters()

    def _validate(self) -> None:
        c = self.config
        if not 1 <= c.top_k <= c.num_partitions:
            raise ValueError(f"need 1 <= top_k <= num_partitions, got top_k={c.top_k}, N={c.num_partitions}")
        if c.lora_rank < 1:
            raise ValueError(f"lora_rank must be >= 1, got {c.lora_rank}")
        for name in ("q_map", "k_map", "v_map"):
            if getattr(c, name) not in FEATURE_MAPS:
                raise ValueError(f"{name} must be one of {FEATURE_MAPS}, got {getattr(c, name)!r}")
        if c.layout not in ("masking", "varlen", "auto"):
            raise ValueError(f"layout must be 'masking', 'varlen' or 'auto', got {c.layout!r}")
        if not 0.0 < c.decay_min <= c.decay_max < 1.0:
            raise ValueError(f"need 0 < decay_min <= decay_max < 1, got {c.decay_min}, {c.decay_max}")

    # ---- backbone-specific pieces (SSEGDN overrides) -----------------------------------------
    def build_gates(self) -> None:
        c = self.config
        paths = ("shared", "sparse") if c.shared_partition else ("sparse",)
        self.gates = nn.ModuleDict({p: LowRank(c.hidden_size, c.gate_rank, c.num_heads * c.head_dim, bias=True)
                                    for p in paths})

    def reset_gates(self) -> None:
        """Up-projection weight 0: decays start data-independent, spread across the key channels."""
        c = self.config
        alpha = _spread_decays(c.head_dim, c.decay_min, c.decay_max)
        s = alpha.pow(c.gate_normalizer)                           # sigmoid(b) = alpha^normalizer
        b = torch.log(s / (1 - s)).repeat(c.num_heads)
        for lr in self.gates.values():
            lr.down.reset_parameters()
            lr.up.weight.zero_()
            lr.up.bias.copy_(b)

    def path_gates(self, x: torch.Tensor, path: str):
        """(g log-decay `[B, T, H, K]` fp32, beta None) of one path."""
        c = self.config
        B, T, _ = x.shape
        z = self.gates[path](x).float().view(B, T, c.num_heads, c.head_dim)
        return F.logsigmoid(z) / c.gate_normalizer, None

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor):
        return q, k

    # ---- initialisation -------------------------------------------------------------------
    def reset_new_parameters(self) -> None:
        """The stated init rules of the module docstring."""
        super().reset_new_parameters()
        c = self.config
        with torch.no_grad():
            for lr in (self.lora_q, self.lora_k):
                lr.down.reset_parameters()
                lr.up.weight.zero_()
            self.router.weight.normal_(0.0, c.router_init_std)
            self.reset_gates()
            self.o_norm.weight.fill_(1.0)
            if c.output_gate:
                self.g_proj.weight.zero_()
                self.g_proj.bias.fill_(SILU_ONE)

    @torch.no_grad()
    def init_router_from_keys(self, hidden_states: torch.Tensor, iters: int = 25, seed: int = 0,
                              sharpness: float = 5.0) -> torch.Tensor:
        """Router from spherical k-means of the teacher's keys (call after `init_from_attention`).

        hidden_states `[..., hidden]`: inputs of this layer on some calibration text. Keys
        k = x W_k (KV heads concatenated, no bias, no RoPE: routing is position-free) are clustered
        into N unit centroids c_i (farthest-point seeding from a random first point, then Lloyd
        iterations on cosine similarity). Router row i = sharpness * c_i^T W_k / mean|k|, so
        logit_i ~ sharpness * cos(k, c_i) and the top-1 partition is the nearest key centroid.
        Returns the cluster id of every input row `[M]`."""
        c = self.config
        x = hidden_states.reshape(-1, c.hidden_size).float()
        W = self.k_proj.weight.float()                                    # [Hkv*D, hidden]
        keys = x @ W.T
        u = F.normalize(keys, dim=-1)
        M = u.shape[0]
        if M < c.num_partitions:
            raise ValueError(f"init_router_from_keys needs at least num_partitions={c.num_partitions} "
                             f"tokens, got {M}")
        gen = torch.Generator().manual_seed(seed)
        first = int(torch.randint(M, (1,), generator=gen))
        cent = [u[first]]
        for _ in range(1, c.num_partitions):                              # farthest point seeding
            sim = (u @ torch.stack(cent).T).max(-1).values
            cent.append(u[int(sim.argmin())])
        C = torch.stack(cent)
        for _ in range(iters):
            assign = (u @ C.T).argmax(-1)
            for i in range(c.num_partitions):
                members = u[assign == i]
                if len(members):
                    C[i] = F.normalize(members.mean(0), dim=-1)
                else:                                                     # re-seed an empty cluster
                    C[i] = u[int((u @ C.T).max(-1).values.argmin())]
        assign = (u @ C.T).argmax(-1)
        scale = sharpness / keys.norm(dim=-1).mean().clamp(min=1e-6)
        self.router.weight.copy_((scale * C @ W).to(self.router.weight.dtype))
        return assign

    # ---- forward ----------------------------------------------------------------------------
    def features(self, x, attention_mask=None, cu_seqlens=None, position_embeddings=None,
                 conv_state: ConvState | None = None):
        """x `[B, T, hidden]` -> (shared PathInputs | None, sparse PathInputs, new ConvState | None)."""
        c = self.config
        B, T, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        conv = None
        if c.short_conv:
            q, k, v = (mask_tokens(t, attention_mask) for t in (q, k, v))
            cs = conv_state or ConvState()
            q, sq = self.q_conv(q, cs.q, cu_seqlens)
            k, sk = self.k_conv(k, cs.k, cu_seqlens)
            v, sv = self.v_conv(v, cs.v, cu_seqlens)
            conv = ConvState(q=sq, k=sk, v=sv)
        heads = lambda t, h: t.view(B, T, h, c.head_dim)  # noqa: E731
        qs = [heads(q, c.num_heads), heads(q + self.lora_q(x), c.num_heads)]     # [shared, sparse]
        ks = [heads(k, c.num_kv_heads), heads(k + self.lora_k(x), c.num_kv_heads)]
        v = feature_map(heads(v, c.num_kv_heads), c.v_map)
        if c.qk_norm:
            qs, ks = [self.q_norm(t) for t in qs], [self.k_norm(t) for t in ks]
        if c.use_rope:
            if position_embeddings is None:
                raise ValueError("use_rope=True needs position_embeddings (cos, sin) from the model")
            cos, sin = position_embeddings
            qs, ks = [apply_rope(t, cos, sin) for t in qs], [apply_rope(t, cos, sin) for t in ks]
        qs = [feature_map(t, c.q_map) for t in qs]
        ks = [repeat_kv(feature_map(t, c.k_map), self.n_rep) for t in ks]
        qs, ks = zip(*(self.normalize_qk(a, b) for a, b in zip(qs, ks)))
        v = repeat_kv(v, self.n_rep)
        g_sp, b_sp = self.path_gates(x, "sparse")
        sparse = PathInputs(q=qs[1], k=ks[1], v=v, g=g_sp, beta=b_sp)
        shared = None
        if c.shared_partition:
            g_sh, b_sh = self.path_gates(x, "shared")
            # padding must leave the shared state untouched: no write, no decay (the sparse path
            # is kept off padding by the routing, which selects nothing there)
            shared = PathInputs(q=qs[0], k=mask_tokens(ks[0], attention_mask), v=mask_tokens(v, attention_mask),
                                g=mask_tokens(g_sh, attention_mask), beta=mask_tokens(b_sh, attention_mask))
        return shared, sparse, conv

    def finish(self, o: torch.Tensor, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        """o `[B, T, H, D]` -> `[B, T, hidden]`: per-head RMSNorm, silu output gate, o_proj.
        `gate` `[B, T, H * D]`: x W_g + b already computed (the fused decode projection), else g_proj(x)."""
        c = self.config
        B, T = o.shape[:2]
        o = self.o_norm(o)
        if c.output_gate:
            gate = self.g_proj(x) if gate is None else gate
            o = o * F.silu(gate).view(B, T, c.num_heads, c.head_dim)
        return self.o_proj(o.reshape(B, T, -1).to(x.dtype))

    def forward(self, x, state: SSEState | None = None, attention_mask=None, cu_seqlens=None,
                position_embeddings=None, output_state: bool = False, mode: str | None = None,
                layout: str | None = None) -> MixerOutput:
        """See base.py for the contract; `layout` overrides `config.layout` for this call."""
        c = self.config
        B, T, _ = x.shape
        if cu_seqlens is not None and B != 1:
            raise ValueError(f"cu_seqlens needs a packed batch of size 1, got batch {B}")
        mode = self.pick_mode(mode, T, state)
        if mode not in ("chunk", "recurrent"):
            raise ValueError(f"mode must be 'chunk' or 'recurrent', got {mode!r}")
        gate = None
        if mode == "recurrent" and T == 1 and cu_seqlens is None and self.fused_step_ok(x, state, attention_mask,
                                                                                         position_embeddings):
            return MixerOutput(hidden=self.fused_step(x, state, position_embeddings),
                               state=state if output_state else None)
        if self._fused_ok() and (T == 1 or current_kernel_options().sse_fused_prefill):
            # no gradient (decode, or prefill): the fused front end (no short conv: no conv state)
            shared, sparse, logits, gate = self.fused_inputs(x, attention_mask, position_embeddings)
            conv = None
        else:
            shared, sparse, conv = self.features(x, attention_mask, cu_seqlens, position_embeddings,
                                                 state.conv if state is not None else None)
            logits = self.router(x)
        routing = route(logits, c.top_k, attention_mask)
        kw = {}
        if mode == "recurrent":
            fn = naive_recurrent_sse
            # the caller owns this state object (decode cache): the GPU step may update it in place
            kw["inplace"] = state is not None and state.writable
        else:
            fn = LAYOUTS[pick_layout(layout or c.layout, T, cu_seqlens, c.varlen_min_len)]
        init = None if state is None else (state.shared, state.sparse)
        o, sh, sp = fn(self.op, shared, sparse, routing, emulq=c.emulq, emulk=c.emulk, initial_state=init,
                       output_final_state=output_state, cu_seqlens=cu_seqlens, chunk_size=c.chunk_size, **kw)
        aux = balance_loss(routing, c.top_k, c.balance_alpha) if self.training else None
        new_state = SSEState(sparse=sp, shared=sh, conv=conv) if output_state else None
        return MixerOutput(hidden=self.finish(o, x, gate), state=new_state, aux_loss=aux)

    # ---- fused decode step (T == 1, no gradient) ----------------------------------------------
    def direct_gate_linears(self) -> list[nn.Linear]:
        """Gate projections applied to x directly (SSEGDN's a_proj, b_proj); SSE has none."""
        return []

    def lowrank_gates(self) -> list[LowRank]:
        """Low-rank gate projections, shared path first (SSE); SSEGDN has none."""
        c = self.config
        return [self.gates[p] for p in (("shared", "sparse") if c.shared_partition else ("sparse",))]

    def _stage1(self) -> list[nn.Linear]:
        """Linear layers that read x, in the order of the fused projection's output columns: the wide ones
        first and the narrow router / direct gates last, so the low-rank block (the second matmul's input)
        starts at a 16-byte-aligned column (a misaligned operand sends cuBLAS to a 2x slower kernel)."""
        c = self.config
        mods = [self.q_proj, self.k_proj, self.v_proj] + ([self.g_proj] if c.output_gate else [])
        return mods + [self.lora_q.down, self.lora_k.down] + [g.down for g in self.lowrank_gates()] + [
            self.router] + self.direct_gate_linears()

    def _stage2(self) -> list[nn.Linear]:
        return [self.lora_q.up, self.lora_k.up] + [g.up for g in self.lowrank_gates()]

    def _fused_ok(self) -> bool:
        """The fused projections (`fused_inputs`, `fused_step`) apply: no gradient, no short conv, and every projection
        a plain `nn.Linear` of one dtype without hooks (a PEFT-wrapped or hooked projection keeps the generic path)."""
        c = self.config
        if not self.fuse_decode or torch.is_grad_enabled() or c.short_conv:
            return False
        mods = self._stage1() + self._stage2()
        if any(type(m) is not nn.Linear or m._forward_hooks or m._forward_pre_hooks for m in mods):
            return False
        if c.qk_norm and (self.q_norm.eps != self.k_norm.eps or c.qk_norm_scope != "head"):
            return False  # the fused pass norms each head row; a norm over all heads (OLMo 2) keeps the generic path
        return len({m.weight.dtype for m in mods}) == 1

    def _fused_weights(self):
        """(W1, b1, W2, b2, wn): the stage-1 weight `[n1, hidden]` (every projection of x stacked) and bias (None
        if no projection has one); the stage-2 block weight `[2 n + gate widths, 2 r + gate ranks]` on the
        stage-1 low-rank columns: first n = (H + Hkv) D zero rows (the shared q/k get + 0, exactly), then the
        LoRA ups and the gate ups (with their biases); and the q/k norm rows `[H + Hkv, D]` (or None). Cached by
        `derived_weights` (refreshed in the same buffers after an in-place update, so a captured CUDA graph keeps
        reading the current weights after `refresh_decode_weights`). Checkpoints and parameters are unchanged."""
        c = self.config
        s1, s2 = self._stage1(), self._stage2()
        params = [p for m in s1 + s2 for p in (m.weight, m.bias) if p is not None]
        if c.qk_norm:
            params += [self.q_norm.weight, self.k_norm.weight]
        return derived_weights(self, "_fused_cache", params, lambda old: self._build_fused(s1, s2, old))

    def _build_fused(self, s1: list[nn.Linear], s2: list[nn.Linear], old: tuple | None) -> tuple:
        """`_fused_weights`' tensors, written into `old`'s buffers when the shapes match."""
        c = self.config
        w = s1[0].weight
        n = (c.num_heads + c.num_kv_heads) * c.head_dim
        rows2 = 2 * n + sum(m.out_features for m in s2[2:])
        cols2 = sum(m.in_features for m in s2)
        rows1 = sum(m.out_features for m in s1)
        # zero rows up to a multiple of 8: the output's row stride stays 16-byte aligned (cuBLAS fast path)
        shapes = [(-(-rows1 // 8) * 8, c.hidden_size), (rows2, cols2)]
        reuse = old is not None and all(t.shape == sh and t.dtype == w.dtype and t.device == w.device
                                        for t, sh in zip((old[0], old[2]), shapes))
        W1, W2 = (old[0], old[2]) if reuse else (w.new_empty(shapes[0]), w.new_empty(shapes[1]))
        torch.cat([m.weight for m in s1], out=W1[:rows1])
        W1[rows1:].zero_()
        W2.zero_()
        r0, c0 = n, 0
        for m in s2:
            W2[r0:r0 + m.out_features, c0:c0 + m.in_features].copy_(m.weight)
            r0, c0 = r0 + m.out_features, c0 + m.in_features
        b1 = b2 = None
        if any(m.bias is not None for m in s1):
            b1 = old[1] if reuse and old[1] is not None else w.new_zeros(shapes[0][0])
            torch.cat([m.bias if m.bias is not None else w.new_zeros(m.out_features) for m in s1], out=b1[:rows1])
        if any(m.bias is not None for m in s2):
            b2 = old[3] if reuse and old[3] is not None else w.new_empty(rows2)
            torch.cat([w.new_zeros(n)] + [m.bias if m.bias is not None else w.new_zeros(m.out_features)
                                          for m in s2], out=b2)
        wn = None
        if c.qk_norm:   # one weight row per q head then per k head: both norms in one pass
            nw = self.q_norm.weight
            shape = (c.num_heads + c.num_kv_heads, c.head_dim)
            wn = old[4] if (reuse and old[4] is not None and old[4].dtype == nw.dtype) else nw.new_empty(shape)
            torch.cat([self.q_norm.gain().expand(c.num_heads, -1),
                       self.k_norm.gain().expand(c.num_kv_heads, -1)], out=wn)   # gain: Gemma's 1 + weight
        return W1, b1, W2, b2, wn

    def merged_lowrank(self) -> bool:
        """Kernel option `sse_merged_lowrank`: "on", "off", or "auto": merged when that adds at most
        `MERGE_MAX_EXTRA_BYTES` of weight per decode step (the merged rows read beside x cost less than the launch
        they save; the SmolLM2-135M shape: 2.0 MB, merged; Qwen3-1.7B: 28 MB, not)."""
        choice = current_kernel_options().sse_merged_lowrank
        if choice != "auto":
            return choice == "on"
        ups = self._stage2()
        extra = sum(up.out_features for up in ups) * self.config.hidden_size - sum(up.weight.numel() for up in ups)
        return extra * ups[0].weight.element_size() <= MERGE_MAX_EXTRA_BYTES

    def _merged_weights(self):
        """(W, b) for the one-kernel step with `kernel_options.sse_merged_lowrank`: the stage-1 weight (its rows as
        `_fused_weights` has them, zero-padded to a multiple of 8) with the low-rank up-projections merged in below:
        the sparse q|k LoRA deltas `up.weight @ down.weight` (n = (H + Hk) D rows) and the gate pre-activations
        (shared path, then sparse), so one matmul of x gives everything the step reads and the stage-2 matmul goes.
        Costs (n + gate widths) x hidden weights more per decode step than the two stages' rank-wide ones. The bias
        (None when nothing has one) takes `up(down.bias) + up.bias`. Cached as `_fused_weights` is."""
        s1, s2 = self._stage1(), self._stage2()
        params = [p for m in s1 + s2 for p in (m.weight, m.bias) if p is not None]
        return derived_weights(self, "_merged_cache", params, self._build_merged)

    def _build_merged(self, old: tuple | None) -> tuple:
        """`_merged_weights`' tensors, written into `old`'s buffers when the shapes match."""
        W1, b1 = self._fused_weights()[:2]
        downs = [self.lora_q.down, self.lora_k.down] + [g.down for g in self.lowrank_gates()]
        pairs = list(zip(self._stage2(), downs))
        rows = W1.shape[0] + sum(up.out_features for up, _ in pairs)
        shape = (-(-rows // 8) * 8, W1.shape[1])
        reuse = old is not None and old[0].shape == shape and old[0].dtype == W1.dtype
        W = old[0] if reuse else W1.new_empty(shape)
        W[:W1.shape[0]].copy_(W1)
        W[rows:].zero_()
        has_bias = b1 is not None or any(m.bias is not None for pair in pairs for m in pair)
        b = (old[1] if reuse and old[1] is not None else W1.new_empty(shape[0])) if has_bias else None
        if b is not None:
            b.zero_()
            if b1 is not None:
                b[:W1.shape[0]].copy_(b1)
        r0 = W1.shape[0]
        for up, down in pairs:   # fp32 products, one rounding to the weights' dtype
            r1 = r0 + up.out_features
            W[r0:r1].copy_(up.weight.float() @ down.weight.float())
            if b is not None:
                part = up.bias.float() if up.bias is not None else torch.zeros(up.out_features, device=W.device)
                if down.bias is not None:
                    part = part + up.weight.float() @ down.bias.float()
                b[r0:r1].copy_(part)
            r0 = r1
        return W, b

    def merged_layout(self, finish: bool = False) -> StepLayout:
        """`step_layout(finish)` for the merged stage 1 (`_merged_weights`): u is y itself, the deltas and gates below
        the stage-1 rows."""
        n = (self.config.num_heads + self.config.num_kv_heads) * self.config.head_dim
        start = self._fused_weights()[0].shape[0]
        return dataclasses.replace(self.step_layout(finish), delta_col=start, gate_col=start + n)

    @torch.no_grad()
    def refresh_decode_weights(self) -> None:
        """Bring the fused decode weights up to date with the parameters (in place when the shapes still
        match): what a decode loop that replays a captured graph calls before replaying."""
        if self._fused_ok():
            self._fused_weights()
            # the merged stage 1 only where the one-kernel step runs (CUDA): on the CPU nothing reads it
            if self.merged_lowrank() and sse_ops.fused_step_applies(self.o_proj.weight):
                self._merged_weights()

    def _decode_columns(self) -> dict[str, tuple[int, int]]:
        """(first column, width) of each block of the stage-1 output: q|k heads, v heads, the output gate,
        the low-rank inputs (the stage-2 matmul's), the router logits, SSEGDN's direct gates."""
        cols = self.__dict__.get("_decode_cols")
        if cols is not None:
            return cols
        c = self.config
        H, Hk, D = c.num_heads, c.num_kv_heads, c.head_dim
        blocks = [("qk", (H + Hk) * D), ("v", Hk * D)] + ([("gate", H * D)] if c.output_gate else []) + [
            ("low", sum(m.in_features for m in self._stage2())), ("router", c.num_partitions)] + [
            (f"direct{i}", m.out_features) for i, m in enumerate(self.direct_gate_linears())]
        cols, start = {}, 0
        for name, width in blocks:
            cols[name], start = (start, width), start + width
        self.__dict__["_decode_cols"] = cols
        return cols

    def _decode_projections(self, x):
        """x `[B, T, hidden]` -> (y `[B, T, n1]` every projection of x in one matmul, u `[B, T, 2n + gate widths]`
        the LoRA and gate up-projections in a second (the first n columns zero: the shared q/k get + 0),
        the q/k norm weights `[H + Hk, D]` or None, the columns of y)."""
        W1, b1, W2, b2, wn = self._fused_weights()
        cols = self._decode_columns()
        y = decode_linear(x, W1, b1)                                              # [B, T, n1]
        lo, width = cols["low"]
        u = decode_linear(y[..., lo:lo + width], W2, b2)                          # [B, T, 2n + gate widths]
        return y, u, wn, cols

    def fused_inputs(self, x, attention_mask=None, position_embeddings=None):
        """The no-gradient front end (prefill and decode): x `[B, T, hidden]` -> (shared PathInputs | None, sparse
        PathInputs, router logits `[B, T, N]`, output-gate pre-activation `[B, T, H * D]`), the same values as
        `features` + the router + g_proj, with every projection of x in one matmul, the LoRA and gate up-projections
        in a second, and the shared and sparse q/k normalised, rotated and feature-mapped together (path-major
        `[2, B, T, heads, D]`, so each path's tensors are contiguous). A packed batch (`cu_seqlens`) needs nothing
        more: without a short conv no op here crosses tokens, and RoPE takes the positions from
        `position_embeddings`."""
        c = self.config
        B, T, _ = x.shape
        H, Hk, D = c.num_heads, c.num_kv_heads, c.head_dim
        n = (H + Hk) * D
        y, u, wn, cols = self._decode_projections(x)
        col = lambda name: y[..., cols[name][0]:sum(cols[name])]  # noqa: E731
        qk, v, logits = col("qk"), col("v"), col("router")
        gate = col("gate") if c.output_gate else None
        direct = [col(f"direct{i}") for i in range(len(self.direct_gate_linears()))]
        if c.use_rope and position_embeddings is None:
            raise ValueError("use_rope=True needs position_embeddings (cos, sin) from the model")
        q, k = qk_front(qk, u[..., n:2 * n], H, D, (c.q_map, c.k_map),
                        norm=(wn, self.q_norm.eps) if c.qk_norm else None,
                        rope=position_embeddings if c.use_rope else None, kernel=sse_ops.qk_front_applies(x))
        k = repeat_kv(k, self.n_rep)
        q, k = self.normalize_qk(q, k)
        v = repeat_kv(feature_map(v.view(B, T, Hk, D), c.v_map), self.n_rep)
        (g_sh, b_sh), (g_sp, b_sp) = self.decode_gates(u[..., 2 * n:], direct, B, T)
        sparse = PathInputs(q=q[1], k=k[1], v=v, g=g_sp, beta=b_sp)
        shared = None
        if c.shared_partition:
            m = attention_mask
            shared = PathInputs(q=q[0], k=mask_tokens(k[0], m), v=mask_tokens(v, m), g=mask_tokens(g_sh, m),
                                beta=mask_tokens(b_sh, m))
        return shared, sparse, logits, gate

    def fused_step_ok(self, x, state: SSEState | None, attention_mask, position_embeddings) -> bool:
        """The whole decode step after the projection matmuls runs as one kernel (`ops/sse/triton_fused_step.py`):
        the fused projections apply, GLA backbone, top-1 routing with a shared partition, no padding mask, a
        writable fp32 state (the fast engine's cache), power-of-two heads, full rotary; and the kernel options
        allow it (CUDA, option `sse_fused_step`)."""
        c = self.config
        D = c.head_dim
        if (not self.fused_step_kernel or c.top_k != 1 or not c.shared_partition or attention_mask is not None
                or state is None or not state.writable or state.shared is None or D & (D - 1)):
            return False
        if c.use_rope and (position_embeddings is None or position_embeddings[0].shape[-1] != D):
            return False
        if any(t.dtype != torch.float32 or not t.is_contiguous() for t in (state.shared, state.sparse)):
            return False
        return sse_ops.fused_step_applies(x) and self._fused_ok()   # looked up per call: the CPU profile stands in

    def step_layout(self, finish: bool = False, in_step: bool = False) -> StepLayout:
        """The fused step's `StepLayout`: where its kernel finds each input, and this mixer's settings; `finish`: the
        step also applies the output norm and gate (kernel option `sse_step_finish`); `in_step`: it also applies the
        low-rank up-projections (`step_ups`) to y's low-rank columns (kernel option `sse_step_lowrank`)."""
        c = self.config
        cols = self._decode_columns()
        gate_col = cols["gate"][0] if finish and c.output_gate else None
        low = dict(low_col=cols["low"][0], lora_rank=c.lora_rank, gate_rank=c.gate_rank) if in_step else {}
        return StepLayout(heads=c.num_heads, kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                          partitions=c.num_partitions, v_col=cols["v"][0], router_col=cols["router"][0],
                          gate_col=2 * cols["qk"][1], delta_col=cols["qk"][1], q_map=c.q_map, k_map=c.k_map,
                          v_map=c.v_map,
                          gate_normalizer=c.gate_normalizer, norm_eps=self.q_norm.eps if c.qk_norm else None,
                          emulq=c.emulq, emulk=c.emulk, out_norm_eps=self.o_norm.eps if finish else None,
                          out_gate_col=gate_col, **low)

    def fused_step(self, x, state: SSEState, position_embeddings=None) -> torch.Tensor:
        """One decode token through the one-kernel step: x `[B, 1, hidden]` -> the mixer's output `[B, 1, hidden]`;
        `state` is updated in place. With kernel option `sse_step_finish` the kernel also applies the output norm
        and gate, and only o_proj follows it."""
        # deferred: imports triton (optional, GPU only)
        from hybridize.ops.sse.triton_fused_step import sse_gla_step
        step = self.step_inputs(x, state, position_embeddings)
        o = sse_gla_step(**step)
        if step["layout"].out_norm_eps is not None:
            return self.o_proj(o.reshape(*x.shape[:2], -1))
        lo, width = self._decode_columns()["gate"] if self.config.output_gate else (0, 0)
        return self.finish(o, x, step["y"][..., lo:lo + width] if width else None)

    def step_inputs(self, x, state: SSEState, position_embeddings=None) -> dict:
        """The one-kernel step's arguments for the token x `[B, 1, hidden]` (`sse_gla_step(**...)`): the projection
        matmuls of x and the layout for the path the kernel options pick. The LoRA and gate up-projections run merged
        into stage 1 (`sse_merged_lowrank`), in the step kernel (`sse_step_lowrank`), or as a stage-2 matmul."""
        merged, finish = self.merged_lowrank(), current_kernel_options().sse_step_finish
        in_step = not merged and self.lowrank_in_step(x.shape[0])
        if merged:   # one matmul: the low-rank up-projections merged into stage 1, u = y
            W, b = self._merged_weights()
            wn = self._fused_weights()[4]
            y = u = decode_linear(x, W, b)
        elif in_step:   # stage 1 only: the step reads the low-rank columns of y and the up-projection weights
            W1, b1, _, _, wn = self._fused_weights()
            y = u = decode_linear(x, W1, b1)
        else:
            y, u, wn, _ = self._decode_projections(x)
        layouts = self.__dict__.setdefault("_step_layouts", {})   # {(merged, finish, in_step): StepLayout}
        key = (merged, finish, in_step)
        if key not in layouts:
            layouts[key] = self.merged_layout(finish) if merged else self.step_layout(finish, in_step)
        cos, sin = position_embeddings if self.config.use_rope else (None, None)
        return dict(y=y, u=u, shared=state.shared, sparse=state.sparse, layout=layouts[key], norm_weight=wn,
                    cos=cos, sin=sin, out_weight=self.o_norm.gain() if finish else None,
                    ups=self.step_ups() if in_step else None)

    def lowrank_in_step(self, rows: int) -> bool:
        """Kernel option `sse_step_lowrank`: "on", "off", or "auto": the step kernel applies the up-projections for at
        most `STEP_LOWRANK_MAX_ROWS` rows (the batch sizes it was timed at: each of a head's programs reads the
        weight panels, so a larger batch reads more of them than the stage-2 GEMM would)."""
        choice = current_kernel_options().sse_step_lowrank
        return choice == "on" or (choice == "auto" and rows <= STEP_LOWRANK_MAX_ROWS)

    def step_ups(self) -> StepUps:
        """The up-projection weights a step with `step_layout(in_step=True)` applies (the parameters themselves: an
        in-place update is what a captured graph reads next)."""
        g_sh, g_sp = self.lowrank_gates()
        return StepUps(q=self.lora_q.up.weight, k=self.lora_k.up.weight, gate_shared=g_sh.up.weight,
                       gate_sparse=g_sp.up.weight, bias_shared=g_sh.up.bias, bias_sparse=g_sp.up.bias)

    def decode_gates(self, z, direct, B: int, T: int):
        """((g, beta) shared, (g, beta) sparse) from the fused projections: z `[B, T, P * H * D]` the gate
        up-projections (shared first), as `path_gates` computes them (fp32 logsigmoid / normalizer)."""
        c = self.config
        P = len(self.lowrank_gates())
        zf = torch.empty(P, B, T, z.shape[-1] // P, dtype=torch.float32, device=z.device)
        zf.copy_(z.view(B, T, P, -1).movedim(2, 0))                             # path-major, = z.float()
        g = F.logsigmoid(zf)
        del zf                         # a prefill's gates are the largest tensors here (fp32): two alive, not three
        g = g.div_(c.gate_normalizer).view(P, B, T, c.num_heads, c.head_dim)
        return ((g[0], None) if P == 2 else (None, None)), (g[-1], None)


def _inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    return y + torch.log(-torch.expm1(-y))


class SSEGDN(SSE):
    """SSE on the Gated DeltaNet backbone (scalar decay and beta per head, L2-normalised q/k)."""

    name: ClassVar[str] = "sse_gdn"
    config_class: ClassVar[type[MixerConfig]] = SSEGDNConfig
    op: ClassVar[str] = "delta"
    #: the one-kernel decode step is GLA's; the delta rule keeps the separate kernels
    fused_step_kernel: ClassVar[bool] = False

    def _validate(self) -> None:
        super()._validate()
        if not 0.0 < self.config.beta_init < 1.0:
            raise ValueError(f"beta_init must lie in (0, 1), got {self.config.beta_init}")

    def build_gates(self) -> None:
        """Rows [0, H) belong to the shared path, [H, 2H) to the sparse path."""
        c = self.config
        self.a_proj = nn.Linear(c.hidden_size, 2 * c.num_heads, bias=False)
        self.b_proj = nn.Linear(c.hidden_size, 2 * c.num_heads, bias=True)
        self.A_log = nn.Parameter(torch.zeros(2 * c.num_heads))
        self.dt_bias = nn.Parameter(torch.zeros(2 * c.num_heads))

    def reset_gates(self) -> None:
        """a_proj, b_proj weight 0; A = 1; decays spread across heads (both paths); beta = beta_init."""
        c = self.config
        alpha = _spread_decays(c.num_heads, c.decay_min, c.decay_max).repeat(2)
        self.a_proj.weight.zero_()
        self.A_log.zero_()
        self.dt_bias.copy_(_inverse_softplus(-torch.log(alpha)))
        self.b_proj.weight.zero_()
        self.b_proj.bias.fill_(math.log(c.beta_init / (1 - c.beta_init)))

    def path_gates(self, x: torch.Tensor, path: str):
        """(g `[B, T, H]` = -exp(A_log) softplus(x W_a + dt_bias), beta `[B, T, H]` = sigmoid(x W_b)), fp32."""
        H = self.config.num_heads
        rows = slice(0, H) if path == "shared" else slice(H, 2 * H)
        z = F.linear(x, self.a_proj.weight[rows]).float() + self.dt_bias[rows].float()
        g = -self.A_log[rows].float().exp() * F.softplus(z)
        beta = torch.sigmoid(F.linear(x, self.b_proj.weight[rows], self.b_proj.bias[rows]).float())
        return g, beta

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor):
        return F.normalize(q, dim=-1), F.normalize(k, dim=-1)

    def direct_gate_linears(self) -> list[nn.Linear]:
        return [self.a_proj, self.b_proj]

    def lowrank_gates(self) -> list[LowRank]:
        return []

    def decode_gates(self, z, direct, B: int, T: int):
        """From the fused x W_a, x W_b + b `[B, T, 2H]` (shared rows first), as `path_gates` computes them."""
        H = self.config.num_heads
        za, zb = direct
        g = -self.A_log.float().exp() * F.softplus(za.float() + self.dt_bias.float())
        beta = torch.sigmoid(zb.float())
        return (g[..., :H], beta[..., :H]), (g[..., H:], beta[..., H:])


__all__ = ["SSE", "SSEConfig", "SSEGDN", "SSEGDNConfig", "SSEState", "LowRank", "feature_map"]
