"""Log-linear attention op: recurrent form vs an independent O(T^2) reference built from the Fenwick
decomposition, chunked form vs recurrent form, the lambda == 1 reduction to the gla op, state size.

The reference never uses bit_length / XOR: it walks the Fenwick prefix query of each position
(segments [i - lowbit(i), i) of size 2^m get level m + 1) and forms the masked T x T matrix.
Where fla-core's pure-PyTorch `naive.py` is installed it is loaded by file path (its package
import needs triton) and checked against our reference too.
"""
from __future__ import annotations

import importlib.util
import math
import pathlib

import pytest
import torch
import torch.nn.functional as F

from hybridize.ops.gla.reference import chunk_gla, naive_recurrent_gla
from hybridize.ops.log_linear.reference import (
    LogLinearState, bit_length, chunk_log_linear, naive_recurrent_log_linear, occupied_levels)


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def levels_for(T: int) -> int:
    return max(2, math.ceil(math.log2(max(T, 1))) + 1)


def inputs(B, T, H=2, K=8, V=6, L=None, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    L = levels_for(T) if L is None else L
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, H, generator=gen) + 2.0)   # decay ~0.88 on average
    lam = torch.rand(B, T, H, L, generator=gen) * 1.5 + 0.25
    return [x.to(dtype) for x in (q, k, v, g, lam)]


def random_state(N, H, L, K, V, t, dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return LogLinearState(torch.randn(N, H, L, K, V, generator=gen).to(dtype), torch.tensor(t))


# ---- independent reference ------------------------------------------------------------------

def fenwick_level_table(T: int, L: int) -> torch.Tensor:
    """`[T, T]` level of source s for query p (-1 above the diagonal) from the Fenwick prefix walk."""
    table = torch.full((T, T), -1, dtype=torch.long)
    for p in range(T):
        table[p, p] = 0
        i = p
        while i > 0:
            low = i & -i
            table[p, i - low:i] = min(low.bit_length(), L - 1)   # size 2^m segment -> level m + 1
            i -= low
    return table


def reference(q, k, v, g, lam, scale=None):
    """fp64 masked O(T^2) form of sequences that start at position 0: (o, final levels [B, H, L, K, V])."""
    q, k, v, g, lam = (x.double() for x in (q, k, v, g, lam))
    B, T, H, K = q.shape
    L = lam.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    lev = fenwick_level_table(T, L)
    G = g.cumsum(1)                                                # [B, T, H]
    mask = lev >= 0
    decay = torch.where(mask[None, :, :, None], (G[:, :, None] - G[:, None, :]), -math.inf).exp()
    # W[b, p, s, h] = lam[b, p, h, level(p, s)]
    W = torch.gather(lam.transpose(1, 2), -1, lev.clamp(min=0).expand(B, H, T, T)).permute(0, 2, 3, 1)
    scores = torch.einsum("bphk,bshk->bpsh", q, k) * decay * W * mask[None, :, :, None]
    o = torch.einsum("bpsh,bshv->bphv", scores, v) * scale
    M = q.new_zeros(B, H, L, K, v.shape[-1])
    if T:
        w_end = (G[:, -1:] - G).exp()                              # [B, T, H]
        onehot = F.one_hot(lev[-1], L).double()                    # [T, L]
        M = torch.einsum("sl,bsh,bshk,bshv->bhlkv", onehot, w_end, k, v)
    return o, M


def _fla_naive():
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / "ops" / "log_linear_attn" / "naive.py"
    if not path.exists():
        return None
    mod_spec = importlib.util.spec_from_file_location("_fla_log_linear_naive", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod.naive_log_linear_attn


# ---- the reference itself -------------------------------------------------------------------

def test_level_table_matches_xor_rule():
    T, L = 70, 8
    p = torch.arange(T)
    xor = torch.where(p[:, None] >= p[None, :], bit_length(p[:, None] ^ p[None, :]).clamp(max=L - 1), -1)
    assert torch.equal(fenwick_level_table(T, L), xor)


def test_reference_matches_fla_naive():
    naive = _fla_naive()
    if naive is None:
        pytest.skip("fla-core naive.py not installed")
    q, k, v, g, lam = inputs(1, 37, dtype=torch.float64)
    o_ref, _ = reference(q, k, v, g, lam, scale=0.5)
    o_fla = naive(q, k, v, g, lam, scale=0.5)
    assert rel(o_fla, o_ref) < 1e-12


# ---- recurrent == reference -------------------------------------------------------------------

@pytest.mark.parametrize("T,L", [(1, None), (63, None), (130, None), (63, 4), (130, 2)])
def test_recurrent_matches_reference(T, L):
    q, k, v, g, lam = inputs(2, T, L=L, dtype=torch.float64)
    o, st = naive_recurrent_log_linear(q, k, v, g, lam, output_final_state=True)
    o_ref, M_ref = reference(q, k, v, g, lam)
    assert rel(o, o_ref) < 1e-12
    assert rel(st.levels, M_ref) < 1e-12
    assert st.t.tolist() == [T, T]


@pytest.mark.parametrize("form", ["recurrent", "chunk"])
def test_initial_state_per_row_matches_reference(form):
    """Rows continue from different positions (prefixes 37 and 64): the state carries the hierarchy."""
    prefixes, T, L = [37, 64], 61, 8
    rows = [inputs(1, n + T, L=L, dtype=torch.float64, seed=3 + i) for i, n in enumerate(prefixes)]
    # prefix of every row through the packed recurrent op -> one state row per document
    cu = torch.tensor([0, prefixes[0], sum(prefixes)])
    packed = [torch.cat([r[j][:, :n] for r, n in zip(rows, prefixes)], 1) for j in range(5)]
    _, st = naive_recurrent_log_linear(*packed, output_final_state=True, cu_seqlens=cu)
    assert st.t.tolist() == prefixes
    suffix = [torch.cat([r[j][:, n:] for r, n in zip(rows, prefixes)], 0) for j in range(5)]
    fn = chunk_log_linear if form == "chunk" else naive_recurrent_log_linear
    kw = {"chunk_size": 16} if form == "chunk" else {}
    o, fin = fn(*suffix, initial_state=st, output_final_state=True, **kw)
    for i, (r, n) in enumerate(zip(rows, prefixes)):
        o_ref, M_ref = reference(*r)
        assert rel(o[i], o_ref[0, n:]) < 1e-12
        assert rel(fin.levels[i], M_ref[0]) < 1e-12
    assert fin.t.tolist() == [n + T for n in prefixes]


# ---- chunk == recurrent (fp32) ----------------------------------------------------------------

@pytest.mark.parametrize("T", [1, 63, 130])
@pytest.mark.parametrize("chunk_size", [16, 32])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_equals_recurrent(T, chunk_size, with_state):
    q, k, v, g, lam = inputs(2, T, L=9)
    st = random_state(2, 2, 9, 8, 6, [5, 77]) if with_state else None
    a, sa = chunk_log_linear(q, k, v, g, lam, initial_state=st, output_final_state=True, chunk_size=chunk_size)
    b, sb = naive_recurrent_log_linear(q, k, v, g, lam, initial_state=st, output_final_state=True)
    assert rel(a, b) < 1e-5
    assert rel(sa.levels, sb.levels) < 1e-5
    assert torch.equal(sa.t, sb.t)


@pytest.mark.parametrize("L", [2, 3, 5])
def test_chunk_equals_recurrent_when_levels_clamp(L):
    """Few levels: the chunk is capped at 2^(L-2) tokens and old history piles into the top level."""
    q, k, v, g, lam = inputs(2, 70, L=L)
    st = random_state(2, 2, L, 8, 6, [3, 12])
    a, sa = chunk_log_linear(q, k, v, g, lam, initial_state=st, output_final_state=True, chunk_size=32)
    b, sb = naive_recurrent_log_linear(q, k, v, g, lam, initial_state=st, output_final_state=True)
    assert rel(a, b) < 1e-5 and rel(sa.levels, sb.levels) < 1e-5


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_cu_seqlens_equals_separate(form):
    lengths = [1, 63, 0, 30]
    L = 8
    q, k, v, g, lam = inputs(1, sum(lengths), L=L)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    st = random_state(len(lengths), 2, L, 8, 6, [0, 9, 4, 16])
    fn = chunk_log_linear if form == "chunk" else naive_recurrent_log_linear
    o, fin = fn(q, k, v, g, lam, initial_state=st, output_final_state=True, cu_seqlens=cu)
    for i in range(len(lengths)):
        s, e = cu[i].item(), cu[i + 1].item()
        st_i = LogLinearState(st.levels[i:i + 1], st.t[i:i + 1])
        o_i, f_i = naive_recurrent_log_linear(*(x[:, s:e] for x in (q, k, v, g, lam)), initial_state=st_i,
                                              output_final_state=True)
        if e > s:
            assert rel(o[:, s:e], o_i) < 1e-5
        assert rel(fin.levels[i:i + 1], f_i.levels) < 1e-5
        assert fin.t[i].item() == f_i.t.item() == st.t[i].item() + lengths[i]


def test_gradients_chunk_equal_recurrent():
    q, k, v, g, lam = inputs(2, 45, L=7)
    st = random_state(2, 2, 7, 8, 6, [6, 21])
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, g, lam, st.levels)]

    def grads(fn, **kw):
        for x in leaves:
            x.grad = None
        o, fin = fn(*leaves[:5], initial_state=LogLinearState(leaves[5], st.t), output_final_state=True, **kw)
        (o.pow(2).sum() + (fin.levels * 0.1).pow(2).sum()).backward()
        return [x.grad.clone() for x in leaves]

    ga = grads(chunk_log_linear, chunk_size=8)
    gb = grads(naive_recurrent_log_linear)
    for name, a, b in zip("q k v g lam h0".split(), ga, gb):
        assert rel(a, b) < 1e-5, name


# ---- reductions and structure -----------------------------------------------------------------

@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_unit_level_weights_give_linear_backbone(form):
    """lambda == 1 on every level: the levels partition the prefix, so this is the gla op."""
    T, L = 130, 9
    q, k, v, g, _ = inputs(2, T, L=L)
    ones = torch.ones(2, T, 2, L)
    # a consistent state: a prefix of 21 / 40 tokens run through the op, and its gla counterpart
    pre = inputs(1, 61, L=L, seed=5)
    cu = torch.tensor([0, 21, 61])
    _, st = naive_recurrent_log_linear(*pre[:4], torch.ones(1, 61, 2, L), output_final_state=True, cu_seqlens=cu)
    fn = chunk_log_linear if form == "chunk" else naive_recurrent_log_linear
    o, fin = fn(q, k, v, g, ones, initial_state=st, output_final_state=True)
    gla = chunk_gla if form == "chunk" else naive_recurrent_gla
    o_ref, S_ref = gla(q, k, v, g, initial_state=st.levels.sum(2), output_final_state=True)
    assert rel(o, o_ref) < 1e-5
    assert rel(fin.levels.sum(2), S_ref) < 1e-5


@pytest.mark.parametrize("T", [1, 2, 5, 64, 100, 130])
def test_state_is_logarithmic(T):
    """After T tokens only the Fenwick levels of T are occupied: at most floor(log2 T) + 2 of them."""
    L = levels_for(T) + 1
    q, k, v, g, lam = inputs(1, T, L=L, H=1)
    _, st = chunk_log_linear(q, k, v, g, lam, output_final_state=True, chunk_size=16)
    nonzero = st.levels.flatten(3).abs().amax(-1)[0, 0] > 0              # [L]
    assert torch.equal(nonzero, occupied_levels(torch.tensor([T]), L)[0])
    assert int(nonzero.sum()) <= int(math.log2(T)) + 2
    assert st.levels.shape[2] == L


def test_bad_inputs_are_refused():
    q, k, v, g, lam = inputs(1, 4, L=3)
    with pytest.raises(ValueError, match="LogLinearState"):
        naive_recurrent_log_linear(q, k, v, g, lam, initial_state=torch.zeros(1, 2, 3, 8, 6))
    with pytest.raises(ValueError, match="at least 2 levels"):
        chunk_log_linear(q, k, v, g, lam[..., :1])
    with pytest.raises(ValueError, match="level_scales"):
        chunk_log_linear(q, k, v, g, lam[:, :2])
    with pytest.raises(ValueError, match="log-decay"):
        chunk_log_linear(q, k, v, g[..., None].expand(1, 4, 2, 8), lam)


def test_bf16_inputs_run():
    q, k, v, g, lam = inputs(1, 40, L=7, dtype=torch.bfloat16)
    o, st = chunk_log_linear(q, k, v, g, lam, output_final_state=True)
    assert o.dtype == torch.bfloat16 and torch.isfinite(o.float()).all()
    o32, _ = chunk_log_linear(*(x.float() for x in (q, k, v, g, lam)))
    assert rel(o, o32) < 2e-2
