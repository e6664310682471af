"""SSE routing and layouts (hybridize/ops/sse/reference.py) against an independent per-partition loop.

The reference `naive_sse` walks every token and every partition with the textbook update (only the
selected partitions are decayed and written, read after write), so it shares no code with the
masking, varlen or gather-recurrent implementations."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridize.ops.sse.reference import (PathInputs, Routing, balance_loss, pick_layout, route, sse_masking,
                                   naive_recurrent_sse, sse_varlen, varlen_index)

LAYOUT_FNS = {"masking": sse_masking, "varlen": sse_varlen, "recurrent": naive_recurrent_sse}


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def make_inputs(op, B, T, H=2, D=4, N=3, K=1, shared=True, dtype=torch.float64, seed=0, valid=None):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731

    def path():
        q, k, v = r(B, T, H, D), r(B, T, H, D), r(B, T, H, D)
        if op == "gla":
            return PathInputs(q=q, k=k.softmax(-1), v=v, g=F.logsigmoid(r(B, T, H, D) + 2) / 4)
        return PathInputs(q=F.normalize(q, dim=-1), k=F.normalize(k, dim=-1), v=v,
                          g=-F.softplus(r(B, T, H) - 2), beta=torch.sigmoid(r(B, T, H)))

    cast = lambda p: PathInputs(*(None if t is None else t.to(dtype) for t in  # noqa: E731
                                  (p.q, p.k, p.v, p.g, p.beta)))
    sh = cast(path()) if shared else None
    sp = cast(path())
    logits = r(B, T, N) * 2
    return sh, sp, logits, route(logits, K, valid)


def random_state(B, N, H, D, shared=True, seed=5):
    gen = torch.Generator().manual_seed(seed)
    sh = torch.randn(B, H, D, D, generator=gen, dtype=torch.float64) if shared else None
    return sh, torch.randn(B, N, H, D, D, generator=gen, dtype=torch.float64)


def naive_sse(op, shared, sparse, routing, emulq=True, emulk=True, initial_state=None):
    """Token by token, partition by partition, fp64: returns (o, shared_state, sparse_state)."""
    B, T, H, D = sparse.q.shape
    N = routing.probs.shape[-1]
    scale = D ** -0.5
    sh0, sp0 = initial_state if initial_state is not None else (None, None)
    S_sh = (sh0.clone() if sh0 is not None else torch.zeros(B, H, D, D, dtype=torch.float64))
    S_sp = (sp0.clone() if sp0 is not None else torch.zeros(B, N, H, D, D, dtype=torch.float64))
    S_sh, S_sp = S_sh.double(), S_sp.double()
    o = torch.zeros(B, T, H, D, dtype=torch.float64)
    d = lambda t: None if t is None else t.double()  # noqa: E731

    def step(S, p, b, t, wq=1.0, wk=1.0):
        q, k, v, g = d(p.q)[b, t] * wq, d(p.k)[b, t] * wk, d(p.v)[b, t], d(p.g)[b, t]
        if op == "gla":
            S = S * g.exp()[..., None] + k[..., None] * v[..., None, :]
        else:
            S = S * g.exp()[:, None, None]
            u = v - torch.einsum("hk,hkv->hv", k, S)
            S = S + d(p.beta)[b, t][:, None, None] * k[..., None] * u[..., None, :]
        return S, scale * torch.einsum("hk,hkv->hv", q, S)

    for b in range(B):
        for t in range(T):
            if shared is not None:
                S_sh[b], out = step(S_sh[b], shared, b, t)
                o[b, t] += out
            for i in range(N):
                if routing.selected[b, t, i]:
                    w = routing.probs[b, t, i].double()
                    S_sp[b, i], out = step(S_sp[b, i], sparse, b, t, w if emulq else 1.0, w if emulk else 1.0)
                    o[b, t] += out
    return o, (S_sh if shared is not None else None), S_sp


# ---- routing and balance loss ---------------------------------------------------------------

def test_route_selects_k_per_real_token_and_none_on_padding():
    logits = torch.randn(2, 5, 4)
    valid = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    r = route(logits, 2, valid)
    assert r.selected.sum(-1).tolist() == [[0, 2, 2, 2, 2], [2, 2, 2, 2, 2]]
    top2 = logits.topk(2, dim=-1).indices
    assert torch.equal(r.selected[1], torch.zeros(5, 4, dtype=torch.bool).scatter_(-1, top2[1], True))
    assert torch.allclose(r.probs, logits.softmax(-1))
    with pytest.raises(ValueError, match="top_k"):
        route(logits, 5)


def test_balance_loss_hand_example():
    # N = 2, K = 1; probs (0.75, 0.25) and (0.6, 0.4): both tokens pick partition 0
    # f = (1, 0), P = (0.675, 0.325): alpha * N/K * sum f P = 0.01 * 2 * 0.675 = 0.0135
    probs = torch.tensor([[[0.75, 0.25], [0.6, 0.4]]])
    r = route(probs.log(), 1)
    assert balance_loss(r, 1, 0.01).item() == pytest.approx(0.0135, abs=1e-8)
    # perfectly balanced: f = (0.5, 0.5), P = (0.5, 0.5) -> exactly alpha
    r = route(torch.tensor([[[0.7, 0.3], [0.3, 0.7]]]).log(), 1)
    assert balance_loss(r, 1, 0.01).item() == pytest.approx(0.01, abs=1e-8)
    # a padded third token does not count
    r = route(torch.tensor([[[0.75, 0.25], [0.6, 0.4], [0.0001, 0.9999]]]).log(), 1,
              torch.tensor([[True, True, False]]))
    assert balance_loss(r, 1, 0.01).item() == pytest.approx(0.0135, abs=1e-8)


def test_varlen_index_hand_example():
    # one sequence of 4 tokens routed to partitions 0, 1, 0, 2 (N = 3): order 0, 2 | 1 | 3
    logits = torch.full((1, 4, 3), -5.0)
    for t, p in enumerate([0, 1, 0, 2]):
        logits[0, t, p] = 5.0
    token, part, seg_cu, seg_id = varlen_index(route(logits, 1), torch.tensor([0, 4]))
    assert token.tolist() == [0, 2, 1, 3] and part.tolist() == [0, 0, 1, 2]
    assert seg_cu.tolist() == [0, 2, 3, 4] and seg_id.tolist() == [0, 1, 2]
    # two sequences [0, 1) and [1, 4): partition 0 of sequence 1 holds token 2 only
    token, part, seg_cu, seg_id = varlen_index(route(logits, 1), torch.tensor([0, 1, 4]))
    assert token.tolist() == [0, 2, 1, 3] and seg_id.tolist() == [0, 3, 4, 5]
    assert seg_cu.tolist() == [0, 1, 2, 3, 4]


def test_pick_layout():
    assert pick_layout("auto", 100) == "masking"
    assert pick_layout("auto", 4096) == "varlen"
    assert pick_layout("auto", 4096, torch.tensor([0, 100, 4096])) == "varlen"
    assert pick_layout("auto", 4096, torch.arange(0, 4097, 64)) == "masking"
    with pytest.raises(ValueError, match="layout"):
        pick_layout("sorted", 10)


# ---- layouts against the naive reference ----------------------------------------------------

@pytest.mark.parametrize("op", ["gla", "delta"])
@pytest.mark.parametrize("T,K,shared,with_state", [(1, 1, True, True), (63, 1, True, False),
                                                    (130, 2, True, True), (37, 1, False, True),
                                                    (20, 3, False, False)])
def test_layouts_match_naive_fp64(op, T, K, shared, with_state):
    B, H, D, N = 2, 2, 4, 3
    sh, sp, _, r = make_inputs(op, B, T, H, D, N, K, shared)
    h0 = random_state(B, N, H, D, shared) if with_state else None
    o_ref, sh_ref, sp_ref = naive_sse(op, sh, sp, r, initial_state=h0)
    for name, fn in LAYOUT_FNS.items():
        o, s1, s2 = fn(op, sh, sp, r, initial_state=h0, output_final_state=True, chunk_size=16)
        assert rel(o, o_ref) < 1e-10, name
        assert rel(s2, sp_ref) < 1e-10, name
        if shared:
            assert rel(s1, sh_ref) < 1e-10, name
        else:
            assert s1 is None


@pytest.mark.parametrize("op", ["gla", "delta"])
def test_layouts_match_naive_fp32_without_emul(op):
    B, T, H, D, N = 2, 63, 2, 4, 4
    sh, sp, _, r = make_inputs(op, B, T, H, D, N, 2, True, dtype=torch.float32)
    o_ref, _, sp_ref = naive_sse(op, sh, sp, r, emulq=False, emulk=False)
    for name, fn in LAYOUT_FNS.items():
        o, _, s2 = fn(op, sh, sp, r, emulq=False, emulk=False, output_final_state=True, chunk_size=16)
        assert o.dtype == torch.float32
        assert rel(o, o_ref) < 1e-5 and rel(s2, sp_ref) < 1e-5, name


@pytest.mark.parametrize("op", ["gla", "delta"])
def test_cu_seqlens_equals_separate_sequences(op):
    lengths, H, D, N = [5, 1, 40, 17], 2, 4, 3
    L = sum(lengths)
    sh, sp, _, r = make_inputs(op, 1, L, H, D, N, 1, True)
    h0 = random_state(len(lengths), N, H, D)
    cu = torch.tensor([0] + lengths).cumsum(0)
    for name, fn in LAYOUT_FNS.items():
        o, s1, s2 = fn(op, sh, sp, r, initial_state=h0, output_final_state=True, cu_seqlens=cu, chunk_size=8)
        for i in range(len(lengths)):
            a, b = int(cu[i]), int(cu[i + 1])
            cut = lambda p: PathInputs(*(None if t is None else t[:, a:b] for t in  # noqa: E731
                                         (p.q, p.k, p.v, p.g, p.beta)))
            ri = Routing(r.probs[:, a:b], r.index[:, a:b], r.selected[:, a:b])
            o_i, sh_i, sp_i = naive_sse(op, cut(sh), cut(sp), ri,
                                        initial_state=(h0[0][i:i + 1], h0[1][i:i + 1]))
            assert rel(o[:, a:b], o_i) < 1e-10, (name, i)
            assert rel(s1[i:i + 1], sh_i) < 1e-10 and rel(s2[i:i + 1], sp_i) < 1e-10, (name, i)


@pytest.mark.parametrize("op", ["gla", "delta"])
def test_masking_equals_varlen_gradients(op):
    B, T, H, D, N = 2, 45, 2, 4, 4
    sh, sp, logits, _ = make_inputs(op, B, T, H, D, N, 2, True)
    h0 = random_state(B, N, H, D)
    leaves = [t.requires_grad_(True) for t in (sh.q, sh.k, sh.v, sh.g, sp.q, sp.k, sp.v, sp.g, logits)]
    grads = {}
    for name in ("masking", "varlen"):
        r = route(logits, 2)
        o, s1, s2 = LAYOUT_FNS[name](op, sh, sp, r, initial_state=h0, output_final_state=True, chunk_size=16)
        w = torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)
        loss = (o * w).sum() + s2.pow(2).sum() * 1e-2 + s1.sum() * 1e-2
        grads[name] = torch.autograd.grad(loss, leaves)
    for i, (a, b) in enumerate(zip(grads["masking"], grads["varlen"])):
        assert rel(a, b) < 1e-10, f"gradient {i}"
    assert grads["masking"][-1].abs().max() > 0, "router logits got no gradient"


@pytest.mark.parametrize("op", ["gla", "delta"])
def test_padding_and_empty_partitions_leave_state_bit_identical(op):
    B, T, H, D, N = 2, 9, 2, 4, 4
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[0] = False                                   # row 0 is all padding
    sh, sp, _, r = make_inputs(op, B, T, H, D, N, 1, False, valid=valid)
    h0 = random_state(B, N, H, D, shared=False)
    for name, fn in LAYOUT_FNS.items():
        _, _, s2 = fn(op, None, sp, r, initial_state=h0, output_final_state=True, chunk_size=4)
        assert torch.equal(s2[0], h0[1][0].to(s2.dtype)), name
        used = r.selected[1].any(0)                    # partitions row 1 never selected stay as they were
        for i in range(N):
            if not used[i]:
                assert torch.equal(s2[1, i], h0[1][1, i]), (name, i)


@pytest.mark.parametrize("op", ["gla", "delta"])
def test_decode_step_touches_only_selected_partitions(op):
    B, H, D, N = 3, 2, 4, 4
    sh, sp, _, r = make_inputs(op, B, 1, H, D, N, 1, True, seed=3)
    h0 = random_state(B, N, H, D)
    _, _, s2 = naive_recurrent_sse(op, sh, sp, r, initial_state=h0, output_final_state=True)
    for b in range(B):
        for i in range(N):
            same = torch.equal(s2[b, i], h0[1][b, i])
            assert same != bool(r.selected[b, 0, i]), (b, i)


def test_bf16_layouts_run_and_agree_loosely():
    B, T, H, D, N = 2, 40, 2, 8, 4
    sh, sp, _, r = make_inputs("gla", B, T, H, D, N, 1, True, dtype=torch.bfloat16)
    o_ref, _, _ = naive_sse("gla", sh, sp, r)
    for name, fn in LAYOUT_FNS.items():
        o, _, s2 = fn("gla", sh, sp, r, output_final_state=True, chunk_size=16)
        assert o.dtype == torch.bfloat16 and s2.dtype == torch.float32
        assert rel(o, o_ref) < 3e-2, name
