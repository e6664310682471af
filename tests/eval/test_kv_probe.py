"""The KV-regression probe of "Rethinking Key-Value Relationships in Linear Attention": the claim that
DeltaNet's identity MSE stays flat with length while linear attention's grows, and the probe's building
blocks against independent references."""
from __future__ import annotations

import torch

from hybridize.eval.kv_probe import (RELATIONS, ProbeConfig, causal_average, make_pairs, method_fn, mse,
                                     retrieval_mse, rls_closed_form, rls_recurrent, run_mse, table_scaling)


def test_deltanet_flat_linear_attention_grows():
    cfg = ProbeConfig(dim=16, trials=2, lengths=(64, 256, 1024), methods=("linear_attn", "deltanet", "rls"))
    rows = {r["method"]: [r[f"T={T}"] for T in cfg.lengths] for r in table_scaling(cfg, "identity", True, progress=False)}
    la, dn, rls = rows["linear_attn"], rows["deltanet"], rows["rls"]
    assert la[0] < la[1] < la[2] and la[2] > 50 * la[0]          # grows ~ (T/d)^2
    assert max(dn) < 1e-2 and dn[2] <= dn[0] + 1e-6               # flat (and small)
    assert max(rls) < 1e-8                                         # identity is exactly linear
    # the same holds without normalisation and for a nonlinear relation: LA grows, DeltaNet does not
    la_exp = [run_mse("linear_attn", "exp", T, cfg, False) for T in cfg.lengths]
    dn_exp = [run_mse("deltanet", "exp", T, cfg, False) for T in cfg.lengths]
    assert la_exp[2] > 10 * la_exp[0] and dn_exp[2] < 2 * dn_exp[0]


def _delta_loop(k, v):
    """Independent reference: S <- S - k (k^T S) + k v^T, token by token."""
    B, T, d = k.shape
    S = torch.zeros(B, d, v.shape[-1], dtype=k.dtype)
    for t in range(T):
        kt, vt = k[:, t], v[:, t]
        S = S - kt[:, :, None] * torch.einsum("bk,bkv->bv", kt, S)[:, None, :] + kt[:, :, None] * vt[:, None, :]
    return S


def test_method_states_match_references():
    cfg = ProbeConfig(dim=8, decay=0.9)
    k, v = make_pairs("sin(10pi x)", 50, 8, True, 2, 0, seed=1, dtype=torch.float64)
    S_dn = method_fn("deltanet", cfg)(k, v)
    ref = _delta_loop(k, v)
    assert (S_dn - ref).abs().max() / ref.abs().max() < 1e-10
    S_la = method_fn("linear_attn", cfg)(k, v)
    ref = torch.einsum("btk,btv->bkv", k, v)
    assert (S_la - ref).abs().max() / ref.abs().max() < 1e-10
    S_gla = method_fn("gla", cfg)(k, v)
    w = 0.9 ** torch.arange(49, -1, -1, dtype=torch.float64)
    ref = torch.einsum("t,btk,btv->bkv", w, k, v)
    assert (S_gla - ref).abs().max() / ref.abs().max() < 1e-10


def test_rls_is_the_least_squares_optimum():
    k, v = make_pairs("exp", 40, 6, False, 2, 0, seed=2, dtype=torch.float64)
    S_closed, S_rec = rls_closed_form(k, v), rls_recurrent(k, v)
    assert (S_closed - S_rec).abs().max() / S_closed.abs().max() < 1e-6
    ref = torch.linalg.lstsq(k, v).solution
    assert (S_closed - ref).abs().max() / ref.abs().max() < 1e-5
    cfg = ProbeConfig(dim=6)
    for m in ("linear_attn", "deltanet", "gdn"):   # nothing beats the optimum on its own objective
        assert mse(S_closed, k, v) <= mse(method_fn(m, cfg)(k, v), k, v) + 1e-12


def test_pairs_and_conv():
    k, v = make_pairs("x^2", 30, 8, normalize=False, batch=1, dtype=torch.float64)
    assert torch.allclose(k.norm(dim=-1), torch.ones(1, 30, dtype=torch.float64))
    assert torch.allclose(v, k ** 2)
    kn, vn = make_pairs("x^2", 30, 8, normalize=True, batch=1, dtype=torch.float64)
    assert torch.allclose(vn.norm(dim=-1), torch.ones(1, 30, dtype=torch.float64))
    x = torch.arange(5, dtype=torch.float64).view(1, 5, 1)
    assert causal_average(x, 3).flatten().tolist() == [0.0, 0.5, 1.0, 2.0, 3.0]
    assert set(RELATIONS) == {"identity", "x^2", "x^3", "x^4", "exp", "sin(10pi x)"}


def test_retrieval_runs():
    cfg = ProbeConfig(dim=8, length=100, trials=1)
    assert retrieval_mse("rls", "identity", cfg, 5) < 1e-10
    assert retrieval_mse("deltanet", "exp", cfg, 10, normalize=False) > 0
