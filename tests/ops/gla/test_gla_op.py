"""Tests of the GLA op (hybridize/ops/gla/reference.py): recurrent == an independent quadratic fp64 formula,
chunk == recurrent (outputs, final state, gradients), varlen == separate sequences, fp64 gradcheck,
strong decays without overflow, bf16."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridize.ops.common import dispatch
from hybridize.ops.gla.reference import chunk_gla, naive_recurrent_gla
from tests.mixers.helpers import cu_seqlens_of, rel_err

H, K, V = 2, 8, 6


def inputs(B, T, gate, dtype=torch.float32, seed=0, state=False, strong=False):
    """q, k, v `[B, T, H, *]`, g (None | `[B, T, H]` | `[B, T, H, K]`), initial state `[B, H, K, V]`."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, H, V)
    shift = -3.0 if strong else 2.0
    g = {"none": None,
         "scalar": F.logsigmoid(r(B, T, H) + shift),
         "vector": F.logsigmoid(r(B, T, H, K) + shift)}[gate]
    s0 = r(B, H, K, V) if state else None
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), cast(g), cast(s0)


def quadratic_reference(q, k, v, g, s0, scale):
    """fp64 attention form: o_t = sum_{s<=t} (q_t * exp(G_t - G_s)) . k_s v_s + (q_t * exp(G_t)) S0,
    G the cumulative log-decay; final state S_T = exp(G_T) S0 + sum_s exp(G_T - G_s) k_s v_s^T."""
    q, k, v = q.double() * scale, k.double(), v.double()
    B, T, Hh, Kk = q.shape
    if g is None:
        g = torch.zeros_like(k)
    g = g.double()
    if g.dim() == 3:
        g = g.unsqueeze(-1).expand_as(k)
    G = g.cumsum(1)                                           # [B, T, H, K]
    decay = (G.unsqueeze(2) - G.unsqueeze(1))                 # [B, t, s, H, K] = G_t - G_s
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    decay = decay.masked_fill(~causal[None, :, :, None, None], float("-inf")).exp()
    A = torch.einsum("bthk,bshk,btshk->bhts", q, k, decay)
    o = torch.einsum("bhts,bshv->bthv", A, v.double())
    S = torch.einsum("bshk,bshv->bhkv", k * (G[:, -1:] - G).exp(), v)
    if s0 is not None:
        o = o + torch.einsum("bthk,bhkv->bthv", q * G.exp(), s0.double())
        S = S + G[:, -1].exp().unsqueeze(-1) * s0.double()
    return o, S


@pytest.mark.parametrize("gate", ["none", "scalar", "vector"])
@pytest.mark.parametrize("state", [False, True])
def test_recurrent_matches_quadratic_reference(gate, state):
    q, k, v, g, s0 = inputs(2, 37, gate, torch.float64, state=state)
    o, S = naive_recurrent_gla(q, k, v, g, initial_state=s0, output_final_state=True)
    o_ref, S_ref = quadratic_reference(q, k, v, g, s0, K ** -0.5)
    assert rel_err(o, o_ref) < 1e-12
    assert rel_err(S, S_ref) < 1e-12


@pytest.mark.parametrize("T", [1, 63, 130])
@pytest.mark.parametrize("chunk_size", [16, 32])
@pytest.mark.parametrize("gate", ["none", "scalar", "vector"])
@pytest.mark.parametrize("state", [False, True])
def test_chunk_equals_recurrent_fp32(T, chunk_size, gate, state):
    q, k, v, g, s0 = inputs(2, T, gate, state=state, seed=T)
    o_r, S_r = naive_recurrent_gla(q, k, v, g, initial_state=s0, output_final_state=True)
    o_c, S_c = chunk_gla(q, k, v, g, initial_state=s0, output_final_state=True, chunk_size=chunk_size)
    assert o_c.dtype == torch.float32 and S_c.dtype == torch.float32
    assert rel_err(o_c, o_r) < 1e-5
    assert rel_err(S_c, S_r) < 1e-5


@pytest.mark.parametrize("gate", ["scalar", "vector"])
def test_chunk_strong_decay_no_overflow(gate):
    """Decays down to exp(-60) per step: the chunk form never forms a positive exponent."""
    q, k, v, _, s0 = inputs(1, 70, "none", state=True)
    shape = (1, 70, H) if gate == "scalar" else (1, 70, H, K)
    g = -torch.rand(shape) * 60
    o_r, S_r = naive_recurrent_gla(q, k, v, g, initial_state=s0, output_final_state=True)
    o_c, S_c = chunk_gla(q, k, v, g, initial_state=s0, output_final_state=True, chunk_size=32)
    assert torch.isfinite(o_c).all() and torch.isfinite(S_c).all()
    assert rel_err(o_c, o_r) < 1e-5 and rel_err(S_c, S_r) < 1e-5


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
@pytest.mark.parametrize("gate", ["none", "scalar", "vector"])
@pytest.mark.parametrize("state", [False, True])
def test_varlen_equals_separate(mode, gate, state):
    lens = [5, 1, 40, 17]
    fn = chunk_gla if mode == "chunk" else naive_recurrent_gla
    kw = {"chunk_size": 16} if mode == "chunk" else {}
    q, k, v, g, _ = inputs(1, sum(lens), gate, seed=3)
    s0 = torch.randn(len(lens), H, K, V) if state else None
    cu = cu_seqlens_of(lens)
    o, S = fn(q, k, v, g, initial_state=s0, output_final_state=True, cu_seqlens=cu, **kw)
    for i in range(len(lens)):
        a, b = int(cu[i]), int(cu[i + 1])
        gi = None if g is None else g[:, a:b]
        si = None if s0 is None else s0[i:i + 1]
        o_i, S_i = naive_recurrent_gla(q[:, a:b], k[:, a:b], v[:, a:b], gi, initial_state=si, output_final_state=True)
        assert rel_err(o[:, a:b], o_i) < 1e-5
        assert rel_err(S[i:i + 1], S_i) < 1e-5


@pytest.mark.parametrize("T,chunk_size", [(1, 16), (63, 16), (130, 32)])
@pytest.mark.parametrize("gate", ["scalar", "vector"])
@pytest.mark.parametrize("varlen", [False, True])
def test_chunk_gradients_equal_recurrent(T, chunk_size, gate, varlen):
    """d/d(q, k, v, g, initial_state) of a loss on the outputs and the final state agree (fp32)."""
    lens = [T] if not varlen else [max(1, T // 3), T - max(1, T // 3)]
    lens = [n for n in lens if n > 0]
    B = 1 if varlen else 2
    N = len(lens) if varlen else B
    q, k, v, g, _ = inputs(B, T, gate, seed=T + 1)
    s0 = torch.randn(N, H, K, V)
    cu = cu_seqlens_of(lens) if varlen else None
    w_o, w_s = torch.randn(B, T, H, V), torch.randn(N, H, K, V)

    def grads(fn, **kw):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v, g, s0)]
        o, S = fn(*leaves[:4], initial_state=leaves[4], output_final_state=True, cu_seqlens=cu, **kw)
        ((o * w_o).sum() + (S * w_s).sum()).backward()
        return [t.grad for t in leaves]

    g_rec = grads(naive_recurrent_gla)
    g_chk = grads(chunk_gla, chunk_size=chunk_size)
    for name, a, b in zip("q k v g initial_state".split(), g_chk, g_rec):
        assert a is not None, f"no gradient for {name}"
        assert rel_err(a, b) < 1e-5, f"gradient of {name}: {rel_err(a, b):.2e}"


@pytest.mark.parametrize("gate", ["none", "scalar", "vector"])
def test_chunk_gradcheck_fp64(gate):
    q, k, v, g, s0 = inputs(1, 7, gate, torch.float64, state=True)
    leaves = [t.requires_grad_(True) for t in (q, k, v, g, s0) if t is not None]

    def f(*xs):
        xs = list(xs)
        gg = xs.pop(3) if g is not None else None
        o, S = chunk_gla(xs[0], xs[1], xs[2], gg, initial_state=xs[3], output_final_state=True, chunk_size=4)
        return o, S
    assert torch.autograd.gradcheck(f, leaves)


def test_no_final_state_unless_asked():
    q, k, v, g, _ = inputs(1, 9, "vector")
    assert chunk_gla(q, k, v, g)[1] is None
    assert naive_recurrent_gla(q, k, v, g)[1] is None


def test_custom_scale():
    q, k, v, g, _ = inputs(1, 9, "vector", torch.float64)
    o1, _ = chunk_gla(q, k, v, g, scale=1.0, chunk_size=4)
    o2, _ = naive_recurrent_gla(q * 0.5, k, v, g, scale=2.0)
    assert rel_err(o1, o2) < 1e-12


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_bf16_close_to_fp32(mode):
    q, k, v, g, s0 = inputs(2, 45, "vector", state=True)
    fn = dispatch.torch_impl("gla", mode)
    o32, S32 = fn(q, k, v, g, initial_state=s0, output_final_state=True)
    bf = [t.bfloat16().requires_grad_(True) for t in (q, k, v, g)]
    o16, S16 = fn(*bf, initial_state=s0.bfloat16(), output_final_state=True)
    assert o16.dtype == torch.bfloat16
    assert S16.dtype == torch.float32                     # the state is kept in fp32
    assert rel_err(o16, o32) < 3e-2 and rel_err(S16, S32) < 3e-2
    o16.float().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad.float()).all() for t in bf)


def test_dispatch_resolves_both_modes():
    q, k, v, g, _ = inputs(1, 20, "scalar")
    a = dispatch.run("gla", "chunk", q, k, v, g, chunk_size=8)[0]
    b = dispatch.run("gla", "recurrent", q, k, v, g)[0]
    assert rel_err(a, b) < 1e-5


def test_bad_cu_seqlens_raise():
    q, k, v, g, _ = inputs(2, 10, "scalar")
    with pytest.raises(ValueError, match="batch size 1"):
        chunk_gla(q, k, v, g, cu_seqlens=cu_seqlens_of([4, 6]))
    q, k, v, g, _ = inputs(1, 10, "scalar")
    with pytest.raises(ValueError, match="does not match"):
        chunk_gla(q, k, v, g, cu_seqlens=cu_seqlens_of([4, 5]))


@pytest.mark.parametrize("gate", ["scalar", "vector"])
def test_factorised_and_pairwise_intra_chunk_scores_agree(monkeypatch, gate):
    """The fast factorised intra-chunk path and the explicit pairwise path give the same op output."""
    import hybridize.ops.gla.reference as gla_mod

    torch.manual_seed(3)
    B, T, H, K, V = 2, 70, 2, 8, 6
    q, k, v = torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, H, V)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, *([K] if gate == "vector" else [])))
    fast, _ = gla_mod.chunk_gla(q, k, v, g, chunk_size=16)
    monkeypatch.setattr(gla_mod, "FACTORISED_MAX_SPAN", -1.0)   # force the pairwise path
    slow, _ = gla_mod.chunk_gla(q, k, v, g, chunk_size=16)
    ref, _ = gla_mod.naive_recurrent_gla(q, k, v, g)
    assert (fast - slow).abs().max() / slow.abs().max() < 1e-5
    assert (fast - ref).abs().max() / ref.abs().max() < 1e-5


def test_only_the_strong_chunks_take_the_pairwise_path_and_gradients_match(monkeypatch):
    """Weak and strong chunks in one call: the pairwise decay tensor is formed for the strong chunks alone, and
    output and gradients equal the fp64 recurrent op's."""
    import hybridize.ops.gla.reference as gla_mod

    torch.manual_seed(5)
    B, T, H, K, V, C = 1, 64, 2, 8, 6, 16
    q, k, v = torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, H, V)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K)) * 0.2     # weak: a chunk spans ~2
    g[:, 16:32, 1] = -torch.rand(16, K) * 20                             # one strong chunk (span ~160) of head 1
    seen = []
    pairwise = gla_mod._pairwise_scores
    monkeypatch.setattr(gla_mod, "_pairwise_scores", lambda *a: seen.append(a[0].shape[0]) or pairwise(*a))
    leaves = [t.clone().double().requires_grad_() for t in (q, k, v, g)]
    o_ref, _ = naive_recurrent_gla(*leaves)
    o_ref.pow(2).sum().backward()
    xs = [t.clone().requires_grad_() for t in (q, k, v, g)]
    o, _ = gla_mod.chunk_gla(*xs, chunk_size=C)
    o.pow(2).sum().backward()
    assert seen == [1], "the pairwise form for the one strong chunk only"
    assert rel_err(o, o_ref.float()) < 1e-5
    for x, r in zip(xs, leaves):
        assert torch.isfinite(x.grad).all() and rel_err(x.grad, r.grad.float()) < 1e-4
