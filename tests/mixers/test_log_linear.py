"""Log-linear mixer: chunk == recurrent, prefill + steps == full, varlen == separate, padding, the
adaptive-lambda init (softplus(0.54) on every level, and then the layer IS its linear backbone),
the baseline lambda formula, clamping beyond max_seq_len, O(log T) state, bf16, gradients, teacher init."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hybridize.ops.gla.reference import chunk_gla
from hybridize.ops.log_linear.reference import occupied_levels
from hybridize.mixers import mixer_class
from hybridize.mixers.base import repeat_kv
from hybridize.mixers.linear_attn import apply_feature_map
from hybridize.mixers.log_linear import LogLinearAttention, LogLinearMixerState
from tests.mixers import helpers as h
from tests.mixers.test_linear_attn import FakeTeacherAttention

CONFIGS = {
    "adaptive": {},
    "baseline": {"lambda_mode": "baseline"},
    "identity_plain": {"feature_map": "identity", "output_norm": False, "output_gate": "none"},
    "conv_rope_qknorm": {"short_conv": True, "use_rope": True, "qk_norm": True, "qkv_bias": True,
                         "output_gate": "sigmoid", "max_seq_len": 300},
}


def mixer(name="adaptive", perturb=0.1, **kw):
    m = h.make_mixer(LogLinearAttention, perturb=perturb, **{**CONFIGS[name], **kw})
    if perturb:
        with torch.no_grad():   # varied, data-dependent decays and level weights so no bug hides behind ~1
            m.dt_proj.weight.normal_(0, 0.3)
            m.dt_bias.normal_(-1.0, 1.0)
            if hasattr(m, "lambda_mlp"):
                m.lambda_mlp[2].weight.normal_(0, 0.5)
    return m


def random_state(m, n, t=(5, 77, 12), seed=5):
    """A state of `n` rows at counters `t` (slots the Fenwick structure leaves empty are zeroed)."""
    gen = torch.Generator().manual_seed(seed)
    c = m.config
    tt = torch.tensor(t[:n])
    levels = torch.randn(n, c.num_heads, c.num_levels, c.head_dim, c.head_dim, generator=gen)
    levels = levels * occupied_levels(tt, c.num_levels)[:, None, :, None, None]
    return LogLinearMixerState(levels=levels, t=tt)


def test_registry_name():
    assert mixer_class("log_linear") is LogLinearAttention


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("T", [1, 63, 130])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_equals_recurrent(cfg, T, with_state):
    m = mixer(cfg)
    x = h.random_hidden(2, T, m.config.hidden_size, seed=T)
    state = random_state(m, 2) if with_state and not m.config.short_conv else None
    h.check_chunk_equals_recurrent(m, x, state=state)


@pytest.mark.parametrize("chunk_size", [8, 32])
def test_chunk_sizes(chunk_size):
    m = mixer("adaptive", chunk_size=chunk_size)
    h.check_chunk_equals_recurrent(m, h.random_hidden(1, 70, m.config.hidden_size), state=random_state(m, 1))


def test_longer_than_max_seq_len_clamps_consistently():
    m = mixer("adaptive", max_seq_len=8)            # 4 levels, chunk capped at 4 tokens
    assert m.config.num_levels == 4
    h.check_chunk_equals_recurrent(m, h.random_hidden(2, 70, m.config.hidden_size), state=random_state(m, 2))


@pytest.mark.parametrize("cfg", ["adaptive", "conv_rope_qknorm"])
@pytest.mark.parametrize("split", [1, 37, 64])
def test_prefill_then_steps(cfg, split):
    m = mixer(cfg)
    h.check_prefill_then_steps(m, h.random_hidden(2, 70, m.config.hidden_size), split)


@pytest.mark.parametrize("cfg", ["adaptive", "conv_rope_qknorm"])
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_varlen_equals_separate(cfg, mode):
    m = mixer(cfg)
    h.check_varlen_equals_separate(m, [1, 40, 17, 33], mode=mode)


def test_varlen_with_initial_state():
    m = mixer("baseline")
    h.check_varlen_equals_separate(m, [9, 40, 1], initial_state=random_state(m, 3))


@pytest.mark.parametrize("cfg", ["adaptive", "conv_rope_qknorm"])
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_left_padding(cfg, mode):
    m = mixer(cfg)
    h.check_left_padding(m, [50, 17, 1], mode=mode)


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_padding_keeps_state_and_counter(mode):
    m = mixer("adaptive")
    h.check_padding_keeps_state(m, h.random_hidden(2, 21, m.config.hidden_size), mode=mode)


def test_padding_inside_a_row_is_skipped():
    """A pad in the middle of a row: same outputs and state as the row without it (the counter does not tick)."""
    m = mixer("adaptive")
    x = h.random_hidden(1, 30, m.config.hidden_size)
    mask = torch.ones(1, 30, dtype=torch.bool)
    mask[0, 11] = False
    a = m(x, attention_mask=mask, output_state=True)
    keep = mask[0]
    b = m(x[:, keep], output_state=True)
    assert h.rel_err(a.hidden[:, keep], b.hidden) < 1e-5
    assert h.state_rel_err(a.state, b.state) < 1e-5
    assert a.state.t.tolist() == [29]


@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_backward_reaches_every_parameter(cfg):
    m = mixer(cfg)
    h.check_backward(m, h.random_hidden(2, 40, m.config.hidden_size), mode="chunk")


def test_gradients_chunk_equal_recurrent():
    m = mixer("adaptive")
    x = h.random_hidden(2, 45, m.config.hidden_size)
    grads = {}
    for mode in ("chunk", "recurrent"):
        m.zero_grad(set_to_none=True)
        m(x, mode=mode).hidden.pow(2).sum().backward()
        grads[mode] = {n: p.grad.clone() for n, p in m.named_parameters()}
    for name, g in grads["chunk"].items():
        assert h.rel_err(g, grads["recurrent"][name]) < 1e-5, name


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_bf16_runs(mode):
    m = mixer("adaptive")
    h.check_runs_in_dtype(m, h.random_hidden(2, 40, m.config.hidden_size), torch.bfloat16, mode=mode)


# ---- init rule, reductions ------------------------------------------------------------------------

def test_adaptive_lambda_is_softplus_054_at_init():
    m = h.make_mixer(LogLinearAttention, perturb=0.0)
    lam = m.level_weights(h.random_hidden(2, 50, m.config.hidden_size) * 5)
    assert lam.shape == (2, 50, m.config.num_heads, m.config.num_levels)
    assert torch.allclose(lam, torch.full_like(lam, F.softplus(torch.tensor(0.54)).item()), rtol=0, atol=1e-7)
    assert (lam - 1).abs().max() < 1e-3     # softplus(0.54) = 0.99917


def _backbone(m, x, lam0):
    """The linear backbone of `m` (gla op, same features and scalar decay) times a constant weight."""
    c = m.config
    q, k, v, _ = m.project_qkv(x)
    q, k = apply_feature_map(c.q_map, q), apply_feature_map(c.k_map, k)
    k, v = repeat_kv(k, m.n_rep), repeat_kv(v, m.n_rep)
    o, _ = chunk_gla(q, k, v, m.log_decay(x), scale=c.read_scale)
    return m.o_proj((lam0 * o).reshape(*x.shape[:2], -1))


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_adaptive_init_equals_linear_backbone(mode):
    """At init lambda = softplus(0.54) on every level, the levels partition the prefix: backbone * 0.9992."""
    m = h.make_mixer(LogLinearAttention, perturb=0.0, output_norm=False, output_gate="none")
    with torch.no_grad():   # non-trivial teacher-like weights and decays
        for p in (m.q_proj.weight, m.k_proj.weight, m.v_proj.weight, m.o_proj.weight, m.dt_proj.weight):
            p.normal_(0, 0.3)
    x = h.random_hidden(2, 130, m.config.hidden_size)
    out = m(x, mode=mode).hidden
    assert h.rel_err(out, _backbone(m, x, F.softplus(torch.tensor(0.54)).item())) < 1e-5


def test_unit_lambda_equals_backbone_after_training_like_perturbation():
    """Whatever the other weights, forcing every level weight to 1 gives the linear backbone."""
    m = mixer("identity_plain")
    m.level_weights = lambda x: torch.ones(*x.shape[:2], m.config.num_heads, m.config.num_levels)
    x = h.random_hidden(2, 97, m.config.hidden_size)
    assert h.rel_err(m(x).hidden, _backbone(m, x, 1.0)) < 1e-5


def test_baseline_lambda_formula():
    m = mixer("baseline")
    c = m.config
    x = h.random_hidden(2, 9, c.hidden_size)
    d = (x @ m.lambda_proj.weight.t()).view(2, 9, c.num_heads, c.num_levels)
    assert h.rel_err(m.level_weights(x), F.softplus(m.lambda_scale * d)) < 1e-6
    assert not hasattr(m, "lambda_mlp")


def test_decay_init_is_near_one_and_data_independent():
    m = h.make_mixer(LogLinearAttention, perturb=0.0, num_heads=4, num_kv_heads=2)
    decay = m.log_decay(h.random_hidden(2, 20, m.config.hidden_size) * 3).exp()
    assert decay.min() >= 0.99 - 1e-6 and decay.max() <= 0.999 + 1e-6
    assert torch.allclose(decay, decay[:1, :1].expand_as(decay))
    per_head = decay[0, 0]
    assert torch.allclose(per_head[[0, -1]], torch.tensor([math.exp(-1e-3), math.exp(-1e-2)]), atol=1e-6)


def test_output_gate_is_identity_at_init():
    m = h.make_mixer(LogLinearAttention, perturb=0.0, output_gate="silu")
    o = torch.randn(2, 5, m.config.num_heads, m.config.head_dim)
    m.o_norm = torch.nn.Identity()
    assert h.rel_err(m.read_out(o, h.random_hidden(2, 5, m.config.hidden_size)), o) < 1e-6


# ---- state ------------------------------------------------------------------------------------

def test_state_is_logarithmic():
    m = mixer("adaptive", max_seq_len=4096)
    c = m.config
    assert c.num_levels == 13
    sizes = []
    for T in (10, 130):
        st = m(h.random_hidden(1, T, c.hidden_size), output_state=True).state
        assert st.levels.shape == (1, c.num_heads, 13, c.head_dim, c.head_dim)
        occupied = (st.levels.flatten(3).abs().amax(-1)[0] > 0).any(0)
        assert torch.equal(occupied, occupied_levels(torch.tensor([T]), 13)[0])
        assert int(occupied.sum()) <= int(math.log2(T)) + 2
        sizes.append(st.nbytes())
    assert sizes[0] == sizes[1]


def test_init_from_teacher_copies_weights():
    m = mixer("conv_rope_qknorm")
    c = m.config
    teacher = FakeTeacherAttention(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, bias=True, qk_norm=True)
    m.init_from_attention(teacher)
    own = m.state_dict()
    assert all(torch.equal(own[k], v) for k, v in teacher.state_dict().items())
    assert torch.equal(m.lambda_mlp[2].weight, torch.zeros_like(m.lambda_mlp[2].weight))
    assert torch.equal(m.lambda_mlp[2].bias, torch.full_like(m.lambda_mlp[2].bias, 0.54))


def test_bad_settings_and_states_raise():
    with pytest.raises(ValueError, match="lambda_mode"):
        h.tiny_config(LogLinearAttention, lambda_mode="softmax")
    with pytest.raises(ValueError, match="max_seq_len"):
        h.tiny_config(LogLinearAttention, max_seq_len=1)
    m = mixer("adaptive")
    x = h.random_hidden(2, 4, m.config.hidden_size)
    with pytest.raises(ValueError, match="do not fit"):
        m(x, state=random_state(m, 1))
    with pytest.raises(ValueError, match="not both"):
        m(x[:1], attention_mask=torch.ones(1, 4, dtype=torch.bool), cu_seqlens=torch.tensor([0, 4]))
