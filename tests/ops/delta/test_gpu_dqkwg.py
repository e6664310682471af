"""The PyTorch `chunk_bwd_dqkwg` replacement (fla issue #640 workaround) against autograd.

Runs on CPU: the function is plain PyTorch. The reference differentiates the chunk-local function
the kernel's outputs are gradients of (module doc of `hybridize.ops.delta.fla_dqkwg`)."""
import math

import pytest
import torch

from hybridize.ops.delta.fla_dqkwg import chunk_bwd_dqkwg_torch, chunk_token_index


def _chunk_objective(q, k, v, w, G, h, do, dh, dv, scale, C, lens):
    """sum(do * o) + sum(dh * h_end) + sum(dv * (-w h)) over every chunk; G natural-log cumulative."""
    total = 0.0
    pos, hidx = 0, 0
    for n in lens:
        for s0 in range(0, n, C):
            sl = slice(pos + s0, pos + min(s0 + C, n))
            qc, kc, vc, wc, Gc = q[0, sl], k[0, sl], v[0, sl], w[0, sl], G[0, sl]        # [c, H, D]
            hc = h[hidx]                                                                   # [H, K, V]
            c = qc.shape[0]
            causal = torch.ones(c, c, dtype=torch.bool).tril()
            dec = (Gc.T[:, :, None] - Gc.T[:, None, :]).masked_fill(~causal, float("-inf")).exp()  # [H, c, c]
            A = torch.einsum("ihk,jhk->hij", qc, kc) * dec
            o = scale * (torch.einsum("ihk,hkv->ihv", qc * Gc.exp()[..., None], hc)
                         + torch.einsum("hij,jhv->ihv", A, vc))
            h_end = Gc[-1].exp()[:, None, None] * hc + torch.einsum(
                "ihk,ihv->hkv", kc * (Gc[-1] - Gc).exp()[..., None], vc)
            total = total + (do[0, sl] * o).sum() + (dh[hidx] * h_end).sum() \
                + (dv[0, sl] * -torch.einsum("ihk,hkv->ihv", wc, hc)).sum()
            hidx += 1
        pos += n
    return total


@pytest.mark.parametrize("lens,gated", [([37], True), ([20, 9, 33], True), ([20, 9], False)])
def test_dqkwg_matches_autograd(lens, gated):
    torch.manual_seed(sum(lens))
    H, K, V, C = 2, 8, 6, 16
    T = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    nc = sum((n + C - 1) // C for n in lens)
    q, k, w = (torch.randn(1, T, H, K, requires_grad=True) for _ in range(3))
    v, do, dv = (torch.randn(1, T, H, V) for _ in range(3))
    h, dh = torch.randn(nc, H, K, V), torch.randn(nc, H, K, V)
    g = -torch.rand(1, T, H) * 0.5
    # in-chunk cumulative (natural log) per sequence, as fla feeds the kernel (in log2 units)
    G = torch.zeros_like(g)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        for s in range(a, b, C):
            G[0, s:min(s + C, b)] = g[0, s:min(s + C, b)].cumsum(0)
    if not gated:
        G = torch.zeros_like(G)
    G.requires_grad_(True)
    scale = K ** -0.5
    _chunk_objective(q, k, v, w, G, h, do, dh, dv, scale, C, lens).backward()
    dq, dk, dw, dg = chunk_bwd_dqkwg_torch(q.detach(), k.detach(), v, do, h, dh, w=w.detach(),
                                           g=(G.detach() / math.log(2)) if gated else None, dv=dv, scale=scale,
                                           cu_seqlens=cu if len(lens) > 1 else None, chunk_size=C)
    rel = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()  # noqa: E731
    assert rel(dq, q.grad) < 1e-5
    assert rel(dk, k.grad) < 1e-5
    assert rel(dw, w.grad) < 1e-5
    if gated:
        assert rel(dg, G.grad) < 1e-5
    else:
        assert dg is None


def test_chunk_token_index_orders_chunks_like_fla():
    idx, valid = chunk_token_index(T=10, B=1, chunk_size=4, cu_seqlens=torch.tensor([0, 5, 10]), device="cpu")
    assert idx.shape == (4, 4)
    assert idx[valid].tolist() == list(range(10))
    assert valid.sum(1).tolist() == [4, 1, 4, 1]
