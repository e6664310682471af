"""CCQ query cleaning: the fused Triton passes (`ops.ccq.triton_clean`) against the PyTorch form.

Gates:
- always (CPU): the PyTorch form's argument checks, and that it is what the mixer computed before
  (q - sigmoid(w . qbar + b) * read(q, kbar));
- interpreter: `TRITON_INTERPRET=1` and triton importable: forward and the gradients of q, k, weight, bias
  (and of the read's output through its own graph) against the PyTorch form in fp64, learned and fixed
  lambda, odd sizes, an all-zero key and query row (F.normalize's clamp);
- CUDA: the compiled kernels, fp32 and bf16, ~4k tokens, and a CCQ-GLA layer with and without them.

    TRITON_INTERPRET=1 PYTHONPATH=/work/triton-site python -m pytest tests/ops/ccq/test_ccq_clean.py
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridize.ops.ccq import reference as ccq
from hybridize.ops.ccq import clean as ccq_clean

from tests.ops.triton_gates import cuda_only, interp_only, rel


def torch_read(q, k_unit):
    return ccq.chunk_ccq(q, k_unit, output_final_state=True)


def make(B, T, H, K, dtype, device="cpu", seed=0, zero_row=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=g, dtype=torch.float64)
    k = torch.randn(B, T, H, K, generator=g, dtype=torch.float64) + 0.4
    if zero_row:   # a padded-like token: F.normalize clamps its norm, the gradient must follow
        q[0, 1, 0] = 0.0
        k[0, 2, 1] = 0.0
    w = torch.randn(H, K, generator=g, dtype=torch.float64) * 0.5
    b = torch.randn(H, generator=g, dtype=torch.float64)
    cast = lambda t: t.to(device, dtype).requires_grad_()  # noqa: E731
    return cast(q), cast(k), cast(w), cast(b)


def grads(fn, q, k, w, b, fixed, seed=5):
    """Output and gradients (q, k, w, b) of a random linear loss over q_clean and the final statistics."""
    out, (C, mu, _) = fn(q, k, None if fixed is not None else w, None if fixed is not None else b, fixed, torch_read)
    g = torch.Generator().manual_seed(seed)
    cot = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.device, out.dtype)
    cC = torch.randn(C.shape, generator=g, dtype=torch.float64).to(C.device, C.dtype)
    loss = (out * cot).sum() + (C * cC).sum() + mu.sum()
    leaves = [q, k] + ([w, b] if fixed is None else [])
    gs = torch.autograd.grad(loss, leaves)
    return [out, *gs]


def test_reference_is_the_mixer_formula():
    q, k, w, b = make(2, 9, 3, 8, torch.float64)
    out, _ = ccq_clean.chunk_ccq_clean(q, k, w, b, None, torch_read)
    sig, _ = ccq.naive_recurrent_ccq(q, F.normalize(k, dim=-1))
    lam = torch.sigmoid(torch.einsum("bthk,hk->bth", F.normalize(q, dim=-1), w) + b)
    torch.testing.assert_close(out, q - lam.unsqueeze(-1) * sig, rtol=1e-10, atol=1e-10)
    fixed, _ = ccq_clean.chunk_ccq_clean(q, k, None, None, 0.25, torch_read)
    torch.testing.assert_close(fixed, q - 0.25 * sig, rtol=1e-10, atol=1e-10)


def test_reference_rejects_bad_gate():
    q, k, w, b = make(1, 4, 2, 8, torch.float64)
    with pytest.raises(ValueError, match="weight and bias"):
        ccq_clean.chunk_ccq_clean(q, k, None, None, None, torch_read)
    with pytest.raises(ValueError, match=r"weight must be \[2, 8\]"):
        ccq_clean.chunk_ccq_clean(q, k, w[:, :4], b, None, torch_read)


@interp_only
@pytest.mark.parametrize("zero_row", [False, True])
@pytest.mark.parametrize("fixed", [None, 0.3])
@pytest.mark.parametrize("shape", [(2, 7, 3, 16), (1, 5, 2, 24)])
def test_fused_matches_reference(shape, fixed, zero_row):
    """Element-wise: an all-zero row's key gradient is dk / 1e-12 (F.normalize's clamp), which would swamp
    a norm-wise comparison of the other rows."""
    from hybridize.ops.ccq.triton_clean import ccq_clean_fused

    B, T, H, K = shape
    test = grads(ccq_clean_fused, *make(B, T, H, K, torch.float32, zero_row=zero_row), fixed)
    ref = grads(ccq_clean.chunk_ccq_clean, *make(B, T, H, K, torch.float64, zero_row=zero_row), fixed)
    for name, a, r in zip(["q_clean", "dq", "dk", "dw", "db"], test, ref):
        torch.testing.assert_close(a.double(), r, rtol=1e-4, atol=1e-5, msg=name)


@cuda_only
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-4), (torch.bfloat16, 2e-2)])
def test_fused_cuda(dtype, tol):
    from hybridize.ops.ccq.triton_clean import ccq_clean_fused

    shape = (1, 4099, 4, 128)
    test = grads(ccq_clean_fused, *make(*shape, dtype, device="cuda", zero_row=False), None)
    ref = grads(ccq_clean.chunk_ccq_clean, *make(*shape, torch.float64, device="cuda", zero_row=False), None)
    for name, a, r in zip(["q_clean", "dq", "dk", "dw", "db"], test, ref):
        assert rel(a, r) < tol, (name, rel(a, r))
    torch.cuda.synchronize()


@cuda_only
def test_layer_uses_fused_path_and_agrees():
    """A CCQ-GLA layer on CUDA (fused cleaning + Triton read) against the same layer with every op forced
    to PyTorch, fp32: output and input gradient."""
    from hybridize.ops.common.options import use_kernel_options
    from hybridize.mixers import build_mixer

    torch.manual_seed(0)
    m = build_mixer("ccq_gla", {"ccq_gate_init": 0.3}, hidden_size=256, num_heads=2, num_kv_heads=2,
                    head_dim=128).cuda()
    with torch.no_grad():
        m.ccq_weight.normal_(0, 0.5)
    x = torch.randn(1, 777, 256, device="cuda", requires_grad=True)
    outs = []
    for backend in ("auto", "torch"):
        with use_kernel_options(kernels=backend):
            y = m(x, mode="chunk").hidden
            (gx,) = torch.autograd.grad(y.square().sum(), x)
        outs.append((y, gx))
    assert rel(outs[0][0], outs[1][0]) < 2e-3
    assert rel(outs[0][1], outs[1][1]) < 2e-3
    torch.cuda.synchronize()


@cuda_only
@pytest.mark.parametrize("name", ["ccq_gla", "ccq_gdn"])
def test_layer_inference_cleans_in_the_read(name, monkeypatch):
    """Without gradient the CUDA layer cleans q in the read's epilogue (the separate gate pass is not run)
    and agrees with the all-PyTorch layer, fp32, learned gate and padding."""
    from hybridize.ops.common.options import use_kernel_options
    from hybridize.ops.ccq import triton_clean as fused
    from hybridize.mixers import build_mixer

    torch.manual_seed(1)
    m = build_mixer(name, {"ccq_gate_init": 0.3}, hidden_size=256, num_heads=2, num_kv_heads=2,
                    head_dim=128).cuda()
    with torch.no_grad():
        m.ccq_weight.normal_(0, 0.5)
    x = torch.randn(2, 1500, 256, device="cuda")
    mask = torch.ones(2, 1500, dtype=torch.bool, device="cuda")
    mask[1, :300] = False   # left padding
    gate_pass = fused._CleanQuery.apply
    calls = []
    monkeypatch.setattr(fused._CleanQuery, "apply", lambda *a: calls.append(1) or gate_pass(*a))
    outs = []
    for backend in ("auto", "torch"):
        with use_kernel_options(kernels=backend), torch.no_grad():
            outs.append(m(x, attention_mask=mask, mode="chunk").hidden)
    assert not calls, "the separate gate pass ran under no_grad"
    assert rel(outs[0], outs[1]) < 2e-3, rel(outs[0], outs[1])
    torch.cuda.synchronize()


@cuda_only
def test_layer_prefill_then_decode_on_gpu():
    """CCQ-GLA on CUDA, fp32: full chunked forward == chunked prefill + token-by-token recurrent decode, both
    through the fused cleaning (and the Triton read for the prefill)."""
    from hybridize.mixers import build_mixer

    torch.manual_seed(1)
    m = build_mixer("ccq_gla", {"ccq_gate_init": 0.3}, hidden_size=256, num_heads=2, num_kv_heads=2,
                    head_dim=128).cuda()
    with torch.no_grad():
        m.ccq_weight.normal_(0, 0.5)
        x = torch.randn(2, 203, 256, device="cuda")
        full = m(x, mode="chunk").hidden
        out = m(x[:, :197], output_state=True, mode="chunk")
        steps, st = [out.hidden], out.state
        for t in range(197, 203):
            o = m(x[:, t:t + 1], state=st, output_state=True, mode="recurrent")
            steps.append(o.hidden)
            st = o.state
    assert rel(torch.cat(steps, 1), full) < 2e-3
    torch.cuda.synchronize()
