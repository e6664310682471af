"""Q-Delta mixer ("qdelta"; "Q-Delta: Beyond Key-Value Associative State Evolution"): contract checks,
hand-written reference, exact reduction to Gated DeltaNet at lambda = 0, lambda init and the stability condition."""
from __future__ import annotations

import pytest
import torch

from hybridize.ops.delta.reference import contraction_factor, query_erase
from hybridize.mixers import build_mixer
from hybridize.mixers.qdelta import QDelta
from tests.mixers.helpers import (FP32_TOL, call, check_backward, check_chunk_equals_recurrent, check_left_padding,
                                  check_padding_keeps_state, check_prefill_then_steps, check_runs_in_dtype,
                                  check_varlen_equals_separate, make_mixer, random_hidden, rel_err)
from tests.mixers.test_deltanet import reference_forward

VARIANTS = {"plain": {}, "conv_rope": {"short_conv": True, "use_rope": True}, "fixed": {"fixed_lambda": 0.8},
            "logsigmoid": {"decay_fn": "logsigmoid", "lambda_init": 0.5}}


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
@torch.no_grad()
def test_matches_hand_written_reference(mode):
    m = make_mixer("qdelta", perturb=0.5)        # lambda far from its init
    x = random_hidden(2, 37, m.config.hidden_size)
    lam = torch.sigmoid(m.lambda_logit)
    assert rel_err(m(x, mode=mode).hidden, reference_forward(m, x, lam)) < FP32_TOL


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("T", [1, 63, 130])
def test_chunk_equals_recurrent(variant, T):
    m = make_mixer("qdelta", **VARIANTS[variant])
    x = random_hidden(2, T, m.config.hidden_size)
    check_chunk_equals_recurrent(m, x)
    st = call(m, random_hidden(2, 9, m.config.hidden_size, seed=3), output_state=True).state
    check_chunk_equals_recurrent(m, x, state=st)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_varlen_padding(variant):
    m = make_mixer("qdelta", **VARIANTS[variant])
    x = random_hidden(2, 40, m.config.hidden_size)
    check_prefill_then_steps(m, x, split=33)
    check_varlen_equals_separate(m, [5, 33, 1, 17])
    check_varlen_equals_separate(m, [5, 33, 1, 17], mode="recurrent")
    check_left_padding(m, [7, 20, 1], T=20)
    if not m.config.short_conv:
        check_padding_keeps_state(m, x)


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_backward_reaches_lambda(mode):
    m = make_mixer("qdelta")
    check_backward(m, random_hidden(2, 20, m.config.hidden_size), mode=mode)
    assert m.lambda_logit.grad.abs().min() > 0


def test_bf16_runs():
    m = make_mixer("qdelta", short_conv=True)
    x = random_hidden(2, 37, m.config.hidden_size)
    ref = m(x).hidden
    assert rel_err(check_runs_in_dtype(m, x, torch.bfloat16).float(), ref) < 5e-2


@pytest.mark.parametrize("how", ["fixed_lambda", "logit_-inf"])
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
@torch.no_grad()
def test_lambda_zero_is_gated_deltanet(how, mode):
    """Exact reduction: Q-Delta with lambda = 0 and GDN with the same weights give identical bits."""
    gdn = make_mixer("gdn", short_conv=True, perturb=0.3)
    qd = QDelta(make_mixer("qdelta", short_conv=True, **({"fixed_lambda": 0.0} if how == "fixed_lambda" else {}))
                .config)
    missing, unexpected = qd.load_state_dict(gdn.state_dict(), strict=False)
    assert not unexpected and missing == ([] if how == "fixed_lambda" else ["lambda_logit"])
    if how == "logit_-inf":
        qd.lambda_logit.fill_(float("-inf"))
    assert torch.equal(qd.query_feedback(), torch.zeros(2))
    x = random_hidden(2, 45, gdn.config.hidden_size)
    a = gdn(x, output_state=True, mode=mode)
    b = qd(x, output_state=True, mode=mode)
    assert torch.equal(a.hidden, b.hidden)
    assert all(torch.equal(s, t) for s, t in zip(a.state.tensors(), b.state.tensors()))
    # and lambda != 0 really changes the layer (the test above could not pass by accident)
    qd2 = make_mixer("qdelta", short_conv=True, fixed_lambda=0.5)
    qd2.load_state_dict(gdn.state_dict())
    assert rel_err(qd2(x, mode=mode).hidden, a.hidden) > 1e-3


@torch.no_grad()
def test_init_and_settings():
    m = build_mixer("qdelta", {"lambda_init": 0.2}, hidden_size=16, num_heads=3, num_kv_heads=1, head_dim=8)
    assert torch.allclose(m.query_feedback(), torch.full((3,), 0.2))
    assert "lambda_logit" in m.new_parameter_names()
    f = build_mixer("qdelta", {"fixed_lambda": 0.5}, hidden_size=16, num_heads=3, num_kv_heads=1, head_dim=8)
    assert not hasattr(f, "lambda_logit") and torch.equal(f.query_feedback(), torch.full((3,), 0.5))
    for bad in ({"fixed_lambda": 1.5}, {"lambda_init": 0.0}):
        with pytest.raises(ValueError, match="lambda"):
            build_mixer("qdelta", bad, hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=8)


@torch.no_grad()
@pytest.mark.parametrize("perturb,x_scale", [(0.5, 1.0), (2.0, 5.0)])
def test_stability_condition_holds(perturb, x_scale):
    """"Q-Delta: Beyond Key-Value Associative State Evolution", Lemma 3.1: beta_t (k_t . x_t) in (0, 2) for the mixer's own inputs, whatever the weights
    (with extreme weights beta may underflow to 0 in fp32: a skipped write, still never expanding)."""
    m = make_mixer("qdelta", perturb=perturb)
    m.lambda_logit.fill_(6.0)                                     # lambda ~ 1, the worst case
    x = random_hidden(2, 50, m.config.hidden_size) * x_scale
    inputs, _ = m.features(x)
    assert inputs["p"] is None   # the op forms x = k + lambda q from lam
    p = query_erase(inputs["q"], inputs["k"], inputs["lam"])
    a = contraction_factor(inputs["k"], inputs["beta"], p)
    assert (a < 2).all() and ((a > 0).all() if x_scale == 1.0 else (a >= 0).all())
    assert torch.allclose(inputs["q"].norm(dim=-1), torch.ones(2, 50, 2))
    k_dot_x = (inputs["k"] * p).sum(-1)
    lam = m.query_feedback()
    assert torch.allclose(k_dot_x, 1 + lam * (inputs["q"] * inputs["k"]).sum(-1), atol=1e-5)
