"""CCQ covariance read: chunked == recurrent == the definition (explicit per-position sums, fp64)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridize.ops.ccq.reference import chunk_ccq, naive_recurrent_ccq

B, H, K = 2, 3, 8


def rel(a, b, floor=1e-3):
    """max|a - b| / max|b|; `floor` keeps an exactly-zero reference (Sigma = 0 after one token) from
    turning rounding noise into a huge ratio."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(floor)).item()


def rel_q(a, b):
    """Error of Sigma_t q_t relative to the query scale (||Sigma_t|| <= 1, so |Sigma q| <= |q| ~ 1)."""
    return rel(a, b, floor=1.0)


def unit(*shape, dtype=torch.float32):
    return F.normalize(torch.randn(*shape, dtype=torch.float64), dim=-1).to(dtype)


def random_state(n, dtype=torch.float32):
    """A consistent state: statistics of `t` random unit keys per row."""
    t = torch.tensor([5, 1, 9][:n])
    C = torch.zeros(n, H, K, K, dtype=torch.float64)
    mu = torch.zeros(n, H, K, dtype=torch.float64)
    for i in range(n):
        ks = unit(int(t[i]), H, K)
        C[i] = torch.einsum("thk,thl->hkl", ks, ks) / t[i]
        mu[i] = ks.mean(0)
    return C.to(dtype), mu.to(dtype), t


def definition(q, k, mask=None, state=None):
    """Sigma_t q_t straight from eq. 8: explicit sums over the real tokens j <= t (fp64)."""
    q, k = q.double(), k.double()
    Bq, T = q.shape[:2]
    m = torch.ones(Bq, T, dtype=torch.bool) if mask is None else mask
    out = torch.zeros_like(q)
    for b in range(Bq):
        if state is None:
            S, M, n = torch.zeros(H, K, K, dtype=torch.float64), torch.zeros(H, K, dtype=torch.float64), 0
        else:
            n = int(state[2][b])
            S, M = state[0][b].double() * n, state[1][b].double() * n
        for t in range(T):
            if m[b, t]:
                S = S + torch.einsum("hk,hl->hkl", k[b, t], k[b, t])
                M = M + k[b, t]
                n += 1
            if n == 0:
                continue
            C, mu = S / n, M / n
            sigma = C - torch.einsum("hk,hl->hkl", mu, mu)
            out[b, t] = torch.einsum("hkl,hl->hk", sigma, q[b, t])
    return out


@pytest.mark.parametrize("T", [1, 63, 130])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_equals_recurrent_and_definition(T, with_state):
    q, k = torch.randn(B, T, H, K), unit(B, T, H, K)
    st = random_state(B) if with_state else None
    o_r, s_r = naive_recurrent_ccq(q, k, initial_state=st, output_final_state=True)
    ref = definition(q, k, state=st)
    assert rel_q(o_r, ref) < 1e-5
    for cs in (16, 32):
        o_c, s_c = chunk_ccq(q, k, initial_state=st, output_final_state=True, chunk_size=cs)
        assert rel_q(o_c, o_r) < 1e-5
        for a, b in zip(s_c[:2], s_r[:2]):
            assert rel(a, b) < 1e-5
        assert torch.equal(s_c[2], s_r[2])
    assert torch.equal(s_r[2], torch.full((B,), T) + (st[2] if with_state else 0))


def test_final_state_is_the_statistics():
    T = 37
    q, k = torch.randn(1, T, H, K, dtype=torch.float64), unit(1, T, H, K, dtype=torch.float64)
    for fn in (naive_recurrent_ccq, chunk_ccq):
        _, (C, mu, t) = fn(q, k, output_final_state=True)
        assert torch.allclose(C[0], torch.einsum("thk,thl->hkl", k[0], k[0]) / T, atol=1e-12)
        assert torch.allclose(mu[0], k[0].mean(0), atol=1e-12)
        assert int(t[0]) == T


def test_state_splits_the_sequence():
    """(first part, state) + (rest) == whole, in both forms and across forms."""
    T, cut = 70, 29
    q, k = torch.randn(B, T, H, K), unit(B, T, H, K)
    full, _ = naive_recurrent_ccq(q, k)
    for first, second in ((chunk_ccq, naive_recurrent_ccq), (naive_recurrent_ccq, chunk_ccq), (chunk_ccq, chunk_ccq)):
        a, st = first(q[:, :cut], k[:, :cut], output_final_state=True)
        b, _ = second(q[:, cut:], k[:, cut:], initial_state=st)
        assert rel(torch.cat([a, b], 1), full) < 1e-5


def test_padding_does_not_count():
    T = 45
    q, k = torch.randn(B, T, H, K), unit(B, T, H, K)
    mask = torch.rand(B, T) > 0.3
    mask[1, :10] = False  # a left-padded row as well
    ref = definition(q, k, mask)
    for fn in (naive_recurrent_ccq, chunk_ccq):
        o, (C, mu, t) = fn(q, k, mask=mask, output_final_state=True)
        assert rel(o[mask], ref[mask]) < 1e-5
        assert torch.equal(t, mask.sum(1))
        for b in range(B):
            kr = k[b, mask[b]].double()
            assert rel(C[b], torch.einsum("thk,thl->hkl", kr, kr) / len(kr)) < 1e-5
            assert rel(mu[b], kr.mean(0)) < 1e-5


@pytest.mark.parametrize("with_state", [False, True])
def test_cu_seqlens_equals_separate(with_state):
    lens = [1, 63, 30]
    cu = torch.tensor([0, 1, 64, 94])
    q, k = torch.randn(1, 94, H, K), unit(1, 94, H, K)
    st = random_state(3) if with_state else None
    for fn in (naive_recurrent_ccq, chunk_ccq):
        o, (C, mu, t) = fn(q, k, initial_state=st, output_final_state=True, cu_seqlens=cu)
        assert torch.equal(t, torch.tensor(lens) + (st[2] if with_state else 0))
        for i in range(3):
            s, e = int(cu[i]), int(cu[i + 1])
            sti = tuple(x[i:i + 1] for x in st) if with_state else None
            oi, (Ci, mui, _) = naive_recurrent_ccq(q[:, s:e], k[:, s:e], initial_state=sti, output_final_state=True)
            assert rel_q(o[:, s:e], oi) < 1e-5
            assert rel(C[i], Ci[0]) < 1e-5 and rel(mu[i], mui[0]) < 1e-5


def test_gradients_chunk_equal_recurrent():
    T = 63
    q0, k0 = torch.randn(B, T, H, K), unit(B, T, H, K)
    C0, mu0, t0 = random_state(B)
    w = torch.randn(B, T, H, K)
    grads = []
    for fn in (naive_recurrent_ccq, chunk_ccq):
        q, k = q0.clone().requires_grad_(), k0.clone().requires_grad_()
        C, mu = C0.clone().requires_grad_(), mu0.clone().requires_grad_()
        o, (Cf, muf, _) = fn(q, k, initial_state=(C, mu, t0), output_final_state=True)
        ((o * w).sum() + Cf.square().sum() + muf.sum()).backward()
        grads.append([q.grad, k.grad, C.grad, mu.grad])
    for a, b in zip(*grads):
        assert rel(a, b) < 1e-5


def test_gradients_against_fp64_finite_differences():
    q = torch.randn(1, 9, 1, 4, dtype=torch.float64, requires_grad=True)
    k = unit(1, 9, 1, 4, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: chunk_ccq(a, b, chunk_size=4)[0], (q, k))


def test_bf16_runs_close_to_fp32():
    q, k = torch.randn(B, 40, H, K), unit(B, 40, H, K)
    o32, _ = chunk_ccq(q, k)
    o16, _ = chunk_ccq(q.bfloat16(), k.bfloat16())
    assert o16.dtype == torch.bfloat16 and rel(o16, o32) < 2e-2


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="same shape"):
        chunk_ccq(torch.randn(1, 4, 2, 8), torch.randn(1, 4, 1, 8))
