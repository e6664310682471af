"""One decode token of sliding-window attention with sinks over its ring state, in one Triton kernel (the window
layer of `hybridize/mixers/swa.py`; "Efficient Streaming Language Models with Attention Sinks" for the sinks).

`SlidingWindowAttention._step` takes a decode token through about a dozen small kernels (slot arithmetic, two
scatters, the mask compare, sdpa, two more scatters to clear the slot that leaves the band); at the 135M shape a
window layer then costs more than the softmax layer it replaces, which reads a few megabytes more but launches half
as many kernels (benchmarks/RESULTS.md, "Decode: SSE's token in one kernel"). Here one program per (row, KV head)
does the step, for the G = H / Hkv query heads of its group, in fp32:

    g = seen + 1                                     (this token's rank)
    scores over the state's valid slots (sink i once g >= i + 1 + window, ring slot j once filled), except the
    ring slot the token is about to take, plus the token itself from registers; online softmax in blocks of slots
    write k, v into ring slot sinks + seen % window (and sink slot g - 1 while g <= sinks), then clear ring slot
    sinks + g % window (the rank that has just left every band), as `_step` does

and writes o `[B, 1, H, D]` in q's dtype. `seen` is read, not written (the caller adds 1). No padding mask: a row's
token is always real (the decode loops' case; `_step` keeps the general path). No host sync, no data-dependent shape:
the step can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _window_step_kernel(q, k_new, v_new, ks, vs, seen, o, scale, W, SINKS, HKV, S: tl.constexpr,
                        G: tl.constexpr, BG: tl.constexpr, D: tl.constexpr, BS: tl.constexpr):
    i_b, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    d = tl.arange(0, D)
    r = tl.arange(0, BG)
    m_r = r < G
    n = tl.load(seen + i_b)                                   # real tokens before this one
    g = n + 1
    ring = SINKS + n % W
    row_q = (i_b * HKV + i_h) * G                             # first query head of the group, as a [B, H] row
    b_q = tl.load(q + (row_q + r[:, None]) * D + d[None, :], mask=m_r[:, None], other=0.0).to(tl.float32)
    kv_row = (i_b * HKV + i_h) * D
    b_kn = tl.load(k_new + kv_row + d).to(tl.float32)
    b_vn = tl.load(v_new + kv_row + d).to(tl.float32)
    # the token itself starts the running softmax
    m = tl.sum(b_q * b_kn[None, :], 1) * scale                # [BG]
    l = tl.full([BG], 1.0, dtype=tl.float32)
    acc = tl.zeros([BG, D], dtype=tl.float32) + b_vn[None, :]
    base = (i_b * HKV + i_h) * S * D
    for j0 in range(0, S, BS):
        j = j0 + tl.arange(0, BS)
        need = tl.where(j < SINKS, j + 1 + W, j - SINKS + 1)  # the rank a query needs to read slot j
        ok = (j < S) & (g >= need) & (j != ring)
        b_k = tl.load(ks + base + j[:, None] * D + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        b_v = tl.load(vs + base + j[:, None] * D + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        s = tl.sum(b_q[:, None, :] * b_k[None, :, :], 2) * scale                   # [BG, BS]
        s = tl.where(ok[None, :], s, -float("inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * b_v[None, :, :], 1)
        m = m_new
    out = acc / l[:, None]
    tl.store(o + (row_q + r[:, None]) * D + d[None, :], out.to(o.dtype.element_ty), mask=m_r[:, None])
    tl.debug_barrier()                                       # every read of the state is done before it is written
    tl.store(ks + base + ring * D + d, b_kn.to(ks.dtype.element_ty))
    tl.store(vs + base + ring * D + d, b_vn.to(vs.dtype.element_ty))
    filling = (d < D) & (g <= SINKS)                          # while the sinks fill: the sink slot too
    sink = tl.minimum(g - 1, S - 1)
    tl.store(ks + base + sink * D + d, b_kn.to(ks.dtype.element_ty), mask=filling)
    tl.store(vs + base + sink * D + d, b_vn.to(vs.dtype.element_ty), mask=filling)
    tl.debug_barrier()
    dead = SINKS + g % W
    tl.store(ks + base + dead * D + d, tl.zeros([D], dtype=ks.dtype.element_ty))
    tl.store(vs + base + dead * D + d, tl.zeros([D], dtype=vs.dtype.element_ty))


@torch.compiler.disable   # opaque to torch.compile, as the other decode kernels: it writes the state in place
def window_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor,
                seen: torch.Tensor, window: int, sinks: int, scale: float) -> torch.Tensor:
    """q `[B, 1, H, D]`, k, v `[B, 1, Hkv, D]` (after RoPE / norms), ring state ks, vs `[B, Hkv, sinks + window, D]`
    (written in place), seen `[B]` int64 (read only) -> o `[B, 1, H, D]` in q's dtype."""
    B, _, H, D = q.shape
    Hkv, S = ks.shape[1], ks.shape[2]
    if D & (D - 1) or H % Hkv or S != sinks + window or vs.shape != ks.shape or not (ks.is_contiguous()
                                                                                      and vs.is_contiguous()):
        raise ValueError(f"window_step needs a power-of-two head dim, whole query groups and contiguous state "
                         f"[B, Hkv, {sinks + window}, D], got q {tuple(q.shape)}, state {tuple(ks.shape)}")
    G = H // Hkv
    o = torch.empty_like(q)
    BS = max(16, min(128, 8192 // (triton.next_power_of_2(G) * D)))
    _window_step_kernel[(B, Hkv)](q.contiguous(), k.contiguous(), v.contiguous(), ks, vs, seen, o, scale, window,
                                  sinks, Hkv, S=S, G=G, BG=triton.next_power_of_2(G), D=D, BS=BS)
    return o
