"""Where the pieces GLA's gate gradient loses its precision: a CPU model of the backward's roundings.

`gla_grad_error.py` measured on a GPU that our dg was 9-19x less precise than fla's chunk_gla (1.46e-2 with 512-token
pieces, 2.92e-2 with 2048, against 1.57e-3), while dq, dk and dv are within 1.5x. This script models the dq and
dk passes (`ops/gla/triton_bwd.py`) tile by tile in PyTorch on the CPU: 16-token tiles, fp32 accumulation, and a
rounding wherever the kernels round an operand to bf16 for a product, each of which can be made more precise here:

    intra   the in-tile products (the tril(do v^T) scores and the decayed k / q operand): bf16 | tf32 | fp32
    read    the products with the carried state (dq: do S^T; dk: v dS^T): bf16 | split (hi/lo, the kernel option
            gla_products=split) | fp32
    update  the decayed operands of the state updates (dq: k exp(last - Gc); dk: q exp(Gc)): bf16 | split | fp32
    anchor  every n tokens dg's suffix sum restarts from its exact value rowsum(S * dS) (S rounded as `anchor_dtype`
            says); 0: one sum over the whole sequence. A piece boundary of the kernels does the same, so n plays the
            piece length
    dgq     q * dq formed from an fp32 dq (the kernels) or a bf16 one
    consistent  (the kernels' way) dg's terms formed from the operands as the other pass rounded them: each part
            of q * dq (in-tile, through the state) with q as the dk pass rounds it for that part's partner product,
            and each part of k * dk with k as the dq pass rounds it. A pair of tokens then contributes exactly
            opposite amounts to q dq and k dk, so the in-tile and update roundings cancel in dg's sums; only the
            rounding of the carried state where it is read (`read`) is left (dq's parts stay fp32: `dgq` unused)
    tile_exact  (with consistent) each tile's total through the state taken from the fp32 state, rowsum(S (q~^T
            do)) and rowsum(dS (k~^T v)), the difference from its tokens' terms added to its first token: the state
            reads' rounding then stays inside a tile. Built in the kernels once (2.9e-3 on an H200 as the model
            says, but the dq and dk passes 27% / 18% slower) and dropped

One sequence, no initial state, the inputs of `gla_grad_error.py` (bf16 q, k, v and output gradient, fp32 gates
logsigmoid(x)/16), dg against the chunked float64 reference (`ops/gla/reference.chunk_gla`), ||x - ref|| / ||ref||.
At 4096 tokens the model gives 1.46e-2 for 512-token pieces, 2.90e-2 for 2048, 5.6e-3 for 64 and 1.68e-2 with a bf16
dq, against 1.46e-2, 2.92e-2, 6.1e-3 and 1.69e-2 measured on one H200 (the kernels before consistent terms); with
consistent terms 8.8e-3 at 512 and 6.6e-3 with anchors every 256, against 8.80e-3 and 6.54e-3 measured once the
kernels had them. So it ranks precision options without a GPU (benchmarks/RESULTS.md, "the gates' gradient").
Every product in fp32 gives 4e-6. The kernels now form dg's terms consistently and reset the suffix every 512 tokens
(`gla_dg_anchor`): `consistent=True, anchor=512`.

    python -m benchmarks.ops.gla_dg_rounding [--T 4096] [--out rows.json]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.ops import gla_grad_error as grad_error

BT = 16
MODES = ("bf16", "tf32", "split", "fp32")


def rounded(x: torch.Tensor, mode: str) -> torch.Tensor:
    """`x` (fp32) as a product's operand in `mode`: bf16, tf32 (10 mantissa bits, round to nearest), split (a bf16
    hi plus a bf16 lo: two products) or fp32 (as is)."""
    if mode == "bf16":
        return x.bfloat16().float()
    if mode == "tf32":
        bits = x.float().contiguous().view(torch.int32)
        return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)
    if mode == "split":
        hi = x.bfloat16().float()
        return hi + (x - hi).bfloat16().float()
    if mode == "fp32":
        return x
    raise ValueError(f"rounding mode {mode!r}: use one of {', '.join(MODES)}")


def model_dg(q, k, v, g, do, scale: float, anchor: int = 0, intra: str = "bf16", read: str = "bf16",
             update: str = "bf16", anchor_dtype: str = "bf16", dgq: str = "fp32",
             consistent: bool = False, tile_exact: bool = False) -> torch.Tensor:
    """dg `[T, H, K]` of one sequence as the dq and dk passes compute it, under the given roundings: q, k, g
    `[T, H, K]`, v, do `[T, H, V]` (fp32 tensors holding the inputs' values), T a multiple of 16, no initial state
    and no final-state gradient."""
    T, H, K = q.shape
    if T % BT or anchor % BT:
        raise ValueError(f"gla_dg_rounding: T ({T}) and anchor ({anchor}) must be multiples of {BT}")
    q, k, v, g, do = (t.transpose(0, 1).float() for t in (q, k, v, g, do))     # [H, T, D]
    tril = torch.tril(torch.ones(BT, BT))
    triu = tril.T
    tiles = [slice(i * BT, (i + 1) * BT) for i in range(T // BT)]
    S = torch.zeros(H, K, v.shape[-1])
    q_dq = torch.empty(H, T, K)
    k_state, k_intra = k.clone(), k.clone()     # k as the dq pass rounds it for each product (`consistent`)
    anchors = {}
    for i, sl in enumerate(tiles):                        # the dq pass, forward in time
        if anchor and i and (i * BT) % anchor == 0:
            anchors[i] = rounded(S, anchor_dtype)
        gc = g[:, sl].cumsum(1)
        last, bk = gc[:, -1:], k[:, sl]
        ref = 0.5 * last
        dq_state = (rounded(do[:, sl], "bf16") @ rounded(S, read).transpose(1, 2)) * gc.exp() * scale
        S_before = S
        k_upd = rounded(bk * (last - gc).exp(), update)
        S = S * last.exp().transpose(1, 2) + k_upd.transpose(1, 2) @ v[:, sl]
        B = (do[:, sl] @ v[:, sl].transpose(1, 2)) * tril
        k_in = rounded(bk * (ref - gc).exp(), intra)
        dq_intra = (rounded(B, intra) @ k_in) * (gc - ref).exp() * scale
        if consistent:
            k_state[:, sl], k_intra[:, sl] = k_upd / (last - gc).exp(), k_in / (ref - gc).exp()
            qs = q[:, sl] * scale
            q_upd = rounded(qs * gc.exp(), update)
            state_part = dq_state * q_upd / (scale * gc.exp())
            if tile_exact:      # the tile's total through the state from the fp32 state: rowsum(S (q~^T do))
                exact = (S_before * (q_upd.transpose(1, 2) @ do[:, sl])).sum(-1)
                state_part[:, 0] += exact - state_part.sum(1)
            q_dq[:, sl] = state_part + dq_intra * rounded(qs * (gc - ref).exp(), intra) / (scale * (gc - ref).exp())
        else:
            q_dq[:, sl] = rounded(dq_state + dq_intra, dgq) * q[:, sl]
    dS = torch.zeros_like(S)
    suffix = torch.zeros(H, K)
    dg = torch.empty(H, T, K)
    for i in reversed(range(len(tiles))):                 # the dk pass, backward in time
        sl = tiles[i]
        if i + 1 in anchors:
            suffix = (anchors[i + 1] * dS).sum(-1)
        gc = g[:, sl].cumsum(1)
        last, qs = gc[:, -1:], q[:, sl] * scale
        ref = 0.5 * last
        Bt = (v[:, sl] @ do[:, sl].transpose(1, 2)) * triu
        dk_intra = (rounded(Bt, intra) @ rounded(qs * (gc - ref).exp(), intra)) * (ref - gc).exp()
        dk_state = (v[:, sl] @ rounded(dS, read).transpose(1, 2)) * (last - gc).exp()
        k_part = dk_state * k_state[:, sl]
        if tile_exact:          # the same from the fp32 state gradient: rowsum(dS (k~^T v))
            k_upd = k_state[:, sl] * (last - gc).exp()
            exact = (dS * (k_upd.transpose(1, 2) @ v[:, sl])).sum(-1)
            k_part[:, 0] += exact - k_part.sum(1)
        dG = q_dq[:, sl] - dk_intra * k_intra[:, sl] - k_part
        dg[:, sl] = suffix[:, None] + triu @ dG
        suffix = suffix + dG.sum(1)
        dS = dS * last.exp().transpose(1, 2) + rounded(qs * gc.exp(), update).transpose(1, 2) @ do[:, sl]
    return dg.transpose(0, 1)


def inputs(T: int, H: int = 16, K: int = 128, V: int = 128, gate_scale: float = 16.0, seed: int = 0):
    """`gla_grad_error.py`'s inputs on the CPU as fp32 `[T, H, D]` tensors: q, k, v, g, do."""
    x = grad_error.inputs(T, gate_scale, seed, H, K, V, device="cpu")
    return tuple(x[n][0].float() for n in ("q", "k", "v", "g", "do"))


def reference_dg(q, k, v, g, do, scale: float) -> torch.Tensor:
    """dg of the chunked float64 reference on the same values."""
    from hybridize.ops.gla.reference import chunk_gla

    leaves = [t[None].double().requires_grad_() for t in (q, k, v, g)]
    o, _ = chunk_gla(*leaves, scale=scale)
    o.backward(do[None].double())
    return leaves[3].grad[0]


#: the settings printed by default: the kernels today at several piece lengths, each rounding made precise, then dg's
#: terms formed consistently
CASES = [dict(anchor=a) for a in (0, 2048, 1024, 512, 256, 128, 64)] + [
    dict(anchor=512, dgq="bf16"), dict(anchor=256, dgq="bf16"), dict(anchor=512, intra="tf32"),
    dict(anchor=512, read="split"),
    dict(anchor=512, read="split", intra="tf32"), dict(anchor=512, read="split", update="split"),
    dict(anchor=0, read="split", update="split", intra="tf32"), dict(anchor=256, read="split", update="split",
                                                                      intra="tf32"),
    dict(anchor=64, intra="tf32"), dict(anchor=256, read="fp32", update="fp32", intra="fp32"),
    dict(anchor=0, read="fp32", update="fp32", intra="fp32"),
    dict(anchor=512, consistent=True), dict(anchor=256, consistent=True), dict(anchor=64, consistent=True),
    dict(anchor=0, consistent=True, read="split"), dict(anchor=512, consistent=True, read="split"),
    dict(anchor=0, consistent=True, tile_exact=True), dict(anchor=512, consistent=True, tile_exact=True)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, default=4096, help="sequence length (a multiple of 16)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--gate-scale", type=float, default=16.0, help="log-decays are logsigmoid(randn) / this")
    ap.add_argument("--out", default="", help="write the rows here as JSON too")
    a = ap.parse_args(argv)
    x = inputs(a.T, a.heads, gate_scale=a.gate_scale)
    scale = x[0].shape[-1] ** -0.5
    t0 = time.time()
    want = reference_dg(*x, scale)
    print(f"T={a.T}, H={a.heads}, K=V=128, gates logsigmoid(x)/{a.gate_scale:g}; float64 reference "
          f"{time.time() - t0:.0f} s. dg's error ||dg - ref|| / ||ref|| (defaults: every rounding bf16, fp32 q dq)")
    rows = []
    for case in CASES:
        err = grad_error.rel(model_dg(*x, scale, **case), want)
        rows.append(dict(T=a.T, **case, dg_error=err))
        print(f"  {', '.join(f'{k}={v}' for k, v in case.items()):<55} {err:.2e}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
