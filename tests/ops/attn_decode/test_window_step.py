"""The window layer's one-kernel decode token (`ops/attn_decode/triton_window_step.py`) against `_step`'s PyTorch form.

A window mixer prefills a few tokens, then decodes token by token with a writable state (the fast engine's case)
twice: through the kernel and through the PyTorch step. Outputs agree (fp32: rel. error < 1e-5) and the states are
bit-identical after every step (the kernel writes the same values into the same slots and clears the same slot),
across the sinks filling, the ring wrapping, windows of 1 and GQA groups that are not a power of two. Needs triton
and CUDA, or TRITON_INTERPRET=1 on the CPU:

    TRITON_INTERPRET=1 PYTHONPATH=/work/triton-site python -m pytest tests/ops/attn_decode/test_window_step.py
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from hybridize.ops.common.options import use_kernel_options
from tests.mixers.helpers import call, make_mixer, random_hidden, rel_err

cuda = torch.cuda.is_available()
triton_ok = importlib.util.find_spec("triton") is not None
runs = triton_ok and (cuda or os.environ.get("TRITON_INTERPRET") == "1")
DEVICE = "cuda" if cuda else "cpu"


def _decode(m, x, kernel: bool, prefill: int):
    """Prefill `prefill` tokens (none: start from the empty state), then decode the rest one token at a time."""
    B, T, _ = x.shape
    pos = torch.arange(T, device=x.device).expand(B, T)
    with torch.no_grad():
        st = (m.empty_state(B, x.device, x.dtype) if prefill == 0 else
              call(m, x[:, :prefill], pos[:, :prefill], output_state=True).state)
        st = st.map(lambda t: t.clone())
        st.writable = True
        outs, states = [], []
        with use_kernel_options(force_triton=kernel and not cuda, window_step=kernel):
            for t in range(prefill, T):
                q = x.new_zeros(B, 1, m.config.num_heads, m.config.head_dim)
                assert m._kernel_step_ok(q, st) == kernel
                o = call(m, x[:, t:t + 1], pos[:, t:t + 1], state=st, output_state=True)
                assert o.state is st                                  # written in place
                outs.append(o.hidden)
                states.append(st.map(lambda t: t.clone()))
    return torch.cat(outs, 1), states


@pytest.mark.skipif(not runs, reason="needs triton and CUDA (or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("window,sinks,heads,prefill,T", [(5, 2, (3, 1), 0, 15), (5, 2, (6, 2), 4, 15),
                                                          (1, 0, (2, 1), 3, 15), (4, 0, (4, 4), 0, 15),
                                                          (3, 4, (2, 1), 2, 15), (37, 3, (4, 2), 30, 50)])
def test_window_step_kernel_equals_the_pytorch_step(window, sinks, heads, prefill, T, monkeypatch):
    """The last case splits its 40 slots over programs of 16-slot blocks (the merge of the splits)."""
    if triton_ok:
        from hybridize.ops.attn_decode import triton_window_step
        monkeypatch.setattr(triton_window_step, "BLOCK_N", 16)
    H, Hkv = heads
    m = make_mixer("swa", window=window, sinks=sinks, num_heads=H, num_kv_heads=Hkv, hidden_size=8 * H).to(DEVICE)
    x = random_hidden(3, T, 8 * H, seed=4).to(DEVICE)
    got, got_states = _decode(m, x, True, prefill)
    ref, ref_states = _decode(m, x, False, prefill)
    assert rel_err(got, ref) < 1e-5
    for a, b in zip(got_states, ref_states):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v) and torch.equal(a.seen, b.seen)


@pytest.mark.skipif(not (cuda and triton_ok), reason="needs triton and CUDA (the interpreter has no bf16 products)")
def test_window_step_kernel_in_bf16():
    """bf16 (the engine's dtype): the outputs within bf16 rounding of the PyTorch step's, the states bit-identical
    (both write the same rounded keys and values into the same slots)."""
    m = make_mixer("swa", window=6, sinks=2, num_heads=4, num_kv_heads=2, hidden_size=32).to(DEVICE, torch.bfloat16)
    x = random_hidden(2, 20, 32, seed=5).to(DEVICE, torch.bfloat16)
    got, got_states = _decode(m, x, True, 9)
    ref, ref_states = _decode(m, x, False, 9)
    assert rel_err(got.float(), ref.float()) < 2e-2
    for a, b in zip(got_states, ref_states):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v) and torch.equal(a.seen, b.seen)


@pytest.mark.skipif(not (cuda and triton_ok), reason="needs triton and CUDA (at these sizes the interpreter is slow)")
@pytest.mark.parametrize("heads,dim", [((9, 3), 64), ((16, 8), 128)])
def test_window_step_kernel_at_the_real_shapes(heads, dim):
    """The 135M and 1.7B shapes' heads and head dims, the recovered plan's window (512 + 4 sinks, 516 slots: several
    splits of 64-slot blocks) after a 600-token prefill, in fp32."""
    H, Hkv = heads
    m = make_mixer("swa", window=512, sinks=4, num_heads=H, num_kv_heads=Hkv, head_dim=dim,
                   hidden_size=64 * H).to(DEVICE)
    x = random_hidden(2, 606, 64 * H, seed=6).to(DEVICE)
    got, got_states = _decode(m, x, True, 600)
    ref, ref_states = _decode(m, x, False, 600)
    assert rel_err(got, ref) < 1e-5
    for a, b in zip(got_states, ref_states):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v) and torch.equal(a.seen, b.seen)


def test_window_step_kernel_taken_only_where_it_applies():
    m = make_mixer("swa", window=4, sinks=1)
    q = torch.zeros(2, 1, 2, 8)
    st = m.empty_state(2)
    assert not m._kernel_step_ok(q, st)                                      # nobody owns the state
    st.writable = True
    with use_kernel_options(force_triton=True):
        assert m._kernel_step_ok(q, st) == triton_ok
        assert not m._kernel_step_ok(q.double(), st)
        assert not make_mixer("swa", window=5, sinks=1)._kernel_step_ok(q, st)   # a state of another window
        with use_kernel_options(window_step=False):
            assert not m._kernel_step_ok(q, st)
    assert not m._kernel_step_ok(q, st)                                      # CPU tensors, no interpreter forced
