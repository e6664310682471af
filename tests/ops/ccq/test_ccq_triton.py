"""Fused Triton CCQ read (`ops.ccq.triton_read.ccq_triton`) against the PyTorch op.

Gates:
- triton importable (CPU, no kernel): the device-side piece table's bounds at the CUDA tests' shapes;
- interpreter: `TRITON_INTERPRET=1` and triton importable (CPU, tiny shapes, chunk 16, odd T): forward
  and gradients (q, k, initial C and mu, through the final state) against `naive_recurrent_ccq` in fp64
  (autograd through the reference), with mask, initial state, varlen (incl. an empty document);
- CUDA: the compiled kernels at T ~ 4k, fp32 and bf16, against the fp64 PyTorch chunked op on the GPU.

    TRITON_INTERPRET=1 PYTHONPATH=/work/triton-site python -m pytest tests/ops/ccq/test_ccq_triton.py
    python -m pytest tests/ops/ccq/test_ccq_triton.py        # on a CUDA machine with triton
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.ops.triton_gates import HAS_TRITON, cuda_only, interp_only, rel


def inputs(B, T, H, K, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=g, dtype=torch.float64)
    k = F.normalize(torch.randn(B, T, H, K, generator=g, dtype=torch.float64) + 0.5, dim=-1)  # mean != 0
    return q.to(device, dtype), k.to(device, dtype)


def state(N, H, K, counts, device="cpu", seed=1):
    """A consistent (C, mu, t): statistics of `counts[i]` random unit keys (t >= 1 everywhere, see below)."""
    g = torch.Generator().manual_seed(seed)
    C = torch.zeros(N, H, K, K, dtype=torch.float64)
    mu = torch.zeros(N, H, K, dtype=torch.float64)
    for i, c in enumerate(counts):
        ks = F.normalize(torch.randn(c, H, K, generator=g, dtype=torch.float64) + 0.5, dim=-1)
        C[i] = torch.einsum("thk,thl->hkl", ks, ks) / c
        mu[i] = ks.mean(0)
    return C.to(device), mu.to(device), torch.tensor(counts, device=device)


def run_both(fn_test, fn_ref, q, k, mask=None, st=None, cu=None, final=True, dtype=torch.float32, seed=3):
    """Outputs and gradients of a random linear loss over o (and the final state) for both ops.

    The reference runs in fp64 on the same (dtype-rounded) inputs. Returns [(name, test, ref), ...]."""
    g = torch.Generator().manual_seed(seed)
    results = []
    for fn, dt in ((fn_test, dtype), (fn_ref, torch.float64)):
        qq = q.detach().to(dt).requires_grad_()
        kk = k.detach().to(dt).requires_grad_()
        leaves = [qq, kk]
        init = None
        if st is not None:
            C0 = st[0].detach().to(torch.float32 if dt != torch.float64 else dt).requires_grad_()
            mu0 = st[1].detach().to(C0.dtype).requires_grad_()
            init = (C0, mu0, st[2])
            leaves += [C0, mu0]
        o, fs = fn(qq, kk, mask=mask, initial_state=init, output_final_state=final, cu_seqlens=cu)
        results.append((o, fs, leaves))
    (o1, fs1, l1), (o2, fs2, l2) = results
    w = torch.randn(o2.shape, generator=g, dtype=torch.float64).to(o2.device)
    loss1, loss2 = (o1.double() * w).sum(), (o2 * w).sum()
    pairs = [("o", o1, o2)]
    if final:
        wC = torch.randn(fs2[0].shape, generator=g, dtype=torch.float64).to(o2.device)
        wm = torch.randn(fs2[1].shape, generator=g, dtype=torch.float64).to(o2.device)
        loss1 = loss1 + (fs1[0].double() * wC).sum() + (fs1[1].double() * wm).sum()
        loss2 = loss2 + (fs2[0] * wC).sum() + (fs2[1] * wm).sum()
        pairs += [("C_end", fs1[0], fs2[0]), ("mu_end", fs1[1], fs2[1])]
        assert torch.equal(fs1[2].cpu(), fs2[2].cpu()), "final counts differ"
    grads1 = torch.autograd.grad(loss1, l1)
    grads2 = torch.autograd.grad(loss2, l2)
    names = ["dq", "dk", "dC0", "dmu0"]
    pairs += [(n, a, b) for n, a, b in zip(names, grads1, grads2)]
    return pairs


def check(pairs, tol):
    bad = {n: rel(a, b) for n, a, b in pairs if rel(a, b) > tol.get(n, tol["*"])}
    assert not bad, f"relative errors above tolerance: {bad}"


# ---- interpreter (CPU) -----------------------------------------------------------------------------

FP32 = {"*": 1e-5}


def _ops(segment_len=None):
    """(kernel op at chunk 16, optionally with the forward split into pieces, reference)."""
    from hybridize.ops.ccq.reference import naive_recurrent_ccq
    from hybridize.ops.ccq.triton_read import ccq_triton

    def test_op(*a, **kw):
        return ccq_triton(*a, chunk_size=16, segment_len=segment_len, **kw)
    return test_op, naive_recurrent_ccq


SPLITS = [None, 32, 20]   # one pass per sequence; pieces of two chunks; pieces that cut a chunk


@interp_only
@pytest.mark.parametrize("T,K,split", [(37, 16, None), (70, 32, None), (33, 12, None), (70, 32, 32)])
def test_interp_plain(T, K, split):
    torch.set_num_threads(1)
    q, k = inputs(2, T, 2, K)
    check(run_both(*_ops(split), q, k), FP32)


@interp_only
@pytest.mark.parametrize("split", SPLITS)
def test_interp_mask_and_state(split):
    torch.set_num_threads(1)
    B, T, H, K = 2, 70, 2, 16
    q, k = inputs(B, T, H, K, seed=4)
    mask = torch.rand(B, T, generator=torch.Generator().manual_seed(5)) > 0.3
    mask[0, :20] = False                      # a leading run of padding (output from the initial state)
    mask[1, -18:] = False                     # trailing padding: more than one chunk of it
    check(run_both(*_ops(split), q, k, mask=mask, st=state(B, H, K, [5, 1])), FP32)


@interp_only
def test_interp_mask_without_state():
    torch.set_num_threads(1)
    B, T, H, K = 2, 37, 2, 16
    q, k = inputs(B, T, H, K, seed=6)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, :3] = False                       # no real token yet: output 0, count clamped
    mask[1, 10:30] = False
    check(run_both(*_ops(), q, k, mask=mask, final=False), FP32)


@interp_only
@pytest.mark.parametrize("split", SPLITS)
def test_interp_varlen(split):
    torch.set_num_threads(1)
    H, K = 2, 16
    cu = torch.tensor([0, 17, 17, 50, 70])    # one empty document: its final state is the initial one
    q, k = inputs(1, 70, H, K, seed=7)
    check(run_both(*_ops(split), q, k, cu=cu, st=state(4, H, K, [2, 3, 1, 9])), FP32)
    mask = torch.rand(1, 70, generator=torch.Generator().manual_seed(8)) > 0.25
    check(run_both(*_ops(split), q, k, mask=mask, cu=cu), FP32)


@interp_only
def test_interp_no_grad_and_errors():
    from hybridize.ops.ccq.triton_read import ccq_triton
    q, k = inputs(1, 20, 1, 16)
    with torch.no_grad():
        o, fs = ccq_triton(q, k, output_final_state=False, chunk_size=16)
    assert fs is None and o.shape == q.shape and o.dtype == q.dtype
    with pytest.raises(ValueError, match="same shape"):
        ccq_triton(q, k[..., :8])
    with pytest.raises(ValueError, match="initial_state"):
        ccq_triton(q, k, initial_state=state(2, 1, 16, [1, 2]))
    with pytest.raises(ValueError, match="chunk_size"):
        ccq_triton(q, k, chunk_size=24)


def _cleaned_ref(q, k, w, b, fixed, **kw):
    """q - lambda Sigma q and the final statistics from the fp64 PyTorch read and gate."""
    from hybridize.ops.ccq import clean as ccq_clean
    from hybridize.ops.ccq.reference import naive_recurrent_ccq

    q64, k64 = q.double(), k.double()
    sig, fs = naive_recurrent_ccq(q64, k64, output_final_state=True, **kw)
    lam = ccq_clean.gate(F.normalize(q64, dim=-1), None if w is None else w.double(),
                         None if b is None else b.double(), fixed)
    return q64 - lam.unsqueeze(-1) * sig, fs


@interp_only
@pytest.mark.parametrize("fixed", [None, 0.3])
@pytest.mark.parametrize("split", SPLITS)
def test_interp_read_cleans_in_its_epilogue(fixed, split):
    """`clean=`: the output pass writes q - lambda Sigma q itself (inference), with padding, an initial state
    and varlen documents; the statistics are the plain read's. With a gradient wanted it refuses."""
    from hybridize.ops.ccq.triton_read import ccq_triton

    torch.set_num_threads(1)
    H, K = 2, 16
    g = torch.Generator().manual_seed(11)
    w, b = torch.randn(H, K, generator=g) * 0.7, torch.randn(H, generator=g)
    gate = (None, None, fixed) if fixed is not None else (w, b, None)
    q, k = inputs(2, 45, H, K, seed=12)
    mask = torch.rand(2, 45, generator=g) > 0.3
    mask[1, :9] = False
    st = state(2, H, K, [3, 1])
    cases = [dict(mask=mask, initial_state=(st[0].float(), st[1].float(), st[2])),
             dict(cu_seqlens=torch.tensor([0, 17, 17, 45]))]
    for kw in cases:
        qq, kk = (q[:1], k[:1]) if "cu_seqlens" in kw else (q, k)
        with torch.no_grad():
            got, fs = ccq_triton(qq, kk, output_final_state=True, chunk_size=16, segment_len=split, clean=gate, **kw)
        ref_kw = dict(kw, initial_state=None if "initial_state" not in kw else tuple(t.double() if t.is_floating_point()
                                                                                      else t for t in st))
        want, fs_ref = _cleaned_ref(qq, kk, *gate, **ref_kw)
        assert rel(got, want) < 1e-5, rel(got, want)
        assert rel(fs[0], fs_ref[0]) < 1e-5 and rel(fs[1], fs_ref[1]) < 1e-5
        assert torch.equal(fs[2].cpu(), fs_ref[2].cpu())
    with pytest.raises(ValueError, match="no backward"):
        ccq_triton(q.requires_grad_(), k, chunk_size=16, clean=gate)


@interp_only
def test_interp_gpu_cleaning_uses_the_read_epilogue_without_grad(monkeypatch):
    """The chunk-mode GPU cleaning hands the gate to the read when nothing needs a gradient (no separate
    gate pass), and runs the separate pass when something does; both equal the PyTorch cleaning."""
    from hybridize.ops.ccq import clean as ccq_clean
    from hybridize.ops.ccq import triton_clean as fused
    from hybridize.ops.ccq.triton_read import ccq_triton

    torch.set_num_threads(1)
    H, K = 2, 16
    q, k = inputs(1, 40, H, K, seed=13)
    g = torch.Generator().manual_seed(14)
    w, b = torch.randn(H, K, generator=g), torch.randn(H, generator=g)
    seen = []

    def read(qq, kk, **extra):
        seen.append("clean" in extra)
        return ccq_triton(qq, kk, output_final_state=True, chunk_size=16, **extra)

    def torch_read(qq, kk):
        from hybridize.ops.ccq.reference import chunk_ccq
        return chunk_ccq(qq, kk, output_final_state=True)
    want, _ = ccq_clean.chunk_ccq_clean(q.double(), k.double(), w.double(), b.double(), None, torch_read,
                                        unit_keys=True)
    with torch.no_grad():
        got, _ = fused.ccq_clean_fused_chunk(q, k, w, b, None, read, unit_keys=True)
    assert seen == [True] and rel(got, want) < 1e-5
    wg = w.clone().requires_grad_()
    got, _ = fused.ccq_clean_fused_chunk(q, k, wg, b, None, read, unit_keys=True)
    assert seen == [True, False] and rel(got, want) < 1e-5
    got.sum().backward()
    assert wg.grad is not None


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton importable (the module imports it; no kernel runs)")
@pytest.mark.parametrize("B,T,H,cu,split", [(2, 4099, 4, None, None), (2, 4099, 4, None, 0),
                                            (1, 4100, 4, [0, 1000, 1000, 3001, 4100], None),
                                            (1, 4100, 4, [0, 1000, 1000, 3001, 4100], 300),
                                            (1, 70, 2, [0, 17, 17, 50, 70], 20), (2, 300, 2, None, None)])
def test_segment_table_bounds_at_cuda_shapes(B, T, H, cu, split):
    """The device-side piece table (`make_pieces`, pure PyTorch) at the CUDA tests' shapes, on the CPU (where
    an index out of range raises instead of a device assert): every piece lies inside the row, pieces
    of a sequence are contiguous and cover exactly its tokens, counts match the mask."""
    from hybridize.ops.common.piece_length import piece_len
    from hybridize.ops.common.triton_utils import make_pieces
    cu_t = None if cu is None else torch.tensor(cu)
    N = B if cu is None else len(cu) - 1
    mask = torch.rand(B, T, generator=torch.Generator().manual_seed(0)) > 0.1
    n0 = torch.arange(N) * 3
    seg_len = (piece_len(B, T, H, T if cu is None else B * T) if split is None
               else (None if split <= 0 else split))
    pc = make_pieces(B, T, cu_t, mask.to(torch.int8), n0, seg_len, n0.device)
    seg, segs, n_end = pc.seg, pc.segs, pc.n_end
    G = seg.shape[0]
    assert bool((seg[:, 0] >= 0).all()) and bool((seg.sum(1) <= B * T).all()) and bool((seg[:, 1] >= 0).all())
    assert bool((segs[:, 0] >= 0).all()) and bool((segs.sum(1) <= G).all())
    starts = torch.arange(B) * T if cu is None else cu_t[:-1]
    lens = torch.full((B,), T) if cu is None else cu_t.diff()
    flat = mask.reshape(-1)
    for i in range(N):
        first, count = (int(x) for x in segs[i])
        pieces = seg[first:first + count]
        assert int(pieces[:, 1].sum()) == int(lens[i]), i
        if count:
            assert int(pieces[0, 0]) == int(starts[i]), i
            assert torch.equal(pieces[1:, 0], (pieces[:-1, 0] + pieces[:-1, 1])), i
        for j in range(first, first + count):   # counts before / after each piece, its sequence
            b, n = (int(x) for x in seg[j])
            before = int(n0[i]) + int(flat[int(starts[i]):b].sum())
            assert int(pc.seq[j]) == i and int(pc.n_before[j]) == before, (i, j)
            assert int(pc.n_after[j]) == before + int(flat[b:b + n].sum()), (i, j)
        s0 = int(starts[i])
        assert int(n_end[i]) == int(n0[i]) + int(flat[s0:s0 + int(lens[i])].sum()), i
    assert torch.equal(pc.n_div, n_end.clamp(min=1).float())


def test_segment_len_rule(monkeypatch):
    """Piece length: ~128 (piece, head) rows, 512..4096 tokens, none when one piece would hold the whole
    sequence; the environment overrides."""
    from hybridize.ops.common.piece_length import piece_len
    monkeypatch.delenv("HYBRIDIZE_CCQ_SEGMENT", raising=False)
    monkeypatch.delenv("HYBRIDIZE_CCQ_ROWS", raising=False)
    assert [piece_len(1, T, 16, T) for T in (4096, 16384, 32768, 65536)] == [512, 2048, 4096, 4096]
    monkeypatch.setenv("HYBRIDIZE_CCQ_ROWS", "64")
    assert [piece_len(1, T, 16, T) for T in (4096, 16384, 32768)] == [1024, 4096, 4096]
    monkeypatch.delenv("HYBRIDIZE_CCQ_ROWS")
    assert piece_len(1, 512, 16, 512) is None and piece_len(8, 8192, 32, 8192) == 4096
    monkeypatch.setenv("HYBRIDIZE_CCQ_SEGMENT", "0")
    assert piece_len(1, 16384, 16, 16384) is None
    monkeypatch.setenv("HYBRIDIZE_CCQ_SEGMENT", "300")
    assert piece_len(1, 16384, 16, 16384) == 300


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton importable (the module imports it; no kernel runs)")
def test_autotuners_keep_their_whole_lists_under_the_global_cap(monkeypatch):
    """The read's autotuners (passes and piece sums) are exempt from HYBRIDIZE_AUTOTUNE_TOP (meant for fla's
    long lists): capped to one config, each still tunes over its whole short list."""
    from hybridize.ops.ccq import triton_read as cr
    from hybridize.ops.common import triton_utils as tu
    from hybridize.ops.common.autotune import limit_autotune

    monkeypatch.delenv("HYBRIDIZE_CCQ_TUNE_TOP", raising=False)   # the read's own cap (tests that check numbers)

    saved = dict(tu.TUNED)
    tu.TUNED.clear()
    try:
        limit_autotune(1)
        for kernel, configs in ((cr._ccq_fwd_kernel, cr._configs), (cr._piece_sums_kernel, cr._sums_configs),
                                (cr._piece_grad_sums_kernel, cr._sums_configs)):
            tuned = tu.autotuned(kernel, configs, ["K"])
            assert len(tuned.prune_configs({})) == len(configs()) > 1
            # picks persist on disk (a new length bucket is tuned once per machine); Triton turns this off when
            # interpreting
            assert tuned.cache_results or tu.interpreting()
    finally:
        limit_autotune(0)
        tu.TUNED.clear()
        tu.TUNED.update(saved)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton importable (the module imports it; no kernel runs)")
def test_pass_autotuners_tune_per_length_bucket(monkeypatch):
    """The passes' autotune key holds power-of-two buckets of the token count and of the rows, so a tile picked
    at 4k is not reused at 32k (an H100 sweep: the best tile at 16k was 2x slow at 32k), nor one picked for a
    training step's rows by a forward alone with half as many."""
    from hybridize.ops.ccq import triton_read as cr

    seen = []

    class Tuned:
        def __getitem__(self, grid):
            return lambda *a, **kw: seen.append(kw)

    monkeypatch.setattr(cr, "interpreting", lambda: False)
    monkeypatch.setattr(cr, "autotuned", lambda kernel, configs, key: seen.append(key) or Tuned())
    for tokens, rows in ((4096, 64), (5000, 64), (32768, 64), (4096, 128)):
        cr._launch(cr._ccq_fwd_kernel, rows, 128, None, (), {"HAS_MASK": False}, tokens)
    keys, kws = seen[0::2], seen[1::2]
    assert all("LEN" in key and "ROWS" in key for key in keys)
    assert [(kw["LEN"], kw["ROWS"]) for kw in kws] == [(4096, 64), (8192, 64), (32768, 64), (4096, 128)]


# ---- CUDA (compiled kernels) -----------------------------------------------------------------------

def _cuda_ops(segment_len=None):
    """(compiled op: forward split automatically, or 0 = one pass per sequence; fp64 PyTorch chunk op)."""
    from hybridize.ops.ccq.reference import chunk_ccq
    from hybridize.ops.ccq.triton_read import ccq_triton

    def test_op(*a, **kw):
        return ccq_triton(*a, segment_len=segment_len, **kw)
    return test_op, chunk_ccq


# fp32: IEEE dots, sums over ~4k tokens; bf16: the output and gradients are rounded to bf16 (~4e-3)
CUDA_TOL = {torch.float32: {"*": 5e-5, "o": 1e-5, "C_end": 1e-5, "mu_end": 1e-5},
            torch.bfloat16: {"*": 2e-2}}


@cuda_only
@pytest.mark.parametrize("split", [None, 0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_long(dtype, split):
    B, T, H, K = 2, 4099, 4, 128
    q, k = inputs(B, T, H, K, dtype=dtype, device="cuda", seed=11)
    mask = torch.rand(B, T, device="cuda") > 0.1
    mask[1, :100] = False
    st = state(B, H, K, [7, 300], device="cuda")
    check(run_both(*_cuda_ops(split), q, k, mask=mask, st=st, dtype=dtype), CUDA_TOL[dtype])
    check(run_both(*_cuda_ops(split), q, k, dtype=dtype, final=False), CUDA_TOL[dtype])


@cuda_only
@pytest.mark.parametrize("split", [None, 0, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_varlen(dtype, split):
    H, K = 4, 128
    cu = torch.tensor([0, 1000, 1000, 3001, 4100], device="cuda")
    q, k = inputs(1, 4100, H, K, dtype=dtype, device="cuda", seed=12)
    st = state(4, H, K, [1, 2, 50, 3], device="cuda")
    check(run_both(*_cuda_ops(split), q, k, cu=cu, st=st, dtype=dtype), CUDA_TOL[dtype])


@cuda_only
def test_cuda_mixer_through_dispatch():
    """CCQ-GLA with the fused read registered for ccq/chunk: same output and gradients as the current
    GPU path (fla `chunk_gla` read), fp32."""
    from hybridize.ops import gpu
    from hybridize.ops.ccq import fla as ccq_fla
    from hybridize.ops.common import registry
    from hybridize.ops.ccq.triton_read import ccq_triton
    from hybridize.mixers.ccq import CCQGLA, CCQGLAConfig

    if not gpu.activate():
        pytest.skip("fla-core not importable")
    torch.manual_seed(0)
    cfg = CCQGLAConfig(hidden_size=256, num_heads=2, num_kv_heads=2, head_dim=128, ccq_fixed_lambda=0.7)
    mixer = CCQGLA(cfg).cuda()
    x = torch.randn(2, 300, 256, device="cuda")
    saved = registry._GPU[("ccq", "chunk")]
    outs = []
    try:
        for fn in (ccq_triton, ccq_fla.chunk_ccq):
            registry.register_gpu("ccq", "chunk", fn)
            mixer.zero_grad()
            y = mixer(x, mode="chunk").hidden
            y.square().sum().backward()
            outs.append((y.detach(), mixer.q_proj.weight.grad.clone()))
    finally:
        registry.register_gpu("ccq", "chunk", saved)
    (y1, g1), (y2, g2) = outs
    assert rel(y1, y2) < 2e-3 and rel(g1, g2) < 2e-3   # the current path reads in tf32 inside chunk_gla


def _shared_direction_keys(B, T, H, K, seed):
    """Unit keys within ~27 degrees of one direction per head (noise of norm 0.5 around it): C_t q and
    mu_t mu_t^T q nearly cancel, which is where a 16-bit product of sums carried about zero goes wrong."""
    g = torch.Generator().manual_seed(seed)
    d = F.normalize(torch.randn(H, K, generator=g, dtype=torch.float64), dim=-1)
    k = F.normalize(d + torch.randn(B, T, H, K, generator=g, dtype=torch.float64) * (0.5 / K ** 0.5), dim=-1)
    q = torch.randn(B, T, H, K, generator=g, dtype=torch.float64)
    return q.cuda().bfloat16(), k.cuda().bfloat16()


#: bf16 with keys sharing a direction: output within 1e-2 of fp64 (bf16 rounding of o alone is ~2e-3)
SHARED_TOL = {"*": 2e-2, "o": 1e-2}


@cuda_only
@pytest.mark.parametrize("products", ["single", "split", "tf32"])
def test_cuda_bf16_keys_sharing_a_direction(products, monkeypatch):
    monkeypatch.setenv("HYBRIDIZE_CCQ_PRODUCTS", products)
    q, k = _shared_direction_keys(2, 4099, 4, 128, seed=13)
    mask = torch.rand(2, 4099, device="cuda") > 0.1
    check(run_both(*_cuda_ops(), q, k, mask=mask, dtype=torch.bfloat16), SHARED_TOL)


@cuda_only
def test_cuda_bf16_single_products_need_the_centre(monkeypatch):
    """The same case with the sums carried about zero instead of the keys' mean: the single bf16 product's
    output error leaves the tolerance, so the centre is what makes the default setting accurate."""
    from hybridize.ops.ccq import triton_read as ccq_read

    monkeypatch.setenv("HYBRIDIZE_CCQ_PRODUCTS", "single")
    monkeypatch.setattr(ccq_read, "_mean_key", lambda M, n: torch.zeros_like(M))
    q, k = _shared_direction_keys(2, 4099, 4, 128, seed=13)
    pairs = dict((n, rel(a, b)) for n, a, b in run_both(*_cuda_ops(), q, k, dtype=torch.bfloat16, final=False))
    assert pairs["o"] > SHARED_TOL["o"], pairs


def _cuda_cleaned(q, k, segment_len, dtype=torch.bfloat16, **kw):
    """(the read's cleaning epilogue on CUDA in `dtype`, the fp64 PyTorch read + gate) for a random gate."""
    from hybridize.ops.ccq.triton_read import ccq_triton

    H, K = q.shape[-2:]
    g = torch.Generator().manual_seed(21)
    w, b = (torch.randn(H, K, generator=g) * 0.7).cuda(), torch.randn(H, generator=g).cuda()
    with torch.no_grad():
        got, _ = ccq_triton(q.to(dtype), k.to(dtype), segment_len=segment_len, clean=(w, b, None), **kw)
    want, _ = _cleaned_ref(q.to(dtype), k.to(dtype), w, b, None, **kw)
    return got, want


@cuda_only
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_cuda_read_cleans_in_its_epilogue(dtype, tol):
    """`clean=` on the compiled kernels: pieces and one pass per sequence, padding, varlen documents."""
    q, k = inputs(1, 4100, 4, 128, device="cuda", seed=22)
    mask = (torch.rand(1, 4100, generator=torch.Generator().manual_seed(23)) > 0.2).cuda()
    cu = torch.tensor([0, 1000, 1000, 3001, 4100], device="cuda")
    for split in (None, 0):
        for kw in (dict(mask=mask), dict(cu_seqlens=cu)):
            got, want = _cuda_cleaned(q, k, split, dtype, **kw)
            assert rel(got, want) < tol, (split, list(kw), rel(got, want))


@cuda_only
def test_cuda_every_autotune_config(monkeypatch):
    """Each tile configuration the autotuner may pick, alone (tests elsewhere run the first one only):
    bf16 forward and gradients against fp64, default products, pieces on."""
    from hybridize.ops.ccq import triton_read as ccq_read
    from hybridize.ops.common import triton_utils

    monkeypatch.delenv("HYBRIDIZE_CCQ_TUNE_TOP", raising=False)
    q, k = _shared_direction_keys(1, 2500, 4, 128, seed=14)
    # the passes' table, then the piece sums' table (the other one at its first entry meanwhile)
    for table in ("_configs", "_sums_configs"):
        configs = getattr(ccq_read, table)()
        assert len(configs) > 1
        for i, cfg in enumerate(configs):
            monkeypatch.setattr(ccq_read, table, lambda cfg=cfg: [cfg])
            triton_utils.TUNED.clear()
            pairs = run_both(*_cuda_ops(600), q, k, dtype=torch.bfloat16)
            if table == "_configs":  # the forward pass's cleaning epilogue (inference) too
                got, want = _cuda_cleaned(q, k, 600)
                pairs.append(("q_clean", got, want))
            bad = {n: rel(a, b) for n, a, b in pairs if rel(a, b) > SHARED_TOL.get(n, SHARED_TOL["*"])}
            assert not bad, (table, i, cfg, bad)
        monkeypatch.setattr(ccq_read, table, lambda configs=configs: configs[:1])
    triton_utils.TUNED.clear()


@interp_only
def test_interp_only_the_final_state_used():
    """A loss on the final statistics alone (the output unused: autograd hands the op no output gradient):
    dk as the reference's, dq zero."""
    from hybridize.ops.ccq.reference import naive_recurrent_ccq
    from hybridize.ops.ccq.triton_read import ccq_triton

    torch.set_num_threads(1)
    q, k = inputs(1, 37, 2, 16, seed=9)
    grads = []
    for fn, dt, kw in ((ccq_triton, torch.float32, {"chunk_size": 16}), (naive_recurrent_ccq, torch.float64, {})):
        qq, kk = q.to(dt).requires_grad_(), k.to(dt).requires_grad_()
        _, (C, mu, _) = fn(qq, kk, output_final_state=True, **kw)
        dq, dk = torch.autograd.grad((C * C).sum() + mu.sum(), [qq, kk], allow_unused=True)
        grads.append((dq, dk))
    (dq, dk), (_, dk_ref) = grads
    assert dq is None or not dq.any()
    assert rel(dk, dk_ref) < 1e-5
