"""SSE's varlen GLA call with its layout read in place, forward and backward (`sse_varlen`: both paths in place
without gradient; with it the shared path in place and the sparse rows packed, `packed=True`, or both in place under
the kernel option `sse_gla_gather="on"`).

`ops.sse.reference.sse_varlen` runs one GLA call over SSE's varlen layout: the shared path's L rows, then the
(token, slot) pairs sorted by (sequence, partition), each sparse row scaled by its router probability on q and / or
k (`emulq`, `emulk`; appendix 11, Algorithm 2 of "Scaling Linear Attention with Sparse State Expansion"). Built
with the row packer (`triton_route.pack_rows`) that costs a copy of q, k, v, g over 2L rows in the forward and one
of the output's gradient in the backward. Here the pieces GLA reads the shared and sparse tensors where they are,
in both directions (`ops.gla.triton_fwd.Gather`; `ops.gla.triton_bwd.backward_pieces(gather=...)`):

    forward:  o_all `[1, L0 + M, H, V]` = pieces GLA over the layout read in place;
              o `[1, L, H, V]` = o_all[t] (shared) + sum_s keep * o_all[L0 + inv[t K + s]]   (`triton_route`'s sum)
    backward: the passes read q, k, v, g in place and each sparse row's do from its token's row of d_o; their
              gradients come in the packed layout, and `triton_route`'s gather-sum takes them back per token
              (shared rows as they are; sparse rows times the router probability where it scaled them, with the
              probability's gradient as row dots), as the packer's backward does.

`packed=True`: only the shared path is read in place. The sparse rows are packed (scaled) by `triton_route`'s packer
in the forward, and their output gradient in the backward, so every pass reads contiguous rows; the shared rows'
packs (half the copies) are gone.

Measured (one H200, SSE's layout at 16k tokens, H=16, D=128, benchmarks/RESULTS.md): the forward alone 1.35 against
1.67 ms with every row packed. Forward+backward, in one call before the dq pass took the backward's piece sums:
sparse rows packed 4.67 ms (peak 730 MiB above the inputs; 4.23-4.26 ms since), every row packed 5.03 (1113 MiB), both
paths in place 5.37 (346 MiB): read in place, a sparse piece's rows are tokens scattered over the sequence, which
slows the backward's passes more than the packs cost. So training reads the shared path in place by default, and
both paths in place is the memory option.

What it computes equals the packed path (the packer, `gla_bwd.gla_triton`, `combine_rows`) up to summation order;
`tests/ops/sse/test_gathered_gla.py` checks values and gradients against it. Dropped (padding) pairs are read as
they are, not zeroed: they sort into the trailing trash segment, whose output, state and gradients the gather-sum
and the caller drop. CUDA, or the Triton interpreter with fp32 inputs (its 16-bit dot is wrong).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from hybridize.ops.common.fla_adapter import needs_grad
from hybridize.ops.gla.triton_bwd import _dg_anchor, _products, backward_pieces
from hybridize.ops.gla.triton_fwd import Gather, _pieces_for, check_inputs, forward_pieces
from hybridize.ops.sse.triton_route import _combine, _pack, _unpack_grad


class Layout(NamedTuple):
    """Where SSE's varlen layout puts every row (`reference.varlen_plan`): `order` `[M]` the sorted pairs, `inv`
    `[L * K]` each pair's sorted place, `keep` `[L * K]` int8 (0: a dropped pair) or None, `seg_cu` the call's
    segment offsets (the shared path's sequences first), K slots per token, `shared`: a shared path in front."""
    order: torch.Tensor
    inv: torch.Tensor
    keep: torch.Tensor | None
    seg_cu: torch.Tensor
    K: int
    shared: bool


def _packed_rows(sp, w, lay: Layout, emul) -> list[torch.Tensor]:
    """The sparse path's q, k, v, g `[1, M, H, *]` in the layout's order, scaled where `emul` asks (the row packer)."""
    scales = (w if emul[0] else None, w if emul[1] else None, None, None)
    return [_pack(None, x, s, lay.keep, lay.order, lay.K) for x, s in zip(sp, scales)]


def _view(rows, w, lay: Layout, L0: int, emul, packed: bool) -> Gather:
    """The kernels' view of the sparse path: `rows` its tensors read in place (scaled in the kernels), or with
    `packed` its rows packed and scaled already (`_packed_rows`)."""
    if packed:
        return Gather(*rows, lay.order, None, lay.K, L0, False, False, packed=True)
    return Gather(*rows, lay.order, w, lay.K, L0, *emul)


class _GatheredGLA(torch.autograd.Function):
    """(shared q, k, v, g, sparse q, k, v, g, router probability per pair `[L * K]` fp32, initial states fp32 or
    None) -> (o `[1, L, H, V]`, each segment's final state fp32). `packed`: the sparse rows are packed (only the
    shared path is read in place)."""

    @staticmethod
    def forward(ctx, sh_q, sh_k, sh_v, sh_g, sp_q, sp_k, sp_v, sp_g, w, s0, lay: Layout, pc, scale, emul, packed,
                keep_scores, longest):
        L = sp_q.shape[1]
        L0 = L if lay.shared else 0
        sp = (sp_q, sp_k, sp_v, sp_g)
        rows = _packed_rows(sp, w, lay, emul) if packed else sp
        o_all, starts, decay, s_end, scores = forward_pieces(sh_q, sh_k, sh_v, sh_g, scale, s0, pc,
                                                             gather=_view(rows, w, lay, L0, emul, packed),
                                                             keep_scores=keep_scores)
        o = _combine(o_all, lay.keep, lay.inv, lay.K, L, lay.shared)
        # packed: the packed rows are what the backward reads, the sparse q and k only for the router's row dots
        ctx.save_for_backward(sh_q, sh_k, sh_v, sh_g, sp_q, sp_k, *rows, w, starts, s_end, decay, scores)
        ctx.lay, ctx.pc, ctx.scale, ctx.emul, ctx.has_h0, ctx.packed = lay, pc, scale, emul, s0 is not None, packed
        ctx.same_v = sh_v is sp_v           # SSE's v: one tensor on both paths, its two gradients summed in one pass
        ctx.prod = _products(sp_q.dtype)    # the forward's options, also for a backward run outside their block
        ctx.anchor = _dg_anchor(longest)
        ctx.set_materialize_grads(False)
        return o, s_end

    @staticmethod
    def backward(ctx, d_o, d_end):
        sh_q, sh_k, sh_v, sh_g, sp_q, sp_k, r_q, r_k, r_v, r_g, w, starts, s_end, decay, scores = ctx.saved_tensors
        lay = ctx.lay
        L = sp_q.shape[1]
        L0 = L if lay.shared else 0
        d_o = torch.zeros(1, L, *r_v.shape[2:], dtype=r_v.dtype, device=r_v.device) if d_o is None else \
            d_o.contiguous()
        d_end = None if d_end is None else d_end.float().contiguous()
        gather = _view((r_q, r_k, r_v, r_g), w, lay, L0, ctx.emul, ctx.packed)
        do_sp = _pack(None, d_o, None, lay.keep, lay.order, lay.K) if ctx.packed else None
        dq, dk, dv, dg, dh0 = backward_pieces(sh_q, sh_k, sh_v, sh_g, d_o, d_end, starts, s_end, decay, scores,
                                              ctx.pc, ctx.scale, prod=ctx.prod, gather=gather, do_sparse=do_sp,
                                              anchor=ctx.anchor)
        w_grad = ctx.needs_input_grad[8]

        def unpack(d, x_sp, scaled, same=False):
            """The packer's backward on a packed gradient: (shared, sparse, router-probability row dots or None)."""
            return _unpack_grad(d, L, lay.shared, w if scaled else None, lay.keep, lay.inv, lay.K,
                                x_sp if scaled and w_grad else None, same)

        d_shq, d_spq, dots_q = unpack(dq, sp_q, ctx.emul[0])
        d_shk, d_spk, dots_k = unpack(dk, sp_k, ctx.emul[1])
        d_shv, d_spv, _ = unpack(dv, None, False, same=ctx.same_v)
        d_shg, d_spg, _ = unpack(dg, None, False)
        dots = [t for t in (dots_q, dots_k) if t is not None]
        d_w = sum(dots[1:], dots[0]).to(w.dtype) if dots else None
        return (d_shq, d_shk, d_shv, d_shg, d_spq, d_spk, d_spv, d_spg, d_w,
                dh0 if ctx.has_h0 else None, None, None, None, None, None, None, None)


def gathered_gla(shared, sparse, w: torch.Tensor, lay: Layout, scale: float | None = None,
                 initial_state: torch.Tensor | None = None, emulq: bool = True, emulk: bool = True,
                 segment_len: int | None = None, packed: bool = False):
    """SSE's varlen GLA call on its layout read in place: `shared` / `sparse` (q, k, v, g) `[1, L, H, K]` (v
    `[1, L, H, V]`, g per-key-channel log-decays; `shared` None: no shared path), `w` `[L * K]` fp32 the router
    probability of every pair, `initial_state` `[S, H, K, V]` one per segment of `lay.seg_cu` ->
    (o `[1, L, H, V]`: both paths summed per token, every segment's final state `[S, H, K, V]` fp32).
    Gradients reach both paths, `w` and the initial state. `segment_len`: the pieces' length (`gla_triton`'s).
    `packed`: only the shared path is read in place; the sparse rows are packed (and their output gradient in the
    backward), so the passes read contiguous rows throughout."""
    for path in (shared, sparse):
        if path is not None:
            check_inputs(path[0], path[1], path[2], path[3], lay.seg_cu)
    if shared is not None and any(a.dtype != b.dtype for a, b in zip(shared, sparse)):
        raise ValueError("gathered_gla: the shared and sparse paths must have the same dtypes")
    src = shared if shared is not None else sparse          # without a shared path never read
    K = sparse[0].shape[-1]
    scale = K ** -0.5 if scale is None else float(scale)
    sh = [t.contiguous() for t in src]
    sp = [t.contiguous() for t in sparse]
    if shared is not None and sparse[2] is shared[2]:
        sh[2] = sp[2]                                        # keep one tensor on both paths one object
    lay = lay._replace(order=lay.order.contiguous(), seg_cu=lay.seg_cu.to(dtype=torch.long).contiguous())
    L = sp[0].shape[1]
    rows = (L if lay.shared else 0) + lay.order.numel()
    pc, longest = _pieces_for(sp[0], 1, rows, lay.seg_cu, segment_len)
    s0 = None if initial_state is None else initial_state.float().contiguous()
    # the in-tile scores the dv pass reads are kept only when a backward can follow (a forward alone stores nothing)
    return _GatheredGLA.apply(*sh, *sp, w, s0, lay, pc, scale, (emulq, emulk), packed, needs_grad(*sh, *sp, w, s0),
                              longest)


__all__ = ["Layout", "gathered_gla"]
