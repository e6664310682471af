"""Log-linear attention op (Guo et al. 2025, Mamba-2 form): a Fenwick-tree hierarchy of decayed states.

At absolute position p (counted from the start of the sequence, continuing across `initial_state`)
the prefix [0, p] is partitioned into levels: source s has level

    level(p, s) = 0 if s == p, else min(bit_length(p XOR s), L - 1)

(level l >= 1 holds the 2^(l-1) tokens that differ from p first in bit l-1: the Fenwick buckets; the
same partition as fla's `naive_log_linear_attn`). With a scalar-per-head log-decay g and
level weights lambda `[B, T, H, L]` (the `level_scales`):

    o_p = scale * sum_s lambda_p^{level(p, s)} exp(G_p - G_s) (q_p . k_s) v_s,   G = cumsum(g)
        = scale * sum_l lambda_p^l (M_p^l)^T q_p,   M_p^l = sum_{level(p,s)=l} exp(G_p - G_s) k_s v_s^T

Since the levels partition the prefix, lambda == 1 gives back the linear backbone (`gla` op with the
same scalar decay). Shapes: q, k `[B, T, H, K]`, v `[B, T, H, V]`, g `[B, T, H]`, state
`LogLinearState(levels [N, H, L, K, V], t [N])` where t counts the tokens already consumed.

Recurrent form (`naive_recurrent_log_linear`, the ground truth, O(L K V) per token): before token t is
written, levels 0..d with d = min(ctz(t) + 1, L - 1) merge into level d (ctz = count of trailing
zeros; the Fenwick carry), every level decays by exp(g_t), and k_t v_t^T becomes level 0.

Chunked form (`chunk_log_linear`): chunks of C = 2^c tokens aligned to absolute positions (multiples
of C), so every query of a chunk sees the tokens of earlier chunks in the same buckets: a source in
an earlier chunk has level c + bit_length(P XOR S) (P, S chunk indices), i.e. the Fenwick hierarchy
again, one level of chunks per level above c. Per chunk: (1) intra-chunk quadratic masked form with
the fixed C x C level-index table bit_length(i XOR j) <= c; (2) inter-chunk read of the J = L-1-c
chunk-level states, each weighted by the query's lambda at level c + j; (3) the chunk's summary
joins the chunk-level states with the same Fenwick carry. Cost O(T C (K + V) + T L K V) time,
O(T C + (T / C) L K V) memory for autograd: log-linear in T for fixed C, against O(T^2) for the fully
parallel masked form (which `tests/ops/log_linear/test_log_linear_op.py` builds as the reference). The fully
parallel form would be simpler but quadratic; the chunked one is what fla's kernel does on GPU.
Rows whose start position `t` is not a multiple of C are shifted right by `t mod C` (zero tokens,
which change nothing) so that their chunks are aligned too.

Departures / conventions:
- levels beyond L - 1 are clamped into the top level (the top level then holds all older history),
  so any length works with a fixed L; with L = ceil(log2 T) + 1 nothing is ever clamped;
- `scale` defaults to K^-0.5 like our other ops (fla's log-linear op defaults to 1.0);
- the state keeps the Fenwick levels plus the counter t instead of fla's chunk-state + last partial
  chunk; slots of `initial_state` that the Fenwick structure of t leaves empty are ignored (zeroed),
  so both forms agree on any state;
- `chunk_size` is rounded down to a power of two and capped at 2^(L-2) (levels <= c stay in-chunk).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from hybridize.ops.gla.reference import acc_dtype
from hybridize.ops.common.varlen import check_cu_seqlens, pack_to_padded, padded_to_pack, seq_lengths


class LogLinearState(NamedTuple):
    """Fenwick level states `levels [N, H, L, K, V]` and tokens consumed so far `t [N]` (int64)."""

    levels: torch.Tensor
    t: torch.Tensor


# ---- integer helpers (exact, no float log2) ---------------------------------------------------

def bit_length(x: torch.Tensor) -> torch.Tensor:
    """Number of bits of non-negative int64 `x` (0 -> 0)."""
    powers = torch.ones(1, dtype=torch.int64, device=x.device) << torch.arange(63, device=x.device)
    return (x.unsqueeze(-1) >= powers).sum(-1)


def merge_level(t: torch.Tensor, num_levels: int) -> torch.Tensor:
    """Level that absorbs levels 0..d before token number `t` is written: d = min(ctz(t) + 1, L - 1).

    `t == 0` (nothing consumed yet) gives L - 1; the state is empty then, so it only matters for
    ignored inputs."""
    ctz = bit_length(t & -t) - 1
    d = torch.where(t > 0, ctz + 1, torch.full_like(t, num_levels - 1))
    return d.clamp(max=num_levels - 1)


def occupied_levels(t: torch.Tensor, num_levels: int) -> torch.Tensor:
    """`[N, L]` bool: which Fenwick levels can be non-empty after `t` tokens (relative to p = t - 1).

    Level 0 = {p}; level l in 1..L-2 holds tokens iff bit l-1 of p is set; the (clamped) top level
    iff p >= 2^(L-2)."""
    p = t - 1
    lev = torch.arange(num_levels, device=t.device)
    occ = ((p[:, None] >> (lev - 1).clamp(min=0)) & 1) == 1
    occ[:, 0] = True
    occ[:, num_levels - 1] |= p >= (1 << (num_levels - 2))
    return occ & (p >= 0)[:, None]


def merge_levels(S: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
    """Fenwick carry: level `dest[n]` of row n becomes the sum of levels 0..dest, levels below are
    cleared, levels above untouched. S `[N, H, L, K, V]`, dest `[N]` int64 in 1..L-1."""
    N, H, L = S.shape[:3]
    rows = torch.arange(N, device=S.device)
    summed = S.cumsum(2)[rows, :, dest]                       # [N, H, K, V]
    lev = torch.arange(L, device=S.device)
    at = (lev == dest[:, None]).view(N, 1, L, 1, 1)
    below = (lev < dest[:, None]).view(N, 1, L, 1, 1)
    return torch.where(at, summed.unsqueeze(2), torch.where(below, torch.zeros_like(S), S))


# ---- argument handling ------------------------------------------------------------------------

def _check(q, k, v, g, level_scales):
    if q.dim() != 4 or k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"expected q, k [B, T, H, K] and v [B, T, H, V]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)} (repeat GQA key/value heads first)")
    if g is not None and g.shape != q.shape[:3]:
        raise ValueError(f"g must be the scalar-per-head log-decay [B, T, H] = {tuple(q.shape[:3])}, "
                         f"got {tuple(g.shape)}")
    if level_scales.dim() != 4 or level_scales.shape[:3] != q.shape[:3]:
        raise ValueError(f"level_scales must be [B, T, H, L] with B, T, H = {tuple(q.shape[:3])}, "
                         f"got {tuple(level_scales.shape)}")
    if level_scales.shape[-1] < 2:
        raise ValueError("log-linear attention needs at least 2 levels (level_scales.shape[-1] >= 2); "
                         "with one level use the gla op")


def _initial(initial_state, N, H, L, K, V, device, acc):
    """-> (levels [N, H, L, K, V] in `acc` with empty slots zeroed, or None; t [N] int64)."""
    if initial_state is None:
        return None, torch.zeros(N, dtype=torch.int64, device=device)
    if isinstance(initial_state, torch.Tensor) or len(initial_state) != 2:
        raise ValueError("initial_state must be a LogLinearState(levels [N, H, L, K, V], t [N]) "
                         "as returned with output_final_state=True")
    levels, t = initial_state
    if tuple(levels.shape) != (N, H, L, K, V):
        raise ValueError(f"initial_state.levels must be {(N, H, L, K, V)}, got {tuple(levels.shape)}")
    t = t.to(device=device, dtype=torch.int64).reshape(N)
    occ = occupied_levels(t, L).view(N, 1, L, 1, 1)
    return torch.where(occ, levels.to(acc), torch.zeros((), dtype=acc, device=device)), t


def _run(fn, q, k, v, g, level_scales, scale, initial_state, output_final_state, cu_seqlens, **kw):
    _check(q, k, v, g, level_scales)
    B, T, H, K = q.shape
    V, L = v.shape[-1], level_scales.shape[-1]
    acc = acc_dtype(q)
    scale = K ** -0.5 if scale is None else scale
    if g is None:
        g = q.new_zeros(B, T, H)
    if cu_seqlens is not None:
        check_cu_seqlens(q, cu_seqlens)
        lengths = torch.tensor(seq_lengths(cu_seqlens), dtype=torch.int64, device=q.device)
        q, k, v, g, level_scales = (pack_to_padded(x, cu_seqlens) for x in (q, k, v, g, level_scales))
    else:
        lengths = torch.full((B,), T, dtype=torch.int64, device=q.device)
    N = lengths.numel()
    h0, t0 = _initial(initial_state, N, H, L, K, V, q.device, acc)
    args = [x.to(acc) for x in (q, k, v, g, level_scales)]
    o, S = fn(*args, h0, t0, lengths, scale, **kw)
    if cu_seqlens is not None:
        o = padded_to_pack(o, cu_seqlens) if N else o.new_zeros(1, 0, H, V)
    final = LogLinearState(S, t0 + lengths) if output_final_state else None
    return o.to(v.dtype), final


# ---- recurrent form -----------------------------------------------------------------------------

def naive_recurrent_log_linear(q, k, v, g, level_scales, scale=None, initial_state=None, output_final_state=False,
                               cu_seqlens=None):
    """Reference: one token at a time, O(L K V) per token.

    q, k `[B, T, H, K]`, v `[B, T, H, V]`, g `[B, T, H]` log-decay (<= 0; None = no decay),
    level_scales `[B, T, H, L]`. Returns (o `[B, T, H, V]`, LogLinearState or None)."""
    return _run(_recurrent, q, k, v, g, level_scales, scale, initial_state, output_final_state, cu_seqlens)


def _recurrent(q, k, v, g, lam, h0, t0, lengths, scale):
    B, T, H, K = q.shape
    V, L = v.shape[-1], lam.shape[-1]
    S = q.new_zeros(B, H, L, K, V) if h0 is None else h0.clone()
    t = t0.clone()
    o = q.new_zeros(B, T, H, V)
    for i in range(T):
        valid = i < lengths                                   # padding of varlen rows: no change, no tick
        S_new = merge_levels(S, merge_level(t, L)) * g[:, i].exp()[:, :, None, None, None]
        kv = k[:, i].unsqueeze(-1) * v[:, i].unsqueeze(-2)    # [B, H, K, V]
        S_new = torch.cat([kv.unsqueeze(2), S_new[:, :, 1:]], dim=2)
        o[:, i] = scale * torch.einsum("bhk,bhl,bhlkv->bhv", q[:, i], lam[:, i], S_new)
        S = torch.where(valid.view(B, 1, 1, 1, 1), S_new, S)
        t = t + valid.long()
    return o, S


# ---- chunked form -------------------------------------------------------------------------------

def chunk_log_linear(q, k, v, g, level_scales, scale=None, initial_state=None, output_final_state=False,
                     cu_seqlens=None, chunk_size: int = 32):
    """Chunkwise form (aligned chunks + chunk-level Fenwick states); equals `naive_recurrent_log_linear`."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return _run(_chunk, q, k, v, g, level_scales, scale, initial_state, output_final_state, cu_seqlens,
                chunk_size=chunk_size)


def _shift_rows(x: torch.Tensor, r: torch.Tensor, Tp: int) -> torch.Tensor:
    """`[B, T, ...]` -> `[B, Tp, ...]` with row b moved right by r[b] (zeros elsewhere)."""
    B, T = x.shape[:2]
    idx = torch.arange(T, device=x.device)[None] + r[:, None]
    rows = torch.arange(B, device=x.device)[:, None].expand(B, T)
    out = x.new_zeros(B, Tp, *x.shape[2:])
    out[rows, idx] = x
    return out


def _chunk(q, k, v, g, lam, h0, t0, lengths, scale, chunk_size):
    B, T, H, K = q.shape
    V, L = v.shape[-1], lam.shape[-1]
    dev = q.device
    c = min(chunk_size.bit_length() - 1, L - 2)               # levels 0..c live inside a chunk
    C, J = 1 << c, L - 1 - c                                  # J chunk-level states above them
    r = t0 % C                                                # in-chunk offset of each row's first token
    n = (int(r.max()) + T + C - 1) // C if B else 0
    Tp = n * C

    def chunked(x):  # [B, T, H, ...] -> [B, H, n, C, ...]
        x = _shift_rows(x, r, Tp)
        return x.view(B, n, C, H, *x.shape[3:]).transpose(1, 3).transpose(2, 3)

    qc, kc, vc, gc, lc = chunked(q) * scale, chunked(k), chunked(v), chunked(g), chunked(lam)
    G = gc.cumsum(-1)                                         # in-chunk cumulative log-decay [B, H, n, C]

    # (1) intra-chunk: quadratic masked form with the level-index table of aligned chunks
    off = torch.arange(C, device=dev)
    lev_in = bit_length(off[:, None] ^ off[None, :])           # [C, C], values 0..c
    causal = off[:, None] >= off[None, :]
    decay = (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    w_lev = torch.gather(lc[..., :c + 1], -1, lev_in.expand(B, H, n, C, C))
    o = ((qc @ kc.transpose(-1, -2)) * decay * w_lev) @ vc    # [B, H, n, C, V]

    # initial state: carry it to "just before token t0", split into in-chunk levels 1..c and chunk levels
    a0 = t0 - r                                               # absolute position of padded index 0
    S_ch = q.new_zeros(B, H, J + 1, K, V)                     # slot 0 = the chunk just finished
    pre_low = None
    if h0 is not None:
        pre = merge_levels(h0, merge_level(t0, L))
        S_ch = torch.cat([S_ch[:, :, :1], pre[:, :, c + 1:]], dim=2)
        if c >= 1:
            pre_low = pre[:, :, 1:c + 1]                      # [B, H, c, K, V]
            ls = torch.arange(1, c + 1, device=dev)
            rep_off = ((t0[:, None] >> ls) << ls) - a0[:, None]       # first token of each bucket, [B, c]
            pre_lev = bit_length(off[None, :, None] ^ rep_off[:, None, :])  # [B, C, c]

    # final-state bookkeeping: the chunk and in-chunk offset of each row's last token
    end = r + lengths - 1
    end_chunk, end_off = torch.div(end, C, rounding_mode="floor"), end % C
    end_chunk = torch.where(lengths > 0, end_chunk, -1)      # empty rows keep their initial state
    final = torch.where(lengths.view(B, 1, 1, 1, 1) > 0, q.new_zeros(B, H, L, K, V),
                        h0 if h0 is not None else q.new_zeros(B, H, L, K, V))

    first_chunk = torch.div(a0, C, rounding_mode="floor")
    inter = []
    for i in range(n):
        qi, ki, vi, Gi, li = qc[:, :, i], kc[:, :, i], vc[:, :, i], G[:, :, i], lc[:, :, i]
        # (2) read the chunk-level states (token level c + j), decayed from the chunk start
        w = li[..., c + 1:] * Gi.exp().unsqueeze(-1)          # [B, H, C, J]
        oi = torch.einsum("bhcj,bhck,bhjkv->bhcv", w, qi, S_ch[:, :, 1:])
        if i == 0 and pre_low is not None:
            wp = torch.gather(li[..., :c + 1], -1, pre_lev.unsqueeze(1).expand(B, H, C, c))
            oi = oi + torch.einsum("bhcl,bhck,bhlkv->bhcv", wp * Gi.exp().unsqueeze(-1), qi, pre_low)
        inter.append(oi)

        rows = (end_chunk == i).nonzero().flatten()
        if rows.numel():
            final = final.index_put((rows,), _final_levels(
                rows, S_ch, Gi, ki, vi, end_off, pre_low if i == 0 else None,
                pre_lev if i == 0 and pre_low is not None else None, lev_in, c))

        # (3) the chunk's summary joins the chunk-level hierarchy with the Fenwick carry
        g_last = Gi[..., -1]                                  # [B, H]
        summary = (ki * (g_last.unsqueeze(-1) - Gi).exp().unsqueeze(-1)).transpose(-1, -2) @ vi
        if i == 0 and pre_low is not None:
            summary = summary + g_last.exp()[..., None, None] * pre_low.sum(2)
        S_ch = S_ch * g_last.exp()[:, :, None, None, None]
        S_ch = torch.cat([summary.unsqueeze(2), S_ch[:, :, 1:]], dim=2)
        S_ch = merge_levels(S_ch, merge_level(first_chunk + i + 1, J + 1))

    if n:
        o = o + torch.stack(inter, dim=2)
    o = o.permute(0, 2, 3, 1, 4).reshape(B, Tp, H, V)
    idx = torch.arange(T, device=dev)[None] + r[:, None]
    o = o[torch.arange(B, device=dev)[:, None], idx]         # undo the row shift
    return o, final


def _final_levels(rows, S_ch, Gi, ki, vi, end_off, pre_low, pre_lev, lev_in, c):
    """Token-level state `[R, H, L, K, V]` relative to the last token of `rows` (which ends in this chunk)."""
    u = end_off[rows]                                         # [R]
    G = Gi[rows]                                              # [R, H, C]
    C = G.shape[-1]
    g_end = torch.gather(G, -1, u.view(-1, 1, 1).expand(-1, G.shape[1], 1))  # [R, H, 1]
    src = torch.arange(C, device=G.device)
    valid = src[None, :] <= u[:, None]                        # [R, C]
    w = torch.where(valid[:, None, :], g_end - G, torch.full_like(G, float("-inf"))).exp()
    onehot = torch.nn.functional.one_hot(lev_in[u], c + 1).to(G.dtype)  # [R, C, c+1] level of each source
    low = torch.einsum("rsl,rhsk,rhsv->rhlkv", onehot, ki[rows] * w.unsqueeze(-1), vi[rows])
    if pre_low is not None:
        lev_p = torch.gather(pre_lev[rows], 1, u.view(-1, 1, 1).expand(-1, 1, pre_lev.shape[-1]))[:, 0]
        oh = torch.nn.functional.one_hot(lev_p, c + 1).to(G.dtype)       # [R, c, c+1]
        low = low + torch.einsum("rlm,rhlkv->rhmkv", oh, pre_low[rows]) * g_end.exp()[..., None, None]
    high = S_ch[rows, :, 1:] * g_end.exp()[..., None, None]  # chunk levels -> token levels c+1..L-1
    return torch.cat([low, high], dim=2)
