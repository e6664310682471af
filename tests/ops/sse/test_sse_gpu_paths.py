"""SSE GPU paths (ops/sse/reference.py + ops/sse/triton_route.py, triton_decode.py) against the PyTorch paths.

Three groups:
- always: the device-side varlen plan against the host-side `varlen_index` (same reorder), and its
  index bounds (`check_plan`, also run on the host before every CUDA varlen call below);
- interpreter (TRITON_INTERPRET=1 and triton importable, CPU tensors): the Triton row movers and the
  slot-broadcast decode step against their PyTorch references, and the whole `sse_varlen` /
  `naive_recurrent_sse` with our kernels forced on against the PyTorch path (tiny shapes, odd lengths,
  padding, an empty sequence);
- CUDA: the GPU paths (fla varlen op + our kernels; Triton decode) against the PyTorch path on the
  same inputs, fp32 and bf16, forward and gradients; decode leaves unselected partitions
  bit-identical, honours `inplace`, is CUDA-graph capturable; the varlen bookkeeping never syncs.
  Every test ends with a device sync (autouse fixture), so an asynchronous device-side error fails
  the test that caused it rather than a later one.

Run the interpreter group with
    TRITON_INTERPRET=1 PYTHONPATH=/work/triton-site python -m pytest tests/ops/sse/test_sse_gpu_paths.py
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

from hybridize.ops.common import options
from hybridize.ops.sse import reference as sse
from hybridize.ops.sse.reference import PathInputs, Routing, route

triton_ok = importlib.util.find_spec("triton") is not None
cuda = torch.cuda.is_available()
interp = triton_ok and os.environ.get("TRITON_INTERPRET") == "1" and not cuda
needs_interp = pytest.mark.skipif(not interp, reason="needs TRITON_INTERPRET=1, triton importable, no CUDA")
needs_cuda = pytest.mark.skipif(not (cuda and triton_ok and importlib.util.find_spec("fla") is not None),
                                reason="needs CUDA, triton and fla-core")


def check_plan(plan, L, K, G):
    """Host-side bounds of a `VarlenPlan` (copied to the CPU), the ranges every gather of the varlen
    layout (torch or Triton) relies on: order and inv are inverse permutations of the L * K pairs,
    seg_cu `[G + 2]` rises from 0 to L * K."""
    order, inv, seg_cu = (t.cpu() for t in (plan.order, plan.inv, plan.seg_cu))
    M = L * K
    keep = torch.ones(M, dtype=torch.bool) if plan.keep is None else plan.keep.cpu()
    assert order.shape == inv.shape == keep.shape == (M,), (order.shape, inv.shape, keep.shape, M)
    assert torch.equal(order.sort().values, torch.arange(M)), "order is not a permutation of the pairs"
    assert torch.equal(inv[order], torch.arange(M)), "inv is not the inverse of order"
    assert seg_cu.shape == (G + 2,) and int(seg_cu[0]) == 0 and int(seg_cu[-1]) == M, seg_cu
    assert bool((seg_cu.diff() >= 0).all()), seg_cu


def check_routing(r, N):
    """Host-side: partition ids in [0, N) (they index the state tensor)."""
    idx = r.index.cpu()
    assert int(idx.min()) >= 0 and int(idx.max()) < N, (int(idx.min()), int(idx.max()), N)


def rel(a, b):
    """max|a - b| / max|b| in fp64."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def nrel(a, b):
    """Norm-wise relative error (the GPU tolerance measure of benchmarks/ops/gpu_check.py)."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def make(op, B, T, H, D, N, K, shared=True, dtype=torch.float32, device="cpu", seed=0, valid=None):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731

    def path():
        q, k, v = r(B, T, H, D), r(B, T, H, D), r(B, T, H, D)
        if op == "gla":
            p = PathInputs(q=q, k=k.softmax(-1), v=v, g=F.logsigmoid(r(B, T, H, D) + 2) / 4)
        else:
            p = PathInputs(q=F.normalize(q, dim=-1), k=F.normalize(k, dim=-1), v=v,
                           g=-F.softplus(r(B, T, H) - 2), beta=torch.sigmoid(r(B, T, H)))
        act = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
        return PathInputs(q=act(p.q), k=act(p.k), v=act(p.v), g=p.g.to(device), beta=act(p.beta))

    sh = path() if shared else None
    sp = path()
    if sh is not None and valid is not None:  # as the mixer does: padding leaves the shared state alone
        m = lambda t: None if t is None else t * valid.to(t).view(*valid.shape, *[1] * (t.dim() - 2))  # noqa: E731
        sh = PathInputs(q=sh.q, k=m(sh.k), v=m(sh.v), g=m(sh.g), beta=m(sh.beta))
    logits = (r(B, T, N) * 2).to(device)
    return sh, sp, logits, (None if valid is None else valid.to(device))


def state(B, N, H, D, device="cpu", seed=5):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, D, D, generator=gen).to(device) * 0.3,
            torch.randn(B, N, H, D, D, generator=gen).to(device) * 0.3)


def leaves(sh, sp, logits):
    ts = [t for p in (sh, sp) if p is not None for t in (p.q, p.k, p.v, p.g, p.beta) if t is not None]
    return [t.requires_grad_(True) for t in ts + [logits]]


def run_layout(fn, op, sh, sp, logits, K, valid, h0, cu=None, grad=True):
    """(o, shared state, sparse state, gradients of every leaf) of one layout call."""
    ls = leaves(sh, sp, logits) if grad else []
    o, s1, s2 = fn(op, sh, sp, route(logits, K, valid), initial_state=h0, output_final_state=True,
                   cu_seqlens=cu, chunk_size=16)
    if not grad:
        return o, s1, s2, []
    w = torch.linspace(-1, 1, o.numel(), device=o.device).view_as(o)
    loss = (o.float() * w).sum() + s2.pow(2).sum() * 1e-2 + (0 if s1 is None else s1.sum() * 1e-2)
    return o, s1, s2, list(torch.autograd.grad(loss, ls, allow_unused=True))


# ---- always: device-side plan == host-side index --------------------------------------------------

@pytest.mark.parametrize("K", [1, 2])
def test_varlen_plan_matches_varlen_index(K):
    L, N = 23, 4
    logits = torch.randn(1, L, N, generator=torch.Generator().manual_seed(1))
    valid = torch.ones(1, L, dtype=torch.bool)
    valid[0, [2, 9, 10]] = False
    r = route(logits, K, valid)
    cu = torch.tensor([0, 5, 5, 16, 23])
    token, part, seg_cu, seg_id = sse.varlen_index(r, cu)
    plan = sse.varlen_plan(r, cu)
    check_plan(plan, L, K, 4 * N)
    n_kept = int(plan.seg_cu[-2])
    assert n_kept == int(r.selected.sum()) and int(plan.seg_cu[-1]) == L * K
    assert torch.equal(plan.order[:n_kept] // K, token)                       # same rows, same order
    assert torch.equal(r.index[0].reshape(-1)[plan.order[:n_kept]], part)
    lens = plan.seg_cu[1:-1] - plan.seg_cu[:-2]                                # all S*N segments
    assert torch.equal(torch.nonzero(lens).flatten(), seg_id)
    assert torch.equal(lens[seg_id].cumsum(0), seg_cu[1:])
    assert torch.equal(plan.inv[plan.order], torch.arange(L * K))
    assert not plan.keep[plan.order[n_kept:]].any() and plan.keep[plan.order[:n_kept]].all()


def test_decode_inplace_flag_on_torch_path_never_writes_inputs():
    sh, sp, logits, _ = make("gla", 2, 1, 2, 4, 3, 1)
    h0 = state(2, 3, 2, 4)
    before = [t.clone() for t in h0]
    sse.naive_recurrent_sse("gla", sh, sp, route(logits, 1), initial_state=h0, output_final_state=True, inplace=True)
    assert all(torch.equal(a, b) for a, b in zip(before, h0))


# ---- interpreter: Triton kernels vs references on CPU ----------------------------------------------

@pytest.mark.skipif(not triton_ok, reason="needs triton")
def test_move_config_moves_4kb_of_a_row_at_a_time():
    from hybridize.ops.sse.triton_route import move_config
    assert move_config(2048, 2).block == 2048            # SSE's 16 x 128 rows, bf16: a whole row
    assert move_config(2048, 4).block == 1024            # fp32 gates: half a row
    assert move_config(576, 2).block == 1024             # a row under 4 KB: its power of two
    assert move_config(10, 4).block == 16                # never under 16 columns


@needs_interp
@pytest.mark.parametrize("paths", ["shared", "sparse only", "one tensor on both"])
@pytest.mark.parametrize("K", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("launch", [None, (4, 2)])    # the default; column blocks with a tail (C = 10)
def test_row_movers_match_reference(paths, K, dtype, launch, monkeypatch):
    """"one tensor on both": SSE's v feeds the shared and the sparse path; the pack's backward then sums both
    gradients itself (no separate add), which must equal autograd's sum through the reference."""
    from hybridize.ops.sse import triton_route
    from hybridize.ops.sse.triton_route import MoveConfig, combine_rows, pack_rows
    if launch is not None:
        monkeypatch.setattr(triton_route, "move_config", lambda C, itemsize: MoveConfig(*launch))
    shared = paths != "sparse only"
    L, N, H, D = 13, 4, 2, 5                                 # C = 10: not a power of two
    gen = torch.Generator().manual_seed(K)
    valid = torch.ones(1, L, dtype=torch.bool)
    valid[0, [4, 12]] = False
    r = route(torch.randn(1, L, N, generator=gen), K, valid)
    plan = sse.varlen_plan(r, torch.tensor([0, 6, 6, L]))
    xs = torch.randn(1, L, H, D, generator=gen).to(dtype).requires_grad_()
    xp = torch.randn(1, L, H, D, generator=gen).to(dtype).requires_grad_()
    if paths == "one tensor on both":
        xs = xp
    w = r.probs[0].gather(-1, r.index[0]).reshape(-1).clone().requires_grad_()
    gy = torch.randn(1, (L if shared else 0) + L * K, H, D, generator=gen).to(dtype)
    res = {}
    for name, (pk, cb) in {"ref": (sse.pack_rows_torch, sse.combine_rows_torch),
                           "triton": (pack_rows, combine_rows)}.items():
        y = pk(xs if shared else None, xp, plan.order, plan.inv, K, scale=w, keep=plan.keep)
        o = cb(y * 1.5, plan.order, plan.inv, K, L, shared, plan.keep)
        loss = (y.float() * gy.float()).sum() + o.float().pow(2).sum()
        res[name] = [y, o, *torch.autograd.grad(loss, [xs, xp, w] if paths == "shared" else [xp, w])]
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    for i, (a, b) in enumerate(zip(res["triton"], res["ref"])):
        assert a.dtype == b.dtype and a.shape == b.shape, i
        assert rel(a, b) < tol, i
    n_kept = int(plan.seg_cu[-2])                            # dropped (padding) pairs: exactly zero rows
    rows = (L if shared else 0) + torch.arange(n_kept, L * K)
    assert len(rows) == 2 * K
    assert torch.equal(res["triton"][0][0, rows], torch.zeros_like(res["triton"][0][0, rows]))


@needs_interp
@pytest.mark.parametrize("backbone", ["gla", "delta"])
def test_decode_step_slot_broadcast_and_weights(backbone):
    from hybridize.ops.sse.triton_decode import sse_decode_step, sse_decode_step_reference
    B, P, S, H, K, V = 2, 4, 2, 3, 8, 12
    gen = torch.Generator().manual_seed(2)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    st = r(B, P, H, K, V)
    index = torch.tensor([[2, -1], [0, 3]])
    q, k, v = r(B, 1, H, K), F.normalize(r(B, 1, H, K), dim=-1), r(B, 1, H, V)
    g = -torch.rand(B, 1, H, K, generator=gen) if backbone == "gla" else -torch.rand(B, 1, H, generator=gen)
    beta = torch.rand(B, 1, H, generator=gen) if backbone == "delta" else None
    wq, wk = torch.rand(B, S, generator=gen), torch.rand(B, S, generator=gen)
    ref_st, out_st = st.clone(), st.clone()
    o_ref = sse_decode_step_reference(ref_st, index, q, k, v, g=g, beta=beta, wq=wq, wk=wk)
    o = sse_decode_step(out_st, index, q, k, v, g=g, beta=beta, wq=wq, wk=wk)
    assert rel(o, o_ref) < 1e-5 and rel(out_st, ref_st) < 1e-5
    assert torch.equal(out_st[0, [0, 1, 3]], st[0, [0, 1, 3]]) and torch.equal(out_st[1, [1, 2]], st[1, [1, 2]])
    # the reference itself against the explicit per-slot form (weights folded into q and k)
    qs, ks = q * wq[:, :, None, None], k * wk[:, :, None, None]
    ref2 = st.clone()
    o2 = sse_decode_step_reference(ref2, index, qs, ks, v.expand(B, S, H, V), g=g.expand(B, S, *g.shape[2:]),
                                   beta=None if beta is None else beta.expand(B, S, H),
                                   p=ks if backbone == "delta" else None)
    assert rel(o_ref, o2) < 1e-6 and rel(ref_st, ref2) < 1e-6


def set_options(monkeypatch, **changes):
    """Make the current kernel options with `changes` explicit for the test (restored after it)."""
    monkeypatch.setattr(options, "_CURRENT", options.current_kernel_options().replace(**changes))


@pytest.fixture
def forced_triton(monkeypatch):
    set_options(monkeypatch, force_triton=True, kernels="auto")


@needs_interp
@pytest.mark.parametrize("op", ["gla", "delta"])
@pytest.mark.parametrize("shared,K,packed", [(True, 1, True), (False, 2, False)])
def test_varlen_with_triton_movers_equals_torch_path(op, shared, K, packed, forced_triton, monkeypatch):
    H, D, N = 2, 4, 3
    if packed:  # lengths 7, 0, 12 (an empty document), one padding token
        B, T, cu = 1, 19, torch.tensor([0, 7, 7, 19])
        valid = torch.ones(1, T, dtype=torch.bool)
        valid[0, 9] = False
    else:
        B, T, cu, valid = 2, 11, None, None
    nseq = 3 if packed else B
    sh, sp, logits, valid = make(op, B, T, H, D, N, K, shared, valid=valid)
    h0 = state(nseq, N, H, D)
    h0 = (h0[0] if shared else None, h0[1])
    got = run_layout(sse.sse_varlen, op, sh, sp, logits, K, valid, h0, cu)
    set_options(monkeypatch, force_triton=False)
    ref = run_layout(sse.sse_varlen, op, sh, sp, logits, K, valid, h0, cu)
    for i, (a, b) in enumerate(zip(got[:3] + tuple(got[3]), ref[:3] + tuple(ref[3]))):
        if b is None:
            assert a is None, i
            continue
        assert rel(a, b) < 1e-5, i


@needs_interp
@pytest.mark.parametrize("op", ["gla", "delta"])
@pytest.mark.parametrize("T,K", [(1, 1), (5, 2)])
def test_recurrent_with_triton_decode_equals_torch_path(op, T, K, forced_triton, monkeypatch):
    B, H, D, N = 3, 2, 4, 4
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, 0] = False                                            # a padding token
    sh, sp, logits, valid = make(op, B, T, H, D, N, K, True, valid=valid)
    h0 = state(B, N, H, D)
    keep = [t.clone() for t in h0]
    with torch.no_grad():
        o, s1, s2 = sse.naive_recurrent_sse(op, sh, sp, route(logits, K, valid), initial_state=h0,
                                            output_final_state=True)
        assert all(torch.equal(a, b) for a, b in zip(keep, h0)), "inplace=False wrote the given state"
        set_options(monkeypatch, force_triton=False)
        o_r, s1_r, s2_r = sse.naive_recurrent_sse(op, sh, sp, route(logits, K, valid), initial_state=h0,
                                                  output_final_state=True)
    assert rel(o, o_r) < 1e-5 and rel(s1, s1_r) < 1e-5 and rel(s2, s2_r) < 1e-5
    used = route(logits, K, valid).selected.any(1)                   # [B, N]
    for b in range(B):
        for i in range(N):
            if not used[b, i]:
                assert torch.equal(s2[b, i], h0[1][b, i]), (b, i)


@needs_interp
def test_recurrent_inplace_updates_given_state(forced_triton):
    sh, sp, logits, _ = make("gla", 2, 1, 2, 4, 3, 1)
    h0 = state(2, 3, 2, 4)
    before = [t.clone() for t in h0]
    with torch.no_grad():
        _, s1, s2 = sse.naive_recurrent_sse("gla", sh, sp, route(logits, 1), initial_state=h0,
                                            output_final_state=True, inplace=True)
    assert s1.data_ptr() == h0[0].data_ptr() and s2.data_ptr() == h0[1].data_ptr()
    assert not torch.equal(h0[1], before[1]) and not torch.equal(h0[0], before[0])


# ---- CUDA: GPU paths vs the PyTorch path on the same inputs ----------------------------------------

@pytest.fixture
def gpu_backend():
    from hybridize.ops import gpu
    gpu.activate()
    old = options.set_kernel_options(None)
    yield
    options.set_kernel_options(old)


def _torch_path(fn):
    with options.use_kernel_options(kernels="torch"):
        return fn()


@needs_cuda
@pytest.mark.parametrize("op", ["gla", "delta"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["dense", "packed"])
def test_cuda_varlen_matches_torch_path(op, dtype, case, gpu_backend):
    H, D, N, K = 2, 64, 4, 1
    if case == "packed":   # odd lengths, an empty document, a padding token, K = 2
        B, T, cu, K = 1, 157, torch.tensor([0, 37, 37, 137, 157], device="cuda"), 2
        valid = torch.ones(1, T, dtype=torch.bool)
        valid[0, 50] = False
    else:
        B, T, cu, valid = 2, 157, None, None
    nseq = 4 if case == "packed" else B
    sh, sp, logits, valid = make(op, B, T, H, D, N, K, True, dtype=dtype, device="cuda", valid=valid)
    h0 = state(nseq, N, H, D, device="cuda")
    r = route(logits, K, valid)                       # the plan sse_varlen builds, checked on the host first
    check_routing(r, N)
    if cu is None:
        r = Routing(*(t.reshape(1, B * T, -1) for t in (r.probs, r.index, r.selected)))
    check_plan(sse.varlen_plan(r, torch.arange(0, (B + 1) * T, T, device="cuda") if cu is None else cu),
               B * T, K, nseq * N)
    got = run_layout(sse.sse_varlen, op, sh, sp, logits, K, valid, h0, cu)
    ref = _torch_path(lambda: run_layout(sse.sse_varlen, op, sh, sp, logits, K, valid, h0, cu))
    tol = 3e-3 if dtype == torch.float32 else 3e-2
    names = ["o", "shared state", "sparse state"] + [f"grad {i}" for i in range(len(got[3]))]
    for name, a, b in zip(names, got[:3] + tuple(got[3]), ref[:3] + tuple(ref[3])):
        assert a.dtype == b.dtype, name
        assert nrel(a, b) < tol, (name, nrel(a, b))
    if case == "packed":   # the empty document's partitions pass through bit-identically
        assert torch.equal(got[2][1], h0[1][1])


@needs_cuda
@pytest.mark.parametrize("op", ["gla", "delta"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_decode_matches_torch_path(op, dtype, gpu_backend):
    B, H, D, N, K = 3, 2, 64, 4, 1
    valid = torch.ones(B, 1, dtype=torch.bool)
    valid[2] = False                                              # a padded row
    sh, sp, logits, valid = make(op, B, 1, H, D, N, K, True, dtype=dtype, device="cuda", valid=valid)
    h0 = state(B, N, H, D, device="cuda")
    keep = [t.clone() for t in h0]
    r = route(logits, K, valid)
    check_routing(r, N)
    with torch.no_grad():
        o, s1, s2 = sse.naive_recurrent_sse(op, sh, sp, r, initial_state=h0, output_final_state=True)
        assert all(torch.equal(a, b) for a, b in zip(keep, h0)), "inplace=False wrote the given state"
        o_r, s1_r, s2_r = sse._recurrent_loop(op, sh, sp, r, True, True, None, h0, True)  # gather/op/scatter
        o_t, s1_t, s2_t = _torch_path(lambda: sse.naive_recurrent_sse(op, sh, sp, r, initial_state=h0,
                                                                      output_final_state=True))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in ((o, o_t), (s1, s1_t), (s2, s2_t), (o, o_r), (s2, s2_r)):
        assert a.dtype == b.dtype and rel(a, b) < tol
    for b in range(B):
        for i in range(N):
            same = torch.equal(s2[b, i], h0[1][b, i])
            assert same != bool(r.selected[b, 0, i]), (b, i)
    assert torch.equal(s1[2], h0[0][2])                             # padded row: shared state untouched
    with torch.no_grad():
        _, s1_i, s2_i = sse.naive_recurrent_sse(op, sh, sp, r, initial_state=h0, output_final_state=True, inplace=True)
    assert s2_i.data_ptr() == h0[1].data_ptr() and torch.equal(h0[1], s2) and torch.equal(h0[0], s1)


@needs_cuda
@pytest.mark.parametrize("op", ["gla", "delta"])
def test_cuda_decode_step_is_graph_capturable(op, gpu_backend):
    B, H, D, N = 2, 2, 64, 4
    sh, sp, logits, _ = make(op, B, 1, H, D, N, 1, True, device="cuda")
    static = [t for p in (sh, sp) for t in (p.q, p.k, p.v, p.g, p.beta) if t is not None] + [logits]
    h0 = state(B, N, H, D, device="cuda")

    def step():
        o, _, _ = sse.naive_recurrent_sse(op, sh, sp, route(logits, 1), initial_state=h0, output_final_state=True,
                                          inplace=True)
        return o
    eager_state = [t.clone() for t in h0]
    with torch.no_grad():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):                                   # compile outside the capture
            step()
        torch.cuda.current_stream().wait_stream(s)
        for a, b in zip(h0, eager_state):
            a.copy_(b)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o_static = step()
        for a, b in zip(h0, eager_state):
            a.copy_(b)
        gen = torch.Generator().manual_seed(9)
        new = [torch.randn(t.shape, generator=gen).to(t) for t in static]
        for t, n in zip(static, new):
            t.copy_(n)
        graph.replay()
        torch.cuda.synchronize()
        got_o, got_state = o_static.clone(), [t.clone() for t in h0]
        ref_h0 = [t.clone() for t in eager_state]
        o_ref, s1_ref, s2_ref = sse.naive_recurrent_sse(op, sh, sp, route(logits, 1), initial_state=ref_h0,
                                                        output_final_state=True)
    assert rel(got_o, o_ref) < 1e-5 and rel(got_state[0], s1_ref) < 1e-5 and rel(got_state[1], s2_ref) < 1e-5


def test_gla_pieces_chosen_on_cuda_bf16_only(monkeypatch):
    """The varlen path's choice of the pieces GLA: GLA only, CUDA, bf16, with or without gradient, not disabled; and
    of reading the layout in place: per-key gates on both paths, one dtype; "auto" both paths without gradient and
    the shared path with it, "on" / "shared" / "off" as named."""
    def inputs(device="cpu", dtype=torch.bfloat16):
        return PathInputs(*(torch.zeros(1, 4, 2, 8, dtype=dtype, device=device) for _ in range(4)), None)
    assert not sse._gla_in_pieces("gla", inputs())           # CPU tensors
    if cuda:
        xc = inputs("cuda")
        assert sse._gla_in_pieces("gla", xc) and not sse._gla_in_pieces("delta", xc)
        assert not sse._gla_in_pieces("gla", inputs("cuda", torch.float32))
        monkeypatch.setenv("HYBRIDIZE_SSE_GLA_PIECES", "0")
        assert not sse._gla_in_pieces("gla", xc)
        monkeypatch.delenv("HYBRIDIZE_SSE_GLA_PIECES")
        assert sse._gla_gathers("gla", xc, xc, torch.ones(4, device="cuda")) == "on"
        assert sse._gla_gathers("gla", xc, xc, torch.ones(4, device="cuda", requires_grad=True)) == "shared"
        scalar_gates = PathInputs(xc.q, xc.k, xc.v, xc.g[..., 0], None)
        assert not sse._gla_gathers("gla", scalar_gates, xc, torch.ones(4, device="cuda"))
        fp32_shared = PathInputs(xc.q.float(), xc.k, xc.v, xc.g, None)
        assert not sse._gla_gathers("gla", fp32_shared, xc, torch.ones(4, device="cuda"))
        monkeypatch.setenv("HYBRIDIZE_SSE_GLA_GATHER", "on")
        assert sse._gla_gathers("gla", xc, xc, torch.ones(4, device="cuda", requires_grad=True)) == "on"
        monkeypatch.setenv("HYBRIDIZE_SSE_GLA_GATHER", "shared")
        assert sse._gla_gathers("gla", xc, xc, torch.ones(4, device="cuda")) == "shared"
        monkeypatch.setenv("HYBRIDIZE_SSE_GLA_GATHER", "off")
        assert not sse._gla_gathers("gla", xc, xc, torch.ones(4, device="cuda"))
        monkeypatch.delenv("HYBRIDIZE_SSE_GLA_GATHER")
        xc.q.requires_grad_()
        assert sse._gla_in_pieces("gla", xc)
        assert sse._gla_gathers("gla", None, xc, torch.ones(4, device="cuda")) == "shared"
    assert not sse._gla_gathers("gla", inputs(), inputs(), torch.ones(4))


@needs_cuda
@pytest.mark.parametrize("case", ["dense", "packed"])
@pytest.mark.parametrize("grad", [False, True])
def test_cuda_varlen_uses_gla_pieces_and_agrees(case, grad, gpu_backend, monkeypatch):
    """bf16, with and without gradient: the varlen call runs the pieces GLA (by default on the layout read in place:
    both paths without gradient, the shared path with it), and the output, the final states and every leaf's
    gradient match the same call on packed rows (HYBRIDIZE_SSE_GLA_GATHER=off), through fla's chunk_gla
    (HYBRIDIZE_SSE_GLA_PIECES=0) and the PyTorch path."""
    from hybridize.ops.gla import triton_bwd as gla_bwd
    from hybridize.ops.sse import triton_gathered_gla as gathered

    H, D, N, K = 2, 64, 4, 1
    if case == "packed":
        B, T, cu = 1, 1157, torch.tensor([0, 370, 370, 1137, 1157], device="cuda")
    else:
        B, T, cu = 2, 1157, None
    nseq = 4 if case == "packed" else B
    sh, sp, logits, valid = make("gla", B, T, H, D, N, K, True, dtype=torch.bfloat16, device="cuda")
    h0 = state(nseq, N, H, D, device="cuda")
    calls = []
    real_train, real_gathered = gla_bwd.gla_triton, gathered.gathered_gla
    monkeypatch.setattr(gla_bwd, "gla_triton", lambda *a, **kw: calls.append("packed") or real_train(*a, **kw))
    monkeypatch.setattr(gathered, "gathered_gla", lambda *a, **kw: calls.append("gather") or real_gathered(*a, **kw))
    with torch.set_grad_enabled(grad):
        got = run_layout(sse.sse_varlen, "gla", sh, sp, logits, K, valid, h0, cu, grad=grad)
        monkeypatch.setenv("HYBRIDIZE_SSE_GLA_GATHER", "off")
        other = run_layout(sse.sse_varlen, "gla", sh, sp, logits, K, valid, h0, cu, grad=grad)
        monkeypatch.delenv("HYBRIDIZE_SSE_GLA_GATHER")
        monkeypatch.setenv("HYBRIDIZE_SSE_GLA_PIECES", "0")
        fla = run_layout(sse.sse_varlen, "gla", sh, sp, logits, K, valid, h0, cu, grad=grad)
        ref = _torch_path(lambda: run_layout(sse.sse_varlen, "gla", sh, sp, logits, K, valid, h0, cu, grad=grad))
    assert calls == ["gather", "packed"]
    names = ["o", "shared state", "sparse state"] + [f"grad {i}" for i in range(len(got[3]))]
    for name, a, p, b, c in zip(names, got[:3] + tuple(got[3]), other[:3] + tuple(other[3]),
                                fla[:3] + tuple(fla[3]), ref[:3] + tuple(ref[3])):
        if c is None:
            assert a is None and b is None and p is None, name
            continue
        assert a.dtype == c.dtype, name
        assert nrel(a, p) < 1e-2, (name, nrel(a, p))
        assert nrel(a, b) < 3e-2 and nrel(a, c) < 3e-2, (name, nrel(a, b), nrel(a, c))


@needs_cuda
def test_cuda_varlen_bookkeeping_and_row_moves_never_sync(gpu_backend):
    from hybridize.ops.sse.triton_route import combine_rows, pack_rows
    L, N, K, H, D = 300, 4, 1, 2, 64
    logits = torch.randn(1, L, N, device="cuda", requires_grad=True)
    cu = torch.tensor([0, 100, 300], device="cuda")
    x = torch.randn(1, L, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for _ in range(2):                                               # 2nd pass: kernels compiled
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            r = route(logits, K)
            plan = sse.varlen_plan(r, cu)
            w = r.probs[0].gather(-1, r.index[0]).reshape(-1)
            y = pack_rows(x, x, plan.order, plan.inv, K, scale=w, keep=plan.keep)
            o = combine_rows(y, plan.order, plan.inv, K, L, True, plan.keep)
            o.float().sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    check_plan(plan, L, K, 2 * N)
    assert logits.grad is not None and x.grad is not None
