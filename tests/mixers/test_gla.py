"""GLA mixer: chunk == recurrent, prefill + steps == full, varlen == separate, left padding, the init
rule, reduction to LinearAttention, an independent quadratic fp64 reference, row-sparse top-k
(written AND decayed rows only), bf16, gradients, teacher init."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridize.mixers import mixer_class
from hybridize.mixers.gla import GLA, GLAState
from hybridize.mixers.linear_attn import LinearAttention
from tests.mixers import helpers as h
from tests.mixers.test_linear_attn import FakeTeacherAttention

CONFIGS = {
    "default": {},
    "identity_nonorm": {"feature_map": "identity", "output_norm": False},
    "sse_maps_sigmoid": {"k_feature_map": "softmax", "q_feature_map": "silu", "v_feature_map": "silu",
                         "output_gate": "sigmoid"},
    "nogate": {"output_gate": "none", "feature_map": "elu1"},
    "topk": {"row_topk": 3},
    "conv_rope_qknorm": {"short_conv": True, "use_rope": True, "qk_norm": True, "qkv_bias": True},
}


def mixer(name="default", perturb=0.1, **kw):
    m = h.make_mixer(GLA, perturb=perturb, **{**CONFIGS[name], **kw})
    if perturb:
        with torch.no_grad():   # varied decays, some strong, so decay bugs cannot hide behind exp(g) ~ 1
            m.gk_proj[1].weight.normal_(0, 0.5)
            m.gk_proj[1].bias.normal_(0, 2.0)
    return m


def random_state(m, n, seed=5):
    gen = torch.Generator().manual_seed(seed)
    c = m.config
    return GLAState(recurrent=torch.randn(n, c.num_heads, c.head_dim, c.head_dim, generator=gen))


def test_registry_name():
    assert mixer_class("gla") is GLA


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("T", [1, 63, 130])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_equals_recurrent(cfg, T, with_state):
    m = mixer(cfg)
    x = h.random_hidden(2, T, m.config.hidden_size, seed=T)
    state = random_state(m, 2) if with_state and not m.config.short_conv else None
    h.check_chunk_equals_recurrent(m, x, state=state)


@pytest.mark.parametrize("chunk_size", [16, 32])
def test_chunk_sizes(chunk_size):
    m = mixer("default", chunk_size=chunk_size)
    h.check_chunk_equals_recurrent(m, h.random_hidden(1, 70, m.config.hidden_size), state=random_state(m, 1))


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("split", [1, 37])
def test_prefill_then_steps(cfg, split):
    m = mixer(cfg)
    h.check_prefill_then_steps(m, h.random_hidden(2, 45, m.config.hidden_size), split)


def test_prefill_then_chunked_continuation():
    m = mixer("conv_rope_qknorm")
    h.check_prefill_then_steps(m, h.random_hidden(2, 30, m.config.hidden_size), 20, step_mode="chunk")


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_varlen_equals_separate(cfg, mode):
    h.check_varlen_equals_separate(mixer(cfg), [7, 1, 33], mode=mode)


def test_varlen_with_initial_state():
    m = mixer("topk")
    h.check_varlen_equals_separate(m, [7, 1, 33], initial_state=random_state(m, 3))


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_left_padding_equals_unpadded(cfg, mode):
    h.check_left_padding(mixer(cfg), [20, 13, 1], mode=mode)


@pytest.mark.parametrize("cfg", ["default", "topk"])
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_padding_keeps_state(cfg, mode):
    m = mixer(cfg)
    h.check_padding_keeps_state(m, h.random_hidden(2, 9, m.config.hidden_size), mode=mode)


def quadratic_reference(m: GLA, x: torch.Tensor) -> torch.Tensor:
    """fp64 GLA from the raw weights: o_t = scale sum_{s<=t} sum_k q_tk k_sk exp(G_tk - G_sk) v_s,
    then per-head RMSNorm * silu gate, then o_proj (identity feature map, silu output gate)."""
    c = m.config
    x = x.double()
    B, T, _ = x.shape
    lin = lambda mod, t: t @ mod.weight.double().T + (mod.bias.double() if mod.bias is not None else 0)  # noqa
    q = lin(m.q_proj, x).view(B, T, c.num_heads, c.head_dim)
    group = torch.arange(c.num_heads) // (c.num_heads // c.num_kv_heads)
    k = lin(m.k_proj, x).view(B, T, c.num_kv_heads, c.head_dim)[:, :, group]
    v = lin(m.v_proj, x).view(B, T, c.num_kv_heads, c.head_dim)[:, :, group]
    g = F.logsigmoid(lin(m.gk_proj[1], lin(m.gk_proj[0], x))).view(B, T, c.num_heads, c.head_dim) / 16
    G = g.cumsum(1)
    D = (G.unsqueeze(2) - G.unsqueeze(1)).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril()[..., None, None],
                                                      float("-inf")).exp()       # [B, t, s, H, K]
    o = torch.einsum("bthk,bshk,btshk,bshv->bthv", q, k, D, v) * c.head_dim ** -0.5
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * m.o_norm.weight.double()
    o = o * F.silu(lin(m.g_proj, x)).view(B, T, c.num_heads, c.head_dim)
    return lin(m.o_proj, o.reshape(B, T, -1))


def test_matches_quadratic_reference():
    m = mixer("default", feature_map="identity", num_heads=4, num_kv_heads=2)
    x = h.random_hidden(2, 40, m.config.hidden_size)
    with torch.no_grad():
        out = m(x, mode="chunk").hidden
    assert h.rel_err(out, quadratic_reference(m, x)) < 1e-5


def test_init_rule():
    """Decays exactly init_decay, output gate exactly 1 (silu), norm weight 1."""
    m = mixer("default", perturb=0.0, init_decay=0.99)
    x = h.random_hidden(2, 9, m.config.hidden_size) * 10
    with torch.no_grad():
        decay = m.log_decay(x).exp()
        gate = F.silu(m.g_proj(x))
    assert torch.allclose(decay, torch.full_like(decay, 0.99), atol=1e-6)
    assert torch.allclose(gate, torch.ones_like(gate), atol=1e-6)
    assert torch.equal(m.o_norm.weight, torch.ones_like(m.o_norm.weight))
    assert set(m.new_parameter_names()) == {"gk_proj.0.weight", "gk_proj.1.weight", "gk_proj.1.bias",
                                            "g_proj.weight", "g_proj.bias", "o_norm.weight"}


def test_at_init_close_to_linear_attention():
    """Converted GLA at init = linear attention with the same q/k/v/o, decay init_decay, silu gate 1:
    with init_decay -> 1 (decay 1 - 1e-7) and the norm off it equals LinearAttention."""
    la = h.make_mixer(LinearAttention, perturb=0.1)
    g = h.make_mixer(GLA, perturb=0.0, output_norm=False, init_decay=1 - 1e-7)
    g.load_state_dict(la.state_dict(), strict=False)
    x = h.random_hidden(2, 50, la.config.hidden_size)
    with torch.no_grad():
        assert h.rel_err(g(x).hidden, la(x).hidden) < 1e-4


@pytest.mark.parametrize("mode", ["recurrent", "chunk"])
def test_row_topk_touches_only_chosen_rows(mode):
    """A step writes AND decays only the top-k rows: every other row stays bit-identical."""
    m = mixer("topk", num_heads=4, num_kv_heads=2)
    c = m.config
    x = h.random_hidden(2, 1, c.hidden_size, seed=3)
    s0 = random_state(m, 2)
    with torch.no_grad():
        out = m(x, state=s0, output_state=True, mode=mode)
        raw_k = m.k_proj(x).view(2, c.num_kv_heads, c.head_dim)
        gk = m.log_decay(x)[:, 0]                                     # [B, H, K]
    chosen = torch.zeros_like(raw_k, dtype=torch.bool).scatter(-1, raw_k.topk(c.row_topk, -1).indices, True)
    chosen = chosen.repeat_interleave(c.num_heads // c.num_kv_heads, dim=1)
    S0, S1 = s0.recurrent, out.state.recurrent
    assert torch.equal(S1[~chosen], S0[~chosen]), "an unselected state row changed"
    # chosen rows: decayed then written with the top-k softmax key (independent recomputation)
    key = torch.zeros_like(raw_k).scatter(-1, raw_k.topk(c.row_topk, -1).indices,
                                          raw_k.topk(c.row_topk, -1).values.softmax(-1))
    key = key.repeat_interleave(c.num_heads // c.num_kv_heads, dim=1)
    v = m.v_proj(x).view(2, c.num_kv_heads, c.head_dim).repeat_interleave(c.num_heads // c.num_kv_heads, 1)
    expect = S0 * gk.exp().unsqueeze(-1) + key.unsqueeze(-1) * v.unsqueeze(-2)
    assert h.rel_err(S1[chosen], expect.detach()[chosen]) < 1e-6


def test_bf16_runs():
    m = mixer("conv_rope_qknorm")
    x = h.random_hidden(2, 37, m.config.hidden_size)
    ref = h.call(m, x, mode="chunk").hidden.detach()
    out = h.check_runs_in_dtype(m, x, torch.bfloat16)
    assert h.rel_err(out, ref) < 5e-2


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_bf16_decode_keeps_fp32_state(mode):
    m = mixer("default").bfloat16()
    x = h.random_hidden(2, 5, m.config.hidden_size, torch.bfloat16)
    out = m(x, output_state=True, mode=mode)
    assert out.hidden.dtype == torch.bfloat16 and out.state.recurrent.dtype == torch.float32
    step = m(x[:, :1], state=out.state, output_state=True)
    assert step.state.recurrent.dtype == torch.float32


@pytest.mark.parametrize("cfg", ["default", "topk", "conv_rope_qknorm", "sse_maps_sigmoid"])
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_backward(cfg, mode):
    m = mixer(cfg)
    h.check_backward(m, h.random_hidden(2, 20, m.config.hidden_size), mode=mode)


def test_init_from_teacher_copies_weights():
    m = mixer("conv_rope_qknorm")
    c = m.config
    teacher = FakeTeacherAttention(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, bias=True, qk_norm=True)
    m.init_from_attention(teacher)
    src = teacher.state_dict()
    own = m.state_dict()
    assert all(torch.equal(own[k], v) for k, v in src.items())
    # and the new parameters follow the init rule again
    assert torch.equal(m.gk_proj[1].weight, torch.zeros_like(m.gk_proj[1].weight))
    assert torch.equal(m.q_conv.weight[:, -1], torch.ones(c.num_heads * c.head_dim))


def test_bad_settings_raise():
    with pytest.raises(ValueError, match="output_gate"):
        h.tiny_config(GLA, output_gate="tanh")
    with pytest.raises(ValueError, match="init_decay"):
        h.tiny_config(GLA, init_decay=1.0)


def test_padding_keeps_conv_state():
    m = mixer("conv_rope_qknorm")
    h.check_padding_keeps_state(m, h.random_hidden(2, 9, m.config.hidden_size))
