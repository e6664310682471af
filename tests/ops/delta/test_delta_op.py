"""The generalised delta-rule op (hybridize/ops/delta/reference.py).

References: an independent per-head matrix-form loop (S <- exp(g) (I - beta k p^T) S + beta k v^T,
explicit identity matrix, fp64) for the recurrent form; the recurrent form for the chunked one."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from hybridize.ops.delta.reference import chunk_delta, contraction_factor, naive_recurrent_delta

TOL = 1e-5


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max()).item()


def make_inputs(B=2, T=63, H=2, K=8, V=6, gate=True, erase=True, state=True, dtype=torch.float32, seed=0,
                lam=0.6):
    """Inputs like the mixers feed: unit q/k, beta in (0, 1), log-decay <= 0, p = k + lam * q."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    g = F.logsigmoid(torch.randn(B, T, H, generator=gen, dtype=torch.float64) + 2) if gate else None
    p = k + lam * q if erase else None
    s0 = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64) if state else None
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    return dict(q=cast(q), k=cast(k), v=cast(v), beta=cast(beta), g=cast(g), p=cast(p)), cast(s0)


def naive(q, k, v, beta, g=None, p=None, initial_state=None, scale=None):
    """Matrix form, one head and one token at a time, fp64: o `[B, T, H, V]`, state `[B, H, K, V]`."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    p = k if p is None else p
    o = torch.zeros(B, T, H, V, dtype=torch.float64)
    S_all = torch.zeros(B, H, K, V, dtype=torch.float64)
    eye = torch.eye(K, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            S = torch.zeros(K, V, dtype=torch.float64) if initial_state is None \
                else initial_state[b, h].double().clone()
            for t in range(T):
                kt, pt, vt, bt = k[b, t, h].double(), p[b, t, h].double(), v[b, t, h].double(), beta[b, t, h].double()
                alpha = 1.0 if g is None else g[b, t, h].double().exp()
                S = alpha * (eye - bt * torch.outer(kt, pt)) @ S + bt * torch.outer(kt, vt)
                o[b, t, h] = scale * S.T @ q[b, t, h].double()
            S_all[b, h] = S
    return o, S_all


@pytest.mark.parametrize("gate,erase,state", list(itertools.product([False, True], repeat=3)))
def test_recurrent_matches_naive_matrix_form(gate, erase, state):
    inp, s0 = make_inputs(B=2, T=17, gate=gate, erase=erase, state=state, dtype=torch.float64)
    o, S = naive_recurrent_delta(**inp, initial_state=s0, output_final_state=True)
    ro, rS = naive(**inp, initial_state=s0)
    assert o.dtype == torch.float64 and S.dtype == torch.float64
    assert rel_err(o, ro) < 1e-12 and rel_err(S, rS) < 1e-12
    # fp32 inputs: fp32 accumulation, same answer to fp32 precision
    inp32 = {n: None if t is None else t.float() for n, t in inp.items()}
    o32, S32 = naive_recurrent_delta(**inp32, initial_state=None if s0 is None else s0.float(), output_final_state=True)
    assert o32.dtype == torch.float32
    assert rel_err(o32, ro) < TOL and rel_err(S32, rS) < TOL


def test_recurrent_naive_unnormalised_and_scale():
    """Raw (non-unit) k, p and an explicit scale: the op is exact for any inputs, not only the mixers'."""
    gen = torch.Generator().manual_seed(3)
    B, T, H, K, V = 1, 9, 2, 4, 3
    inp = {n: torch.randn(*s, generator=gen, dtype=torch.float64) * 0.5 for n, s in
           dict(q=(B, T, H, K), k=(B, T, H, K), v=(B, T, H, V), p=(B, T, H, K)).items()}
    inp["beta"] = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    inp["g"] = -torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    o, S = naive_recurrent_delta(**inp, scale=0.7, output_final_state=True)
    ro, rS = naive(**inp, scale=0.7)
    assert rel_err(o, ro) < 1e-12 and rel_err(S, rS) < 1e-12
    oc, Sc = chunk_delta(**inp, scale=0.7, output_final_state=True, chunk_size=4)
    assert rel_err(oc, ro) < 1e-12 and rel_err(Sc, rS) < 1e-12


@pytest.mark.parametrize("T,chunk", [(1, 16), (1, 32), (63, 16), (63, 32), (130, 16), (130, 32)])
@pytest.mark.parametrize("gate,erase,state", list(itertools.product([False, True], repeat=3)))
def test_chunk_equals_recurrent(T, chunk, gate, erase, state):
    inp, s0 = make_inputs(T=T, gate=gate, erase=erase, state=state)
    o, S = chunk_delta(**inp, initial_state=s0, output_final_state=True, chunk_size=chunk)
    ro, rS = naive_recurrent_delta(**inp, initial_state=s0, output_final_state=True)
    assert o.shape == ro.shape and S.shape == rS.shape
    assert rel_err(o, ro) < TOL, rel_err(o, ro)
    assert rel_err(S, rS) < TOL, rel_err(S, rS)


def test_chunk_fp64_is_exact():
    inp, s0 = make_inputs(T=70, dtype=torch.float64)
    o, S = chunk_delta(**inp, initial_state=s0, output_final_state=True, chunk_size=16)
    ro, rS = naive(**inp, initial_state=s0)
    assert o.dtype == torch.float64
    assert rel_err(o, ro) < 1e-12 and rel_err(S, rS) < 1e-12


def test_strong_decay_is_stable():
    """log-decay -30 per token: a naive exp(+G) factorisation would overflow; ours stays exact."""
    inp, s0 = make_inputs(T=64)
    inp["g"] = torch.full_like(inp["beta"], -30.0)
    o, S = chunk_delta(**inp, initial_state=s0, output_final_state=True, chunk_size=32)
    ro, rS = naive_recurrent_delta(**inp, initial_state=s0, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert rel_err(o, ro) < TOL and rel_err(S, rS) < TOL


def test_p_equal_k_is_p_none():
    inp, s0 = make_inputs(T=40, erase=False)
    a, _ = chunk_delta(**inp, initial_state=s0, chunk_size=16)
    b, _ = chunk_delta(**{**inp, "p": inp["k"].clone()}, initial_state=s0, chunk_size=16)
    assert torch.equal(a, b)


@pytest.mark.parametrize("fn", ["chunk", "recurrent"])
@pytest.mark.parametrize("state", [False, True])
def test_varlen_equals_separate(fn, state):
    op = chunk_delta if fn == "chunk" else naive_recurrent_delta
    kw = {"chunk_size": 16} if fn == "chunk" else {}
    lens = [1, 37, 16, 50]
    inp, _ = make_inputs(B=1, T=sum(lens), seed=5)
    gen = torch.Generator().manual_seed(7)
    s0 = torch.randn(len(lens), 2, 8, 6, generator=gen) if state else None
    cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32)
    o, S = op(**inp, initial_state=s0, output_final_state=True, cu_seqlens=cu, **kw)
    outs, states = [], []
    for i in range(len(lens)):
        part = {n: None if t is None else t[:, cu[i]:cu[i + 1]] for n, t in inp.items()}
        ro, rS = naive(**part, initial_state=None if s0 is None else s0[i:i + 1])
        outs.append(ro)
        states.append(rS)
    assert rel_err(o, torch.cat(outs, 1)) < TOL
    assert rel_err(S, torch.cat(states, 0)) < TOL
    # chunk and recurrent agree on packed input too
    o2, S2 = naive_recurrent_delta(**inp, initial_state=s0, output_final_state=True, cu_seqlens=cu)
    assert rel_err(o, o2) < TOL and rel_err(S, S2) < TOL


@pytest.mark.parametrize("varlen", [False, True])
def test_gradients_chunk_equal_recurrent(varlen):
    """Gradients of q, k, v, beta, g, p and the initial state agree (fp32, rel. err < 1e-5)."""
    if varlen:
        inp, s0 = make_inputs(B=1, T=70, seed=2)
        s0 = torch.randn(2, 2, 8, 6)
        cu = torch.tensor([0, 29, 70], dtype=torch.int32)
    else:
        inp, s0 = make_inputs(T=63, seed=2)
        cu = None
    gen = torch.Generator().manual_seed(11)
    wo = torch.randn(*inp["v"].shape, generator=gen)
    wS = torch.randn(*s0.shape, generator=gen)

    def grads(op, **kw):
        leaves = {n: t.detach().clone().requires_grad_(True) for n, t in inp.items()}
        st = s0.detach().clone().requires_grad_(True)
        o, S = op(**leaves, initial_state=st, output_final_state=True, cu_seqlens=cu, **kw)
        ((o * wo).sum() + (S * wS).sum()).backward()
        return {**{n: t.grad for n, t in leaves.items()}, "initial_state": st.grad}

    gc = grads(chunk_delta, chunk_size=16)
    gr = grads(naive_recurrent_delta)
    assert set(gc) == {"q", "k", "v", "beta", "g", "p", "initial_state"}
    for n in gr:
        assert gc[n] is not None and gr[n] is not None, n
        assert rel_err(gc[n], gr[n]) < TOL, (n, rel_err(gc[n], gr[n]))


def test_bf16_inputs():
    inp, s0 = make_inputs(T=45)
    ref, rS = naive_recurrent_delta(**inp, initial_state=s0, output_final_state=True)
    low = {n: t.to(torch.bfloat16).requires_grad_(True) for n, t in inp.items()}
    o, S = chunk_delta(**low, initial_state=s0, output_final_state=True, chunk_size=16)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    assert rel_err(o.float(), ref) < 3e-2
    o.float().sum().backward()
    assert all(torch.isfinite(t.grad.float()).all() for t in low.values())


def test_contraction_factor_qdelta_range():
    """"Q-Delta: Beyond Key-Value Associative State Evolution", Lemma 3.1: beta * k.(k + lambda q) in (0, 2) for unit q, k, beta in (0,1), lambda in [0,1]."""
    for lam in (0.0, 0.3, 1.0):
        inp, _ = make_inputs(T=200, lam=lam, seed=4)
        a = contraction_factor(inp["k"], inp["beta"], inp["p"])
        assert (a >= 0).all() and (a < 2).all()
        assert torch.allclose(a, inp["beta"] * (1 + lam * (inp["q"] * inp["k"]).sum(-1)), atol=1e-6)


def test_bad_inputs_raise():
    inp, _ = make_inputs(T=5)
    with pytest.raises(ValueError, match="beta"):
        chunk_delta(**{**inp, "beta": inp["beta"][..., None]})
    with pytest.raises(ValueError, match="g must"):
        naive_recurrent_delta(**{**inp, "g": inp["q"]})
    with pytest.raises(ValueError, match="p must"):
        naive_recurrent_delta(**{**inp, "p": inp["p"][..., :3]})
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_delta(**inp, cu_seqlens=torch.tensor([0, 5]))
