"""SSE's varlen GLA read in place (`ops/sse/triton_gathered_gla.py`) against the packed path it replaces.

The packed path: the PyTorch row packer (`pack_rows_torch`, router scales and dropped pairs zeroed), the pieces GLA
with its own backward (`gla_triton`) and the PyTorch sum back per token (`combine_rows_torch`). Compared: the
output, the final states the caller keeps, and the gradients of both paths' q, k, v, g, of the router probabilities
and of the initial states, through a loss on the output and on the final states. Cases: with and without the shared
path, K = 1 and 2, router scales on q and / or k, a padding token (a dropped pair), two documents, pieces that cut
the segments, one v tensor on both paths (SSE's). Both forms of the op: both paths read in place, and `packed` (only
the shared path in place, the sparse rows packed by the Triton packer, their output gradient too).

    TRITON_INTERPRET=1 PYTHONPATH=/work/triton-site python -m pytest tests/ops/sse/test_gathered_gla.py
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.ops.triton_gates import cuda_only, interp_only, rel


def _case(shared, K, same_v, device="cpu", dtype=torch.float32, L=45, H=2, D=16, N=4, seed=21):
    from hybridize.ops.sse import reference as sse

    gen = torch.Generator().manual_seed(seed)

    def path():
        q, k, v = (torch.randn(1, L, H, D, generator=gen) for _ in range(3))
        g = F.logsigmoid(torch.randn(1, L, H, D, generator=gen) * 2 + 1)
        return [t.to(device=device, dtype=dtype) for t in (q, k, v, g)]
    sh, sp = path(), path()
    if same_v:
        sh[2] = sp[2]
    valid = torch.ones(1, L, dtype=torch.bool)
    valid[0, 7] = False
    cu = torch.tensor([0, 20, L])
    r = sse.route(torch.randn(1, L, N, generator=gen), K, valid)
    plan = sse.varlen_plan(r, cu, shared)
    w = r.probs[0].gather(-1, r.index[0]).reshape(-1).to(device)
    h0 = torch.randn(len(plan.layout_cu) - 1, H, D, D, generator=gen).to(device)
    plan = type(plan)(**{f: getattr(plan, f).to(device) if getattr(plan, f) is not None else None
                         for f in ("order", "inv", "keep", "seg_cu", "layout_cu")})
    return sh if shared else None, sp, w, h0, plan


def _leaves(sh, sp, w, h0, same_v):
    """Fresh leaves (one v leaf on both paths when `same_v`)."""
    sp = [t.detach().clone().requires_grad_() for t in sp]
    if sh is not None:
        sh = [t.detach().clone().requires_grad_() for t in sh]
        if same_v:
            sh[2] = sp[2]
    return sh, sp, w.detach().clone().requires_grad_(), h0.detach().clone().requires_grad_()


def _packed(sh, sp, w, h0, plan, K, emul, segment_len):
    from hybridize.ops.gla.triton_bwd import gla_triton
    from hybridize.ops.sse import reference as sse

    scales = [w if emul[0] else None, w if emul[1] else None, None, None]
    x = [sse.pack_rows_torch(None if sh is None else a, b, plan.order, plan.inv, K, scale=c, keep=plan.keep)
         for a, b, c in zip(sh if sh is not None else [None] * 4, sp, scales)]
    o_all, st = gla_triton(*x, initial_state=h0, output_final_state=True, cu_seqlens=plan.layout_cu,
                           chunk_size=16, segment_len=segment_len)
    L = sp[0].shape[1]
    return sse.combine_rows_torch(o_all, plan.order, plan.inv, K, L, sh is not None, plan.keep), st


def _gathered(sh, sp, w, h0, plan, K, emul, segment_len, packed=False):
    from hybridize.ops.sse.triton_gathered_gla import Layout, gathered_gla

    keep = None if plan.keep is None else plan.keep.to(torch.int8)
    lay = Layout(plan.order, plan.inv, keep, plan.layout_cu, K, sh is not None)
    return gathered_gla(sh, sp, w, lay, initial_state=h0, emulq=emul[0], emulk=emul[1], segment_len=segment_len,
                        packed=packed)


def _compare(shared, K, emul, same_v, segment_len, device="cpu", dtype=torch.float32, tol=1e-5, states=True,
             packed=False, **kw):
    """`states=False`: no initial states and a loss on the output alone (the final states get no gradient).
    `packed`: the op's form with the sparse rows packed."""
    sh0, sp0, w0, h00, plan = _case(shared, K, same_v, device=device, dtype=dtype, **kw)
    gen = torch.Generator().manual_seed(5)
    do = torch.randn(sp0[2].shape, generator=gen).to(device)
    kept = len(plan.layout_cu) - 2            # the last segment is the dropped pairs' trash: not kept
    dst = torch.randn((kept,) + h00.shape[1:], generator=gen).to(device)
    results = []
    gathered = lambda *a: _gathered(*a, packed=packed)  # noqa: E731
    for run in (_packed, gathered):
        sh, sp, w, h0 = _leaves(sh0, sp0, w0, h00, same_v)
        o, st = run(sh, sp, w, h0 if states else None, plan, K, emul, segment_len)
        ((o.float() * do).sum() + ((st[:kept] * dst).sum() if states else 0)).backward()
        grads = {f"sparse.{n}": t.grad for n, t in zip("qkvg", sp)}
        if sh is not None:
            grads.update({f"shared.{n}": t.grad for n, t in zip("qkvg", sh) if not (same_v and n == "v")})
        grads.update(w=w.grad, **({"h0": h0.grad[:kept]} if states else {}))
        results.append((o, st[:kept], grads))
    (o_want, st_want, g_want), (o_got, st_got, g_got) = results
    assert o_got.shape == o_want.shape and o_got.dtype == o_want.dtype
    assert rel(o_got, o_want) < tol, rel(o_got, o_want)
    assert rel(st_got, st_want) < tol, rel(st_got, st_want)
    if not any(emul):
        assert g_want["w"] is None and g_got["w"] is None
        g_want.pop("w"), g_got.pop("w")
    for name, want in g_want.items():
        got = g_got[name]
        assert got is not None and got.shape == want.shape and got.dtype == want.dtype, name
        assert want.abs().max() > 0, name
        assert rel(got, want) < tol, (name, rel(got, want))


@interp_only
@pytest.mark.parametrize("shared,K,emul,same_v,split", [
    (True, 1, (True, True), True, None), (True, 1, (True, False), False, 8), (True, 2, (False, True), True, 8),
    (False, 1, (True, True), False, 8), (True, 1, (False, False), True, 8)])
def test_interp_gathered_equals_packed_values_and_gradients(shared, K, emul, same_v, split):
    torch.set_num_threads(1)
    _compare(shared, K, emul, same_v, split)


@interp_only
@pytest.mark.parametrize("shared,K,emul,same_v,split", [
    (True, 1, (True, True), True, 8), (True, 2, (False, True), False, None), (False, 1, (True, False), False, 8)])
def test_interp_sparse_rows_packed_equals_packed_values_and_gradients(shared, K, emul, same_v, split):
    """The form with only the shared path read in place (`packed=True`, kernel option `sse_gla_gather="shared"`)."""
    torch.set_num_threads(1)
    _compare(shared, K, emul, same_v, split, packed=True)


@interp_only
@pytest.mark.parametrize("packed", [False, True])
def test_interp_gathered_without_initial_or_final_states(packed):
    """No initial states and no gradient into the final states (`sse_varlen` without `initial_state` or
    `output_final_state`): the backward runs without them."""
    torch.set_num_threads(1)
    _compare(True, 1, (True, True), True, 8, states=False, packed=packed)


@interp_only
def test_interp_gathered_without_gradient_is_the_forward():
    """Under no_grad the same function gives the packed path's output (the prefill / evaluation use)."""
    torch.set_num_threads(1)
    sh, sp, w, h0, plan = _case(True, 1, True)
    with torch.no_grad():
        want, _ = _packed(sh, sp, w, h0, plan, 1, (True, True), 8)
        got, _ = _gathered(sh, sp, w, h0, plan, 1, (True, True), 8)
    assert rel(got, want) < 1e-6


@interp_only
def test_interp_gathered_refuses_mixed_dtypes():
    from hybridize.ops.sse.triton_gathered_gla import Layout, gathered_gla

    sh, sp, w, h0, plan = _case(True, 1, False)
    lay = Layout(plan.order, plan.inv, None, plan.layout_cu, 1, True)
    with pytest.raises(ValueError, match="same dtypes"):
        gathered_gla([sh[0].double()] + sh[1:], sp, w, lay)


@cuda_only
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_cuda_gathered_equals_packed(dtype, tol):
    """On the GPU at a few thousand tokens, H=4, D=128, automatic pieces."""
    for packed in (False, True):
        _compare(True, 1, (True, True), True, None, device="cuda", dtype=dtype, tol=tol, L=3001, H=4, D=128,
                 packed=packed)
        _compare(True, 2, (True, False), False, None, device="cuda", dtype=dtype, tol=tol, L=1500, H=2, D=64,
                 packed=packed)
