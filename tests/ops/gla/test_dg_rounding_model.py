"""The CPU model of the pieces GLA backward's roundings (`benchmarks/ops/gla_dg_rounding.py`): exact when nothing is
rounded (with and without anchors, consistent terms or exact tile totals, so the model's tiles, suffix sums, anchor
resets and corrections are the algorithm), and each rounding mode as precise as it claims."""
from __future__ import annotations

import pytest
import torch

from benchmarks.ops.gla_dg_rounding import inputs, model_dg, reference_dg, rounded


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("consistent, tile_exact", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("anchor", [0, 32, 48])
def test_model_without_rounding_is_the_gradient(anchor, consistent, tile_exact):
    torch.manual_seed(0)
    x = inputs(112, H=2, K=16, V=16, gate_scale=4.0)
    want = reference_dg(*x, 0.25)
    exact = dict(intra="fp32", read="fp32", update="fp32", anchor_dtype="fp32")
    opts = dict(anchor=anchor, consistent=consistent, tile_exact=tile_exact)
    assert rel(model_dg(*x, 0.25, **opts, **exact), want) < 1e-5
    assert rel(model_dg(*x, 0.25, **opts), want) > 1e-4   # bf16 roundings do show


def test_consistent_terms_make_dg_independent_of_the_sum_length():
    """With dg's terms formed from the other pass's rounded operands and the state read exactly, the in-tile and
    update roundings cancel pair by pair: one sum over 1024 tokens is as precise as sums restarted every 64, and far
    more precise than the kernels' form over the same 1024."""
    x = inputs(1024, H=2, K=32, V=32, gate_scale=16.0)
    scale = 32 ** -0.5
    want = reference_dg(*x, scale)
    err = {(c, a): rel(model_dg(*x, scale, anchor=a, consistent=c, read="fp32", anchor_dtype="fp32"), want)
           for c in (False, True) for a in (0, 64)}
    assert abs(err[True, 0] - err[True, 64]) < 0.05 * err[True, 64], err
    assert err[True, 0] < 0.3 * err[False, 0] and err[False, 0] > 2 * err[False, 64], err


def test_exact_tile_totals_make_dg_independent_of_the_sum_length_with_bf16_state_reads():
    """With each tile's total through the state taken from the fp32 state (`tile_exact`) on top of consistent
    terms, the bf16 reads of the state leave their error inside a tile: one sum over 1024 tokens is as precise as
    sums restarted every 64 (model: 2.9e-3 and 3.3e-3), and more precise than consistent terms alone restarted every
    64 (4.3e-3; 1.1e-2 over the 1024)."""
    x = inputs(1024, H=2, K=32, V=32, gate_scale=16.0)
    scale = 32 ** -0.5
    want = reference_dg(*x, scale)
    err = {(t, a): rel(model_dg(*x, scale, anchor=a, consistent=True, tile_exact=t), want)
           for t in (False, True) for a in (0, 64)}
    assert err[True, 0] < 1.1 * err[True, 64], err          # (the resets' bf16 states add a little of their own)
    assert err[True, 0] < 0.8 * err[False, 64] and err[False, 0] > 1.5 * err[False, 64], err


def test_rounding_modes():
    x = torch.randn(4096) * 3
    assert rel(rounded(x, "bf16"), x) < 2 ** -8 and rel(rounded(x, "bf16"), x) > 2 ** -12
    assert 2 ** -14 < rel(rounded(x, "tf32"), x) < 2 ** -11
    assert rel(rounded(x, "split"), x) < 2 ** -15
    assert torch.equal(rounded(x, "fp32"), x)
    with pytest.raises(ValueError, match="use one of"):
        rounded(x, "fp8")
