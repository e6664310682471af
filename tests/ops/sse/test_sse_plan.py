"""SSE's varlen plan as a counting sort (`ops/sse/triton_plan.py`) against the PyTorch plan (interpreter)."""
import importlib.util
import os

import pytest
import torch

from hybridize.ops.common import options
from hybridize.ops.sse import reference as sse

interp = (importlib.util.find_spec("triton") is not None and os.environ.get("TRITON_INTERPRET") == "1"
          and not torch.cuda.is_available())
needs_interp = pytest.mark.skipif(not interp, reason="needs TRITON_INTERPRET=1, triton importable, no CUDA")


def routing(L, n, K, pad, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, L, n, generator=gen)
    logits[0, : L // 3, 0] += 3.0                      # a skewed router: uneven segments
    valid = None
    if pad:
        valid = torch.rand(1, L, generator=gen) > 0.2
    return sse.route(logits, K, valid)


@needs_interp
@pytest.mark.parametrize("L, n, K, cu, pad, shared", [
    (1000, 4, 1, [0, 1000], False, True),
    (700, 3, 2, [0, 100, 100, 450, 700], True, False),     # an empty document, padding, N not a power of 2
    (300, 16, 2, [0, 1, 2, 299, 300], False, True),       # one-token documents
    (2500, 4, 1, [0, 1300, 2500], True, True),            # several chunks of pairs before a boundary
    (64, 8, 8, [0, 64], False, False),                    # K = N: every partition of every token
])
def test_counting_sort_plan_equals_torch_plan(L, n, K, cu, pad, shared, monkeypatch):
    r = routing(L, n, K, pad, seed=L + n + K)
    cu_t = torch.tensor(cu)
    base = options.current_kernel_options()
    monkeypatch.setattr(options, "_CURRENT", base.replace(force_triton=False))
    want = sse.varlen_plan(r, cu_t, shared)
    monkeypatch.setattr(options, "_CURRENT", base.replace(force_triton=True))
    got = sse.varlen_plan(r, cu_t, shared)
    for name in ("order", "inv", "seg_cu", "layout_cu"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), (name, a, b)
    assert (got.keep is None) == (not pad) and (got.keep is None or torch.equal(got.keep, want.keep))


@pytest.mark.skipif(not (torch.cuda.is_available() and importlib.util.find_spec("triton") is not None),
                    reason="needs CUDA and triton")
@pytest.mark.parametrize("L, n, K, cu, pad", [(4096, 4, 1, [0, 4096], False), (5000, 16, 2, [0, 7, 7, 2600, 5000], True)])
def test_cuda_counting_sort_plan_equals_cpu_plan(L, n, K, cu, pad):
    r = routing(L, n, K, pad, seed=L)
    want = sse.varlen_plan(r, torch.tensor(cu), True)                                  # PyTorch sort, CPU
    rc = sse.Routing(r.probs.cuda(), r.index.cuda(), None if r.dense else r.selected.cuda())
    got = sse.varlen_plan(rc, torch.tensor(cu).cuda(), True)
    torch.cuda.synchronize()
    for name in ("order", "inv", "seg_cu", "layout_cu"):
        assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), name
