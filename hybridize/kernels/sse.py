"""Sparse State Expansion (seed 001, sec. 4 and appendix 11): routing and the two training layouts.

The backbone op (`"gla"`: diagonal gate, or `"delta"`: gated delta rule) runs unchanged; this module
decides which tokens reach which of the N state partitions of each head.

- `route` turns router logits `[B, T, N]` into `Routing`: softmax probabilities (fp32), the top-K
  partitions of every token and a selection mask that is all False on padding.
- `balance_loss`: alpha * (N / K) * sum_i f_i * P_i, f_i the fraction of (real) tokens that select
  partition i (so sum_i f_i = K), P_i the mean router probability of partition i. It equals alpha
  for a perfectly balanced router.
- Three ways to run one SSE layer, all returning `(o [B, T, H, V], shared_state, sparse_state)`:
  * `sse_masking`: every partition is a copy of the sparse path folded into the head dimension
    (`[B, T, (1 + N) * H, D]`, shared partition first); tokens not routed to a partition get zero
    query, key, value, log-decay (and beta), so that partition's state is untouched on that token;
    one op call (paper Algorithm 1; best for short or packed sequences).
  * `sse_varlen`: the (token, partition) pairs are reordered so each partition of each sequence is
    one contiguous segment, new `cu_seqlens` are built, the shared path is concatenated in front
    along time, one varlen op call, outputs scattered back with `index_add` (paper Algorithm 2;
    best for long sequences). Empty segments are dropped (their states pass through untouched).
  * `sse_recurrent`: per-token ground truth and decode: gathers the K selected partition states,
    runs the op's recurrent form for one step on them (with the shared partition), scatters back.
    Partitions that were not selected are never read or written, so they stay bit-identical.

Router gradient (the fla PR #882 reading): the selected partition's router probability multiplies
the sparse query (`emulq`) and/or key (`emulk`), so the router is trained by the main loss even at
K = 1. Unlike the paper's eq. 11 there is no 1/K factor and no router bias inside the key softmax
(that bias would cancel in the softmax at K = 1). Separate read partitions (the paper's top-K') are
not offered: every layout reads exactly the partitions it writes (the paper's default T' = T).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import dispatch
from .varlen import check_cu_seqlens, pack_to_padded, padded_to_pack, seq_lengths

OPS = ("gla", "delta")


@dataclass
class Routing:
    """Router decision for every token.

    probs `[B, T, N]` softmax of the router logits (fp32, fp64 for fp64 logits); index `[B, T, K]` the
    selected partitions (by descending probability); selected `[B, T, N]` bool, K True entries per
    real token, none on padding.
    """

    probs: torch.Tensor
    index: torch.Tensor
    selected: torch.Tensor

    @property
    def weight(self) -> torch.Tensor:
        """`[B, T, N]` router probability on selected partitions, 0 elsewhere."""
        return self.probs * self.selected

    @property
    def valid(self) -> torch.Tensor:
        """`[B, T]` bool, real (non-padding) tokens."""
        return self.selected.any(-1)


@dataclass
class PathInputs:
    """Per-token inputs of one path (shared or sparse), after feature maps, at query-head width.

    q, k `[B, T, H, K]`; v `[B, T, H, V]`; g log-decay `[B, T, H, K]` (gla) or `[B, T, H]` (delta);
    beta `[B, T, H]` (delta only). Sparse q/k are NOT yet scaled by the router probability."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor | None = None


def route(logits: torch.Tensor, top_k: int, valid: torch.Tensor | None = None) -> Routing:
    """logits `[B, T, N]` -> Routing; `valid` `[B, T]` bool (False on padding) or None."""
    n = logits.shape[-1]
    if not 1 <= top_k <= n:
        raise ValueError(f"top_k must be in [1, num_partitions={n}], got {top_k}")
    probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    index = probs.topk(top_k, dim=-1).indices
    selected = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, index, True)
    if valid is not None:
        selected = selected & valid.bool().unsqueeze(-1)
    return Routing(probs=probs, index=index, selected=selected)


def balance_loss(routing: Routing, top_k: int, alpha: float = 0.01) -> torch.Tensor:
    """alpha * (N / K) * sum_i f_i * P_i over real tokens (scalar, fp32). Gradient flows through P."""
    valid = routing.valid
    n = routing.probs.shape[-1]
    count = valid.sum().clamp(min=1).to(routing.probs.dtype)
    f = routing.selected.to(routing.probs.dtype).sum((0, 1)) / count
    p = (routing.probs * valid.unsqueeze(-1)).sum((0, 1)) / count
    return alpha * n / top_k * (f * p).sum()


def call_op(op: str, mode: str, x: PathInputs, scale=None, initial_state=None, output_final_state=False,
            cu_seqlens=None, chunk_size: int | None = None):
    """Run the backbone op on one set of inputs through `dispatch.run`. Returns (o, state)."""
    kw = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
              cu_seqlens=cu_seqlens)
    if mode == "chunk" and chunk_size is not None:
        kw["chunk_size"] = chunk_size
    if op == "gla":
        return dispatch.run("gla", mode, x.q, x.k, x.v, x.g, **kw)
    if op == "delta":
        return dispatch.run("delta", mode, x.q, x.k, x.v, x.beta, g=x.g, **kw)
    raise ValueError(f"unknown SSE backbone op {op!r}; use one of {', '.join(OPS)}")


# ---- helpers ---------------------------------------------------------------------------------

def _bcast(m: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Give a per-(token, slot) factor `[B, T, S]` the trailing singleton dims of `x` `[B, T, H, ...]`
    after x gets a slot dim: result `[B, T, S, 1, ...]`."""
    return m.view(*m.shape, *([1] * (x.dim() - 2)))


def _expand_slots(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x `[B, T, H, ...]`, m `[B, T, S]` -> `[B, T, S * H, ...]` (slot-major), x scaled per slot."""
    return (x.unsqueeze(2) * _bcast(m.to(x.dtype), x)).flatten(2, 3)


def _sparse_slots(sp: PathInputs, w: torch.Tensor, m: torch.Tensor, emulq: bool, emulk: bool) -> PathInputs:
    """Sparse inputs replicated over S slots. w: router prob (0 when unselected), m: 0/1 selection,
    both `[B, T, S]`. Unselected slots get zero q, k, v, g, beta: the state is left as it was."""
    return PathInputs(
        q=_expand_slots(sp.q, w if emulq else m),
        k=_expand_slots(sp.k, w if emulk else m),
        v=_expand_slots(sp.v, m),
        g=_expand_slots(sp.g, m),
        beta=None if sp.beta is None else _expand_slots(sp.beta, m),
    )


def _cat_heads(shared: PathInputs | None, sparse: PathInputs) -> PathInputs:
    if shared is None:
        return sparse
    cat = lambda a, b: torch.cat([a, b], dim=2)  # noqa: E731
    return PathInputs(q=cat(shared.q, sparse.q), k=cat(shared.k, sparse.k), v=cat(shared.v, sparse.v),
                      g=cat(shared.g, sparse.g),
                      beta=None if sparse.beta is None else cat(shared.beta, sparse.beta))


def _num_seqs(x: torch.Tensor, cu_seqlens) -> int:
    return x.shape[0] if cu_seqlens is None else len(cu_seqlens) - 1


def _init_states(sparse: PathInputs, shared: PathInputs | None, n: int, nseq: int, initial_state):
    """(shared [S, H, K, V] | None, sparse [S, N, H, K, V]) in fp32/fp64, zeros where not given."""
    sh0, sp0 = initial_state if initial_state is not None else (None, None)
    H, K, V = sparse.q.shape[2], sparse.q.shape[3], sparse.v.shape[3]
    acc = torch.float64 if sparse.q.dtype == torch.float64 else torch.float32
    zeros = lambda *s: sparse.q.new_zeros(*s, dtype=acc)  # noqa: E731
    if sp0 is None:
        sp0 = zeros(nseq, n, H, K, V)
    elif tuple(sp0.shape) != (nseq, n, H, K, V):
        raise ValueError(f"sparse state must be {(nseq, n, H, K, V)}, got {tuple(sp0.shape)}")
    if shared is not None:
        if sh0 is None:
            sh0 = zeros(nseq, H, K, V)
        elif tuple(sh0.shape) != (nseq, H, K, V):
            raise ValueError(f"shared state must be {(nseq, H, K, V)}, got {tuple(sh0.shape)}")
    return (sh0.to(acc) if shared is not None else None), sp0.to(acc)


# ---- layout 1: masking -----------------------------------------------------------------------

def sse_masking(op: str, shared: PathInputs | None, sparse: PathInputs, routing: Routing, *,
                emulq: bool = True, emulk: bool = True, scale=None, initial_state=None,
                output_final_state: bool = False, cu_seqlens=None, chunk_size: int | None = None):
    """Replicate-and-mask layout: partitions folded into heads, one op call in chunk mode.

    initial_state: (shared `[S, H, K, V]` | None, sparse `[S, N, H, K, V]` | None) or None.
    Returns o `[B, T, H, V]`, shared final state | None, sparse final state | None."""
    n = routing.probs.shape[-1]
    H = sparse.q.shape[2]
    m = routing.selected.to(routing.probs.dtype)
    x = _cat_heads(shared, _sparse_slots(sparse, routing.weight, m, emulq, emulk))
    h0 = None
    if initial_state is not None:
        sh0, sp0 = _init_states(sparse, shared, n, _num_seqs(sparse.q, cu_seqlens), initial_state)
        h0 = sp0.flatten(1, 2) if shared is None else torch.cat([sh0.unsqueeze(1), sp0], 1).flatten(1, 2)
    o, st = call_op(op, "chunk", x, scale, h0, output_final_state, cu_seqlens, chunk_size)
    B, T = o.shape[:2]
    o = o.view(B, T, -1, H, o.shape[-1]).sum(2)
    if st is None:
        return o, None, None
    st = st.view(st.shape[0], -1, H, *st.shape[2:])
    if shared is None:
        return o, None, st
    return o, st[:, 0], st[:, 1:]


# ---- layout 2: varlen reorder ----------------------------------------------------------------

def varlen_index(routing: Routing, cu_seqlens: torch.Tensor):
    """Bookkeeping of the varlen layout for packed routing (B == 1, L tokens, S sequences).

    Returns token `[M]` (source token of every reordered row), part `[M]` (its partition),
    seg_cu `[G + 1]` (cu_seqlens of the G non-empty (sequence, partition) segments, in
    sequence-major, partition-minor order) and seg_id `[G]` (s * N + i of each segment)."""
    n = routing.probs.shape[-1]
    K = routing.index.shape[-1]
    L = routing.index.shape[1]
    dev = routing.index.device
    lens = torch.as_tensor(seq_lengths(cu_seqlens), device=dev)
    seq = torch.repeat_interleave(torch.arange(len(lens), device=dev), lens)          # [L]
    token = torch.arange(L, device=dev).repeat_interleave(K)                             # [L*K], token-major
    part = routing.index[0].reshape(-1)
    keep = routing.selected[0].gather(-1, routing.index[0]).reshape(-1)                 # drop padding
    token, part = token[keep], part[keep]
    key = seq[token] * n + part
    order = torch.sort(key, stable=True).indices  # stable: time order kept inside a segment
    token, part, key = token[order], part[order], key[order]
    counts = torch.bincount(key, minlength=len(lens) * n)
    seg_id = torch.nonzero(counts).flatten()
    seg_cu = torch.zeros(len(seg_id) + 1, dtype=torch.long, device=dev)
    seg_cu[1:] = counts[seg_id].cumsum(0)
    return token, part, seg_cu, seg_id


def sse_varlen(op: str, shared: PathInputs | None, sparse: PathInputs, routing: Routing, *,
               emulq: bool = True, emulk: bool = True, scale=None, initial_state=None,
               output_final_state: bool = False, cu_seqlens=None, chunk_size: int | None = None):
    """Reorder-by-partition layout, one varlen op call (shared path in front along time).

    Same arguments and results as `sse_masking`."""
    B, T, H = sparse.q.shape[:3]
    n = routing.probs.shape[-1]
    if cu_seqlens is None:  # a batch of equal-length rows is a packed row with regular offsets
        flat = lambda t: None if t is None else t.reshape(1, B * T, *t.shape[2:])  # noqa: E731
        sparse = PathInputs(*(flat(t) for t in (sparse.q, sparse.k, sparse.v, sparse.g, sparse.beta)))
        if shared is not None:
            shared = PathInputs(*(flat(t) for t in (shared.q, shared.k, shared.v, shared.g, shared.beta)))
        routing = Routing(flat(routing.probs), flat(routing.index), flat(routing.selected))
        cu = torch.arange(0, (B + 1) * T, T, device=sparse.q.device)
    else:
        check_cu_seqlens(sparse.q, cu_seqlens)
        cu = cu_seqlens.to(torch.long)
    L = sparse.q.shape[1]
    nseq = len(cu) - 1
    token, part, seg_cu, seg_id = varlen_index(routing, cu)

    w = routing.probs[0, token, part].to(sparse.q.dtype)[None, :, None, None]
    gather = lambda t: None if t is None else t[:, token]  # noqa: E731
    x = PathInputs(q=gather(sparse.q) * w if emulq else gather(sparse.q),
                   k=gather(sparse.k) * w if emulk else gather(sparse.k),
                   v=gather(sparse.v), g=gather(sparse.g), beta=gather(sparse.beta))
    if shared is not None:  # fuse the shared path: its sequences first, then the partition segments
        x = PathInputs(*(None if a is None else torch.cat([a, b], dim=1)
                         for a, b in zip((shared.q, shared.k, shared.v, shared.g, shared.beta),
                                         (x.q, x.k, x.v, x.g, x.beta))))
        seg_cu = torch.cat([cu, seg_cu[1:] + L])
    h0 = sp_flat = None
    if initial_state is not None or output_final_state:
        sh0, sp0 = _init_states(sparse, shared, n, nseq, initial_state)
        sp_flat = sp0.flatten(0, 1)                                                        # [S*N, H, K, V]
        h0 = sp_flat[seg_id] if shared is None else torch.cat([sh0, sp_flat[seg_id]])
    V = sparse.v.shape[-1]
    if len(seg_cu) > 1 and int(seg_cu[-1]) > 0:
        o_all, st = call_op(op, "chunk", x, scale, h0, output_final_state,
                            seg_cu.to(cu_seqlens.dtype if cu_seqlens is not None else torch.long), chunk_size)
    else:  # no token at all (everything padded and no shared path)
        o_all, st = x.v.new_zeros(1, 0, H, V), h0
    off = L if shared is not None else 0
    o = o_all[:, :L] if shared is not None else sparse.v.new_zeros(1, L, H, V)
    o = o.index_add(1, token, o_all[:, off:].to(o.dtype))
    if cu_seqlens is None:
        o = o.view(B, T, H, V)
    if not output_final_state:
        return o, None, None
    sh = st[:nseq] if shared is not None else None
    sp = sp_flat.index_copy(0, seg_id, st[nseq if shared is not None else 0:].to(sp_flat.dtype))
    return o, sh, sp.view(nseq, n, *sp.shape[1:])


# ---- recurrent ground truth / decode ---------------------------------------------------------

def sse_recurrent(op: str, shared: PathInputs | None, sparse: PathInputs, routing: Routing, *,
                  emulq: bool = True, emulk: bool = True, scale=None, initial_state=None,
                  output_final_state: bool = False, cu_seqlens=None, chunk_size: int | None = None):
    """Token-by-token: gather the K selected partition states, one recurrent op step, scatter back.

    Same arguments and results as `sse_masking` (`chunk_size` unused)."""
    if cu_seqlens is not None:  # right-pad the documents; padding is unselected and zero: no effect
        check_cu_seqlens(sparse.q, cu_seqlens)
        pad = lambda t: pack_to_padded(t, cu_seqlens)  # noqa: E731
        sp = PathInputs(*(pad(t) for t in (sparse.q, sparse.k, sparse.v, sparse.g, sparse.beta)))
        sh = None if shared is None else PathInputs(
            *(pad(t) for t in (shared.q, shared.k, shared.v, shared.g, shared.beta)))
        rt = Routing(pad(routing.probs), pad(routing.index), pad(routing.selected))
        o, s1, s2 = _recurrent_loop(op, sh, sp, rt, emulq, emulk, scale, initial_state, output_final_state)
        return padded_to_pack(o, cu_seqlens), s1, s2
    return _recurrent_loop(op, shared, sparse, routing, emulq, emulk, scale, initial_state, output_final_state)


def _recurrent_loop(op, shared, sparse, routing, emulq, emulk, scale, initial_state, output_final_state):
    B, T, H = sparse.q.shape[:3]
    n = routing.probs.shape[-1]
    sh_state, sp_state = _init_states(sparse, shared, n, B, initial_state)
    rows = torch.arange(B, device=sparse.q.device).unsqueeze(1)                           # [B, 1]
    outs = []
    for t in range(T):
        idx = routing.index[:, t]                                                          # [B, K]
        m = routing.selected[:, t].gather(-1, idx).to(routing.probs.dtype)                # [B, K]
        w = routing.probs[:, t].gather(-1, idx) * m
        step = lambda a: None if a is None else a[:, t:t + 1]  # noqa: E731
        one = PathInputs(*(step(a) for a in (sparse.q, sparse.k, sparse.v, sparse.g, sparse.beta)))
        x = _sparse_slots(one, w.unsqueeze(1), m.unsqueeze(1), emulq, emulk)              # [B, 1, K*H, ...]
        h0 = sp_state[rows, idx].flatten(1, 2)                                             # [B, K*H, K, V]
        if shared is not None:
            x = _cat_heads(PathInputs(*(step(a) for a in (shared.q, shared.k, shared.v, shared.g, shared.beta))), x)
            h0 = torch.cat([sh_state, h0], dim=1)
        o, st = call_op(op, "recurrent", x, scale, h0, True)
        outs.append(o.view(B, 1, -1, H, o.shape[-1]).sum(2))
        st = st.view(B, -1, H, *st.shape[2:])
        if shared is not None:
            sh_state, st = st[:, 0], st[:, 1:]
        sp_state = sp_state.index_put((rows.expand_as(idx), idx), st.to(sp_state.dtype))
    o = torch.cat(outs, dim=1) if outs else sparse.v.new_zeros(B, 0, H, sparse.v.shape[-1])
    if not output_final_state:
        return o, None, None
    return o, sh_state, sp_state


LAYOUTS = {"masking": sse_masking, "varlen": sse_varlen}


def pick_layout(layout: str, T: int, cu_seqlens=None, varlen_min_len: int = 1024) -> str:
    """"masking" | "varlen" | "auto": auto picks varlen when the mean sequence length reaches
    `varlen_min_len` tokens (the paper: masking is competitive up to ~1k tokens, varlen beyond)."""
    if layout not in ("masking", "varlen", "auto"):
        raise ValueError(f"SSE layout must be 'masking', 'varlen' or 'auto', got {layout!r}")
    if layout != "auto":
        return layout
    mean_len = T if cu_seqlens is None else T / max(len(cu_seqlens) - 1, 1)
    return "varlen" if mean_len >= varlen_min_len else "masking"
