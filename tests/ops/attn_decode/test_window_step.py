"""The window layer's decode step on the GPU path (`ops/attn_decode/triton_window_step.py`, its contract and PyTorch
reference in `ops/attn_decode/window_step.py`) against the layer's PyTorch step (`SlidingWindowAttention._step`).

A window mixer prefills a few tokens, then decodes token by token with a writable state (the fast engine's case)
through the kernel (CUDA, or the Triton interpreter), through the kernel's reference in the kernel's place (any
machine: `generation.profile.emulated_decode_kernel`) and through the PyTorch step. Outputs agree (fp32: rel. error
< 1e-5) and the states are bit-identical after every step (the same values written into the same slots, the same slot
cleared), across the sinks filling, the ring wrapping, windows of 1 and GQA groups that are not a power of two. The
kernel is also compared with its reference op by op on random states with NaN in the slots no token reads. The
kernel's cases:

    TRITON_INTERPRET=1 PYTHONPATH=/work/triton-site python -m pytest tests/ops/attn_decode/test_window_step.py
"""
from __future__ import annotations

import importlib.util
import os
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from hybridize.generation.profile import emulated_decode_kernel
from hybridize.ops.attn_decode.window_step import readable_slots, window_step_reference
from hybridize.ops.common.options import use_kernel_options
from tests.mixers.helpers import call, make_mixer, random_hidden, rel_err

cuda = torch.cuda.is_available()
triton_ok = importlib.util.find_spec("triton") is not None
runs = triton_ok and (cuda or os.environ.get("TRITON_INTERPRET") == "1")
DEVICE = "cuda" if cuda else "cpu"
CASES = [(5, 2, (3, 1), 0, 15), (5, 2, (6, 2), 4, 15), (1, 0, (2, 1), 3, 15), (4, 0, (4, 4), 0, 15),
         (3, 4, (2, 1), 2, 15), (37, 3, (4, 2), 30, 50)]


def _decode(m, x, path: str, prefill: int):
    """Prefill `prefill` tokens (none: start from the empty state), then decode the rest one token at a time through
    `path`: "kernel" (the Triton step), "reference" (its PyTorch reference in its place) or "torch" (`_step`)."""
    B, T, _ = x.shape
    pos = torch.arange(T, device=x.device).expand(B, T)
    gpu_path = path != "torch"
    with torch.no_grad():
        st = (m.empty_state(B, x.device, x.dtype) if prefill == 0 else
              call(m, x[:, :prefill], pos[:, :prefill], output_state=True).state)
        st = st.map(lambda t: t.clone())
        st.writable = True
        outs, states = [], []
        with use_kernel_options(force_triton=path == "kernel" and not x.is_cuda, window_step=gpu_path), \
                (emulated_decode_kernel() if path == "reference" else nullcontext()):
            for t in range(prefill, T):
                q = x.new_zeros(B, 1, m.config.num_heads, m.config.head_dim)
                assert m._kernel_step_ok(q, st) == gpu_path
                o = call(m, x[:, t:t + 1], pos[:, t:t + 1], state=st, output_state=True)
                assert o.state is st                                  # written in place
                outs.append(o.hidden)
                states.append(st.map(lambda t: t.clone()))
    return torch.cat(outs, 1), states


def _compare(m, x, path: str, prefill: int, tol: float = 1e-5):
    """`path` against the PyTorch step: outputs within `tol` (rel. error), the states bit-identical after every step."""
    got, got_states = _decode(m, x, path, prefill)
    ref, ref_states = _decode(m, x, "torch", prefill)
    assert rel_err(got.float(), ref.float()) < tol
    for a, b in zip(got_states, ref_states):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v) and torch.equal(a.seen, b.seen)


def _check(window, sinks, heads, prefill, T, path, device):
    H, Hkv = heads
    m = make_mixer("swa", window=window, sinks=sinks, num_heads=H, num_kv_heads=Hkv, hidden_size=8 * H).to(device)
    _compare(m, random_hidden(3, T, 8 * H, seed=4).to(device), path, prefill)


@pytest.mark.parametrize("window,sinks,heads,prefill,T", CASES)
def test_window_step_reference_equals_the_pytorch_step(window, sinks, heads, prefill, T):
    """The kernel's contract, run anywhere: the mixer's GPU path with the reference in the kernel's place."""
    _check(window, sinks, heads, prefill, T, "reference", "cpu")


@pytest.mark.skipif(not runs, reason="needs triton and CUDA (or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("window,sinks,heads,prefill,T", CASES)
def test_window_step_kernel_equals_the_pytorch_step(window, sinks, heads, prefill, T, monkeypatch):
    """The last case splits its 40 slots over programs of 16-slot blocks (the merge of the splits)."""
    from hybridize.ops.attn_decode import triton_window_step
    monkeypatch.setattr(triton_window_step, "BLOCK_N", 16)
    _check(window, sinks, heads, prefill, T, "kernel", DEVICE)


@pytest.mark.skipif(not runs, reason="needs triton and CUDA (or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("window,sinks,G,D", [(40, 4, 3, 16), (7, 9, 2, 32), (64, 0, 1, 8)])
def test_window_step_kernel_equals_its_reference(window, sinks, G, D, monkeypatch):
    """Op level: random states and ranks (rows before, inside and after the sinks fill and the ring wraps), NaN in
    every slot the token does not read; outputs and both state tensors against `window_step_reference`."""
    from hybridize.ops.attn_decode import triton_window_step
    monkeypatch.setattr(triton_window_step, "BLOCK_N", 16)
    gen = torch.Generator().manual_seed(window + sinks)
    B, Hkv = 5, 2
    L = sinks + window
    seen = torch.tensor([0, 1, sinks + window - 1, sinks + window + 3, 3 * window + 7]).clamp(min=0)
    ks = torch.randn(B, Hkv, L, D, generator=gen)
    vs = torch.randn(B, Hkv, L, D, generator=gen)
    unread = ~readable_slots(seen, window, sinks)[:, None, :, None]
    ks, vs = ks.masked_fill(unread, float("nan")), vs.masked_fill(unread, float("nan"))
    q = torch.randn(B, 1, Hkv * G, D, generator=gen)
    k, v = torch.randn(B, 1, Hkv, D, generator=gen), torch.randn(B, 1, Hkv, D, generator=gen)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    ks_ref, vs_ref = ks.clone(), vs.clone()
    o_ref = window_step_reference(q, k, v, ks_ref, vs_ref, seen, window, sinks, D ** -0.5)
    ks_k, vs_k = to(ks), to(vs)
    with use_kernel_options(force_triton=not cuda):
        o = triton_window_step.window_step(to(q), to(k), to(v), ks_k, vs_k, to(seen), window, sinks, D ** -0.5)
    assert rel_err(o.cpu(), o_ref) < 1e-5
    # written slots equal; unread NaN slots stay NaN on both sides
    assert torch.equal(ks_k.cpu().nan_to_num(7.0), ks_ref.nan_to_num(7.0))
    assert torch.equal(vs_k.cpu().nan_to_num(7.0), vs_ref.nan_to_num(7.0))


@pytest.mark.skipif(not (cuda and triton_ok), reason="needs triton and CUDA (the interpreter has no bf16 products)")
def test_window_step_kernel_in_bf16():
    """bf16 (the engine's dtype): the outputs within bf16 rounding of the PyTorch step's, the states bit-identical
    (both write the same rounded keys and values into the same slots)."""
    m = make_mixer("swa", window=6, sinks=2, num_heads=4, num_kv_heads=2, hidden_size=32).to(DEVICE, torch.bfloat16)
    _compare(m, random_hidden(2, 20, 32, seed=5).to(DEVICE, torch.bfloat16), "kernel", 9, tol=2e-2)


@pytest.mark.skipif(not (cuda and triton_ok), reason="needs triton and CUDA (at these sizes the interpreter is slow)")
@pytest.mark.parametrize("heads,dim", [((9, 3), 64), ((16, 8), 128)])
def test_window_step_kernel_at_the_real_shapes(heads, dim):
    """The 135M and 1.7B shapes' heads and head dims, the recovered plan's window (512 + 4 sinks, 516 slots: several
    splits of 64-slot blocks) after a 600-token prefill, in fp32."""
    H, Hkv = heads
    m = make_mixer("swa", window=512, sinks=4, num_heads=H, num_kv_heads=Hkv, head_dim=dim,
                   hidden_size=64 * H).to(DEVICE)
    _compare(m, random_hidden(2, 606, 64 * H, seed=6).to(DEVICE), "kernel", 600)


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


#: ops per window layer per decode step, CPU profiler with the window step emulated as one op (measured: 18 at this
#: tiny Qwen3 shape; 32 on the PyTorch step)
MAX_WINDOW_OPS = 19


@pytest.mark.parametrize("window_step,budget", [(True, MAX_WINDOW_OPS), (False, 32)])
def test_window_layer_decode_op_budget(window_step, budget):
    """A decode step of a small hybrid with window layers (the fast engine's path, `generation.profile` counting): the
    window layer's token is its projections, norms, RoPE and one step op on the GPU path, no host sync."""
    from hybridize.generation.profile import profile_model
    from tests.rl.test_decode_ops import _tiny_qwen3_hybrid

    torch.set_num_threads(1)
    model = _tiny_qwen3_hybrid(4, "attn=0", "swa", {"swa.window": 8, "swa.sinks": 2})
    args = SimpleNamespace(batch=2, prompt_len=20, steps=3, attention="auto", top=5, graphs=False,
                           decode_kernel="emulate", compile="off", gemm="auto")
    with use_kernel_options(window_step=window_step):
        res = profile_model(model, args, torch.device("cpu"))
    rows = {r["layer_type"]: r for r in res["eager"]["by_layer_type"]}
    ops = {r["op"] for r in res["eager"]["top_by_count"]} | {r["op"] for r in res["eager"]["top_by_time"]}
    assert rows["swa"]["layers"] == 3
    assert rows["swa"]["kernels_per_layer"] <= budget, rows
    assert ("kernel:window_step" in ops) == window_step, ops
    assert not res["eager"]["host_syncs_per_step"]
