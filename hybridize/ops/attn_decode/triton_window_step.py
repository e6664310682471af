"""One decode token of a window layer (`hybridize/mixers/swa.py`) over its ring state, split-KV style.

`SlidingWindowAttention._step` takes a decode token through about a dozen kernels: slot arithmetic, two scatters,
the mask, a masked sdpa call and two more scatters that clear the slot leaving the band. Compiled, at the 135M shape
and batch 8 on an H200, that was about 35 us a window layer, of which cuDNN's masked attention over the 516 slots
took 13 and the state writes (which torch.compile turns into copies of the whole state) most of the rest, against
22 us for a softmax layer over an 8k cache (benchmarks/RESULTS.md, "Decode: the window layer's token in two
kernels"). Here the step is the two launches of the split-KV decode attention (`triton_split_kv.py`, after
"Flash-Decoding for long-context inference"):

- phase 1, one program per (slot split, row, KV head), for the G = H / Hkv query heads of the group: the online
  softmax over the split's slots that the query of rank g = seen + 1 reads (sink i once g >= i + 1 + window, ring
  slot j once filled, never the slot g's own key goes to: it holds the rank that left the band last step, already
  cleared); split 0 starts from the token's own key and value, read from the inputs, and writes them into the ring
  slot sinks + seen % window (and the sink slot g - 1 while g <= sinks). No program reads those slots in this step,
  so the writes need no ordering.
- phase 2, one program per (row, query head): merges the splits; the group's first head clears the ring slot of
  rank g + 1 - window, which phase 1 still read (as `_step` does, so the state equals the one a chunk call writes).

The contract and its PyTorch reference: `window_step.py` (tested against each other and against `_step`). `seen` is
read, not written (the caller adds 1). No padding mask (the decode loops' case; `_step` keeps the general path). No
host sync and no data-dependent shape, so the step can be captured in a CUDA graph. An earlier version ran one
program per (row, KV head) over all slots and was slower than the sdpa path (RESULTS.md).
"""
from __future__ import annotations

import os

import torch

from hybridize.ops.common.pdl import pdl_args

from .triton_split_kv import LOG2E, _attend_block, combine, sm_count, split_plan, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _window_partial(q, k_new, v_new, ks, vs, seen, m_out, l_out, acc_out, qk_scale, Hkv, G, window, sinks, L,
                        chunk, S, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                        IEEE: tl.constexpr, LOOP_WHILE: tl.constexpr, PDL: tl.constexpr):
        """One (split, row b, KV head h): running softmax stats (log2 units) of the group's query heads over the
        slots of the split that the query reads; split 0 also holds the token itself and writes it to the state."""
        if PDL:   # launched before the previous kernel finished (ops/common/pdl.py): wait for its outputs
            tl.extra.cuda.gdc_wait()
        i_s, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
        i_b = i_bh // Hkv
        i_h = i_bh % Hkv
        n = tl.load(seen + i_b)
        g = n + 1                                                         # this token's rank
        ring = sinks + n % window                                         # the slot its key goes to
        o_g = tl.arange(0, BLOCK_G)
        o_d = tl.arange(0, BLOCK_D)
        m_g = o_g < G
        m_d = o_d < D
        heads = i_h * G + o_g
        b_q = tl.load(q + (i_b * Hkv * G + heads[:, None]) * D + o_d[None, :], mask=m_g[:, None] & m_d[None, :],
                      other=0.0)
        b_kn = tl.load(k_new + i_bh * D + o_d, mask=m_d, other=0.0)
        b_vn = tl.load(v_new + i_bh * D + o_d, mask=m_d, other=0.0)
        # split 0 starts from the token itself (score in log2 units, weight 1); the others from nothing
        s_new = tl.sum(b_q.to(tl.float32) * b_kn.to(tl.float32)[None, :], axis=1) * qk_scale
        first = i_s == 0
        b_m = tl.where(first, s_new, float("-inf"))
        b_l = tl.where(first, 1.0, 0.0) + tl.zeros([BLOCK_G], dtype=tl.float32)
        b_acc = tl.where(first, 1.0, 0.0) * b_vn.to(tl.float32)[None, :] + tl.zeros([BLOCK_G, BLOCK_D],
                                                                                     dtype=tl.float32)
        base = i_bh * L * D
        s_lo = i_s * chunk
        s_hi = tl.minimum(L, s_lo + chunk)
        if LOOP_WHILE:   # the interpreter cannot take tensor bounds in range()
            j0 = s_lo
            while j0 < s_hi:
                b_m, b_l, b_acc = _attend_block(b_q, ks + base, vs + base, j0, s_hi, D, D, o_d, m_d, b_m, b_l, b_acc,
                                                qk_scale, BLOCK_N, IEEE, g, ring, window, sinks, True)
                j0 += BLOCK_N
        else:
            for j0 in range(s_lo, s_hi, BLOCK_N):
                b_m, b_l, b_acc = _attend_block(b_q, ks + base, vs + base, j0, s_hi, D, D, o_d, m_d, b_m, b_l, b_acc,
                                                qk_scale, BLOCK_N, IEEE, g, ring, window, sinks, True)
        rows = (i_b * Hkv * G + heads) * S + i_s                         # index into [B, Hq, S]
        tl.store(m_out + rows, b_m, mask=m_g)
        tl.store(l_out + rows, b_l, mask=m_g)
        tl.store(acc_out + rows[:, None] * D + o_d[None, :], b_acc, mask=m_g[:, None] & m_d[None, :])
        # the token's key and value into its ring slot (and its sink slot while the sinks fill): slots no program
        # reads in this step
        tl.store(ks + base + ring * D + o_d, b_kn.to(ks.dtype.element_ty), mask=m_d & first)
        tl.store(vs + base + ring * D + o_d, b_vn.to(vs.dtype.element_ty), mask=m_d & first)
        sink = tl.minimum(g - 1, L - 1)
        filling = m_d & first & (g <= sinks)
        tl.store(ks + base + sink * D + o_d, b_kn.to(ks.dtype.element_ty), mask=filling)
        tl.store(vs + base + sink * D + o_d, b_vn.to(vs.dtype.element_ty), mask=filling)


#: slots per block of phase 1 (a module setting, so tests can make splits of a few slots)
BLOCK_N = 64


def window_splits(L: int, rows: int, device, block_n: int) -> int:
    """Slot splits: about 4 programs per SM in phase 1, at least two blocks of slots per split."""
    return max(1, min(-(-4 * sm_count(device) // max(1, rows)), -(-L // (2 * block_n))))


@torch.compiler.disable   # opaque to torch.compile, as the other decode kernels: it writes the state in place
def window_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor,
                seen: torch.Tensor, window: int, sinks: int, scale: float, block_n: int | None = None) -> torch.Tensor:
    """q `[B, 1, H, D]`, k, v `[B, 1, Hkv, D]` (after RoPE / norms), ring state ks, vs `[B, Hkv, sinks + window, D]`
    (contiguous, written in place), seen `[B]` int64 (read only) -> o `[B, 1, H, D]` in q's dtype."""
    if triton is None:
        raise ImportError("window_step needs triton; the window layer's PyTorch step runs without it")
    B, _, H, D = q.shape
    Hkv, L = ks.shape[1], ks.shape[2]
    if (D & (D - 1) or H % Hkv or L != sinks + window or vs.shape != ks.shape or vs.dtype != ks.dtype
            or not (ks.is_contiguous() and vs.is_contiguous())):
        raise ValueError(f"window_step needs a power-of-two head dim, whole query groups and a contiguous "
                         f"state [B, Hkv, {sinks + window}, D] of one dtype, got q {tuple(q.shape)}, state "
                         f"{tuple(ks.shape)} {ks.dtype} / {tuple(vs.shape)} {vs.dtype}")
    G = H // Hkv
    dev = q.device
    block_n = block_n or BLOCK_N
    chunk, S, (m, lsum, acc) = split_plan(L, window_splits(L, B * Hkv, dev, block_n), block_n, B, H, D, dev)
    qk = q.to(ks.dtype).contiguous()
    ieee = ks.dtype == torch.float32
    _window_partial[(S, B * Hkv)](
        qk, k.to(ks.dtype).contiguous(), v.to(ks.dtype).contiguous(), ks, vs, seen, m, lsum, acc, scale * LOG2E,
        Hkv, G, window, sinks, L, chunk, S, D=D, BLOCK_D=max(16, D), BLOCK_G=max(16, triton.next_power_of_2(G)),
        BLOCK_N=block_n, IEEE=ieee, LOOP_WHILE=os.environ.get("TRITON_INTERPRET") == "1", num_warps=4, num_stages=2,
        **pdl_args(dev))
    o = torch.empty(B, H, D, dtype=q.dtype, device=dev)
    combine(m, lsum, acc, o, ks=ks, vs=vs, seen=seen, G=G, L=L, window=window, sinks=sinks, CLEAR=True)
    return o.view(B, 1, H, D)
