"""The piece table kernel (`piece_table` in `ops/common/triton_utils.py`) against the PyTorch table it
replaces (under the Triton interpreter)."""
import importlib.util
import os

import pytest
import torch

interp = (importlib.util.find_spec("triton") is not None and os.environ.get("TRITON_INTERPRET") == "1"
          and not torch.cuda.is_available())
needs_interp = pytest.mark.skipif(not interp, reason="needs TRITON_INTERPRET=1, triton importable, no CUDA")


def torch_table(B, T, cu, n0, seg_len, monkeypatch):
    from hybridize.ops.common import triton_utils
    monkeypatch.setenv("TRITON_INTERPRET", "0")       # the PyTorch form (`build_pieces` takes it off the GPU)
    try:
        return triton_utils.build_pieces(B, T, cu, None, n0, seg_len, cu.device)
    finally:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@needs_interp
@pytest.mark.parametrize("cu, seg_len, with_n0", [
    ([0, 4100], 512, False),                          # one document, a short last piece
    ([0, 1000, 1000, 3001, 4100], 300, True),         # an empty document, pieces cutting documents
    ([0, 17, 17, 50, 70], 20, False),
    ([0, 2048, 4096], 512, True),                     # exact multiples: every slot used
    (list(range(0, 2600, 1)), 512, False),            # 2599 one-token documents: several blocks of earlier ones
])
def test_kernel_table_equals_torch_table(cu, seg_len, with_n0, monkeypatch):
    from hybridize.ops.common.triton_utils import piece_table
    cu_t = torch.tensor(cu)
    N, total = len(cu) - 1, cu[-1]
    n0 = torch.arange(N) * 3 + 1 if with_n0 else None
    want = torch_table(1, total, cu_t, n0, seg_len, monkeypatch)
    got = piece_table(cu_t, seg_len, total, n0)
    names = ("seg", "n_before", "n_after", "seq", "segs", "n_end", "n_div")
    for name, a, b in zip(names, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a, b), (name, a, b)


@pytest.mark.skipif(not (torch.cuda.is_available() and importlib.util.find_spec("triton") is not None),
                    reason="needs CUDA and triton")
def test_cuda_kernel_table_equals_cpu_table():
    from hybridize.ops.common import triton_utils
    cu = torch.tensor([0, 1000, 1000, 3001, 8192])
    want = triton_utils.build_pieces(1, 8192, cu, None, None, 512, cu.device)
    got = triton_utils.build_pieces(1, 8192, cu.cuda(), None, None, 512, torch.device("cuda"))
    for a, b in zip(got, want):
        assert torch.equal(a.cpu(), b)
