"""Sliding-window softmax attention (SWA): the teacher's attention restricted to the last `window` tokens.

Used in hybrid patterns such as the SSE paper's "sse,swa,sse,swa,attn" ("Scaling Linear Attention with
Sparse State Expansion", 12B conversion).
Teacher weights and RoPE are kept (q/k/v/o, Qwen2 biases, Qwen3 q/k norms), so with `window >= T`
this is exactly the teacher's causal attention. Query t attends to the real tokens j <= t with
`rank(t) - rank(j) < window` (rank = index among the sequence's real tokens), i.e. itself plus the
`window - 1` real tokens before it, the same band as the `sliding_window` of Mistral/Qwen2 in HF.

- chunk mode (training, prefill): one `scaled_dot_product_attention` call with a banded causal
  boolean mask over `[buffer, new tokens]`; packed `cu_seqlens` without a state use a
  block-diagonal band on the packed row (no state crosses a document boundary). A prefill from no state
  longer than `BAND_BLOCK` + window runs blocks of `BAND_BLOCK` queries against the keys their band reaches
  (`_band_blocks`): O(T x window) work and mask memory instead of the dense mask's O(T^2); the blocks go to sdpa
  together, as overlapping windows of the keys, unless padding inside a row stretches a band.
- recurrent mode (ground truth): one token at a time against the buffer in token order, explicit fp32
  softmax. A single token (decode) runs `_step` instead: the new key and value are written into their ring
  slot (in place when the state's owner marks it writable, as the fast engine does), then one sdpa call reads
  the whole state tensor, each KV head's query heads as its query rows; no shift, no concatenation, no repeated
  or fp32 copy of the buffer (tested against `_recurrent`). On the GPU, with a writable state and no padding mask
  (the fast engine's decode loop), the write, the attention and the clearing of the slot that leaves the band run as
  the two launches of a split-KV decode kernel (`ops/attn_decode/triton_window_step.py`; option `window_step`),
  tested against this step: same outputs, same state.
- state (`SWAState`): keys (after RoPE) and values `[N, Hkv, sinks + window, D]`, fixed-size, plus `seen` `[N]`
  real tokens so far. Slot i < sinks holds the real token of rank i + 1 (the attention sinks); the other
  `window` slots are a ring, the real token of rank r in slot sinks + (r - 1) % window. A new token overwrites
  the one `window` ranks before it, which no later query's band reaches, so a decode step writes one slot and
  reads the tensor as it stands; validity follows from `seen` alone. The cache does not grow with the sequence.

Attention sinks (`sinks` > 0; "Efficient Streaming Language Models with Attention Sinks"): every query also
attends to the sequence's first `sinks` real tokens, kept in the state's first `sinks` slots (read from there
once they have left the window). A model trained with full attention parks much of its attention on the first
tokens; a plain window takes them away once the sequence is longer than the window. Measured on the embedded
default (30 layers, 5 kept softmax layers at 16, 17, 18, 20, 23, the other 25 as windows of 512, no training):
teacher-forced S-NIAH-1 answer top-1 at 2k context 0.19 without sinks, 0.80 with 4 (the teacher 0.88).

Padding (`attention_mask` False) is neither attended to nor stored and does not count towards the
window; outputs at padded positions are unspecified (they attend to themselves only, so no NaN).
Not a linear mixer: `short_conv` is refused.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from hybridize.ops.attn_decode import window_step as window_ops
from hybridize.ops.common.varlen import check_cu_seqlens, pack_to_padded, padded_to_pack, seq_lengths

from .base import Mixer, MixerConfig, MixerOutput, MixerState, repeat_kv


@dataclass
class SWAConfig(MixerConfig):
    window: int = field(default=512, metadata={"help": "tokens each query sees, itself included"})
    sinks: int = field(default=0, metadata={
        "help": "the sequence's first real tokens every query also sees (attention sinks; 0 = a plain window)"})
    use_rope: bool = field(default=True, metadata={"help": "apply the teacher's RoPE (kept for SWA)"})
    softmax_scale: float | None = field(
        default=None, metadata={"help": "score scale; None = the teacher's (attn_scale, else head_dim ** -0.5)"})


@dataclass
class SWAState(MixerState):
    """The sinks and a ring of the last real keys/values (module docstring): slot i < sinks holds rank i + 1,
    slot sinks + (r - 1) % window rank r."""

    k: torch.Tensor | None = None        # [N, Hkv, sinks + window, D], after RoPE / k_norm
    v: torch.Tensor | None = None        # [N, Hkv, sinks + window, D]
    seen: torch.Tensor | None = None     # [N] int64, real tokens so far (the global rank of the newest)


#: queries per block of a long prefill's band (`_band_blocks`): each block reads at most `window - 1 + BAND_BLOCK`
#: keys, plus the sinks
BAND_BLOCK = 1024
#: the most elements one batched call of the band's blocks holds (`_band_windows`): its boolean mask x 2 on CUDA (the
#: memory-efficient kernel reads the mask), its fp32 scores (mask x heads) on the CPU's math path
BAND_GROUP_ELEMENTS = 2 ** 28


class SlidingWindowAttention(Mixer):
    name = "swa"
    config_class = SWAConfig
    state_class = SWAState

    def __init__(self, config: SWAConfig):
        if config.window < 1:
            raise ValueError(f"window must be >= 1, got {config.window}")
        if config.sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {config.sinks}")
        if config.short_conv:
            raise ValueError("short_conv is an option of the linear mixers; set short_conv=False for swa")
        super().__init__(config)
        self.slots = config.window - 1
        self.scale = config.softmax_scale if config.softmax_scale is not None else config.teacher_scale

    # ---- public ---------------------------------------------------------------------------
    def forward(self, x, state: SWAState | None = None, attention_mask=None, cu_seqlens=None,
                position_embeddings=None, output_state=False, mode=None) -> MixerOutput:
        """x `[B, T, hidden]` -> MixerOutput(hidden `[B, T, hidden]`, state `SWAState` if asked)."""
        c = self.config
        B, T, _ = x.shape
        mode = self.pick_mode(mode, T, state)
        if mode not in ("chunk", "recurrent"):
            raise ValueError(f"mode must be 'chunk' or 'recurrent', got {mode!r}")
        q, k, v, _ = self.project_qkv(x, attention_mask, cu_seqlens, position_embeddings)
        if cu_seqlens is not None:
            if attention_mask is not None:
                raise ValueError("give either cu_seqlens (packed) or attention_mask (padded), not both")
            check_cu_seqlens(x, cu_seqlens)
            o, new = self._packed(q, k, v, cu_seqlens, state, mode, output_state)
        elif mode == "recurrent" and T == 1:   # decode: no padding mask is the common case, and costs no kernels
            o, new = self._step(q, k, v, None if attention_mask is None else attention_mask.bool(), state, output_state)
        else:
            real = (torch.ones(B, T, dtype=torch.bool, device=x.device) if attention_mask is None
                    else attention_mask.bool())
            if mode == "chunk":
                o, new = self._chunk(q, k, v, real, state, output_state, dense=attention_mask is None)
            else:
                o, new = self._recurrent(q, k, v, real, state, output_state)
        hidden = self.o_proj(o.reshape(B, T, c.num_heads * c.head_dim).to(x.dtype))
        return MixerOutput(hidden=hidden, state=new if output_state else None)

    def empty_state(self, batch: int, device=None, dtype=torch.float32) -> SWAState:
        c = self.config
        z = torch.zeros(batch, c.num_kv_heads, c.sinks + c.window, c.head_dim, device=device, dtype=dtype)
        return SWAState(k=z, v=z.clone(), seen=torch.zeros(batch, dtype=torch.long, device=device))

    # ---- helpers ----------------------------------------------------------------------------
    def _checked(self, state: SWAState | None, B: int, k: torch.Tensor) -> SWAState:
        st = state if state is not None else self.empty_state(B, k.device, k.dtype)
        c = self.config
        if st.k.shape[0] != B or st.k.shape[2] != c.sinks + c.window:
            raise ValueError(f"state buffer {tuple(st.k.shape)} does not fit batch {B}, window {c.window} and "
                             f"{c.sinks} sinks (expected [B, Hkv, {c.sinks + c.window}, D]: it came from another "
                             f"window or sink count)")
        return st

    def _ring_slots(self, seen: torch.Tensor) -> torch.Tensor:
        """The ring slots of the last `window - 1` real ranks, oldest first, after `seen` `[B]`: `[B, window - 1]`
        (ranks below 1 get the slots they would have; they are marked invalid by `_buffer`)."""
        j = torch.arange(self.slots, device=seen.device)
        return self.config.sinks + (seen.unsqueeze(1) - self.slots + j) % self.config.window

    def _valid(self, seen: torch.Tensor) -> torch.Tensor:
        """`[B, window - 1]`: which of the last `window - 1` ranks (oldest first) exist after `seen` real tokens."""
        return torch.arange(self.slots, device=seen.device).unsqueeze(0) >= (self.slots - seen).unsqueeze(1)

    def _buffer(self, state: SWAState | None, k: torch.Tensor):
        """State -> (the last `window - 1` real keys, values `[B, P, Hkv, D]` oldest first, right-aligned, in the
        token layout and dtype of k; valid `[B, P]`)."""
        B = k.shape[0]
        st = self._checked(state, B, k)
        seen = st.seen.to(k.device)
        idx = self._ring_slots(seen)[:, None, :, None].expand(B, st.k.shape[1], self.slots, st.k.shape[3])
        valid = self._valid(seen)
        return (st.k.gather(2, idx).transpose(1, 2).to(k.dtype), st.v.gather(2, idx).transpose(1, 2).to(k.dtype),
                valid)

    def _sink_buffer(self, state: SWAState | None, B: int, k: torch.Tensor):
        """(sink keys, values `[B, sinks, Hkv, D]` in the token layout, valid `[B, sinks]`, seen `[B]`)."""
        st = self._checked(state, B, k)
        seen = st.seen.to(k.device)
        n_sink = self.config.sinks
        if not n_sink:
            return None, None, None, seen
        valid = torch.arange(n_sink, device=k.device).unsqueeze(0) < seen.unsqueeze(1)
        return (st.k[:, :, :n_sink].transpose(1, 2).to(k.dtype), st.v[:, :, :n_sink].transpose(1, 2).to(k.dtype),
                valid, seen)

    def _new_sinks(self, sk, sv, k, v, real, seen):
        """The sink buffer after new tokens k, v `[B, T, Hkv, D]` (real `[B, T]`) followed `seen` real tokens:
        the ones whose global rank is at most `sinks` fill their slots. Returns `[B, sinks, Hkv, D]` twice."""
        B, T = real.shape
        grank = seen.unsqueeze(1) + real.long().cumsum(1)            # [B, T], 1-based, non-decreasing
        ranks = torch.arange(1, self.config.sinks + 1, device=k.device).expand(B, -1).contiguous()
        # rank r is taken by the first token whose global rank reaches r (the count steps up at real tokens only);
        # it is new here when seen < r <= the row's count after these tokens
        at = torch.searchsorted(grank, ranks).clamp(max=T - 1)             # [B, sinks]
        hit = ((ranks > seen.unsqueeze(1)) & (ranks <= grank[:, -1:]))[:, :, None, None]
        idx = at[:, :, None, None].expand(B, ranks.shape[1], *k.shape[2:])
        return torch.where(hit, k.gather(1, idx), sk), torch.where(hit, v.gather(1, idx), sv)

    def _state_from(self, bk, bv, seen, sk=None, sv=None) -> SWAState:
        """A state from the last `window - 1` real keys / values `[B, P, Hkv, D]` (oldest first, right-aligned:
        `_buffer`'s layout), the real-token count `seen` `[B]` and the sinks `[B, sinks, Hkv, D]` (token layout)."""
        B, P, Hkv, D = bk.shape
        st = self.empty_state(B, bk.device, bk.dtype)
        idx = self._ring_slots(seen)[:, None, :, None].expand(B, Hkv, P, D)
        st.k.scatter_(2, idx, bk.transpose(1, 2))
        st.v.scatter_(2, idx, bv.transpose(1, 2))
        if sk is not None:
            st.k[:, :, :sk.shape[1]] = sk.transpose(1, 2)
            st.v[:, :, :sv.shape[1]] = sv.transpose(1, 2)
        st.seen = seen.clone()
        return st

    def _keep_last(self, k, v, valid):
        """Last `window - 1` valid entries of k, v `[B, S, Hkv, D]` (valid `[B, S]`), right-aligned, oldest first:
        `[B, window - 1, Hkv, D]` twice (empty slots zero)."""
        B, S = valid.shape
        P = self.slots
        if S < P:  # too short to fill the buffer: prepend empty slots
            pad = P - S
            k, v = F.pad(k, (0, 0, 0, 0, pad, 0)), F.pad(v, (0, 0, 0, 0, pad, 0))
            valid = F.pad(valid, (pad, 0), value=False)
            S = P
        pos = torch.arange(S, device=k.device).expand(B, S)
        score = torch.where(valid, pos, torch.full_like(pos, -1))
        idx = score.topk(P, dim=1).indices.flip(1)       # the P latest valid slots, oldest first
        count = valid.sum(1).clamp(max=P)
        keep = torch.arange(P, device=k.device).unsqueeze(0) >= (P - count).unsqueeze(1)
        gather = idx[:, :, None, None].expand(B, P, *k.shape[2:])
        zero = keep[:, :, None, None].to(k.dtype)
        return k.gather(1, gather) * zero, v.gather(1, gather) * zero

    def _sdpa(self, q, k, v, allowed):
        """q `[B, T, H, D]`, k/v `[B, S, Hkv, D]`, allowed `[B or 1, T, S]` bool -> `[B, T, H, D]`."""
        k, v = repeat_kv(k, self.n_rep), repeat_kv(v, self.n_rep)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=allowed.unsqueeze(1), scale=self.scale)
        return o.transpose(1, 2)

    # ---- chunk mode -------------------------------------------------------------------------
    def _chunk(self, q, k, v, real, state, output_state, dense: bool = False):
        """Banded causal attention over `[buffer, new tokens]`; real `[B, T]` marks non-padding (`dense`: known on the
        host to be all True)."""
        B, T = real.shape
        W = self.config.window
        if state is None and T > BAND_BLOCK + W:   # a long prefill from nothing: the band, a block at a time
            o = self._band_blocks(q, k, v, real, dense)
            return o, self._chunk_state(None, k, v, real, k, v, real) if output_state else None
        if state is not None:
            bk, bv, bvalid = self._buffer(state, k)
            k_all, v_all = torch.cat([bk, k], 1), torch.cat([bv, v], 1)
            valid = torch.cat([bvalid, real], 1)
        else:
            k_all, v_all, valid = k, v, real
        S = valid.shape[1]
        P = S - T
        rank = valid.long().cumsum(1)                     # rank among real tokens, buffer included
        q_rank = rank[:, P:]
        key_pos = torch.arange(S, device=q.device)
        q_pos = torch.arange(P, S, device=q.device)
        causal = key_pos.view(1, 1, S) <= q_pos.view(1, T, 1)
        in_window = q_rank.unsqueeze(2) - rank.unsqueeze(1) < W
        sk, sv, svalid, seen = self._sink_buffer(state, B, k)
        if sk is not None:
            # global ranks: the buffer's newest real token is `seen`; the new tokens follow it
            q_grank = seen.unsqueeze(1) + real.long().cumsum(1)                          # [B, T]
            new_sink = torch.cat([torch.zeros_like(valid[:, :P]), real & (q_grank <= self.config.sinks)], 1)
            in_window = in_window | new_sink.unsqueeze(1)   # a new sink stays visible after it leaves the window
            # a buffered sink is read from the sink buffer only once it has left the window (no double count)
            s_rank = torch.arange(1, self.config.sinks + 1, device=q.device)
            s_ok = svalid.unsqueeze(1) & (q_grank.unsqueeze(2) - s_rank.view(1, 1, -1) >= W)
        allowed = valid.unsqueeze(1) & causal & in_window
        allowed = allowed | (key_pos.view(1, 1, S) == q_pos.view(1, T, 1))   # padded queries: self only
        if sk is None:
            o = self._sdpa(q, k_all, v_all, allowed)
        else:   # the sink buffer as extra keys in front
            o = self._sdpa(q, torch.cat([sk, k_all], 1), torch.cat([sv, v_all], 1), torch.cat([s_ok, allowed], 2))
        return o, self._chunk_state(state, k_all, v_all, valid, k, v, real) if output_state else None

    def _chunk_state(self, state, k_all, v_all, valid, k, v, real) -> SWAState:
        """The state after new tokens k, v `[B, T, Hkv, D]` (real `[B, T]`) followed `state`: the last `window - 1`
        valid entries of `[buffer, new]` (k_all, v_all, valid), the real-token count, and the sinks filled."""
        bk, bv = self._keep_last(k_all, v_all, valid)
        sk, sv, _, seen = self._sink_buffer(state, real.shape[0], k)
        if sk is not None:
            sk, sv = self._new_sinks(sk, sv, k, v, real, seen)
        return self._state_from(bk, bv, seen + real.long().sum(1), sk, sv)

    def _block_starts(self, rank, T: int, dense: bool) -> tuple[list[int], bool]:
        """(starts, contiguous): the first key position each `BAND_BLOCK` block of queries reaches in any row (rank
        `[B, T]`), and whether every block's band lies within `[a - window + 1, a + BAND_BLOCK)` for its first query a
        (true without padding, and with padding only in front or behind each row's real tokens). Without padding
        (`dense`) both are known on the host; otherwise they are computed on the device and read in one host sync for
        the layer (it was one per block: at 8k on the 135M shape, batch 1, the prefill waited on the host for 3x its
        GPU time)."""
        W = self.config.window
        if dense:
            return [max(0, a - W + 1) for a in range(0, T, BAND_BLOCK)], True
        # rank is non-decreasing, so a block's lowest query rank is at its first query; keys ranked W or more below
        # it are outside every band of the block (only sinks reach further back)
        first = (rank[:, ::BAND_BLOCK] - W + 1).contiguous()                      # [B, blocks]
        starts = torch.searchsorted(rank, first).amin(0)
        # the band stays within the uniform slice when the real keys before it are W ranks below the block's first
        # real query: rank(a - W) = 0 (none) or rank(a - 1) + 1 - rank(a - W) >= W
        a = torch.arange(0, T, BAND_BLOCK, device=rank.device)
        r0 = F.pad(rank, (W + 1, 0))                                             # r0[:, p + W + 1] = rank(p), 0 before
        before, q_first = r0[:, a + 1], r0[:, a + W] + 1
        contiguous = ((before == 0) | (q_first - before >= W)).all()
        out = torch.cat([starts, contiguous.long().view(1)]).tolist()
        return out[:-1], bool(out[-1])

    def _band_blocks(self, q, k, v, real, dense: bool = False):
        """`_chunk`'s output without a state, `BAND_BLOCK` queries at a time against the keys their band reaches
        (and each row's first `sinks` real tokens in front): O(T x (window + block)) work and mask memory, where
        one dense `[T, T]` mask costs O(T^2) (at 16k, 32x the work of a 512 window). When every band lies within its
        block's uniform slice (`_block_starts`), the blocks run as few batched sdpa calls on overlapping windows of
        the keys (`_band_windows`); otherwise one call per block from its searched start."""
        B, T = real.shape
        n_sink = self.config.sinks
        rank = real.long().cumsum(1)                                              # [B, T]
        pos = torch.arange(T, device=q.device)
        sinks = None
        if n_sink:   # each row's first `sinks` real tokens, as positions [B, sinks] (T: the row has fewer)
            sink_pos = torch.where(real & (rank <= n_sink), pos, T).sort(1).values[:, :n_sink]
            sink_idx = sink_pos.clamp(max=T - 1)[:, :, None, None].expand(B, n_sink, *k.shape[2:])
            sinks = (sink_pos, sink_pos < T, k.gather(1, sink_idx), v.gather(1, sink_idx))
        starts, contiguous = self._block_starts(rank, T, dense)
        if contiguous:
            return self._band_windows(q, k, v, real, rank, sinks)
        out = []
        for a, lo in zip(range(0, T, BAND_BLOCK), starts):
            b = min(a + BAND_BLOCK, T)
            allowed = self._band_mask(rank[:, a:b], pos[a:b], rank[:, lo:b], real[:, lo:b], pos[lo:b])
            ks, vs = k[:, lo:b], v[:, lo:b]
            if sinks is not None:   # sinks before the slice as extra keys in front (those inside it are in `allowed`)
                sink_pos, sink_real, sink_k, sink_v = sinks
                early = (sink_real & (sink_pos < lo)).unsqueeze(1).expand(B, b - a, n_sink)
                ks, vs, allowed = torch.cat([sink_k, ks], 1), torch.cat([sink_v, vs], 1), torch.cat([early, allowed], 2)
            out.append(self._sdpa(q[:, a:b], ks, vs, allowed))
        return torch.cat(out, 1)

    def _band_mask(self, q_rank, q_pos, k_rank, k_real, k_pos):
        """Which keys each query attends to, `[..., Tq, Tk]` from q_rank `[..., Tq]`, k_rank / k_real `[..., Tk]` and
        positions q_pos `[Tq]` / k_pos `[Tk]` (or with the same leading dims): real, causal, in the window or among
        the sinks; a padded query attends to itself only."""
        causal = k_pos.unsqueeze(-2) <= q_pos.unsqueeze(-1)
        near = (q_rank.unsqueeze(-1) - k_rank.unsqueeze(-2) < self.config.window) | (
            k_rank <= self.config.sinks).unsqueeze(-2)
        return (k_real.unsqueeze(-2) & causal & near) | (k_pos.unsqueeze(-2) == q_pos.unsqueeze(-1))

    def _band_windows(self, q, k, v, real, rank, sinks):
        """`_band_blocks` when every block's keys lie in `[a - window + 1, a + BAND_BLOCK)`: the keys padded by
        `window - 1` in front and the queries to whole blocks, each block's keys an overlapping window of them
        (`unfold`, a view), and the blocks run in groups as batched sdpa calls, a few per layer instead of one per
        block (the 135M shape's prefill was bound by these launches), in groups of blocks within
        `BAND_GROUP_ELEMENTS`."""
        B, T, H, D = q.shape
        W, Bk, n_sink = self.config.window, BAND_BLOCK, self.config.sinks
        n = -(-T // Bk)
        S, tail = Bk + W - 1, n * Bk - T
        win = lambda t, fill=0: F.pad(t, (0, 0) * (t.dim() - 2) + (W - 1, tail), value=fill).unfold(1, S, Bk)  # noqa: E731
        kw, vw = (win(t).movedim(-1, 2) for t in (k, v))                           # [B, n, S, Hkv, D]
        k_real, k_rank = win(real, False), win(rank)                               # [B, n, S]
        k_pos = torch.arange(-(W - 1), n * Bk, device=q.device).unfold(0, S, Bk)  # [n, S]
        q_pos = torch.arange(n * Bk, device=q.device).view(n, Bk)
        q_rank = F.pad(rank, (0, tail)).view(B, n, Bk)
        qb = F.pad(q, (0, 0, 0, 0, 0, tail)).view(B, n, Bk, H, D)
        allowed = self._band_mask(q_rank, q_pos, k_rank, k_real, k_pos)           # [B, n, Bk, S]
        if sinks is not None:   # each row's sinks before a block's slice, as extra keys in front
            sink_pos, sink_real, sink_k, sink_v = sinks
            early = sink_real.unsqueeze(1) & (sink_pos.unsqueeze(1) < k_pos[:, :1].unsqueeze(0))   # [B, n, sinks]
            allowed = torch.cat([early.unsqueeze(2).expand(B, n, Bk, n_sink), allowed], 3)
            kw = torch.cat([sink_k.unsqueeze(1).expand(B, n, *sink_k.shape[1:]), kw], 2)
            vw = torch.cat([sink_v.unsqueeze(1).expand(B, n, *sink_v.shape[1:]), vw], 2)
        group = max(1, BAND_GROUP_ELEMENTS // (B * Bk * allowed.shape[-1] * (2 if q.is_cuda else H)))
        out = []
        for j in range(0, n, group):
            g = slice(j, min(j + group, n))
            flat = lambda t: t[:, g].flatten(0, 1)                                  # noqa: E731
            out.append(self._sdpa(flat(qb), flat(kw), flat(vw), flat(allowed)).view(B, -1, H, D))
        return torch.cat(out, 1)[:, :T]

    # ---- recurrent mode ---------------------------------------------------------------------
    def _recurrent(self, q, k, v, real, state, output_state):
        """Token by token against the buffer (explicit fp32 softmax): decode and ground truth."""
        B, T, H, D = q.shape
        W, n_sink = self.config.window, self.config.sinks
        st = state if state is not None else self.empty_state(B, q.device, k.dtype)
        bk, bv, bvalid = self._buffer(st, k)              # [B, P, Hkv, D]
        sk, sv, svalid, seen = self._sink_buffer(st, B, k)
        s_rank = torch.arange(1, n_sink + 1, device=q.device)
        out = []
        for t in range(T):
            ks, vs = torch.cat([bk, k[:, t:t + 1]], 1), torch.cat([bv, v[:, t:t + 1]], 1)
            ok = torch.cat([bvalid, bvalid.new_ones(B, 1)], 1)            # [B, P + 1]
            if n_sink:   # the sinks that have left the window (the ring holds the others)
                g = seen + real[:, t].long()                               # this token's global rank
                s_ok = svalid & (g.unsqueeze(1) - s_rank.unsqueeze(0) >= W)
                ks, vs, ok = torch.cat([sk, ks], 1), torch.cat([sv, vs], 1), torch.cat([s_ok, ok], 1)
            kr, vr = repeat_kv(ks, self.n_rep).float(), repeat_kv(vs, self.n_rep).float()
            s = torch.einsum("bhd,bshd->bhs", q[:, t].float(), kr) * self.scale
            p = s.masked_fill(~ok.unsqueeze(1), float("-inf")).softmax(-1)
            out.append(torch.einsum("bhs,bshd->bhd", p, vr).to(q.dtype))
            # a real token enters the buffer (the oldest slot drops out); padding leaves it as is
            r = real[:, t].view(B, 1, 1, 1)
            ring_k, ring_v = ks[:, n_sink:], vs[:, n_sink:]
            bk = torch.where(r, ring_k[:, 1:], bk)
            bv = torch.where(r, ring_v[:, 1:], bv)
            if n_sink:   # one of the first `sinks` real tokens takes its sink slot
                hit = (real[:, t] & (g <= n_sink)).view(B, 1, 1, 1) & (s_rank.view(1, -1, 1, 1) == g.view(B, 1, 1, 1))
                sk = torch.where(hit, k[:, t:t + 1], sk)
                sv = torch.where(hit, v[:, t:t + 1], sv)
                svalid = s_rank.unsqueeze(0) <= (g.unsqueeze(1))
            seen = seen + real[:, t].long()
            bvalid = self._valid(seen)
        o = torch.stack(out, 1)
        return o, self._state_from(bk, bv, seen, sk, sv) if output_state else None

    def _step_thresholds(self, device) -> torch.Tensor:
        """`[sinks + window]`: the rank g a decode query needs to read each slot (`window_step.slot_ranks`): sink i
        (rank i + 1) once it has left the window (g >= i + 1 + window; inside it the ring holds it); ring slot j once
        filled (g >= j + 1). Built once per device and shape (the decode step's mask is then one compare)."""
        key = (device, self.config.window, self.config.sinks)
        if getattr(self, "_thresholds", (None,))[0] != key:
            self._thresholds = (key, window_ops.slot_ranks(self.config.window, self.config.sinks, device))
        return self._thresholds[1]

    def _step(self, q, k, v, real, state, output_state):
        """One token (decode), `_recurrent` for T = 1 in the state's own layout: the new key and value go into the
        ring slot of rank seen + 1 (and, while the sinks fill, into their sink slot), then one sdpa call reads the
        whole state `[B, Hkv, sinks + window, D]`, each KV head's query heads as its query rows, under the mask
        `seen` gives. In place when the state is writable (its owner holds it: the fast engine), else on a copy.
        A padding row writes into the slot of rank seen + 1 - window, which no band reaches any more (and is
        cleared after the call), and its count stays. `real` `[B, 1]`, or None: no padding (the decode loops' case,
        which then spends no kernels on it)."""
        B, _, H, D = q.shape
        W, n_sink = self.config.window, self.config.sinks
        if real is None and output_state and self._kernel_step_ok(q, state):
            # deferred: imports triton (optional, GPU only)
            from hybridize.ops.attn_decode.triton_window_step import window_step
            o = window_step(q, k, v, state.k, state.v, state.seen, W, n_sink, self.scale)
            state.seen.add_(1)
            return o, state
        st = self._checked(state, B, k)
        Hkv = st.k.shape[1]
        seen = st.seen.to(q.device)
        r = None if real is None else real[:, 0].long()
        g = seen + 1 if r is None else seen + r                               # this token's rank (padding: seen)
        ring = n_sink + seen % W
        slots = ring.unsqueeze(1)                                             # [B, 1]: the ring slot
        if n_sink:   # and, while the sinks fill, the sink slot
            hit = g <= n_sink if r is None else (g <= n_sink) & (r > 0)
            slots = torch.stack([ring, torch.where(hit, g - 1, ring)], 1)
        idx = slots[:, None, :, None].expand(B, Hkv, slots.shape[1], D)
        inplace = output_state and state is not None and state.writable
        ks, vs = (st.k, st.v) if inplace else (st.k.clone(), st.v.clone())
        ks.scatter_(2, idx, k.transpose(1, 2).to(ks.dtype).expand(idx.shape))
        vs.scatter_(2, idx, v.transpose(1, 2).to(vs.dtype).expand(idx.shape))
        rank = g if r is None else g.clamp(min=1)                             # a padding row at 0 reads its own slot
        ok = rank.unsqueeze(1) >= self._step_thresholds(q.device)                             # [B, sinks + window]
        qg = q[:, 0].reshape(B, Hkv, self.n_rep, D)                                               # [B, Hkv, rep, D]
        o = F.scaled_dot_product_attention(qg, ks.to(q.dtype), vs.to(q.dtype), attn_mask=ok[:, None, None, :],
                                           scale=self.scale)
        o = o.reshape(B, 1, H, D)
        if not output_state:
            return o, None
        # the slot of rank g + 1 - window has just left every band: cleared, so the state equals the one a
        # chunk call over the same tokens writes (a padding row clears what it wrote)
        dead = (n_sink + g % W)[:, None, None, None].expand(B, Hkv, 1, D)
        ks.scatter_(2, dead, 0.0)
        vs.scatter_(2, dead, 0.0)
        if inplace:
            state.seen.add_(1 if r is None else r.to(state.seen.device))
            return o, state
        return o, SWAState(k=ks, v=vs, seen=g)

    def _kernel_step_ok(self, q, state: SWAState | None) -> bool:
        """The decode token runs as the split-KV window kernel (`ops/attn_decode/triton_window_step.py`): a writable
        state (the fast engine's cache) of this layer's shape, contiguous, on q's device; a power-of-two head dim; CUDA
        (or the interpreter with option `force_triton`), option `window_step` on, kernels not "torch", no fp64."""
        if state is None or not state.writable or state.k is None:
            return False
        D = q.shape[-1]
        if (D & (D - 1) or state.k.shape[2] != self.config.sinks + self.config.window or not state.k.is_contiguous()
                or not state.v.is_contiguous() or state.seen.device != q.device or state.k.device != q.device):
            return False
        return window_ops.window_step_applies(q)

    # ---- packed documents -------------------------------------------------------------------
    def _packed(self, q, k, v, cu_seqlens, state, mode, output_state):
        """B == 1 packed row: block-diagonal band (no state), else per-document padded batch."""
        lens = seq_lengths(cu_seqlens)
        if state is None and mode == "chunk":
            T = q.shape[1]
            doc = torch.repeat_interleave(torch.arange(len(lens), device=q.device),
                                          torch.tensor(lens, device=q.device))
            pos = torch.arange(T, device=q.device)
            starts = torch.tensor([0, *lens], device=q.device).cumsum(0)[doc]   # each token's document start
            allowed = ((doc.unsqueeze(1) == doc.unsqueeze(0)) & (pos.unsqueeze(0) <= pos.unsqueeze(1))
                       & ((pos.unsqueeze(1) - pos.unsqueeze(0) < self.config.window)
                          | (pos - starts < self.config.sinks).unsqueeze(0)))
            o = self._sdpa(q, k, v, allowed.unsqueeze(0))
            new = None
            if output_state:
                real = pack_to_padded(torch.ones(q.shape[:2], dtype=torch.bool, device=q.device),
                                      cu_seqlens, value=False)
                pk, pv = pack_to_padded(k, cu_seqlens), pack_to_padded(v, cu_seqlens)
                new = self._chunk_state(None, pk, pv, real, pk, pv, real)
            return o, new
        # with a per-document state: right-pad the documents into a batch (padding is not stored)
        real = pack_to_padded(torch.ones(q.shape[:2], dtype=torch.bool, device=q.device), cu_seqlens, value=False)
        pq, pk, pv = (pack_to_padded(t, cu_seqlens) for t in (q, k, v))
        run = self._chunk if mode == "chunk" else self._recurrent
        o, new = run(pq, pk, pv, real, state, output_state)
        return padded_to_pack(o, cu_seqlens), new
