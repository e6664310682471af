"""`benchmarks/ops/decode_gemm_variants.py`: its TMA variant computes x @ W^T (under TRITON_INTERPRET=1 in fp32, or
on a CUDA GPU in bf16), and `best` picks the fastest timed entry of each family, skipping failures."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

TRITON = importlib.util.find_spec("triton") is not None
CUDA = TRITON and torch.cuda.is_available()
INTERPRET = TRITON and os.environ.get("TRITON_INTERPRET") == "1" and not CUDA


@pytest.mark.skipif(not (INTERPRET or CUDA), reason="needs CUDA or TRITON_INTERPRET=1 with triton")
@pytest.mark.parametrize("N,K,bn,bk", [(96, 256, 32, 64), (70, 384, 64, 128)])   # a partial last column block
def test_tma_variant_matches_the_product(N, K, bn, bk):
    from triton.tools.tensor_descriptor import TensorDescriptor

    from benchmarks.ops.decode_gemm_variants import _tma_kernels

    dtype = torch.bfloat16 if CUDA else torch.float32
    dev = "cuda" if CUDA else "cpu"
    torch.manual_seed(0)
    x, w = torch.randn(8, K, device=dev).to(dtype), torch.randn(N, K, device=dev).to(dtype)
    out = torch.empty(8, N, device=dev, dtype=dtype)
    _tma_kernels()(x, TensorDescriptor.from_tensor(w, [bn, bk]), out, bn, bk, 4, 3)
    ref = x.float() @ w.float().T
    assert torch.allclose(out.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


def test_best_per_family_skips_failures():
    from benchmarks.ops.decode_gemm_variants import best

    times = {"cublas": 1.0, "BN16_BK512_S1_w4_s3": 5.0, "BN64_BK128_S1_w4_s4": 4.0, "extra BN32_BK512_S1_w4_s3": 3.0,
             "tma BN64_BK128_w4_s4": "failed: OutOfResources", "tma BN32_BK64_w4_s3": 6.0}
    assert best(times, "") == (4.0, "BN64_BK128_S1_w4_s4")
    assert best(times, "extra ") == (3.0, "extra BN32_BK512_S1_w4_s3")
    assert best(times, "tma ") == (6.0, "tma BN32_BK64_w4_s3")
    assert best({"cublas": 1.0}, "tma ")[1] == "-"
