"""DeltaNet ("deltanet") and Gated DeltaNet ("gdn") mixers: generic contract checks, an independent
hand-written reference of the whole layer, the init rules and the transform_query hook."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from hybridize.mixers import build_mixer, mixer_class
from hybridize.mixers.deltanet import DeltaNet, DeltaState, GatedDeltaNet
from tests.ops.delta.test_delta_op import naive
from tests.mixers.helpers import (FP32_TOL, check_backward, check_chunk_equals_recurrent, check_left_padding,
                                  check_padding_keeps_state, check_prefill_then_steps, check_runs_in_dtype,
                                  call, check_varlen_equals_separate, make_mixer, random_hidden, rel_err)

VARIANTS = {
    "plain": {},
    "conv": {"short_conv": True},
    "rope_qknorm": {"use_rope": True, "qk_norm": True},
    "bias_silu_nogate": {"qkv_bias": True, "qk_activation": "silu", "output_gate": False, "output_norm": False},
}
GDN_VARIANTS = {"logsigmoid": {"decay_fn": "logsigmoid"}}
CASES = [(n, v) for n in ("deltanet", "gdn") for v in VARIANTS] + [("gdn", v) for v in GDN_VARIANTS]


def settings(variant):
    return {**VARIANTS, **GDN_VARIANTS}[variant]


def reference_forward(m: DeltaNet, x: torch.Tensor, lam: torch.Tensor | None = None) -> torch.Tensor:
    """The layer written out by hand (no conv/RoPE/qk-norm), op replaced by the naive matrix loop.
    `lam` `[H]`: Q-Delta's erase direction p = k + lam q."""
    c = m.config
    B, T, _ = x.shape
    H, D, r = c.num_heads, c.head_dim, c.num_heads // c.num_kv_heads
    q = F.normalize(m.q_proj(x).view(B, T, H, D), dim=-1)
    k = F.normalize(m.k_proj(x).view(B, T, c.num_kv_heads, D), dim=-1)
    v = m.v_proj(x).view(B, T, c.num_kv_heads, D)
    # query head h reads KV head h // r
    k, v = k[:, :, torch.arange(H) // r], v[:, :, torch.arange(H) // r]
    beta = torch.sigmoid(m.b_proj(x))
    g = None
    if isinstance(m, GatedDeltaNet):
        z = m.a_proj(x) + m.dt_bias
        g = -m.A_log.exp() * F.softplus(z) if c.decay_fn == "mamba2" else F.logsigmoid(z)
    p = None if lam is None else k + lam[:, None] * q
    o, _ = naive(q, k, v, beta, g, p)
    o = o.float()
    if c.output_norm:
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * m.o_norm.weight
    if c.output_gate:
        o = o * F.silu(m.g_proj(x)).view(B, T, H, D)
    return m.o_proj(o.reshape(B, T, H * D))


@pytest.mark.parametrize("name,variant", [("deltanet", "plain"), ("deltanet", "bias_silu_nogate"),
                                          ("gdn", "plain"), ("gdn", "logsigmoid")])
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
@torch.no_grad()
def test_matches_hand_written_reference(name, variant, mode):
    s = dict(settings(variant), qk_activation="identity")
    m = make_mixer(name, **s)
    x = random_hidden(2, 37, m.config.hidden_size)
    out = m(x, mode=mode).hidden
    assert rel_err(out, reference_forward(m, x)) < FP32_TOL


@pytest.mark.parametrize("name", ["deltanet", "gdn"])
@torch.no_grad()
def test_gqa_head_mapping(name):
    """4 query heads on 2 KV heads: heads 0,1 read KV head 0 and heads 2,3 read KV head 1."""
    m = make_mixer(name, num_heads=4, num_kv_heads=2, hidden_size=24)
    x = random_hidden(2, 21, 24)
    assert rel_err(m(x).hidden, reference_forward(m, x)) < FP32_TOL


@pytest.mark.parametrize("name,variant", CASES)
@pytest.mark.parametrize("T", [1, 63, 130])
def test_chunk_equals_recurrent(name, variant, T):
    m = make_mixer(name, **settings(variant))
    x = random_hidden(2, T, m.config.hidden_size)
    check_chunk_equals_recurrent(m, x)
    # with an initial state (from a prefix)
    st = call(m, random_hidden(2, 9, m.config.hidden_size, seed=3), output_state=True).state
    check_chunk_equals_recurrent(m, x, state=st)


@pytest.mark.parametrize("name,variant", CASES)
def test_prefill_then_steps(name, variant):
    m = make_mixer(name, **settings(variant))
    x = random_hidden(2, 40, m.config.hidden_size)
    check_prefill_then_steps(m, x, split=33)
    check_prefill_then_steps(m, x, split=1, step_mode="chunk")


@pytest.mark.parametrize("name,variant", CASES)
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_varlen_equals_separate(name, variant, mode):
    m = make_mixer(name, **settings(variant))
    check_varlen_equals_separate(m, [5, 33, 1, 17], mode=mode)


@pytest.mark.parametrize("name,variant", [(n, v) for n, v in CASES if v != "conv"] + [("gdn", "conv")])
def test_varlen_with_initial_state(name, variant):
    m = make_mixer(name, **settings(variant))
    x0 = random_hidden(3, 6, m.config.hidden_size, seed=9)
    init = call(m, x0, output_state=True).state
    check_varlen_equals_separate(m, [4, 20, 9], initial_state=init)


@pytest.mark.parametrize("name,variant", CASES)
def test_left_padding(name, variant):
    m = make_mixer(name, **settings(variant))
    check_left_padding(m, [7, 20, 1], T=20)
    check_left_padding(m, [7, 20, 1], T=20, mode="recurrent")


@pytest.mark.parametrize("name", ["deltanet", "gdn"])
def test_padding_keeps_state(name):
    m = make_mixer(name)
    check_padding_keeps_state(m, random_hidden(2, 12, m.config.hidden_size))
    check_padding_keeps_state(m, random_hidden(2, 12, m.config.hidden_size), mode="chunk")


@pytest.mark.parametrize("name,variant", CASES)
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_backward(name, variant, mode):
    m = make_mixer(name, **settings(variant))
    check_backward(m, random_hidden(2, 20, m.config.hidden_size), mode=mode)


@pytest.mark.parametrize("name", ["deltanet", "gdn"])
def test_bf16_runs(name):
    m = make_mixer(name, short_conv=True)
    x = random_hidden(2, 37, m.config.hidden_size)
    ref = m(x, mode="chunk").hidden
    out = check_runs_in_dtype(m, x, torch.bfloat16)
    assert rel_err(out.float(), ref) < 5e-2
    st = m(x.bfloat16(), output_state=True).state
    assert st.recurrent.dtype == torch.float32
    step = m(x[:, :1].bfloat16(), state=st, output_state=True)    # default mode: recurrent decode
    assert step.hidden.dtype == torch.bfloat16


def test_state_shape_and_registry():
    m = build_mixer("gdn", {"short_conv": True}, hidden_size=16, num_heads=4, num_kv_heads=2, head_dim=8)
    assert type(m) is GatedDeltaNet and mixer_class("deltanet") is DeltaNet
    out = m(torch.randn(3, 5, 16), output_state=True)
    assert isinstance(out.state, DeltaState)
    assert out.state.recurrent.shape == (3, 4, 8, 8)
    assert out.state.conv.k.shape == (3, 16, 3)
    assert m(torch.randn(3, 5, 16)).state is None


@pytest.mark.parametrize("decay_fn", ["mamba2", "logsigmoid"])
@torch.no_grad()
def test_init_rules(decay_fn):
    m = build_mixer("gdn", {"decay_fn": decay_fn, "beta_init": 0.7, "decay_min": 0.95, "decay_max": 0.999},
                    hidden_size=16, num_heads=3, num_kv_heads=1, head_dim=8)
    x = torch.randn(2, 5, 16) * 10
    beta = torch.sigmoid(m.b_proj(x))
    assert torch.allclose(beta, torch.full_like(beta, 0.7), atol=1e-6)
    assert torch.allclose(F.silu(m.g_proj(x)), torch.ones(2, 5, 24), atol=1e-6)       # gate = 1
    alpha = m.log_decay(x).exp()
    assert torch.allclose(alpha[0, 0], torch.tensor([0.999, 1 - 0.05 ** 0.5 * 0.001 ** 0.5, 0.95]), atol=1e-5)
    assert torch.equal(alpha, alpha[:1, :1].expand_as(alpha))                           # data-independent
    assert set(m.new_parameter_names()) >= {"b_proj.weight", "b_proj.bias", "g_proj.weight", "a_proj.weight",
                                            "dt_bias", "o_norm.weight"}


def test_bad_settings_raise():
    with pytest.raises(ValueError, match="decay_fn"):
        build_mixer("gdn", {"decay_fn": "exp"}, hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="beta_init"):
        build_mixer("deltanet", {"beta_init": 1.0}, hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="qk_activation"):
        build_mixer("deltanet", {"qk_activation": "relu"}, hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=8)


@dataclass
class _TaggedState(DeltaState):
    tag: torch.Tensor | None = None


class _DoubledQuery(GatedDeltaNet):
    """Reads with 2 q through the `transform_query` hook and returns sum(k) as an extra state field."""

    state_class = _TaggedState

    def transform_query(self, q, k, state, attention_mask, cu_seqlens, mode, output_state):
        self.seen = (q, k, mode, output_state)
        return 2 * q, ({"tag": k.sum()} if output_state else {})


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
@torch.no_grad()
def test_transform_query_hook(mode):
    """The hook gets q, k as `features` returns them; its query is the one read (without output norm and
    gate the layer is linear in q, so the output doubles), the write is untouched, its dict joins the state."""
    base = make_mixer("gdn", output_norm=False, output_gate=False)
    probe = _DoubledQuery(base.config)
    probe.load_state_dict(base.state_dict())
    x = random_hidden(2, 9, base.config.hidden_size)
    ref = base(x, output_state=True, mode=mode)
    out = probe(x, output_state=True, mode=mode)
    inputs, _ = base.features(x)
    assert torch.equal(probe.seen[0], inputs["q"]) and torch.equal(probe.seen[1], inputs["k"])
    assert probe.seen[2:] == (mode, True)
    assert rel_err(out.hidden, 2 * ref.hidden) < FP32_TOL
    assert torch.equal(out.state.recurrent, ref.state.recurrent)
    assert isinstance(out.state, _TaggedState) and torch.equal(out.state.tag, inputs["k"].sum())
    assert probe(x, mode=mode).state is None
