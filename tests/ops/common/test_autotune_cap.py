"""`ops.common.autotune.limit_autotune`: the global cap on Triton's config lists (meant for fla's long
lists) keeps the preferred configs, and leaves an autotuner marked `full_tune` (our own short lists) alone.
Needs triton importable (no kernel runs)."""
from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton importable")


def test_cap_and_full_tune_exemption():
    import triton
    import triton.language as tl

    from hybridize.ops.common.autotune import limit_autotune

    @triton.jit
    def kernel(x, BLOCK: tl.constexpr):
        pass

    configs = [triton.Config({"BLOCK": b}, num_warps=w, num_stages=s)
               for b, w, s in [(16, 8, 3), (32, 4, 2), (64, 4, 3), (128, 2, 2)]]
    capped = triton.autotune(configs=configs, key=[])(kernel)
    full = triton.autotune(configs=configs, key=[])(kernel)
    full.full_tune = True
    try:
        limit_autotune(1)
        kept = capped.prune_configs({})
        assert [c.kwargs["BLOCK"] for c in kept] == [32]       # num_warps=4, num_stages=2 ranks first
        assert len(full.prune_configs({})) == len(configs)
    finally:
        limit_autotune(0)
    assert len(capped.prune_configs({})) == len(configs)       # 0 restores Triton's own pruning
