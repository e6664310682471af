"""LinearAttention mixer: chunk == recurrent, prefill + steps == full, varlen == separate, left padding,
row-sparse top-k, an independent quadratic fp64 reference, bf16, gradients, teacher init, and the
transform_query hook."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hybridize.mixers import build_mixer, mixer_class
from hybridize.mixers.linear_attn import LinearAttention, LinearAttentionState, topk_softmax
from tests.mixers import helpers as h

CONFIGS = {
    "default": {},
    "identity": {"feature_map": "identity"},
    "elu1_norm": {"feature_map": "elu1", "output_norm": True},
    "relu_silu_v": {"feature_map": "relu", "v_feature_map": "silu"},
    "topk": {"row_topk": 3},
    "conv_rope_qknorm": {"short_conv": True, "use_rope": True, "qk_norm": True, "qkv_bias": True},
}


def mixer(name="default", **kw):
    return h.make_mixer(LinearAttention, **{**CONFIGS[name], **kw})


def random_state(m, n, seed=5):
    gen = torch.Generator().manual_seed(seed)
    c = m.config
    return LinearAttentionState(recurrent=torch.randn(n, c.num_heads, c.head_dim, c.head_dim, generator=gen))


def test_registry_name():
    assert mixer_class("linear_attn") is LinearAttention
    assert isinstance(build_mixer("linear_attn", {}, hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=8),
                      LinearAttention)


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("T", [1, 63, 130])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_equals_recurrent(cfg, T, with_state):
    m = mixer(cfg)
    x = h.random_hidden(2, T, m.config.hidden_size, seed=T)
    state = random_state(m, 2) if with_state and not m.config.short_conv else None
    h.check_chunk_equals_recurrent(m, x, state=state)


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("split", [1, 37])
def test_prefill_then_steps(cfg, split):
    m = mixer(cfg)
    h.check_prefill_then_steps(m, h.random_hidden(2, 45, m.config.hidden_size), split)


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_varlen_equals_separate(cfg, mode):
    h.check_varlen_equals_separate(mixer(cfg), [7, 1, 33], mode=mode)


def test_varlen_with_initial_state():
    m = mixer("default")
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


def quadratic_reference(m: LinearAttention, x: torch.Tensor) -> torch.Tensor:
    """fp64 o_t = scale * sum_{s<=t} (phi(q_t) . phi(k_s)) v_s, from the raw weights (no shared code)."""
    c = m.config
    x = x.double()
    W = {n: getattr(m, n).weight.double() for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    B, T, _ = x.shape
    q = (x @ W["q_proj"].T).view(B, T, c.num_heads, c.head_dim)
    k = (x @ W["k_proj"].T).view(B, T, c.num_kv_heads, c.head_dim)
    v = (x @ W["v_proj"].T).view(B, T, c.num_kv_heads, c.head_dim)
    maps = {"identity": lambda t: t, "elu1": lambda t: F.elu(t) + 1, "softmax": lambda t: t.softmax(-1)}
    q, k = maps[c.feature_map](q), maps[c.feature_map](k)
    group = torch.arange(c.num_heads) // (c.num_heads // c.num_kv_heads)   # query head -> its KV head
    k, v = k[:, :, group], v[:, :, group]
    A = torch.einsum("bthd,bshd->bhts", q, k).tril()
    o = torch.einsum("bhts,bshd->bthd", A, v) * (c.head_dim ** -0.5 if c.feature_map == "identity" else 1.0)
    return o.reshape(B, T, -1) @ W["o_proj"].T


@pytest.mark.parametrize("fmap", ["identity", "elu1", "softmax"])
def test_matches_quadratic_reference(fmap):
    m = h.make_mixer(LinearAttention, feature_map=fmap, num_heads=4, num_kv_heads=2)
    x = h.random_hidden(2, 40, m.config.hidden_size)
    with torch.no_grad():
        out = m(x, mode="chunk").hidden
    assert h.rel_err(out, quadratic_reference(m, x)) < 1e-5


def test_topk_softmax_formula():
    x = torch.randn(3, 5, 8)
    key, sel = topk_softmax(x, 3)
    thresh = x.topk(3, -1).values[..., -1:]
    ref = x.masked_fill(x < thresh, float("-inf")).softmax(-1)
    assert torch.allclose(key, ref, atol=1e-7) and torch.equal(sel, x >= thresh)
    assert (key > 0).sum(-1).eq(3).all()


@pytest.mark.parametrize("mode", ["recurrent", "chunk"])
def test_row_topk_writes_only_chosen_rows(mode):
    m = mixer("topk", num_heads=4, num_kv_heads=2)
    c = m.config
    x = h.random_hidden(2, 1, c.hidden_size, seed=3)
    s0 = random_state(m, 2)
    with torch.no_grad():
        out = m(x, state=s0, output_state=True, mode=mode)
        raw_k = m.k_proj(x).view(2, c.num_kv_heads, c.head_dim)           # [B, Hkv, K] for the one token
    chosen = torch.zeros_like(raw_k, dtype=torch.bool).scatter(-1, raw_k.topk(c.row_topk, -1).indices, True)
    chosen = chosen.repeat_interleave(c.num_heads // c.num_kv_heads, dim=1)   # [B, H, K]
    S0, S1 = s0.recurrent, out.state.recurrent
    assert torch.equal(S1[~chosen], S0[~chosen]), "an unselected state row changed"
    assert (S1[chosen] != S0[chosen]).any(-1).all(), "a selected row was not written"


def test_bf16_runs():
    m = mixer("conv_rope_qknorm")
    x = h.random_hidden(2, 37, m.config.hidden_size)
    ref = h.call(m, x, mode="chunk").hidden.detach()
    out = h.check_runs_in_dtype(m, x, torch.bfloat16)
    assert h.rel_err(out, ref) < 5e-2


@pytest.mark.parametrize("cfg", ["default", "topk", "conv_rope_qknorm", "elu1_norm"])
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_backward(cfg, mode):
    m = mixer(cfg)
    h.check_backward(m, h.random_hidden(2, 20, m.config.hidden_size), mode=mode)


class FakeTeacherAttention(nn.Module):
    def __init__(self, hidden, heads, kv_heads, head_dim, bias=False, qk_norm=False):
        super().__init__()
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        if qk_norm:
            self.q_norm = nn.Module()
            self.q_norm.weight = nn.Parameter(torch.randn(head_dim))
            self.k_norm = nn.Module()
            self.k_norm.weight = nn.Parameter(torch.randn(head_dim))


@pytest.mark.parametrize("settings", [{}, {"qkv_bias": True, "qk_norm": True, "output_norm": True}])
def test_init_from_teacher_copies_weights(settings):
    m = h.make_mixer(LinearAttention, **settings)
    c = m.config
    teacher = FakeTeacherAttention(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                                   bias=c.qkv_bias, qk_norm=c.qk_norm)
    m.init_from_attention(teacher)
    src = teacher.state_dict()
    for name, p in m.state_dict().items():
        if name in src:
            assert torch.equal(p, src[name]), name
    assert all(k in m.state_dict() for k in src)
    if c.output_norm:
        assert torch.equal(m.o_norm.weight, torch.ones_like(m.o_norm.weight))


def test_bad_settings_raise():
    with pytest.raises(ValueError, match="feature_map"):
        h.tiny_config(LinearAttention, feature_map="cosh")
    with pytest.raises(ValueError, match="row_topk"):
        h.tiny_config(LinearAttention, row_topk=9)
    m = mixer()
    with pytest.raises(ValueError, match="does not fit"):
        m(h.random_hidden(2, 3, 16), state=random_state(m, 3))


@dataclass
class _TaggedState(LinearAttentionState):
    tag: torch.Tensor | None = None


class _DoubledQuery(LinearAttention):
    """Reads with 2 q through the `transform_query` hook and returns sum(k) as an extra state field."""

    state_class = _TaggedState

    def transform_query(self, q, k, state, attention_mask, cu_seqlens, mode, output_state):
        self.seen = (q, k, mode, output_state)
        return 2 * q, ({"tag": k.sum()} if output_state else {})


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
@torch.no_grad()
def test_transform_query_hook(mode):
    """The hook gets q, k as `features` returns them; its query is the one read (the read is linear in
    q and o_proj has no bias, so the output doubles), the write is untouched, its dict joins the state."""
    base = mixer()
    probe = _DoubledQuery(base.config)
    probe.load_state_dict(base.state_dict())
    x = h.random_hidden(2, 9, base.config.hidden_size)
    ref = base(x, output_state=True, mode=mode)
    out = probe(x, output_state=True, mode=mode)
    q, k, *_ = base.features(x)
    assert torch.equal(probe.seen[0], q) and torch.equal(probe.seen[1], k)
    assert probe.seen[2:] == (mode, True)
    assert h.rel_err(out.hidden, 2 * ref.hidden) < h.FP32_TOL
    assert torch.equal(out.state.recurrent, ref.state.recurrent)
    assert isinstance(out.state, _TaggedState) and torch.equal(out.state.tag, k.sum())
    assert probe(x, mode=mode).state is None
