"""The one-kernel SSE-on-GLA decode step's contract (`StepLayout`) and its PyTorch reference.

`triton_fused_step.sse_gla_step` (the kernel, its module docstring gives the math) and `sse_gla_step_reference` (here,
plain PyTorch, fp32) take the same arguments and give the same results: o `[B, 1, H, D]` in y's dtype, the shared and
the selected partition's states updated in place. The reference is what the kernel's op-level test compares against,
and what `hybridize.generation.profile` runs on the CPU in place of the kernel (counted as one kernel). `block_v` is
the kernel's value columns per program. No triton import here: the mixer builds its layout without it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class StepLayout:
    """Where the step finds its inputs, and the mixer's settings it applies."""

    heads: int
    kv_heads: int
    head_dim: int
    partitions: int
    v_col: int          # first v column in y
    router_col: int     # first router logit in y
    gate_col: int       # first gate pre-activation in u (shared path, then sparse)
    delta_col: int      # first column of the sparse path's q|k LoRA delta in u ((H + Hk) D of them)
    q_map: str
    k_map: str
    v_map: str
    gate_normalizer: float
    norm_eps: float | None   # None: no q/k norm
    emulq: bool
    emulk: bool
    out_norm_eps: float | None = None   # set: the step also applies the output norm (and gate) the mixer's finish does
    out_gate_col: int | None = None     # first output-gate pre-activation column in y (silu gate); None: no gate
    # set: the step computes the sparse q|k LoRA deltas and both gates' pre-activations itself, from y's low-rank
    # columns at low_col (the q LoRA's `lora_rank`, the k LoRA's, then the shared and the sparse gate's `gate_rank`)
    # and the up-projection weights (`StepUps`); u is not read (kernel option `sse_step_lowrank`)
    low_col: int | None = None
    lora_rank: int = 0
    gate_rank: int = 0


@dataclass(frozen=True)
class StepUps:
    """The low-rank up-projections a step with `StepLayout.low_col` applies itself: the q and k LoRA ups
    `[H D, r]` / `[Hk D, r]`, the shared and the sparse gate ups `[H D, r_g]` and their biases `[H D]` (or None)."""

    q: torch.Tensor
    k: torch.Tensor
    gate_shared: torch.Tensor
    gate_sparse: torch.Tensor
    bias_shared: torch.Tensor | None = None
    bias_sparse: torch.Tensor | None = None


def block_v(rows: int, heads: int, dim: int, finish: bool = False) -> int:
    """Value columns per program: narrow blocks when rows x heads are few, so more programs share the
    state traffic (the step is latency-bound at batch 1); wide ones otherwise (fewer repeated front ends).
    A step that finishes its heads takes a whole head per program when the head is at most 64 wide: its two state
    blocks are then 32 KB, and streaming them costs less than the last-program handshake (an H100, one SSE layer's
    kernel: 5.7 against 6.6 us at the SmolLM2-135M shape, batch 1; at the Qwen3-1.7B shape, 128 wide, 11.9
    against 8.2 us the other way; `python -m benchmarks.ops.sse_step`), and also a 128-wide head when rows x heads
    are 65-128 (one H200, the 1.7B shape at batch 8 as the engine launches it, `step_warps`' 8 warps: 13.3 us
    against 15.4 us for 32-wide blocks of 4 warps; `sse_step --scan-bv`). With a program per partition (`step_paths`:
    a 128-wide head at batch 1) 32-wide blocks: 7.1 us against 8.1 for the 16-wide blocks of one program per pair
    (one H200, the kernel on eight states read from memory in turn, `sse_step --cold 8 --scan-paths 1,2`)."""
    programs_per_block = rows * heads
    if finish and (dim <= 64 or 64 < programs_per_block <= 128):
        return dim
    if finish and step_paths(rows, dim) == 2:
        return 32
    bv = 16 if programs_per_block <= 64 else (32 if programs_per_block <= 256 else 64)
    return min(dim, bv)


def step_warps(rows: int, dim: int) -> int:
    """Warps per program of the one-kernel step: 8 for heads 128 wide at up to 8 rows, else Triton's 4 (one H200, the
    1.7B shape as the engine launches it: batch 1, 16-wide blocks, 9.2 against 10.0 us; batch 8 above; at the
    SmolLM2-135M shape, 64 wide, 4 warps stayed the fastest; `python -m benchmarks.ops.sse_step --scan-bv`)."""
    return 8 if dim >= 128 and rows <= 8 else 4


def step_paths(rows: int, dim: int) -> int:
    """Programs per (value block, row, head) of a finishing step: 1 updates both partitions' states one after the
    other; 2 gives the shared and the selected partition a program each, so their two state round trips overlap (the
    head's last program sums the two outputs). 2 for heads 128 wide at batch 1, the one cell where it won (one H200,
    the 1.7B shape, the kernel alone on eight states read from memory in turn: 7.1 against 8.1 us; at batch 8 15.8
    against 17.1 us for one program per pair, and at the SmolLM2-135M shape 4.2 against 4.8;
    `python -m benchmarks.ops.sse_step --cold 8 --scan-paths 1,2`)."""
    return 2 if dim >= 128 and rows == 1 else 1


def _feature(x: torch.Tensor, name: str) -> torch.Tensor:
    if name == "silu":
        return F.silu(x)
    if name == "softmax":
        return torch.softmax(x, dim=-1)
    return x


def lowrank_ups(y: torch.Tensor, layout: StepLayout, ups: StepUps) -> tuple[torch.Tensor, StepLayout]:
    """(u `[B, n + 2 H D]` fp32, its layout): the sparse q|k LoRA delta, then the shared and the sparse gate
    pre-activations, from y's low-rank columns `[B, 1, ...]`, as a step with `layout.low_col` computes them (fp32,
    no rounding between the low-rank input and the step)."""
    L = layout
    r, rg = L.lora_rank, L.gate_rank
    low = y[:, 0, L.low_col:L.low_col + 2 * r + 2 * rg].float()
    parts = [low[:, :r] @ ups.q.float().T, low[:, r:2 * r] @ ups.k.float().T]
    for i, (w, b) in enumerate(((ups.gate_shared, ups.bias_shared), (ups.gate_sparse, ups.bias_sparse))):
        z = low[:, 2 * r + i * rg:2 * r + (i + 1) * rg] @ w.float().T
        parts.append(z + b.float() if b is not None else z)
    n = (L.heads + L.kv_heads) * L.head_dim
    return torch.cat(parts, dim=-1), dataclasses.replace(L, delta_col=0, gate_col=n, low_col=None)


def sse_gla_step_reference(y, u, shared, sparse, layout: StepLayout, norm_weight=None, cos=None, sin=None,
                           scale=None, bv=None, out_weight=None, ups: StepUps | None = None):
    """`triton_fused_step.sse_gla_step` in PyTorch, fp32 (`bv`, the kernel's block width, is ignored)."""
    L = layout
    B, H, Hk, D = y.shape[0], L.heads, L.kv_heads, L.head_dim
    n, rep = (H + Hk) * D, H // Hk
    scale = D ** -0.5 if scale is None else scale
    if L.low_col is not None:
        uf, L = lowrank_ups(y, L, ups)
    else:
        uf = u[:, 0].float()
    yf = y[:, 0].float()
    probs = torch.softmax(yf[:, L.router_col:L.router_col + L.partitions], dim=-1)
    w, part = probs.max(dim=-1)                                                        # [B]: top-1
    v = _feature(yf[:, L.v_col:L.v_col + Hk * D].view(B, Hk, D), L.v_map).repeat_interleave(rep, dim=1)
    rows = torch.arange(B, device=y.device)
    o = torch.zeros(B, H, D, dtype=torch.float32, device=y.device)
    delta = uf[:, L.delta_col:L.delta_col + n]
    for path, x in enumerate((yf[:, :n], yf[:, :n] + delta)):                         # shared, then sparse
        x = x.view(B, H + Hk, D)
        if L.norm_eps is not None:
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + L.norm_eps) * norm_weight.float()
        if cos is not None:
            c, s = cos.float().view(-1, 1, D), sin.float().view(-1, 1, D)
            x = x * c + torch.cat([-x[..., D // 2:], x[..., :D // 2]], dim=-1) * s
        q = _feature(x[:, :H], L.q_map)
        k = _feature(x[:, H:], L.k_map).repeat_interleave(rep, dim=1)
        g0 = L.gate_col + path * H * D
        g = F.logsigmoid(uf[:, g0:g0 + H * D].view(B, H, D)) / L.gate_normalizer
        if path == 1:
            q = q * w[:, None, None] if L.emulq else q
            k = k * w[:, None, None] if L.emulk else k
        state = shared if path == 0 else sparse[rows, part]                           # [B, H, D, D]
        state = state * g.exp()[..., None] + k[..., None] * v[..., None, :]
        if path == 0:
            shared.copy_(state)
        else:
            sparse[rows, part] = state
        o += torch.einsum("bhkv,bhk->bhv", state, q) * scale
    if L.out_norm_eps is not None:   # the mixer's finish before o_proj: per-head RMSNorm, silu output gate
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + L.out_norm_eps) * out_weight.float()
        if L.out_gate_col is not None:
            o = o * F.silu(yf[:, L.out_gate_col:L.out_gate_col + H * D].view(B, H, D))
    return o.to(y.dtype).unsqueeze(1)
