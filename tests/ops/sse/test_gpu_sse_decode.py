"""Partition-sparse SSE decode kernel vs its PyTorch reference (CUDA, or Triton's CPU interpreter).

Skips cleanly when triton is not importable; without CUDA it needs TRITON_INTERPRET=1."""
import importlib.util
import os

import pytest
import torch

triton_ok = importlib.util.find_spec("triton") is not None
cuda = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not triton_ok or not (cuda or os.environ.get("TRITON_INTERPRET") == "1"),
                                reason="needs triton and CUDA (or TRITON_INTERPRET=1)")


@pytest.mark.parametrize("backbone", ["gla_vec", "gla_scalar", "delta", "qdelta"])
def test_sse_decode_matches_reference(backbone):
    from hybridize.ops.sse.triton_decode import sse_decode_step, sse_decode_step_reference
    dev = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    B, P, S, H, K, V = 2, 5, 2, 3, 16, 24
    state = torch.randn(B, P, H, K, V, device=dev)
    index = torch.tensor([[3, 0], [1, -1]], device=dev)
    q, k, p = (torch.randn(B, S, H, K, device=dev) for _ in range(3))
    v = torch.randn(B, S, H, V, device=dev)
    g = -torch.rand(B, S, H, K, device=dev) if backbone == "gla_vec" else -torch.rand(B, S, H, device=dev)
    beta = torch.rand(B, S, H, device=dev) if backbone in ("delta", "qdelta") else None
    pp = p if backbone == "qdelta" else None
    ref_state = state.clone()
    o_ref = sse_decode_step_reference(ref_state, index, q, k, v, g=g, beta=beta, p=pp)
    out_state = state.clone()
    o = sse_decode_step(out_state, index, q, k, v, g=g, beta=beta, p=pp)
    assert ((o - o_ref).abs().max() / o_ref.abs().max()) < 1e-5
    assert ((out_state - ref_state).abs().max() / ref_state.abs().max()) < 1e-5
    untouched = torch.ones(B, P, dtype=torch.bool)
    untouched[0, 3] = untouched[0, 0] = untouched[1, 1] = False
    assert torch.equal(out_state[untouched], state[untouched])   # unselected partitions bit-identical
    assert torch.equal(o[1, 1], torch.zeros_like(o[1, 1]))        # skipped slot
