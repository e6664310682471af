"""Packing helpers shared by every op: turn `cu_seqlens` packed input into a padded batch and back.

Ops are written for a batch of equal-length sequences `[B, T, ...]`. Packed input (`B == 1` plus
`cu_seqlens` of length N+1, the layout of fla and flash-attention varlen) is right-padded into
`[N, T_max, ...]`, run, and scattered back. Right padding with zero keys/values and zero log-decay
leaves every state untouched, so the final state of each sequence is exact.
"""
from __future__ import annotations

import torch


def check_cu_seqlens(x: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    if x.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs batch size 1 (packed layout), got batch {x.shape[0]}; "
                         "flatten the batch into one row first")
    if int(cu_seqlens[-1]) != x.shape[1]:
        raise ValueError(f"cu_seqlens[-1]={int(cu_seqlens[-1])} does not match the packed length {x.shape[1]}")


def seq_lengths(cu_seqlens: torch.Tensor) -> list[int]:
    return (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()


def pack_to_padded(x: torch.Tensor | None, cu_seqlens: torch.Tensor, value: float = 0.0) -> torch.Tensor | None:
    """`[1, T_total, ...]` -> `[N, T_max, ...]`, right-padded with `value`."""
    if x is None:
        return None
    lens = seq_lengths(cu_seqlens)
    t_max = max(lens) if lens else 0
    out = x.new_full((len(lens), t_max, *x.shape[2:]), value)
    for i, (start, n) in enumerate(zip(cu_seqlens[:-1].tolist(), lens)):
        out[i, :n] = x[0, start:start + n]
    return out


def padded_to_pack(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """`[N, T_max, ...]` -> `[1, T_total, ...]`, dropping the padding."""
    lens = seq_lengths(cu_seqlens)
    return torch.cat([x[i, :n] for i, n in enumerate(lens)], dim=0).unsqueeze(0)


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Packed rows restart `position_ids` at 0 for every document: recover `cu_seqlens` (batch 1 only).

    Returns None when the row holds a single sequence (nothing to split)."""
    if position_ids is None or position_ids.shape[0] != 1:
        return None
    pos = position_ids[0]
    starts = torch.nonzero(pos == 0).flatten()
    if starts.numel() <= 1 and (starts.numel() == 0 or int(starts[0]) == 0):
        return None
    if starts.numel() == 0 or int(starts[0]) != 0:
        starts = torch.cat([starts.new_zeros(1), starts])
    return torch.cat([starts, starts.new_tensor([pos.numel()])]).to(torch.long)
