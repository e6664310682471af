"""CCQ on GLA and on Gated DeltaNet: forms agree, state, varlen, padding, the lambda = 0 reduction to
the backbone, and an end-to-end check against an independent fp64 computation of q_clean."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from hybridize.ops.delta.reference import naive_recurrent_delta
from hybridize.ops.gla.reference import naive_recurrent_gla
from hybridize.mixers.ccq import CCQGDN, CCQGLA
from hybridize.mixers.deltanet import GatedDeltaNet
from hybridize.mixers.gla import GLA
from hybridize.mixers.base import repeat_kv

from .helpers import (FP32_TOL, call, check_backward, check_chunk_equals_recurrent, check_left_padding,
                      check_padding_keeps_state, check_prefill_then_steps, check_runs_in_dtype,
                      check_varlen_equals_separate, make_mixer, random_hidden, rel_err)

NAMES = ["ccq_gla", "ccq_gdn"]
BACKBONE = {"ccq_gla": GLA, "ccq_gdn": GatedDeltaNet}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("T", [1, 63, 130])
def test_chunk_equals_recurrent(name, T):
    m = make_mixer(name)
    x = random_hidden(2, T, 16)
    check_chunk_equals_recurrent(m, x)
    st = call(m, random_hidden(2, 5, 16, seed=1), output_state=True).state
    check_chunk_equals_recurrent(m, x, state=st)


@pytest.mark.parametrize("name", NAMES)
def test_prefill_then_steps(name):
    m = make_mixer(name)
    x = random_hidden(2, 40, 16)
    check_prefill_then_steps(m, x, 17)
    check_prefill_then_steps(m, x, 1, step_mode="chunk")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_varlen_equals_separate(name, mode):
    m = make_mixer(name)
    lengths = [1, 37, 5, 20]
    check_varlen_equals_separate(m, lengths, mode=mode)
    st = call(m, random_hidden(4, 6, 16, seed=3), output_state=True).state
    check_varlen_equals_separate(m, lengths, mode=mode, initial_state=st)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_padding(name, mode):
    m = make_mixer(name)
    check_left_padding(m, [12, 4, 1], mode=mode)
    check_padding_keeps_state(m, random_hidden(2, 9, 16), mode=mode)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_lambda_zero_is_the_backbone(name, mode):
    """ccq_fixed_lambda = 0: exactly the backbone with the same weights; the learned gate is not."""
    m = make_mixer(name, ccq_fixed_lambda=0.0)
    cfg = {k: v for k, v in dataclasses.asdict(m.config).items() if not k.startswith("ccq_")}
    base = BACKBONE[name](BACKBONE[name].config_class.from_dict(cfg))
    missing, unexpected = base.load_state_dict(m.state_dict(), strict=False)
    assert not missing and not unexpected
    x = random_hidden(2, 45, 16)
    a = m(x, output_state=True, mode=mode)
    b = base(x, output_state=True, mode=mode)
    assert torch.equal(a.hidden, b.hidden)
    assert torch.equal(a.state.recurrent, b.state.recurrent)
    # with the gate on (perturbed from sigmoid(b) = 0.1) the read changes, the write does not
    on = make_mixer(name)
    on.load_state_dict(m.state_dict(), strict=False)
    c = on(x, output_state=True, mode=mode)
    assert rel_err(c.hidden, b.hidden) > 1e-4   # measured 2e-3 (GLA), 3e-2 (GDN)
    assert torch.equal(c.state.recurrent, b.state.recurrent)


def backbone_keys_queries(m, x):
    """q, k `[B, T, H, K]` exactly as the backbone's op receives them, computed without the CCQ hook."""
    if isinstance(m, CCQGLA):
        q, k, v, g, _ = GLA.features(m, x)
        return q, k, dict(v=v, g=g)
    inputs, _ = GatedDeltaNet.features(m, x)
    return inputs["q"], inputs["k"], inputs


def independent_q_clean(m, q, k):
    """fp64 q_clean from explicit per-position sums and the gate formula (eq. 8-9)."""
    q64, ku = q.double(), F.normalize(k.double(), dim=-1)
    B, T, H, K = q.shape
    out = torch.empty_like(q64)
    for t in range(T):
        kk = ku[:, :t + 1]
        C = torch.einsum("bjhk,bjhl->bhkl", kk, kk) / (t + 1)
        mu = kk.mean(1)
        sigma = C - mu.unsqueeze(-1) * mu.unsqueeze(-2)
        qbar = F.normalize(q64[:, t], dim=-1)
        lam = torch.sigmoid((qbar * m.ccq_weight.double()).sum(-1) + m.ccq_bias.double())
        out[:, t] = q64[:, t] - lam.unsqueeze(-1) * torch.einsum("bhkl,bhl->bhk", sigma, q64[:, t])
    return out


@pytest.mark.parametrize("name", NAMES)
@torch.no_grad()
def test_against_independent_computation(name):
    """Mixer output == backbone op run on an independently computed q_clean; state == statistics."""
    m = make_mixer(name)
    x = random_hidden(2, 23, 16)
    out = m(x, output_state=True)
    q, k, rest = backbone_keys_queries(m, x)
    qc = independent_q_clean(m, q, k).float()
    if name == "ccq_gla":
        o, S = naive_recurrent_gla(qc, k, rest["v"], rest["g"], scale=m.config.read_scale, output_final_state=True)
        hidden = m.o_proj(m.read_out(o, x).reshape(2, 23, -1))
    else:
        rest = {**rest, "q": qc}
        o, S = naive_recurrent_delta(**rest, output_final_state=True)
        hidden = m.finish(o, x)
    assert rel_err(out.hidden, hidden) < FP32_TOL
    assert rel_err(out.state.recurrent, S) < FP32_TOL
    # decode state: C_t, mu_t, t over the unit keys of each query head (GQA keys repeated)
    raw_k = m.k_proj(x).view(2, 23, 1, 8)
    if name == "ccq_gla":
        raw_k = raw_k.softmax(-1)                      # GLA's default key feature map
    ku = F.normalize(repeat_kv(raw_k, 2).double(), dim=-1)
    assert rel_err(out.state.key_moment, torch.einsum("bthk,bthl->bhkl", ku, ku) / 23) < FP32_TOL
    assert rel_err(out.state.key_mean, ku.mean(1)) < FP32_TOL
    assert torch.equal(out.state.key_count, torch.tensor([23, 23]))


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_gdn_keys_used_unnormalised_match_normalising_again(mode):
    """CCQ-GDN skips the key normalisation (its front end already gives unit keys): output and every gradient
    equal those with the normalisation (padding's zero keys included)."""
    x = random_hidden(2, 19, 16)
    mask = torch.ones(2, 19, dtype=torch.bool)
    mask[1, :5] = False
    results = []
    for unit in (True, False):
        m = make_mixer("ccq_gdn")
        m.keys_are_unit = unit
        xi = x.clone().requires_grad_(True)
        out = m(xi, attention_mask=mask, mode=mode, output_state=True)
        (out.hidden.square().sum() + out.state.key_moment.sum()).backward()
        grads = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
        results.append((out.hidden.detach(), xi.grad, grads))
    (h1, dx1, g1), (h2, dx2, g2) = results
    assert rel_err(h1, h2) < 1e-5 and rel_err(dx1, dx2) < 1e-5
    assert g1.keys() == g2.keys() and "k_proj.weight" in g1
    for n in g1:
        assert rel_err(g1[n], g2[n]) < 1e-5, n


@pytest.mark.parametrize("name", NAMES)
def test_decode_state_counts_real_tokens(name):
    """Left padding and documents: t counts only real tokens, restarting per document."""
    m = make_mixer(name)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, :6] = False
    st = m(random_hidden(2, 10, 16), attention_mask=mask, output_state=True).state
    assert st.key_count.tolist() == [10, 4]
    cu = torch.tensor([0, 3, 10, 11], dtype=torch.int32)
    st = m(random_hidden(1, 11, 16), cu_seqlens=cu, output_state=True).state
    assert st.key_count.tolist() == [3, 7, 1]
    st2 = m(random_hidden(3, 1, 16), state=st, output_state=True).state
    assert st2.key_count.tolist() == [4, 8, 2]


@pytest.mark.parametrize("name", NAMES)
def test_gate_init_and_gradients(name):
    m = make_mixer(name, perturb=0.0)
    assert torch.allclose(torch.sigmoid(m.ccq_bias), torch.full((2,), 0.1))
    assert (m.ccq_weight == 0).all()
    with torch.no_grad():
        m.ccq_bias.zero_()
    m.reset_new_parameters()
    assert torch.allclose(torch.sigmoid(m.ccq_bias), torch.full((2,), 0.1))
    m = make_mixer(name)
    x = random_hidden(2, 20, 16)
    check_backward(m, x)
    check_backward(m, x, mode="recurrent")
    check_runs_in_dtype(m, x, torch.bfloat16)


def test_fixed_lambda_has_no_gate_parameters_and_bad_values_raise():
    m = make_mixer("ccq_gla", ccq_fixed_lambda=0.5)
    assert not hasattr(m, "ccq_weight")
    with pytest.raises(ValueError, match="ccq_fixed_lambda"):
        make_mixer("ccq_gdn", ccq_fixed_lambda=2.0)
    with pytest.raises(ValueError, match="ccq_gate_init"):
        make_mixer("ccq_gla", ccq_gate_init=0.0)
