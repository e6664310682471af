"""SSE's no-gradient q/k front end in one kernel (`ops/sse/triton_qk_front.py`) against its PyTorch reference
(`ops/sse/qk_front.qk_front_torch`): fp32 random inputs, rel. error < 1e-5; every norm / rotary / map setting,
column views of a wider projection output (the fused matmul's), a batch with cos/sin broadcast from one row,
one-token rows, row counts that leave the last block part-empty. bf16: within the PyTorch chain's own rounding.
Needs triton and CUDA, or TRITON_INTERPRET=1 on the CPU:

    TRITON_INTERPRET=1 PYTHONPATH=/work/triton-site python -m pytest tests/ops/sse/test_qk_front.py
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from hybridize.ops.sse.qk_front import qk_front, qk_front_torch

cuda = torch.cuda.is_available()
runs = importlib.util.find_spec("triton") is not None and (cuda or os.environ.get("TRITON_INTERPRET") == "1")
needs_kernel = pytest.mark.skipif(not runs, reason="needs triton and CUDA (or TRITON_INTERPRET=1)")
DEVICE = "cuda" if cuda else "cpu"


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def _inputs(B, T, H, Hk, D, dtype=torch.float32, cos_rows=None, seed=0):
    """qk and delta as column views of one wider [B, T, width] tensor, as the fused projections give them."""
    g = torch.Generator().manual_seed(seed)
    n = (H + Hk) * D
    y = torch.randn(B, T, 3 * n + 5, generator=g)
    w = 1 + 0.3 * torch.randn(H + Hk, D, generator=g)
    pos = torch.arange(T).float() + 3
    ang = pos[:, None] / (10000 ** (torch.arange(0, D, 2).float() / D))
    emb = torch.cat([ang, ang], -1)[None].expand(cos_rows or B, T, D)
    cos, sin = emb.cos(), emb.sin()
    to = lambda t: t.to(DEVICE, dtype)   # noqa: E731
    y = to(y)
    return y, y[..., 3:3 + n], y[..., 3 + n + 2:3 + 2 * n + 2], to(w), to(cos), to(sin)


CASES = [   # norm, rope, maps
    (True, True, ("silu", "softmax")),
    (False, False, ("identity", "identity")),
    (True, False, ("softmax", "silu")),
    (False, True, ("silu", "identity")),
]


@needs_kernel
@pytest.mark.parametrize("norm,rope,maps", CASES)
@pytest.mark.parametrize("B,T,cos_rows", [(2, 37, None), (3, 5, 1), (4, 1, None), (1, 19, None)])
def test_kernel_equals_reference(norm, rope, maps, B, T, cos_rows):
    from hybridize.ops.sse.triton_qk_front import qk_front_triton
    H, Hk, D = 4, 2, 16
    y, qk, delta, w, cos, sin = _inputs(B, T, H, Hk, D, cos_rows=cos_rows)
    args = (qk, delta, H, D, maps, (w, 1e-6) if norm else None, (cos, sin) if rope else None)
    q_k, k_k = qk_front_triton(*args, block_rows=8)
    q_r, k_r = qk_front_torch(*args)
    assert q_k.shape == (2, B, T, H, D) and k_k.shape == (2, B, T, Hk, D)
    assert q_k.is_contiguous() and k_k.is_contiguous()
    assert rel(q_k, q_r) < 1e-5 and rel(k_k, k_r) < 1e-5
    # the shared path (0) takes no delta: it differs from the sparse path wherever the delta is not zero
    assert rel(q_k[0], q_k[1]) > 1e-3


@needs_kernel
def test_kernel_bf16_within_the_chains_rounding():
    """bf16 inputs: the kernel (fp32 inside, one rounding) is at least as close to the fp32 reference as the
    PyTorch chain (a rounding per op)."""
    from hybridize.ops.sse.triton_qk_front import qk_front_triton
    H, Hk, D = 4, 2, 32
    y, qk, delta, w, cos, sin = _inputs(2, 23, H, Hk, D, dtype=torch.bfloat16)
    args = dict(norm=(w, 1e-6), rope=(cos, sin))
    q_k, k_k = qk_front_triton(qk, delta, H, D, ("silu", "softmax"), **args)
    q_c, k_c = qk_front_torch(qk, delta, H, D, ("silu", "softmax"), **args)
    f = lambda t: t.float()   # noqa: E731
    q_r, k_r = qk_front_torch(f(qk), f(delta), H, D, ("silu", "softmax"), norm=(f(w), 1e-6), rope=(f(cos), f(sin)))
    assert rel(q_k, q_r) <= rel(q_c, q_r) + 1e-3 and rel(q_k, q_r) < 1e-2
    assert rel(k_k, k_r) <= rel(k_c, k_r) + 1e-3 and rel(k_k, k_r) < 1e-2


def test_dispatch_falls_back_where_the_kernel_does_not_fit():
    """kernel=False, partial rotary, or a head dim that is not a power of two: the PyTorch chain (on any machine)."""
    H, Hk, D = 2, 1, 12
    y, qk, delta, w, cos, sin = _inputs(2, 4, H, Hk, D)
    q, k = qk_front(qk.cpu(), delta.cpu(), H, D, ("silu", "softmax"), norm=(w.cpu(), 1e-6),
                    rope=(cos.cpu(), sin.cpu()), kernel=True)
    q_r, k_r = qk_front_torch(qk.cpu(), delta.cpu(), H, D, ("silu", "softmax"), norm=(w.cpu(), 1e-6),
                              rope=(cos.cpu(), sin.cpu()))
    assert torch.equal(q, q_r) and torch.equal(k, k_r)


@needs_kernel
def test_dispatch_takes_the_kernel_where_it_fits(monkeypatch):
    from hybridize.ops.sse import triton_qk_front
    H, Hk, D = 2, 2, 8
    y, qk, delta, w, cos, sin = _inputs(2, 3, H, Hk, D)
    calls = []
    real = triton_qk_front.qk_front_triton
    monkeypatch.setattr(triton_qk_front, "qk_front_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    qk_front(qk, delta, H, D, ("silu", "softmax"), rope=(cos, sin), kernel=True)
    assert calls == [1]
    qk_front(qk, delta, H, D, ("silu", "softmax"), rope=(cos[..., :4], sin[..., :4]), kernel=True)  # partial rotary
    assert calls == [1]
