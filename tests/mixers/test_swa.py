"""Sliding-window attention: equals the HF teacher's attention (window >= T, and a banded teacher mask
for window < T), chunk == recurrent, prefill + steps == full, varlen, padding, fixed-size buffer."""
from __future__ import annotations

import pytest
import torch

from hybridize.mixers.base import apply_rope
from hybridize.mixers.swa import SlidingWindowAttention, SWAConfig

from .helpers import (FP32_TOL, call, check_backward, check_chunk_equals_recurrent, check_left_padding,
                      check_padding_keeps_state, check_prefill_then_steps, check_runs_in_dtype,
                      check_varlen_equals_separate, left_pad_mask, make_mixer, random_hidden, rel_err, rope_cos_sin,
                      state_rel_err)


def teacher(family: str):
    """A tiny HF attention layer (eager) and its rotary embedding: 4 query heads on 2 KV heads."""
    common = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  max_position_embeddings=256, rms_norm_eps=1e-6)
    if family == "llama":
        from transformers import LlamaConfig as Cfg
        from transformers.models.llama.modeling_llama import LlamaAttention as Att, LlamaRotaryEmbedding as Rope
    elif family == "qwen2":
        from transformers import Qwen2Config as Cfg
        from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention as Att, Qwen2RotaryEmbedding as Rope
    else:
        from transformers import Qwen3Config as Cfg
        from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention as Att, Qwen3RotaryEmbedding as Rope
    cfg = Cfg(**common)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    att = Att(cfg, layer_idx=0).eval()
    with torch.no_grad():  # random biases / norm weights so that copying them matters
        for p in att.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return att, Rope(cfg), cfg


def student_of(att, family, window):
    cfg = SWAConfig(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, window=window,
                    qkv_bias=family == "qwen2", qk_norm=family == "qwen3")
    m = SlidingWindowAttention(cfg)
    m.init_from_attention(att)
    return m.eval()


def banded_additive_mask(T, window):
    """Teacher-side mask built independently: 0 where 0 <= i - j < window, -inf elsewhere."""
    i, j = torch.arange(T).unsqueeze(1), torch.arange(T).unsqueeze(0)
    ok = (j <= i) & (i - j < window)
    return torch.zeros(T, T).masked_fill(~ok, float("-inf")).view(1, 1, T, T)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("window", [200, 7])
@torch.no_grad()
def test_equals_teacher_attention(family, window):
    """window >= T: the teacher's causal attention; window < T: the teacher under a banded mask."""
    att, rope, _ = teacher(family)
    T = 37
    x = torch.randn(2, T, 32)
    pos = torch.arange(T).expand(2, T)
    cos_sin = rope(x, pos)
    ref, _ = att(x, position_embeddings=cos_sin, attention_mask=banded_additive_mask(T, window))
    m = student_of(att, family, window)
    for mode in ("chunk", "recurrent"):
        out = m(x, position_embeddings=cos_sin, mode=mode)
        assert rel_err(out.hidden, ref) < FP32_TOL


@torch.no_grad()
def test_teacher_decode_with_buffer():
    """Teacher on the full sequence == student prefill + decode steps with a window-limited buffer."""
    att, rope, _ = teacher("llama")
    T, window, split = 40, 9, 13
    x = torch.randn(1, T, 32)
    pos = torch.arange(T).unsqueeze(0)
    ref, _ = att(x, position_embeddings=rope(x, pos), attention_mask=banded_additive_mask(T, window))
    m = student_of(att, "llama", window)
    out = m(x[:, :split], position_embeddings=rope(x, pos[:, :split]), output_state=True)
    hs, st = [out.hidden], out.state
    for t in range(split, T):
        o = m(x[:, t:t + 1], state=st, position_embeddings=rope(x, pos[:, t:t + 1]), output_state=True)
        assert o.state.k.shape == (1, 2, window, 8)        # buffer never grows
        hs.append(o.hidden)
        st = o.state
    assert rel_err(torch.cat(hs, 1), ref) < FP32_TOL


@pytest.mark.parametrize("T", [1, 5, 63])
@pytest.mark.parametrize("window", [1, 4, 16, 100])
def test_chunk_equals_recurrent(T, window):
    m = make_mixer("swa", window=window)
    x = random_hidden(2, T, 16)
    check_chunk_equals_recurrent(m, x)
    # and from a non-empty, partly filled state
    st = call(m, random_hidden(2, 3, 16, seed=1), output_state=True).state
    check_chunk_equals_recurrent(m, x, state=st, positions=torch.arange(3, 3 + T).expand(2, T))


@pytest.mark.parametrize("split", [1, 6, 25])
def test_prefill_then_steps(split):
    m = make_mixer("swa", window=8)
    x = random_hidden(2, 30, 16)
    check_prefill_then_steps(m, x, split)
    check_prefill_then_steps(m, x, split, step_mode="chunk")


def check_chunked_continuation(m, cuts):
    """Chunks of several tokens after a prefill (speculative / chunked prefill) == the full forward."""
    x = random_hidden(2, 30, 16)
    pos = torch.arange(30).expand(2, 30)
    full = call(m, x, pos).hidden
    st, hs = None, []
    for a, b in cuts:
        o = call(m, x[:, a:b], pos[:, a:b], state=st, output_state=True, mode="chunk")
        hs.append(o.hidden)
        st = o.state
    assert rel_err(torch.cat(hs, 1), full) < FP32_TOL


def test_multi_token_continuation():
    check_chunked_continuation(make_mixer("swa", window=6), ((0, 4), (4, 11), (11, 12), (12, 30)))


def test_buffer_contents_and_size():
    """The state is a ring of `window` slots holding exactly the last window-1 keys/values (after RoPE): the
    token of rank r in slot (r - 1) % window, the slot a next token takes empty; `_buffer` reads them oldest
    first."""
    window = 5
    m = make_mixer("swa", window=window)
    for T in (2, 4, 11):
        x = random_hidden(1, T, 16)
        st = call(m, x, output_state=True).state
        assert st.k.shape == st.v.shape == (1, 1, window, 8) and int(st.seen) == T
        n = min(T, window - 1)
        # independent: the projected keys of the last n tokens
        k = m.k_proj(x).view(1, T, 1, 8)
        cos, sin = rope_cos_sin(torch.arange(T).unsqueeze(0), 8)
        k = apply_rope(k, cos, sin)
        v = m.v_proj(x).view(1, T, 1, 8)
        for r in range(T - n + 1, T + 1):
            assert torch.allclose(st.k[0, :, (r - 1) % window], k[0, r - 1], atol=1e-6)
            assert torch.allclose(st.v[0, :, (r - 1) % window], v[0, r - 1], atol=1e-6)
        filled = {(r - 1) % window for r in range(T - n + 1, T + 1)}
        assert all((st.k[0, :, j] == 0).all() for j in range(window) if j not in filled)
        bk, bv, valid = m._buffer(st, k)
        assert valid[0].tolist() == [False] * (window - 1 - n) + [True] * n
        assert torch.allclose(bk[0, window - 1 - n:], k[0, T - n:], atol=1e-6)
        assert torch.allclose(bv[0, window - 1 - n:], v[0, T - n:], atol=1e-6)


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_varlen_equals_separate(mode):
    m = make_mixer("swa", window=6)
    check_varlen_equals_separate(m, [1, 13, 4, 9], mode=mode)
    st = call(m, random_hidden(4, 3, 16, seed=2), output_state=True).state
    check_varlen_equals_separate(m, [1, 13, 4, 9], mode=mode, initial_state=st)


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_left_padding(mode):
    m = make_mixer("swa", window=5)
    check_left_padding(m, [9, 3, 1], mode=mode)
    check_padding_keeps_state(m, random_hidden(2, 7, 16), mode=mode)


def test_padding_does_not_count_in_window():
    """Padding in the middle of a row is skipped: the window counts real tokens only."""
    m = make_mixer("swa", window=4)
    x = random_hidden(1, 12, 16)
    mask = torch.ones(1, 12, dtype=torch.bool)
    mask[0, 3:6] = False
    real = mask[0].nonzero().flatten()
    pos = (mask.long().cumsum(1) - 1).clamp(min=0)
    for mode in ("chunk", "recurrent"):
        out = call(m, x, pos, attention_mask=mask, mode=mode, output_state=True)
        ref = call(m, x[:, real], output_state=True)
        assert rel_err(out.hidden[:, real], ref.hidden) < FP32_TOL
        assert rel_err(out.state.k, ref.state.k) < FP32_TOL


def test_backward_and_bf16():
    m = make_mixer("swa", window=8)
    x = random_hidden(2, 20, 16)
    check_backward(m, x)
    check_backward(m, x, mode="recurrent")
    check_runs_in_dtype(m, x, torch.bfloat16)


def test_bad_settings_raise():
    with pytest.raises(ValueError, match="window"):
        make_mixer("swa", window=0)
    with pytest.raises(ValueError, match="short_conv"):
        make_mixer("swa", short_conv=True)
    with pytest.raises(ValueError, match="position_embeddings"):
        make_mixer("swa")(random_hidden(1, 3, 16))


# ---- attention sinks ------------------------------------------------------------------------------

def sink_mask(T, window, sinks):
    """Teacher-side mask built independently: the band of `window` plus the first `sinks` tokens, causal."""
    i, j = torch.arange(T).unsqueeze(1), torch.arange(T).unsqueeze(0)
    ok = (j <= i) & ((i - j < window) | (j < sinks))
    return torch.zeros(T, T).masked_fill(~ok, float("-inf")).view(1, 1, T, T)


@pytest.mark.parametrize("window,sinks", [(7, 1), (5, 3), (4, 9)])
@torch.no_grad()
def test_sinks_equal_teacher_under_band_plus_sink_mask(window, sinks):
    """Every query sees its window and the sequence's first `sinks` tokens: the teacher under that mask, in
    chunk and recurrent mode, and prefill + decode steps through the fixed-size buffers."""
    att, rope, _ = teacher("llama")
    T = 37
    x = torch.randn(2, T, 32)
    pos = torch.arange(T).expand(2, T)
    ref, _ = att(x, position_embeddings=rope(x, pos), attention_mask=sink_mask(T, window, sinks))
    cfg = SWAConfig(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, window=window, sinks=sinks)
    m = SlidingWindowAttention(cfg)
    m.init_from_attention(att)
    m.eval()
    for mode in ("chunk", "recurrent"):
        assert rel_err(m(x, position_embeddings=rope(x, pos), mode=mode).hidden, ref) < FP32_TOL
    split = 11
    o = m(x[:, :split], position_embeddings=rope(x, pos[:, :split]), output_state=True)
    hs, st = [o.hidden], o.state
    for t in range(split, T):
        o = m(x[:, t:t + 1], state=st, position_embeddings=rope(x, pos[:, t:t + 1]), output_state=True)
        assert o.state.k.shape == o.state.v.shape == (2, 2, sinks + window, 8)
        hs.append(o.hidden)
        st = o.state
    assert rel_err(torch.cat(hs, 1), ref) < FP32_TOL
    assert st.seen.tolist() == [T, T]


@pytest.mark.parametrize("T", [1, 6, 40])
@pytest.mark.parametrize("window,sinks", [(1, 1), (4, 2), (16, 4)])
def test_sinks_chunk_equals_recurrent(T, window, sinks):
    m = make_mixer("swa", window=window, sinks=sinks)
    x = random_hidden(2, T, 16)
    check_chunk_equals_recurrent(m, x)
    for n in (1, 3, 9):   # from states before, at and after the sinks filled
        st = call(m, random_hidden(2, n, 16, seed=1), output_state=True).state
        check_chunk_equals_recurrent(m, x, state=st, positions=torch.arange(n, n + T).expand(2, T))


@pytest.mark.parametrize("split", [1, 3, 25])
def test_sinks_prefill_then_steps_and_continuation(split):
    m = make_mixer("swa", window=6, sinks=3)
    x = random_hidden(2, 30, 16)
    check_prefill_then_steps(m, x, split)
    check_prefill_then_steps(m, x, split, step_mode="chunk")
    check_chunked_continuation(m, ((0, 2), (2, 11), (11, 12), (12, 30)))


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_sinks_varlen_padding_and_backward(mode):
    """Packed documents each keep their own sinks (none leak across a boundary); padding is no sink."""
    m = make_mixer("swa", window=5, sinks=2)
    check_varlen_equals_separate(m, [1, 13, 4, 9], mode=mode)
    st = call(m, random_hidden(4, 3, 16, seed=2), output_state=True).state
    check_varlen_equals_separate(m, [1, 13, 4, 9], mode=mode, initial_state=st)
    check_left_padding(m, [9, 3, 1], mode=mode)
    check_padding_keeps_state(m, random_hidden(2, 7, 16), mode=mode)
    x = random_hidden(1, 14, 16)
    mask = torch.ones(1, 14, dtype=torch.bool)
    mask[0, 1:4] = False                  # padding among the first tokens: the sinks are the first *real* ones
    real = mask[0].nonzero().flatten()
    pos = (mask.long().cumsum(1) - 1).clamp(min=0)
    out = call(m, x, pos, attention_mask=mask, mode=mode, output_state=True)
    ref = call(m, x[:, real], output_state=True)
    assert rel_err(out.hidden[:, real], ref.hidden) < FP32_TOL
    assert rel_err(out.state.k[:, :, :2], ref.state.k[:, :, :2]) < FP32_TOL   # the sink slots
    check_backward(m, random_hidden(2, 20, 16), mode=mode)


def test_sink_buffer_holds_the_first_keys():
    m = make_mixer("swa", window=3, sinks=4)
    for T in (2, 4, 11):
        x = random_hidden(1, T, 16)
        st = call(m, x, output_state=True).state
        k = apply_rope(m.k_proj(x).view(1, T, 1, 8), *rope_cos_sin(torch.arange(T).unsqueeze(0), 8))
        n = min(T, 4)
        assert st.k.shape == (1, 1, 4 + 3, 8) and int(st.seen) == T
        assert torch.allclose(st.k[0, :, :n], k[0, :n].transpose(0, 1), atol=1e-6)   # slots 0..sinks-1
    with pytest.raises(ValueError, match="sinks"):
        make_mixer("swa", sinks=-1)


@pytest.mark.parametrize("sinks", [0, 3])
@pytest.mark.parametrize("window", [1, 4, 9])
def test_long_prefill_runs_the_band_a_block_at_a_time(monkeypatch, window, sinks):
    """A prefill from no state longer than BAND_BLOCK + window runs the band one block of queries at a time
    (O(T x window), not a dense [T, T] mask): the same outputs and state as the token-by-token ground truth and as
    the dense band, with left padding of other lengths per row (each row's own window and sinks)."""
    from hybridize.mixers import swa

    m = make_mixer("swa", window=window, sinks=sinks)
    x = random_hidden(3, 41, 16)
    dense = call(m, x, output_state=True, mode="chunk")        # 41 <= BAND_BLOCK + window: the dense band
    blocks, windows = [], []
    monkeypatch.setattr(swa, "BAND_BLOCK", 5)
    monkeypatch.setattr(swa, "BAND_GROUP_ELEMENTS", 3 * 5 * (5 + window - 1 + sinks) * 4 * 3)  # 6 of 9 blocks per call (2 heads)
    original, batched = SlidingWindowAttention._band_blocks, SlidingWindowAttention._band_windows
    monkeypatch.setattr(SlidingWindowAttention, "_band_blocks",
                        lambda self, *a, **kw: blocks.append(1) or original(self, *a, **kw))
    monkeypatch.setattr(SlidingWindowAttention, "_band_windows",
                        lambda self, *a, **kw: windows.append(1) or batched(self, *a, **kw))
    check_chunk_equals_recurrent(m, x)
    got = call(m, x, output_state=True, mode="chunk")
    assert rel_err(got.hidden, dense.hidden) < FP32_TOL
    check_left_padding(m, [41, 30, 12], mode="chunk")
    assert blocks and len(windows) == len(blocks)   # the blocked path ran, batched: left padding keeps bands uniform


@pytest.mark.parametrize("sinks", [0, 2])
@torch.no_grad()
def test_band_blocks_with_padding_inside_rows_reach_as_far_back_as_the_band(monkeypatch, sinks):
    """Padding inside a row (not only in front) stretches a band over more positions than the window: the blocks'
    key slices start where the band does (searched on the device), so the blocked band equals the dense one at every
    real position, and without a mask (starts known on the host) equals the all-True mask."""
    from hybridize.mixers import swa

    m = make_mixer("swa", window=4, sinks=sinks)
    T = 37
    x = random_hidden(2, T, 16, seed=3)
    mask = torch.ones(2, T, dtype=torch.long)
    mask[0, 6:19] = 0          # a hole longer than a block and than the window
    mask[1, :5] = 0
    mask[1, 25:28] = 0
    outs, windows = {}, []
    batched = SlidingWindowAttention._band_windows
    monkeypatch.setattr(SlidingWindowAttention, "_band_windows",
                        lambda self, *a, **kw: windows.append(1) or batched(self, *a, **kw))
    for block in (10**6, 4):   # the dense band, then blocks of 4 queries
        monkeypatch.setattr(swa, "BAND_BLOCK", block)
        outs[block] = (call(m, x, attention_mask=mask, mode="chunk").hidden, call(m, x, mode="chunk").hidden,
                       call(m, x, attention_mask=torch.ones_like(mask), mode="chunk").hidden)
    assert len(windows) == 2   # batched without a mask and with the all-True one; the holes took one call per block
    real = mask.bool()
    assert rel_err(outs[4][0][real], outs[10**6][0][real]) < FP32_TOL
    assert rel_err(outs[4][1], outs[10**6][1]) < FP32_TOL and rel_err(outs[4][1], outs[4][2]) < FP32_TOL


def test_band_blocks_backward_equals_the_dense_band(monkeypatch):
    """Training rows longer than BAND_BLOCK + window (no packing) take the blocked band: same gradients."""
    from hybridize.mixers import swa

    m = make_mixer("swa", window=4, sinks=2)
    x = random_hidden(2, 23, 16, requires_grad=True)
    grads = []
    for block in (10**6, 3):   # the dense band, then blocks of 3 queries
        monkeypatch.setattr(swa, "BAND_BLOCK", block)
        x.grad = None
        m.zero_grad()
        call(m, x, mode="chunk").hidden.square().sum().backward()
        grads.append((x.grad.clone(), m.q_proj.weight.grad.clone()))
    assert rel_err(grads[1][0], grads[0][0]) < FP32_TOL and rel_err(grads[1][1], grads[0][1]) < FP32_TOL


@pytest.mark.parametrize("sinks", [0, 2])
@pytest.mark.parametrize("window", [1, 3, 6])
@torch.no_grad()
def test_one_token_step_equals_the_recurrent_reference(monkeypatch, window, sinks):
    """Decode (T = 1) runs `_step` in the state's layout; token by token over left-padded rows of other lengths
    (padding steps included), its outputs and states equal `_recurrent`'s, the ground truth."""
    m = make_mixer("swa", window=window, sinks=sinks)
    T = 14
    x = random_hidden(3, T, 16, seed=2)
    mask = left_pad_mask([14, 9, 3], T)
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)

    def run():
        st, outs, states = None, [], []
        for t in range(T):
            o = call(m, x[:, t:t + 1], pos[:, t:t + 1], attention_mask=mask[:, t:t + 1], state=st,
                     output_state=True, mode="recurrent")
            outs.append(o.hidden)
            states.append(o.state)
            st = o.state
        return torch.cat(outs, 1), states

    steps = []
    original = SlidingWindowAttention._step
    monkeypatch.setattr(SlidingWindowAttention, "_step", lambda self, *a: steps.append(1) or original(self, *a))
    got, got_states = run()
    assert len(steps) == T
    monkeypatch.setattr(SlidingWindowAttention, "_step", SlidingWindowAttention._recurrent)
    ref, ref_states = run()
    real = mask.unsqueeze(-1)
    assert rel_err(got * real, ref * real) < FP32_TOL
    for a, b in zip(got_states, ref_states):
        assert state_rel_err(a, b) < FP32_TOL and torch.equal(a.seen, b.seen)


@pytest.mark.parametrize("sinks", [0, 2])
@torch.no_grad()
def test_writable_state_is_updated_in_place(sinks):
    """A state its owner marks writable (the fast engine) is written in place by a decode step: the same tensors
    come back, with the values a step on a copy gives; an unmarked state is left as it was."""
    m = make_mixer("swa", window=4, sinks=sinks)
    x = random_hidden(2, 12, 16, seed=3)
    pos = torch.arange(12).expand(2, 12)
    st = call(m, x[:, :5], pos[:, :5], output_state=True).state
    held = st.map(lambda t: t.clone())
    held.writable = True
    for t in range(5, 12):
        before = st.map(lambda t: t.clone())
        ref = call(m, x[:, t:t + 1], pos[:, t:t + 1], state=st, output_state=True)
        assert all(torch.equal(a, b) for a, b in zip(st.tensors(), before.tensors()))   # not written
        got = call(m, x[:, t:t + 1], pos[:, t:t + 1], state=held, output_state=True)
        assert got.state is held and all(a.data_ptr() == b.data_ptr() for a, b in zip(got.state.tensors(),
                                                                                   held.tensors()))
        assert torch.equal(got.hidden, ref.hidden) and state_rel_err(got.state, ref.state) == 0
        st = ref.state
