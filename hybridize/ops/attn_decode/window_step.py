"""The window layer's decode token over its ring state: the contract of the Triton kernel
(`triton_window_step.window_step`) as a PyTorch reference, and where the kernel applies.

The state is `SWAState`'s (`hybridize/mixers/swa.py`): keys / values `[B, Hkv, sinks + window, D]`, slot i < sinks
holding the real token of rank i + 1, ring slot sinks + (r - 1) % window the token of rank r, and `seen` `[B]`. A
decode token of rank g = seen + 1 attends to the sinks that have left its window (sink i once g >= i + 1 + window), the
filled ring slots except the one its own key goes to (sinks + seen % window: it holds the rank that left the band
last step, already cleared), and itself. The step then writes its key and value into that ring slot (and into sink
slot g - 1 while g <= sinks) and clears the ring slot of rank g + 1 - window, which leaves the band with this token,
so the state equals the one the layer's chunk form writes. `seen` is read, not written.

No triton here: the reference runs anywhere (CI tests the mixer's kernel path with it in the kernel's place, and the
CPU decode profile counts it as the kernel, `hybridize.generation.profile`).
"""
from __future__ import annotations

import torch

from hybridize.ops.common.options import current_kernel_options, triton_kernels_apply


def slot_ranks(window: int, sinks: int, device=None) -> torch.Tensor:
    """`[sinks + window]`: the rank a query needs to read each slot: sink i (rank i + 1) once it has left the window
    (rank >= i + 1 + window; inside it the ring holds it), ring slot j once filled (rank >= j + 1)."""
    j = torch.arange(sinks + window, device=device)
    return torch.where(j < sinks, j + 1 + window, j - sinks + 1)


def readable_slots(seen: torch.Tensor, window: int, sinks: int) -> torch.Tensor:
    """`[B, sinks + window]` bool: the state slots the token after `seen` `[B]` real tokens reads (itself aside)."""
    j = torch.arange(sinks + window, device=seen.device)
    g = (seen + 1).unsqueeze(1)
    return (g >= slot_ranks(window, sinks, seen.device)) & (j != (sinks + seen % window).unsqueeze(1))


def window_step_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor,
                          seen: torch.Tensor, window: int, sinks: int, scale: float) -> torch.Tensor:
    """q `[B, 1, H, D]`, k, v `[B, 1, Hkv, D]` (after RoPE / norms), state ks, vs `[B, Hkv, sinks + window, D]`
    (written in place), seen `[B]` int64 (read only) -> o `[B, 1, H, D]` in q's dtype. fp32 math."""
    B, _, H, D = q.shape
    Hkv = ks.shape[1]
    ok = readable_slots(seen, window, sinks)                                     # [B, L]
    qf = q[:, 0].float().view(B, Hkv, H // Hkv, D)
    kn, vn = k[:, 0].to(ks.dtype), v[:, 0].to(vs.dtype)                          # [B, Hkv, D], as stored
    s = torch.einsum("bhgd,bhld->bhgl", qf, ks.float()) * scale
    s = s.masked_fill(~ok[:, None, None, :], float("-inf"))
    s = torch.cat([s, torch.einsum("bhgd,bhd->bhg", qf, kn.float()).unsqueeze(-1) * scale], -1)
    p = torch.softmax(s, -1)
    # masked slots are never read: a NaN left in one must not leak through 0 * NaN
    o = torch.einsum("bhgl,bhld->bhgd", p[..., :-1], vs.float().masked_fill(~ok[:, None, :, None], 0))
    o = o + p[..., -1:] * vn.float().unsqueeze(2)
    rows = torch.arange(B, device=q.device)
    ring = sinks + seen % window
    ks[rows, :, ring], vs[rows, :, ring] = kn, vn
    fill = rows[seen < sinks]
    ks[fill, :, seen[fill]], vs[fill, :, seen[fill]] = kn[fill], vn[fill]
    dead = sinks + (seen + 1) % window
    ks[rows, :, dead], vs[rows, :, dead] = 0, 0
    return o.reshape(B, 1, H, D).to(q.dtype)


def window_step_applies(x: torch.Tensor) -> bool:
    """The Triton window step may run on x: our Triton kernels apply (`triton_kernels_apply`) and option
    `window_step` is on (the mixer checks its own state: `SlidingWindowAttention._kernel_step_ok`)."""
    opts = current_kernel_options()
    return triton_kernels_apply(x, opts, opts.window_step)
