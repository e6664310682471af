"""GLA in pieces (`ops/gla/triton_fwd.py`, `triton_bwd.py`) against `naive_recurrent_gla`, forward and gradients.

Gates: interpreter (`TRITON_INTERPRET=1`, triton importable): fp32 against the fp64 recurrent reference,
odd lengths, K != V, pieces that cut tiles, an initial and a final state, varlen documents with an empty one,
strong and weak decay, the gradients of q, k, v, g and the initial state through the output and the final state;
CUDA: bf16 and fp32 at ~4k tokens, both directions.

    TRITON_INTERPRET=1 PYTHONPATH=/work/triton-site python -m pytest tests/ops/gla/test_gla_triton.py
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridize.errors import UserError
from hybridize.ops.gla.reference import naive_recurrent_gla

from tests.ops.triton_gates import cuda_only, interp_only, rel


def inputs(B, T, H, K, V, device="cpu", seed=0, strength=1.0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    gate = F.logsigmoid(torch.randn(B, T, H, K, generator=g, dtype=torch.float64) * 2 + 1) * strength
    h0 = torch.randn(B, H, K, V, generator=g, dtype=torch.float64)
    return [t.to(device) for t in (q, k, v, gate, h0)]


def compare(q, k, v, gate, h0=None, cu=None, dtype=torch.float32, tol=1e-5, strong=None, **kw):
    """Kernel (given `strong` gates instead of `gate`, if any) against the fp64 recurrent op with `gate`."""
    from hybridize.ops.gla.triton_fwd import gla_fwd_triton

    want, want_end = naive_recurrent_gla(q, k, v, gate, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    with torch.no_grad():
        got, end = gla_fwd_triton(*(t.to(dtype) for t in (q, k, v, gate if strong is None else strong)),
                                  initial_state=h0, output_final_state=True, cu_seqlens=cu, **kw)
    assert bool(torch.isfinite(got).all()) and bool(torch.isfinite(end).all())
    assert got.dtype == dtype and end.dtype == torch.float32
    assert rel(got, want) < tol, ("o", rel(got, want))
    assert rel(end, want_end) < tol, ("final state", rel(end, want_end))


@interp_only
def test_interp_strong_decay_is_floored_not_nan():
    """Log-decays far below G_MIN (-30 per token in some channels): finite, and equal to the op with the gates
    floored at G_MIN (the documented departure); moderate gates (above the floor) are exact."""
    from hybridize.ops.gla.triton_fwd import G_MIN

    torch.set_num_threads(1)
    q, k, v, gate, h0 = inputs(1, 40, 2, 16, 16, seed=9)
    gate[0, 5:30, :, :4] = -30.0
    gate[0, 10:12] = -9.0
    compare(q, k, v, gate.clamp(min=G_MIN), h0, chunk_size=16, segment_len=20, strong=gate)


@interp_only
def test_interp_refuses_gradient_and_bad_gates():
    from hybridize.ops.gla.triton_fwd import gla_fwd_triton

    q, k, v, gate, _ = (t.float() for t in inputs(1, 8, 1, 16, 16))
    with pytest.raises(ValueError, match="no backward"):
        gla_fwd_triton(q.requires_grad_(), k, v, gate)
    with pytest.raises(ValueError, match="per-key-channel"):
        with torch.no_grad():
            gla_fwd_triton(q, k, v, gate[..., 0])


def compare_grads(q, k, v, gate, h0=None, cu=None, dtype=torch.float32, tol=1e-5, strong=None, **kw):
    """`gla_triton`'s output, final state and the gradients of q, k, v, g, h0 (loss: a random projection of the
    output plus one of the final state) against the fp64 recurrent op's (given `strong` gates, if any, the
    kernel runs on those; its gate gradient is then compared with the reference's through a clamp at G_MIN)."""
    from hybridize.ops.gla.triton_bwd import gla_triton
    from hybridize.ops.gla.triton_fwd import G_MIN

    gen = torch.Generator().manual_seed(11)
    N = q.shape[0] if cu is None else len(cu) - 1
    do = torch.randn(q.shape[:3] + v.shape[-1:], generator=gen, dtype=torch.float64).to(q.device)
    dht = torch.randn(N, q.shape[2], q.shape[-1], v.shape[-1], generator=gen, dtype=torch.float64).to(q.device)

    def run(fn, cast, gates, **extra):
        leaves = [t.detach().clone().to(cast).requires_grad_() for t in (q, k, v, gates)]
        s0 = None if h0 is None else h0.detach().clone().to(cast).requires_grad_()
        g_in = leaves[3].clamp(min=G_MIN) if strong is not None and fn is naive_recurrent_gla else leaves[3]
        o, end = fn(*leaves[:3], g_in, initial_state=s0, output_final_state=True, cu_seqlens=cu, **extra)
        ((o.double() * do).sum() + (end.double() * dht).sum()).backward()
        return [o, end] + [t.grad for t in leaves] + ([] if s0 is None else [s0.grad])

    want = run(naive_recurrent_gla, torch.float64, strong if strong is not None else gate)
    got = run(gla_triton, dtype, gate if strong is None else strong, **kw)
    for name, a, b in zip(("o", "final state", "dq", "dk", "dv", "dg", "dh0"), got, want):
        assert a is not None and bool(torch.isfinite(a).all()), name
        assert rel(a, b) < tol, (name, rel(a, b))


#: the forward alone (`gla_fwd_triton`, no gradient) and the op with its backward (`gla_triton`, all gradients)
CHECKS = pytest.mark.parametrize("check", [compare, compare_grads], ids=["forward", "gradients"])


@interp_only
@CHECKS
@pytest.mark.parametrize("T,K,V,split", [(37, 16, 32, None), (70, 32, 16, 32), (45, 16, 16, 20)])
@pytest.mark.parametrize("strength", [1.0, 0.05])
def test_interp_matches_recurrent(check, T, K, V, split, strength):
    torch.set_num_threads(1)
    q, k, v, gate, h0 = inputs(2, T, 2, K, V, strength=strength)
    check(q, k, v, gate, h0, chunk_size=16, segment_len=split)
    check(q, k, v, gate, None, chunk_size=16, segment_len=split)


@interp_only
@CHECKS
@pytest.mark.parametrize("split", [None, 20])
def test_interp_varlen(check, split):
    torch.set_num_threads(1)
    cu = torch.tensor([0, 17, 17, 50, 61])
    q, k, v, gate, _ = inputs(1, 61, 2, 16, 16, seed=3)
    h0 = torch.randn(4, 2, 16, 16, dtype=torch.float64)
    check(q, k, v, gate, h0, cu=cu, chunk_size=16, segment_len=split)


@interp_only
@pytest.mark.parametrize("split", [None, 48])
def test_interp_gate_gradient_anchors(split, monkeypatch):
    """The dk pass's exact resets of dg's suffix sum every `gla_dg_anchor` tokens (32 here: several per piece and
    per sequence, pieces that cut them, sequences shorter than one): the gradients still equal the reference's."""
    monkeypatch.setenv("HYBRIDIZE_GLA_DG_ANCHOR", "32")
    torch.set_num_threads(1)
    q, k, v, gate, h0 = inputs(2, 100, 2, 16, 16, seed=5, strength=0.1)
    compare_grads(q, k, v, gate, h0, chunk_size=16, segment_len=split)
    cu = torch.tensor([0, 20, 20, 117, 200])
    q, k, v, gate, _ = inputs(1, 200, 2, 16, 16, seed=6, strength=0.1)
    compare_grads(q, k, v, gate, torch.randn(4, 2, 16, 16, dtype=torch.float64), cu=cu, chunk_size=16,
                  segment_len=split)


@interp_only
def test_interp_every_launch_names_only_its_kernels_parameters(monkeypatch):
    """A compiled launch refuses a keyword its kernel does not declare ("specified but unrecognised"); the
    interpreter ignores it. So every pass of the op, forward and backward, is launched here through a check of its
    keywords against the kernel's parameters (a constexpr meant for two passes once reached a third, and only a GPU
    run showed it)."""
    from hybridize.ops.gla import triton_bwd, triton_fwd
    from hybridize.ops.gla.triton_bwd import gla_triton

    seen = []

    class Checked:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                unknown = set(kwargs) - set(self.kernel.arg_names) - {"num_warps", "num_stages"}
                assert not unknown, (self.kernel.__name__, unknown)
                seen.append(self.kernel.__name__)
                return self.kernel[grid](*args, **kwargs)
            return launch

    for mod in (triton_fwd, triton_bwd):
        for name in dir(mod):
            if name.startswith("_") and name.endswith("_kernel"):
                monkeypatch.setattr(mod, name, Checked(getattr(mod, name)))
    torch.set_num_threads(1)
    q, k, v, gate, h0 = (t.float().requires_grad_() for t in inputs(1, 40, 1, 16, 16, seed=2))
    o, end = gla_triton(q, k, v, gate, initial_state=h0, output_final_state=True, segment_len=32)
    (o.sum() + end.sum()).backward()
    assert {"_dq_kernel", "_dk_kernel", "_dv_kernel", "_output_kernel"} <= set(seen), seen


@interp_only
@pytest.mark.parametrize("T, split, want", [(40, 32, 0), (40, 48, 32), (40, None, 32), (32, None, 0), (33, 0, 32)])
def test_interp_anchors_only_where_a_piece_is_longer(T, split, want, monkeypatch):
    """An anchor falls only inside a piece, so a call whose pieces are all at most `gla_dg_anchor` tokens runs the
    passes without anchors (ANCHOR=0: no stores, resets or memory); the host knows the bound without a sync (the
    piece length, or T for whole sequences: `split` None in the interpreter, 0 anywhere)."""
    from hybridize.ops.gla import triton_bwd

    monkeypatch.setenv("HYBRIDIZE_GLA_DG_ANCHOR", "32")
    got = []

    def spy(*args, **kwargs):
        got.append(kwargs["anchor"])
        return backward_pieces(*args, **kwargs)

    backward_pieces = triton_bwd.backward_pieces
    monkeypatch.setattr(triton_bwd, "backward_pieces", spy)
    torch.set_num_threads(1)
    q, k, v, gate, _ = (t.float().requires_grad_() for t in inputs(1, T, 1, 16, 16, seed=3))
    o, _ = triton_bwd.gla_triton(q, k, v, gate, segment_len=split)
    o.sum().backward()
    assert got == [want]


@interp_only
def test_interp_bad_anchor_fails_at_the_call(monkeypatch):
    from hybridize.ops.gla.triton_bwd import gla_triton

    monkeypatch.setenv("HYBRIDIZE_GLA_DG_ANCHOR", "40")
    q, k, v, gate, _ = (t.float().requires_grad_() for t in inputs(1, 8, 1, 16, 16))
    with pytest.raises(UserError, match="gla_dg_anchor .* multiple of 16 tokens or 0, got 40"):
        gla_triton(q, k, v, gate)


@interp_only
def test_interp_floored_gates_get_no_gradient():
    """Gates far below G_MIN: the gradients equal the reference's through a clamp at G_MIN (zero for the
    floored gates), finite."""
    torch.set_num_threads(1)
    q, k, v, gate, h0 = inputs(1, 40, 2, 16, 16, seed=9)
    gate[0, 5:30, :, :4] = -30.0
    gate[0, 10:12] = -9.0
    compare_grads(q, k, v, gate, h0, chunk_size=16, segment_len=20, strong=gate)


@interp_only
def test_interp_gradient_from_the_final_state_alone():
    """Only the final state is used (the output's gradient is None): dq is zero, the rest flows."""
    from hybridize.ops.gla.triton_bwd import gla_triton

    torch.set_num_threads(1)
    q, k, v, gate, h0 = (t.float().requires_grad_() for t in inputs(1, 30, 1, 16, 16, seed=4))
    _, end = gla_triton(q, k, v, gate, initial_state=h0, output_final_state=True, chunk_size=16, segment_len=20)
    end.sum().backward()
    ref = [t.detach().double().requires_grad_() for t in (q, k, v, gate, h0)]
    naive_recurrent_gla(*ref[:4], initial_state=ref[4], output_final_state=True)[1].sum().backward()
    assert float(q.grad.abs().max()) == 0.0
    for a, b in zip((k, v, gate, h0), ref[1:]):
        assert rel(a.grad, b.grad) < 1e-5


@interp_only
def test_interp_kept_scores_are_each_tiles_scores():
    """`forward_pieces(keep_scores=True)`: row t holds scale * q_t . (k_s * exp(g summed over (s, t])) for the tokens
    s <= t of its 16-token tile (tiles counted from each piece's start), 0 above the diagonal; the same o as without
    them; and `backward_pieces` without them fails in one line."""
    from hybridize.ops.common.triton_utils import make_pieces
    from hybridize.ops.gla.triton_bwd import backward_pieces
    from hybridize.ops.gla.triton_fwd import forward_pieces

    torch.set_num_threads(1)
    B, T, H, K, V, split = 1, 45, 2, 16, 16, 20
    q, k, v, gate, _ = (t.float() for t in inputs(B, T, H, K, V, seed=5))
    pc = make_pieces(B, T, None, None, None, split, q.device)
    o, starts, decay, s_end, scores = forward_pieces(q, k, v, gate, K ** -0.5, None, pc, keep_scores=True)
    o_plain, *_, none = forward_pieces(q, k, v, gate, K ** -0.5, None, pc)
    assert none is None and torch.equal(o, o_plain) and scores.shape == (B * T, H, 16)
    want = torch.zeros(B * T, H, 16)
    cg = gate[0].cumsum(0)                                    # [T, H, K]
    for t in range(T):
        bos = (t // split) * split
        ts = bos + (t - bos) // 16 * 16
        for s in range(ts, t + 1):
            w = (q[0, t] * k[0, s] * torch.exp(cg[t] - cg[s])).sum(-1) * K ** -0.5    # [H]
            want[t, :, s - ts] = w
    assert rel(scores, want) < 1e-5
    with pytest.raises(ValueError, match="keep_scores=True"):
        backward_pieces(q, k, v, gate, torch.ones_like(v), None, starts, s_end, decay, None, pc, K ** -0.5)


@interp_only
def test_interp_scores_are_kept_only_when_a_backward_can_follow(monkeypatch):
    """`gla_triton` asks the forward to keep its scores under gradient only: not under no_grad, nor for inputs
    that need none."""
    from hybridize.ops.gla import triton_bwd

    torch.set_num_threads(1)
    seen, real = [], triton_bwd.forward_pieces

    def spy(*a, keep_scores=False, **kw):
        seen.append(keep_scores)
        return real(*a, keep_scores=keep_scores, **kw)
    monkeypatch.setattr(triton_bwd, "forward_pieces", spy)
    q, k, v, gate, _ = (t.float() for t in inputs(1, 20, 1, 16, 16, seed=6))
    with torch.no_grad():
        triton_bwd.gla_triton(q.requires_grad_(), k, v, gate, chunk_size=16)
    triton_bwd.gla_triton(q.detach(), k, v, gate, chunk_size=16)
    o, _ = triton_bwd.gla_triton(q.detach().requires_grad_(), k, v, gate, chunk_size=16)
    o.sum().backward()
    assert seen == [False, False, True]


@interp_only
@pytest.mark.parametrize("shared,K,emul,split", [(True, 1, (True, True), None), (True, 2, (True, False), 8),
                                                 (False, 1, (False, True), 8), (True, 1, (False, False), 8)])
def test_interp_gather_reads_the_sse_layout_in_place(shared, K, emul, split):
    """`Gather`: the forward reading SSE's shared and sparse tensors where they are equals the forward on the rows
    the packer builds (`sse.pack_rows_torch`), on every row and state the caller keeps (the trash segment of
    dropped pairs aside): two documents, a padding token, K = 1 and 2, router scales on q and / or k, pieces."""
    from hybridize.ops.sse import reference as sse
    from hybridize.ops.gla.triton_fwd import Gather, gla_fwd_triton

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(21)
    L, H, D, N = 45, 2, 16, 4
    paths = []
    for _ in range(2):
        q, k, v, gate, _ = inputs(1, L, H, D, D, seed=int(torch.randint(0, 99, (1,), generator=gen)))
        paths.append([t.float() for t in (q, k, v, gate)])
    sh, sp = paths
    valid = torch.ones(1, L, dtype=torch.bool)
    valid[0, 7] = False
    cu = torch.tensor([0, 20, 45])
    r = sse.route(torch.randn(1, L, N, generator=gen), K, valid)
    plan = sse.varlen_plan(r, cu)
    w = r.probs[0].gather(-1, r.index[0]).reshape(-1)
    L0 = L if shared else 0
    seg_cu = torch.cat([cu, plan.seg_cu[1:] + L]) if shared else plan.seg_cu
    scales = [w if emul[0] else None, w if emul[1] else None, None, None]
    packed = [sse.pack_rows_torch(a if shared else None, b, plan.order, plan.inv, K, scale=c, keep=plan.keep)
              for a, b, c in zip(sh, sp, scales)]
    h0 = torch.randn(len(seg_cu) - 1, H, D, D, generator=gen)
    gather = Gather(*sp, plan.order, w, K, L0, *emul)
    with torch.no_grad():
        want, want_end = gla_fwd_triton(*packed, initial_state=h0, output_final_state=True, cu_seqlens=seg_cu,
                                        chunk_size=16, segment_len=split)
        got, end = gla_fwd_triton(*(sh if shared else sp), initial_state=h0, output_final_state=True,
                                  cu_seqlens=seg_cu, chunk_size=16, segment_len=split, gather=gather)
    kept = int(seg_cu[-2])   # rows from here on are the dropped pairs' trash segment
    assert got.shape == want.shape and kept < got.shape[1]
    assert rel(got[:, :kept], want[:, :kept]) < 1e-6
    assert rel(end[:-1], want_end[:-1]) < 1e-6


@cuda_only
@pytest.mark.parametrize("dtype,tol,products", [(torch.float32, 1e-4, "single"), (torch.bfloat16, 2e-2, "single"),
                                                (torch.bfloat16, 2e-2, "split")])
def test_cuda_gradients_match_recurrent(dtype, tol, products, monkeypatch):
    monkeypatch.setenv("HYBRIDIZE_GLA_PRODUCTS", products)
    q, k, v, gate, h0 = inputs(1, 2100, 4, 128, 128, device="cuda", seed=6, strength=0.3)
    compare_grads(q, k, v, gate, h0, dtype=dtype, tol=tol, segment_len=512)
    cu = torch.tensor([0, 700, 700, 1601, 2100], device="cuda")
    compare_grads(q, k, v, gate, torch.randn(4, 4, 128, 128, device="cuda", dtype=torch.float64), cu=cu,
                  dtype=dtype, tol=tol)


@cuda_only
def test_cuda_gate_gradient_over_a_long_piece(monkeypatch):
    """bf16, one 4096-token piece, mild gates: dg is a suffix sum over the piece whose terms cancel, so its rounding
    grows with the piece's length; the anchors (`gla_dg_anchor`, default 512) reset it to its exact value. With them
    dg's error stays within 2e-2 and well below the same piece's without them."""
    from hybridize.ops.gla.triton_bwd import gla_triton

    q, k, v, gate, _ = inputs(1, 4096, 4, 128, 128, device="cuda", seed=7, strength=0.05)
    do = torch.randn_like(v)

    def dg(fn, dtype, **kw):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k * 128 ** -0.5, v)]
        g = gate.detach().float().requires_grad_()
        o, _ = fn(*leaves, g, **kw)
        (o.double() * do).sum().backward()
        return g.grad.double()

    want = dg(naive_recurrent_gla, torch.float64)
    monkeypatch.delenv("HYBRIDIZE_GLA_DG_ANCHOR", raising=False)
    anchored = rel(dg(gla_triton, torch.bfloat16, segment_len=0), want)
    monkeypatch.setenv("HYBRIDIZE_GLA_DG_ANCHOR", "0")
    plain = rel(dg(gla_triton, torch.bfloat16, segment_len=0), want)
    assert anchored < 2e-2 and anchored < 0.6 * plain, (anchored, plain)


@cuda_only
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_cuda_matches_recurrent(dtype, tol):
    q, k, v, gate, h0 = inputs(1, 4100, 4, 128, 128, device="cuda", seed=5, strength=0.3)
    compare(q, k, v, gate, h0, dtype=dtype, tol=tol)
    cu = torch.tensor([0, 1000, 1000, 3001, 4100], device="cuda")
    compare(q, k, v, gate, torch.randn(4, 4, 128, 128, device="cuda", dtype=torch.float64), cu=cu, dtype=dtype,
            tol=tol)


@interp_only
def test_interp_bad_products_setting_fails_at_the_call(monkeypatch):
    from hybridize.ops.gla.triton_bwd import gla_triton

    monkeypatch.setenv("HYBRIDIZE_GLA_PRODUCTS", "fast")
    q, k, v, gate, _ = (t.float().requires_grad_() for t in inputs(1, 8, 1, 16, 16))
    with pytest.raises(UserError, match=r"HYBRIDIZE_GLA_PRODUCTS='fast' .*must be one of single \| split"):
        gla_triton(q, k, v, gate)


@interp_only
def test_gla_tune_top_keeps_the_first_configs(monkeypatch):
    """Kernel option `gla_tune_top=n`: every autotune list of the pieces GLA keeps its first n configs (tests that only
    check numbers compile fewer); 0 keeps them all."""
    from hybridize.ops.gla import triton_bwd, triton_fwd

    lists = (triton_fwd._out_configs, triton_fwd._state_configs, triton_bwd._dq_configs, triton_bwd._row_configs,
             triton_bwd._col_configs)
    monkeypatch.delenv("HYBRIDIZE_GLA_TUNE_TOP", raising=False)
    full = [f() for f in lists]
    monkeypatch.setenv("HYBRIDIZE_GLA_TUNE_TOP", "1")
    assert [[str(c) for c in f()] for f in lists] == [[str(c[0])] for c in full]
    assert min(len(c) for c in full) > 1


def test_automatic_piece_length_on_sse_layout(monkeypatch):
    """The default `gla_rows` (512) on SSE's 2T-row layout, H=16: 512-token pieces up to 8k, then 1024 / 2048 / 4096
    tokens at 16k / 32k / 64k (the lengths timed fastest on one H200, benchmarks/RESULTS.md); the option overrides."""
    from hybridize.ops.common.options import current_kernel_options
    from hybridize.ops.common.piece_length import piece_len

    for var in ("HYBRIDIZE_GLA_ROWS", "HYBRIDIZE_CCQ_SEGMENT"):
        monkeypatch.delenv(var, raising=False)

    def lengths():
        rows = current_kernel_options().gla_rows
        return [piece_len(1, 2 * T, 16, 2 * T, rows) for T in (4096, 8192, 16384, 32768, 65536)]
    assert lengths() == [512, 512, 1024, 2048, 4096]
    monkeypatch.setenv("HYBRIDIZE_GLA_ROWS", "1024")
    assert lengths() == [512, 512, 512, 1024, 2048]
