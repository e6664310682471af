"""Sparse State Expansion: routing and the two training layouts (sec. 4 and appendix 11 of "Scaling Linear
Attention with Sparse State Expansion").

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
    along time, one varlen op call, outputs summed back per token (paper Algorithm 2; best for long
    sequences). The bookkeeping (`varlen_plan`) is device-side with static shapes: on CUDA a stable
    counting sort in three Triton kernels (`ops/sse/triton_plan.py`), elsewhere a stable sort of the pair
    keys and `searchsorted` for the segment offsets; every (sequence, partition) segment is
    passed, empty ones included (their states pass through untouched), and padding pairs go to one
    trailing trash segment with zero inputs. On CUDA the row movement (gather + router-probability
    multiply + concat with the shared path, and the per-token sum of the outputs) is one Triton
    kernel per tensor (`ops/sse/triton_route.py`); `pack_rows_torch` / `combine_rows_torch` are the
    PyTorch forms (CPU, fp64, reference). On CUDA with bf16 GLA inputs (training, prefill, evaluation) the
    varlen GLA call is our pieces GLA (`ops/gla/triton_fwd.py`, `ops/gla/triton_bwd.py`) instead of fla's chunk_gla;
    without gradient it reads the shared and sparse tensors in place (`_gla_gathers`, `ops/sse/triton_gathered_gla.py`),
    so the row packs are skipped; with gradient it reads the shared path in place and packs only the sparse rows
    (both in place with the kernel option `sse_gla_gather="on"`: less activation memory, a slower backward).
    `varlen_index` is the older host-side form of the same reorder (non-empty segments only; it waits for
    the device), kept as a readable reference.
  * `naive_recurrent_sse`: per-token ground truth and decode: gathers the K selected partition states,
    runs the op's recurrent form for one step on them (with the shared partition), scatters back.
    On CUDA without gradients the Triton `ops/sse/triton_decode.py` step does this inside the state
    tensor instead (no copies, no host sync, CUDA-graph capturable; `inplace=True` writes the given
    state). Partitions that were not selected are never read or written, so they stay bit-identical.
    A T == 1 step there is 2 kernel calls (sparse slots, shared partition) + 1 sum/cast; routing without
    padding needs no selection mask (`Routing.dense`: the top-K indices and probabilities are used as is).

Host syncs, by reading the code (before -> now), per varlen forward: `cu_seqlens.tolist()`,
`repeat_interleave` with tensor repeats, two boolean-mask gathers, `bincount` (reads the max),
`nonzero`, `int(cu_seqlens[-1])`, `int(seg_cu[-1])` -> none in this module; fla's varlen op still
reads its chunk count on the host once (`prepare_chunk_indices`: the chunk grid size depends on
the segment lengths, and fla-core 0.6.0's public ops take no precomputed chunk indices). Passes over
the 2T rows: 4 gathers + 2 multiplies + 4 concatenations + `index_add` (backward: 4 `index_put`
with accumulation, 2 multiply backwards) -> 4 pack kernels + 1 combine kernel (backward: 4
gather-sum kernels, the scale gradient fused, + 1 pack kernel; a tensor on both paths, SSE's v, gets
its two gradients summed there). The kernel option `kernels="torch"` (`HYBRIDIZE_KERNELS=torch`) or
`sse_triton=False` (`use_kernel_options(sse_triton=False)`; was `USE_TRITON = False`) selects the PyTorch
forms on CUDA (`hybridize.ops.common.options`).

Router gradient (the fla PR #882 reading): the selected partition's router probability multiplies
the sparse query (`emulq`) and/or key (`emulk`), so the router is trained by the main loss even at
K = 1. Unlike the paper's eq. 11 there is no 1/K factor and no router bias inside the key softmax
(that bias would cancel in the softmax at K = 1). Separate read partitions (the paper's top-K') are
not offered: every layout reads exactly the partitions it writes (the paper's default T' = T).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridize.ops.common import dispatch
from hybridize.ops.common.options import current_kernel_options, triton_kernels_apply
from hybridize.ops.common.varlen import check_cu_seqlens, pack_to_padded, padded_to_pack, seq_lengths

OPS = ("gla", "delta")


class Routing:
    """Router decision for every token.

    probs `[B, T, N]` softmax of the router logits (fp32, fp64 for fp64 logits); index `[B, T, K]` the
    selected partitions (by descending probability); selected `[B, T, N]` bool, K True entries per
    real token, none on padding; top_probs `[B, T, K]` = probs at index (None: gathered when asked).
    `selected` may be left None when no token is padding: it is then built on first use (a decode step
    on the GPU never needs it: every top-K slot is selected, `dense` is True)."""

    def __init__(self, probs: torch.Tensor, index: torch.Tensor, selected: torch.Tensor | None = None,
                 top_probs: torch.Tensor | None = None):
        self.probs, self.index, self._selected, self._top = probs, index, selected, top_probs
        #: every top-K slot of every token is selected (no padding mask was applied)
        self.dense = selected is None

    @property
    def selected(self) -> torch.Tensor:
        if self._selected is None:
            self._selected = torch.zeros_like(self.probs, dtype=torch.bool).scatter_(-1, self.index, True)
        return self._selected

    @property
    def top_probs(self) -> torch.Tensor:
        """`[B, T, K]` router probability of each selected slot (padding included)."""
        if self._top is None:
            self._top = self.probs.gather(-1, self.index)
        return self._top

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
    if top_k == 1:   # a max reduction: torch.topk's CUDA kernel costs ~4.5 us per decode step and layer
        top, index = probs.max(dim=-1, keepdim=True)
    else:
        top, index = probs.topk(top_k, dim=-1)
    if valid is None:   # `selected` is built only if a layout asks for it (decode steps do not)
        return Routing(probs, index, None, top)
    selected = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, index, True) & valid.bool().unsqueeze(-1)
    return Routing(probs, index, selected, top)


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


@dataclass
class VarlenPlan:
    """Device-side bookkeeping of the varlen layout (no host sync, shapes fixed by L, K, N, S).

    The M = L * K (token, slot) pairs (pair p = t * K + s) are sorted stably by key = s_seq * N + i
    (sequence-major, partition-minor); pairs of padding tokens get key G = S * N and sort last.
    order `[M]` sorted pair ids; inv `[M]` sorted position of every pair; keep `[M]` bool (False on
    padding; None when the routing has no padding); seg_cu `[G + 2]` offsets of the G (sequence, partition)
    segments in sorted order, empty ones included, then one trailing "trash" segment [seg_cu[G], M) holding
    the padding pairs; layout_cu: the op call's offsets, seg_cu or, with the shared path's L rows in front,
    `[cu_seqlens, seg_cu[1:] + L]`."""

    order: torch.Tensor
    inv: torch.Tensor
    keep: torch.Tensor | None
    seg_cu: torch.Tensor
    layout_cu: torch.Tensor


def varlen_plan(routing: Routing, cu_seqlens: torch.Tensor, shared: bool = False) -> VarlenPlan:
    """Packed routing (B == 1, L tokens) and `cu_seqlens` `[S + 1]` -> `VarlenPlan` (`shared`: the shared
    path's rows go in front of the op call, see `layout_cu`).

    No `nonzero`, `bincount`, boolean indexing or `.tolist()` (each of which waits for the device). On CUDA a
    counting sort in three Triton kernels (`ops/sse/triton_plan.py`); otherwise one stable device sort and two
    `searchsorted` calls."""
    n, K, L = routing.probs.shape[-1], routing.index.shape[-1], routing.index.shape[1]
    dev = routing.index.device
    cu = cu_seqlens.to(device=dev, dtype=torch.long)
    keep = None if routing.dense else routing.selected[0].gather(-1, routing.index[0]).reshape(-1)
    if _triton_ok(routing.index):
        # deferred: imports triton (optional, GPU only)
        from hybridize.ops.sse.triton_plan import MAX_PARTITIONS, plan_triton
        if n <= MAX_PARTITIONS:
            order, inv, seg_cu, layout_cu = plan_triton(routing.index[0], keep, cu.contiguous(), n,
                                                        L if shared else None)
            return VarlenPlan(order=order, inv=inv, keep=keep, seg_cu=seg_cu, layout_cu=layout_cu)
    G = (len(cu) - 1) * n
    seq = torch.searchsorted(cu[1:], torch.arange(L, device=dev), right=True)            # [L] sequence of token
    part = routing.index[0].reshape(-1)                                                  # [M], token-major
    key = seq.unsqueeze(1).expand(L, K).reshape(-1) * n + part
    if keep is not None:
        key = torch.where(keep, key, torch.full_like(part, G))
    skey, order = torch.sort(key, stable=True)           # stable: time order kept inside a segment
    inv = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=dev))
    seg_cu = torch.searchsorted(skey, torch.arange(G + 1, device=dev))                   # first row of each key
    seg_cu = torch.cat([seg_cu, seg_cu.new_full((1,), order.numel())])
    layout_cu = torch.cat([cu, seg_cu[1:] + L]) if shared else seg_cu
    return VarlenPlan(order=order, inv=inv, keep=keep, seg_cu=seg_cu, layout_cu=layout_cu)


def _bshape(m: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`[M]` -> `[1, M, 1, ...]` to broadcast against x `[1, M, *C]`."""
    return m.view(1, -1, *([1] * (x.dim() - 2)))


def pack_rows_torch(x_sh, x_sp, order, inv, K: int, scale=None, keep=None):
    """PyTorch reference of `triton.sse_route.pack_rows`: `[1, L0 + M, *C]` = shared rows, then the
    sparse rows of the sorted pairs times `scale`, exactly 0 for pairs with keep False."""
    y = x_sp[:, order // K]
    if scale is not None or keep is not None:
        acc = torch.promote_types(x_sp.dtype, torch.float32)
        y = y.to(acc)
        if scale is not None:
            y = y * _bshape(scale[order].to(acc), y)
        if keep is not None:
            y = torch.where(_bshape(keep[order], y), y, torch.zeros((), dtype=acc, device=y.device))
        y = y.to(x_sp.dtype)
    return y if x_sh is None else torch.cat([x_sh.to(x_sp.dtype), y], dim=1)


def combine_rows_torch(o_all, order, inv, K: int, L: int, shared: bool, keep=None):
    """PyTorch reference of `triton.sse_route.combine_rows`: o[t] = o_all[t] (if shared) + sum over
    the K pairs of t of their row (0 for keep False), summed in fp32, `[1, L, *C]` in o_all's dtype."""
    L0 = L if shared else 0
    acc = torch.promote_types(o_all.dtype, torch.float32)
    rows = o_all[:, L0 + inv].to(acc)                                                  # [1, L*K, *C]
    if keep is not None:
        rows = torch.where(_bshape(keep, rows), rows, torch.zeros((), dtype=acc, device=rows.device))
    o = rows.view(1, L, K, *o_all.shape[2:]).sum(2)
    if shared:
        o = o + o_all[:, :L].to(acc)
    return o.to(o_all.dtype)


def _triton_ok(x: torch.Tensor) -> bool:
    """Our Triton kernels apply: CUDA tensor (or the kernel option `force_triton`, for the interpreter), not
    fp64, option `kernels` not torch, option `sse_triton` (False keeps the PyTorch forms on CUDA too: benchmarks
    compare the two) or `force_triton` (tests run our Triton kernels on CPU tensors under TRITON_INTERPRET=1)."""
    opts = current_kernel_options()
    return triton_kernels_apply(x, opts, opts.sse_triton or opts.force_triton)


def qk_front_applies(x: torch.Tensor) -> bool:
    """SSE's no-gradient q/k front end may take its one-kernel form (`triton_qk_front.py`) on x."""
    return _triton_ok(x)


def fused_step_applies(x: torch.Tensor) -> bool:
    """The one-kernel SSE-on-GLA decode step (`triton_fused_step.py`) may run on x: our Triton kernels apply
    and option `sse_fused_step` is on (the mixer checks its own settings: `SSE.fused_step_ok`)."""
    return _triton_ok(x) and current_kernel_options().sse_fused_step   # the device first: on the CPU one options read


def _row_movers(x: torch.Tensor):
    if _triton_ok(x):
        # deferred: imports triton (optional, GPU only)
        from hybridize.ops.sse.triton_route import combine_rows, pack_rows
        return pack_rows, combine_rows
    return pack_rows_torch, combine_rows_torch


def _check_packed(x: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    """Full check on CPU; on CUDA only the batch size (comparing cu_seqlens[-1] would wait for the device)."""
    if x.is_cuda:
        if x.shape[0] != 1:
            raise ValueError(f"cu_seqlens needs batch size 1 (packed layout), got batch {x.shape[0]}")
    else:
        check_cu_seqlens(x, cu_seqlens)


def sse_varlen(op: str, shared: PathInputs | None, sparse: PathInputs, routing: Routing, *,
               emulq: bool = True, emulk: bool = True, scale=None, initial_state=None,
               output_final_state: bool = False, cu_seqlens=None, chunk_size: int | None = None):
    """Reorder-by-partition layout, one varlen op call (shared path in front along time).

    Same arguments and results as `sse_masking`. Host syncs: none here (`varlen_plan` is device-side;
    every (sequence, partition) segment is passed, empty ones included, so the segment count is
    static); fla's varlen op itself reads its chunk count on the host once per forward
    (`prepare_chunk_indices`)."""
    B, T, H = sparse.q.shape[:3]
    n, K = routing.probs.shape[-1], routing.index.shape[-1]
    if cu_seqlens is None:  # a batch of equal-length rows is a packed row with regular offsets
        flat = lambda t: None if t is None else t.reshape(1, B * T, *t.shape[2:])  # noqa: E731
        sparse = PathInputs(*(flat(t) for t in (sparse.q, sparse.k, sparse.v, sparse.g, sparse.beta)))
        if shared is not None:
            shared = PathInputs(*(flat(t) for t in (shared.q, shared.k, shared.v, shared.g, shared.beta)))
        routing = Routing(flat(routing.probs), flat(routing.index), None if routing.dense else flat(routing.selected),
                          flat(routing.top_probs))
        cu = torch.arange(0, (B + 1) * T, T, device=sparse.q.device)
    else:
        _check_packed(sparse.q, cu_seqlens)
        cu = cu_seqlens.to(device=sparse.q.device, dtype=torch.long)
    L, nseq = sparse.q.shape[1], len(cu) - 1
    Kd, V = sparse.q.shape[-1], sparse.v.shape[-1]
    if L == 0:
        sh0, sp0 = _init_states(sparse, shared, n, nseq, initial_state)
        o = sparse.v.new_zeros(1, 0, H, V)
        return (o.view(B, T, H, V) if cu_seqlens is None else o), *(
            (sh0, sp0) if output_final_state else (None, None))
    plan = varlen_plan(routing, cu, shared is not None)
    pack, combine = _row_movers(sparse.q)
    w = routing.top_probs[0].reshape(-1)                                            # [L*K] router prob per pair
    sh = shared if shared is not None else PathInputs(None, None, None, None, None)

    def mv(a, b, s=None):
        return None if b is None else pack(a, b, plan.order, plan.inv, K, scale=s, keep=plan.keep)
    seg_cu = plan.layout_cu
    h0 = None
    if initial_state is not None:
        sh0, sp0 = _init_states(sparse, shared, n, nseq, initial_state)
        parts = ([] if shared is None else [sh0]) + [sp0.flatten(0, 1), sp0.new_zeros(1, H, Kd, V)]
        h0 = torch.cat(parts)                                      # [(S +) S*N + 1, H, K, V], trash last
    gathers = _gla_gathers(op, shared, sparse, w)
    if gathers:
        # deferred: imports triton (optional, GPU only)
        from hybridize.ops.sse.triton_gathered_gla import Layout, gathered_gla
        keep = None if plan.keep is None else plan.keep.to(torch.int8)
        lay = Layout(plan.order, plan.inv, keep, seg_cu, K, shared is not None)
        paths = [None if p is None else (p.q, p.k, p.v, p.g) for p in (shared, sparse)]
        o, st = gathered_gla(*paths, w, lay, scale=scale, initial_state=h0, emulq=emulq, emulk=emulk,
                             packed=gathers == "shared")
        return _varlen_results(o, st, B, T, cu_seqlens, output_final_state, shared, sparse, nseq, n, H, Kd, V)
    x = PathInputs(q=mv(sh.q, sparse.q, w if emulq else None), k=mv(sh.k, sparse.k, w if emulk else None),
                   v=mv(sh.v, sparse.v), g=mv(sh.g, sparse.g), beta=mv(sh.beta, sparse.beta))
    if _gla_in_pieces(op, x):
        # deferred: imports triton (optional, GPU only)
        from hybridize.ops.gla.triton_bwd import gla_triton
        g = x.g if x.g.dim() == 4 else x.g.unsqueeze(-1).expand_as(x.q)
        o_all, st = gla_triton(x.q, x.k, x.v, g, scale=scale, initial_state=h0,
                               output_final_state=output_final_state, cu_seqlens=seg_cu)
    else:
        o_all, st = call_op(op, "chunk", x, scale, h0, output_final_state, seg_cu, chunk_size)
    o = combine(o_all, plan.order, plan.inv, K, L, shared is not None, plan.keep)
    return _varlen_results(o, st, B, T, cu_seqlens, output_final_state, shared, sparse, nseq, n, H, Kd, V)


def _varlen_results(o, st, B, T, cu_seqlens, output_final_state, shared, sparse, nseq, n, H, Kd, V):
    """`sse_varlen`'s (o, shared end state, sparse end states) from the combined output and the op's states."""
    if cu_seqlens is None:
        o = o.view(B, T, H, V)
    if not output_final_state:
        return o, None, None
    acc = torch.float64 if sparse.q.dtype == torch.float64 else torch.float32
    first = 0 if shared is None else nseq
    sh_end = None if shared is None else st[:nseq].to(acc)
    return o, sh_end, st[first:first + nseq * n].to(acc).view(nseq, n, H, Kd, V)


def _gla_gathers(op: str, shared: PathInputs | None, sparse: PathInputs, w: torch.Tensor) -> str | None:
    """How much of the varlen layout the pieces GLA reads in place (`ops/sse/triton_gathered_gla.py`) instead of the
    row packer copying it: "on" both paths, "shared" the shared path (the sparse rows packed), None neither (every
    row packed). Needs the pieces GLA (`_gla_in_pieces`), per-key gates on both paths and both paths in one dtype;
    then the kernel option `sse_gla_gather` decides: "auto" (the default) reads both paths in place when nothing
    needs a gradient and the shared path with it, "on" / "shared" / "off" as named. SSE's op at 16k on one H200
    (benchmarks/RESULTS.md): without gradient the in-place reads save the four packs (forward 1.34 against 1.65
    ms); with gradient "shared" is the fastest, 4.67 ms forward+backward (4.61 since the dq pass took the piece sums,
    4.51 since the output pass stopped spilling, 4.38 with 1024-token pieces, 4.23-4.26 since the dv pass reads the
    forward's in-tile scores) against 5.03 with every row packed and 5.37 with both paths in place (the scattered
    sparse rows slow the backward's passes more than the packs cost), at a peak of 730 against 1113 and 346 MiB above
    the inputs. Storing the sparse rows' gradients at their tokens' rows instead of gather-summing them back was
    slower (4.93 against 4.48 ms)."""
    paths = [sparse] + ([] if shared is None else [shared])
    mode = current_kernel_options().sse_gla_gather
    if mode == "off" or not _gla_in_pieces(op, sparse) or any(p.g is None or p.g.dim() != 4 for p in paths):
        return None
    if any((p.q.dtype, p.k.dtype, p.v.dtype, p.g.dtype) != (sparse.q.dtype, sparse.k.dtype, sparse.v.dtype,
                                                            sparse.g.dtype) for p in paths):
        return None
    if mode in ("on", "shared"):
        return mode
    ts = [t for p in paths for t in (p.q, p.k, p.v, p.g)] + [w]
    return "shared" if torch.is_grad_enabled() and any(t.requires_grad for t in ts) else "on"


def _gla_in_pieces(op: str, x: PathInputs) -> bool:
    """Whether the varlen GLA call runs our pieces GLA (`ops/gla/triton_fwd.py`, `ops/gla/triton_bwd.py`; CUDA, bf16
    inputs, the dtype it was measured in), forward and backward: 0.61x / 0.54x of chunk_gla's device time
    (forward / forward+backward) on this 2T-row layout at 16k, against chunk_gla with fla's autotuning capped to one
    config (H100, benchmarks/RESULTS.md);
    per-token log-decays below -8 are taken as -8 there (see `ops/gla/triton_fwd.py`).
    The kernel option `sse_gla_pieces=False` (`HYBRIDIZE_SSE_GLA_PIECES=0`) or `kernels="torch"` keeps
    `dispatch`'s op (fla's chunk_gla on CUDA)."""
    if op != "gla" or x.g is None or not x.q.is_cuda or x.q.dtype != torch.bfloat16:
        return False
    opts = current_kernel_options()
    if opts.kernels == "torch" or not opts.sse_gla_pieces:
        return False
    return not torch.compiler.is_compiling()   # a traced region keeps dispatch's op (it wraps launchers opaquely)


# ---- recurrent ground truth / decode ---------------------------------------------------------

def naive_recurrent_sse(op: str, shared: PathInputs | None, sparse: PathInputs, routing: Routing, *,
                        emulq: bool = True, emulk: bool = True, scale=None, initial_state=None,
                        output_final_state: bool = False, cu_seqlens=None, chunk_size: int | None = None,
                        inplace: bool = False):
    """Token-by-token ground truth and decode step.

    PyTorch path (CPU, fp64, kernel option `kernels="torch"`, or gradients needed): gather the K selected
    partition states, one recurrent op step, scatter back. CUDA path (no gradients): the Triton
    `sse_decode_step` updates only the selected partitions inside the state tensor; no host sync and
    no data-dependent shape, so a T == 1 step can be captured in a CUDA graph.
    `inplace=True` lets the CUDA path overwrite the given (contiguous fp32) state tensors instead of
    working on copies; the returned states are then those same tensors (what a decode cache wants;
    callers that keep the old state must leave it False). The PyTorch path never writes its inputs.
    Same arguments and results as `sse_masking` otherwise (`chunk_size` unused)."""
    if cu_seqlens is not None:  # right-pad the documents; padding is unselected and zero: no effect
        check_cu_seqlens(sparse.q, cu_seqlens)
        pad = lambda t: pack_to_padded(t, cu_seqlens)  # noqa: E731
        sp = PathInputs(*(pad(t) for t in (sparse.q, sparse.k, sparse.v, sparse.g, sparse.beta)))
        sh = None if shared is None else PathInputs(
            *(pad(t) for t in (shared.q, shared.k, shared.v, shared.g, shared.beta)))
        rt = Routing(pad(routing.probs), pad(routing.index), pad(routing.selected))
        o, s1, s2 = naive_recurrent_sse(op, sh, sp, rt, emulq=emulq, emulk=emulk, scale=scale,
                                        initial_state=initial_state, output_final_state=output_final_state)
        return padded_to_pack(o, cu_seqlens), s1, s2
    if _decode_kernel_ok(shared, sparse, routing, initial_state):
        return _recurrent_loop_triton(op, shared, sparse, routing, emulq, emulk, scale, initial_state,
                                      output_final_state, inplace)
    return _recurrent_loop(op, shared, sparse, routing, emulq, emulk, scale, initial_state, output_final_state)


def _path_tensors(p: PathInputs | None) -> list:
    return [] if p is None else [t for t in (p.q, p.k, p.v, p.g, p.beta) if t is not None]


def _decode_kernel_ok(shared, sparse, routing, initial_state) -> bool:
    """The Triton decode step applies: CUDA (or forced interpreter), no fp64, no gradient needed."""
    if not _triton_ok(sparse.q):
        return False
    ts = _path_tensors(shared) + _path_tensors(sparse) + [routing.probs]
    ts += [t for t in (initial_state or ()) if t is not None]
    if any(t.dtype == torch.float64 for t in ts):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in ts))


def _owned(state: torch.Tensor | None, given: torch.Tensor | None, inplace: bool) -> torch.Tensor | None:
    """A contiguous fp32 state the kernel may write: the given tensor itself only when `inplace`."""
    if state is None:
        return None
    state = state.float().contiguous()
    if not inplace and given is not None and state.data_ptr() == given.data_ptr():
        state = state.clone()
    return state


_ZERO_INDEX: dict = {}


def _zero_index(B: int, device) -> torch.Tensor:
    """A `[B, 1]` long tensor of zeros (the shared partition's index), made once per (B, device): never
    written, so a decode step (and a CUDA graph of it) need not fill a new one every token."""
    key = (B, str(device))
    if key not in _ZERO_INDEX:
        _ZERO_INDEX[key] = torch.zeros(B, 1, dtype=torch.long, device=device)
    return _ZERO_INDEX[key]


def _slot_index(routing: Routing):
    """(index `[B, T, K]` with -1 on unselected slots, router probability `[B, T, K]` fp32)."""
    if routing.dense:   # no padding: every top-K slot is selected, nothing to mask
        return routing.index, routing.top_probs.float()
    sel = routing.selected.gather(-1, routing.index)                                  # [B, T, K]
    idx = torch.where(sel, routing.index, torch.full_like(routing.index, -1))          # -1: slot skipped
    return idx, routing.top_probs.float()


def _recurrent_loop_triton(op, shared, sparse, routing, emulq, emulk, scale, initial_state, output_final_state,
                           inplace):
    # deferred: imports triton (optional, GPU only)
    from hybridize.ops.sse.triton_decode import sse_decode_step
    B, T, H = sparse.q.shape[:3]
    n = routing.probs.shape[-1]
    sh_state, sp_state = _init_states(sparse, shared, n, B, initial_state)
    given = initial_state if initial_state is not None else (None, None)
    sh_state, sp_state = _owned(sh_state, given[0], inplace), _owned(sp_state, given[1], inplace)
    idx, w = _slot_index(routing)
    zero = _zero_index(B, sparse.q.device)
    if T == 1:   # a decode step: no per-token list, no concatenation, one fused sum + cast
        o = _triton_token(sse_decode_step, 0, shared, sparse, sh_state, sp_state, idx, w, zero, emulq, emulk, scale)
        o = o.unsqueeze(1)
        return (o, sh_state, sp_state) if output_final_state else (o, None, None)
    outs = [_triton_token(sse_decode_step, t, shared, sparse, sh_state, sp_state, idx, w, zero, emulq, emulk,
                          scale).unsqueeze(1) for t in range(T)]
    o = torch.cat(outs, 1) if outs else sparse.v.new_zeros(B, 0, H, sparse.v.shape[-1])
    if not output_final_state:
        return o, None, None
    return o, sh_state, sp_state


def _triton_token(step_fn, t, shared, sparse, sh_state, sp_state, idx, w, zero, emulq, emulk, scale):
    """Token t of every row through the decode kernel: `[B, H, V]` in v's dtype (the same values as the
    loop's fp32 sum of slots + shared output, then cast: the sum is done in fp32 and rounded on store)."""
    step = lambda a: None if a is None else a[:, t:t + 1]  # noqa: E731 - [B, 1, ...]: broadcast to slots
    o = step_fn(sp_state, idx[:, t], step(sparse.q), step(sparse.k), step(sparse.v), g=step(sparse.g),
                beta=step(sparse.beta), scale=scale, wq=w[:, t] if emulq else None, wk=w[:, t] if emulk else None)
    o = o[:, 0] if o.shape[1] == 1 else o.sum(1)                  # K == 1: the slot sum is the slot itself
    if shared is None:
        return o.to(sparse.v.dtype)
    o_sh = step_fn(sh_state.unsqueeze(1), zero, step(shared.q), step(shared.k), step(shared.v),
                   g=step(shared.g), beta=step(shared.beta), scale=scale)[:, 0]
    if sparse.v.dtype == o.dtype:
        return o + o_sh
    return torch.add(o, o_sh, out=torch.empty(o.shape, dtype=sparse.v.dtype, device=o.device))


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
