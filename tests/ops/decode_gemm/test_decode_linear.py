"""The decode-step GEMM (`ops/decode_gemm/triton_gemm.py`) and its dispatcher (`ops/decode_gemm/route.py`).

Reference: `F.linear` in fp32 on the same 16-bit values, rounded once to the output dtype. The kernel
runs under TRITON_INTERPRET=1 on CPU (its bf16 dot is done in fp32 there: the interpreter's own bf16 dot is
wrong) and on CUDA in bf16/fp16 tensor-core dots. The dispatcher tests need neither: they check when the
kernel applies, that everything else is F.linear bit for bit, and that `linears_routed` patches exactly
the plain linears of a model and restores them. A fast-generation test checks the wiring end to end.
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hybridize.ops.decode_gemm import route as dl

TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = TRITON and os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()
CUDA = TRITON and torch.cuda.is_available()
needs_kernel = pytest.mark.skipif(not (INTERPRET or CUDA), reason="needs CUDA or TRITON_INTERPRET=1 with triton")
DEVICE = "cuda" if CUDA else "cpu"

# (rows, N, K): odd N (a partial last column block), K below / not a multiple of / a multiple of the K tile
SHAPES = [(1, 33, 17), (3, 70, 200), (8, 50, 40), (16, 64, 96), (8, 130, 256)]


def _reference(x, w, b):
    return F.linear(x.float(), w.float(), None if b is None else b.float())


# None: the config picked for the shape (on CUDA timed against cuBLAS); the others force split-K paths,
# including slices that start past K (3 x 32 > 17) and a partial last slice
CONFIGS = [None, dict(BN=16, BK=32, SPLIT=2), dict(BN=32, BK=16, SPLIT=3, num_warps=2)]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,N,K", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("config", CONFIGS, ids=["picked", "split2", "split3"])
def test_kernel_matches_fp32_reference(dtype, rows, N, K, bias, config):
    from hybridize.ops.decode_gemm.triton_gemm import decode_linear_triton

    torch.manual_seed(rows * 1000 + N + K)
    x = torch.randn(rows, K, device=DEVICE).to(dtype)
    w = torch.randn(N, K, device=DEVICE).to(dtype)
    b = torch.randn(N, device=DEVICE).to(dtype) if bias else None
    y = decode_linear_triton(x, w, b, config=config)
    ref = _reference(x, w, b)
    assert y.shape == (rows, N) and y.dtype == dtype
    # fp32 accumulation in another order, then one rounding to the output dtype: within 1 ulp of |ref|
    ulp = torch.finfo(dtype).eps
    assert torch.allclose(y.float(), ref, rtol=2 * ulp, atol=2 * ulp * ref.abs().max().item())


@needs_kernel
def test_every_candidate_config_matches_fp32_reference():
    """Each config the choice may pick, on a K past one 1024-wide tile and not a multiple of any tile (masked
    tails) and an N past one column block: a config that is wrong only at some tile shape fails here, not later in
    a decode step that happened to pick it."""
    from hybridize.ops.decode_gemm import triton_gemm as kern

    torch.manual_seed(3)
    x = torch.randn(8, 1100, device=DEVICE).to(torch.bfloat16)
    w = torch.randn(150, 1100, device=DEVICE).to(torch.bfloat16)
    ref = _reference(x, w, None)
    tol = 2 * torch.finfo(torch.bfloat16).eps * ref.abs().max().item()
    for cfg in kern.CONFIGS:
        y = kern.decode_linear_triton(x, w, None, config=cfg)
        assert torch.allclose(y.float(), ref, rtol=2 * torch.finfo(torch.bfloat16).eps, atol=tol), kern._name(cfg)


@needs_kernel
def test_kernel_strided_rows_and_leading_dims():
    """x `[B, 1, K]` as a column slice of a wider tensor (SSE's fused projection feeds one this way)."""
    from hybridize.ops.decode_gemm.triton_gemm import decode_linear_triton

    torch.manual_seed(0)
    wide = torch.randn(5, 1, 90, device=DEVICE).bfloat16()
    x = wide[..., 10:74]                                # row stride 90, K = 64
    w = torch.randn(24, 64, device=DEVICE).bfloat16()
    y = decode_linear_triton(x, w)
    assert y.shape == (5, 1, 24)
    ref = _reference(x, w, None)
    assert torch.allclose(y.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


@needs_kernel
def test_choice_is_the_fastest_timed_candidate(monkeypatch):
    """The per-shape choice: every candidate is timed once on the real tensors, the fastest kept (cuBLAS when
    it wins), a config that fails is skipped, the choice is reused, and nothing is timed during a capture."""
    from hybridize.ops.decode_gemm import triton_gemm as kern

    x = torch.randn(4, 64, device=DEVICE).bfloat16()
    w = torch.randn(48, 64, device=DEVICE).bfloat16()
    ref = _reference(x, w, None)
    timed = []

    def fake_bench(fn, device):
        fn()                       # every candidate runs once on the real tensors
        timed.append(fn)
        n = len(timed)
        if n == 3:
            raise RuntimeError("out of shared memory")
        return {1: 5.0, 6: 1.0}.get(n, 3.0)      # cuBLAS is timed first (5.0); candidate 5 is fastest

    monkeypatch.setattr(kern, "time_cold", fake_bench)
    monkeypatch.setattr(kern, "_CHOICE", {})
    monkeypatch.setattr(kern, "_TIMINGS", {})
    key = (48, 64, 4, torch.bfloat16, False)
    best = kern._choose(x, w, None, key)
    assert best == kern.CONFIGS[4] and kern._CHOICE[key] == best
    assert len(timed) == 1 + len(kern.CONFIGS)
    shown = kern.choices()["48x64 m=4 bfloat16"]
    assert shown["choice"] == kern._name(best) and len(shown["us"]) == len(kern.CONFIGS)   # one failed
    # cuBLAS (timed first) wins when it is fastest
    calls = []

    def cublas_fastest(fn, device):
        calls.append(fn)
        return 0.5 if len(calls) == 1 else 2.0

    monkeypatch.setattr(kern, "time_cold", cublas_fastest)
    assert kern._choose(x, w, None, ("other",)) == "cublas"
    # out of memory while timing (the L2 flush buffer): cuBLAS, no error
    def oom(fn, device):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(kern, "time_cold", oom)
    assert kern._choose(x, w, None, ("full",)) == "cublas"
    # the kept config computes the product
    out = torch.empty(4, 48, dtype=torch.bfloat16, device=DEVICE)
    kern._launch(x, w, None, out, best)
    assert torch.allclose(out.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())
    # the kept choice is reused without timing again; during a capture an untimed shape gets cuBLAS, untimed
    monkeypatch.setattr(kern, "time_cold", lambda fn, device: pytest.fail("timed again"))
    assert kern._picked(x, w, None) == best
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    x5 = torch.randn(5, 64, device=DEVICE).bfloat16()
    assert kern._picked(x5, w, None) == "cublas"
    assert (48, 64, 5, torch.bfloat16, False) not in kern._CHOICE


@needs_kernel
@pytest.mark.skipif(not CUDA, reason="timing runs on CUDA only")
def test_timed_choice_and_custom_op_on_cuda():
    """The timed choice on a real shape (every config compiles and runs), through the registered op, then
    replayed from a CUDA graph with new inputs."""
    from hybridize.ops.decode_gemm import triton_gemm as kern

    torch.manual_seed(0)
    x = torch.randn(8, 1, 2048, device="cuda").bfloat16()
    w = torch.randn(6144, 2048, device="cuda").bfloat16()
    ref = _reference(x, w, None)
    y = dl.decode_linear(x, w, None, "auto")
    torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=2e-2 * ref.abs().max().item())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        z = dl.decode_linear(x, w, None, "auto")
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    ref = _reference(x, w, None)
    torch.testing.assert_close(z.float(), ref, rtol=1e-2, atol=2e-2 * ref.abs().max().item())
    shown = kern.choices()["6144x2048 m=8 bfloat16"]
    assert len(shown["us"]) > len(kern.CONFIGS) // 2 and "cublas" in shown["us"]


@pytest.mark.skipif(not (CUDA and torch.cuda.get_device_capability()[0] >= 9), reason="PDL needs a Hopper or later GPU")
def test_pdl_chain_in_a_cuda_graph_matches_plain_launches():
    """Kernel option pdl: each GEMM is launched before the kernel producing its input has finished and waits
    in-kernel. A chain behind a long cuBLAS GEMM (the producer), split-K and not, replayed from a CUDA graph with
    new inputs, gives the plain launches' outputs bit for bit; a missing wait would read a stale input."""
    from hybridize.ops.common.options import use_kernel_options
    from hybridize.ops.common.pdl import pdl_launch
    from hybridize.ops.decode_gemm.triton_gemm import decode_linear_triton

    torch.manual_seed(0)
    big = torch.randn(4096, 4096, device="cuda").bfloat16()
    src = torch.randn(8, 4096, device="cuda").bfloat16()
    w1 = torch.randn(2048, 4096, device="cuda").bfloat16() / 64
    w2 = torch.randn(1000, 2048, device="cuda").bfloat16() / 32
    w3 = torch.randn(3000, 1000, device="cuda").bfloat16() / 32
    cfg1, cfg2, cfg3 = dict(BN=16, BK=256, SPLIT=1), dict(BN=32, BK=256, SPLIT=4), dict(BN=64, BK=128, SPLIT=1)

    def chain():
        x = (src @ big)[:, :4096] / 64                      # the slow producer: a cuBLAS GEMM over 4096 x 4096
        y = decode_linear_triton(x, w1, config=cfg1)
        z = decode_linear_triton(y, w2, config=cfg2)
        return decode_linear_triton(torch.tanh(z), w3, config=cfg3)

    outs = {}
    for pdl in (False, True):
        with use_kernel_options(pdl=pdl):
            assert pdl_launch(src.device) == pdl
            chain()   # compile outside the capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = chain()
        got = []
        for seed in range(5):
            torch.manual_seed(100 + seed)
            src.copy_(torch.randn_like(src))
            g.replay()
            got.append(out.clone())
        torch.cuda.synchronize()
        outs[pdl] = got
    for a, b in zip(outs[False], outs[True]):
        assert torch.equal(a, b)


def test_pdl_applies_only_on_hopper_gpus_with_the_option(monkeypatch):
    """The option turns PDL on for CUDA tensors only; the interpreter and CPU tensors never launch with it, and a
    compiled step asks inductor for its PDL kernels only under the option."""
    from hybridize.generation.fast import _inductor_options
    from hybridize.ops.common.options import KernelOptions, use_kernel_options
    from hybridize.ops.common.pdl import pdl_launch

    assert KernelOptions.from_env({"HYBRIDIZE_PDL": "0"}).pdl is False
    assert KernelOptions().pdl is True
    with use_kernel_options(pdl=True):
        assert not pdl_launch(torch.device("cpu"))
        import torch._inductor.config as ic
        want = {"triton.enable_pdl": True} if hasattr(ic.triton, "enable_pdl") else None
        assert _inductor_options(use_graphs=True) == want
        assert _inductor_options(use_graphs=False) is None      # without graphs: inductor's static launcher
        monkeypatch.setattr(torch.version, "hip", "6.0")       # ROCm's devices are "cuda" too
        assert not pdl_launch(torch.device("cuda", 0))
        monkeypatch.setattr(torch.version, "hip", None)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert not pdl_launch(torch.device("cuda", 0))
    with use_kernel_options(pdl=False):
        assert _inductor_options(use_graphs=True) is None


def test_check_args_one_line_errors():
    from hybridize.ops.decode_gemm.triton_gemm import check_args

    w = torch.zeros(4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="at most 16 rows"):
        check_args(torch.zeros(17, 8, dtype=torch.bfloat16), w, None)
    with pytest.raises(ValueError, match="bf16/fp16"):
        check_args(torch.zeros(2, 8), w.float(), None)
    with pytest.raises(ValueError, match="do not fit"):
        check_args(torch.zeros(2, 7, dtype=torch.bfloat16), w, None)
    with pytest.raises(ValueError, match="row-major"):
        check_args(torch.zeros(2, 4, dtype=torch.bfloat16), w.t(), None)
    with pytest.raises(ValueError, match="bias"):
        check_args(torch.zeros(2, 8, dtype=torch.bfloat16), w, torch.zeros(5, dtype=torch.bfloat16))


def test_applies_only_where_the_kernel_can_run():
    x = torch.zeros(8, 1, 64, dtype=torch.bfloat16)
    w = torch.zeros(32, 64, dtype=torch.bfloat16)
    assert not dl.applies(x, w, "auto")            # CPU under auto: never
    assert not dl.applies(x, w, "torch")
    assert not dl.applies(x.float(), w.float(), "triton")                      # fp32: tf32 dots, not F.linear
    assert not dl.applies(torch.zeros(17, 64, dtype=torch.bfloat16), w, "triton")   # too many rows
    assert not dl.applies(x, torch.zeros(64, 32, dtype=torch.bfloat16).t(), "triton")  # column-major weight
    assert dl.applies(x, w, "triton") == INTERPRET
    with pytest.raises(ValueError, match="auto | triton | torch"):
        dl.check_mode("cublas")


def test_fallback_is_f_linear_bit_for_bit():
    torch.manual_seed(0)
    for x, w, b in [(torch.randn(3, 40), torch.randn(50, 40), torch.randn(50)),             # fp32
                    (torch.randn(20, 40).bfloat16(), torch.randn(50, 40).bfloat16(), None)]:  # 20 rows
        assert torch.equal(dl.decode_linear(x, w, b, "triton"), F.linear(x, w, b))
        assert torch.equal(dl.decode_linear(x, w, b), F.linear(x, w, b))   # no block: mode "torch"


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4, bias=False)
        self.hooked = nn.Linear(4, 4)
        self.hooked.forward = lambda x: x * 2          # someone else's forward override: left alone
        self.emb = nn.Embedding(5, 8)

    def forward(self, x):
        return self.hooked(self.b(torch.relu(self.a(x))))


def test_linears_routed_patches_plain_linears_and_restores(monkeypatch):
    net = _Net()
    calls = []
    real = dl.decode_linear

    def counting(x, w, b=None, mode=None):
        calls.append((tuple(w.shape), mode))
        return real(x, w, b, mode)

    monkeypatch.setattr(dl, "decode_linear", counting)
    x = torch.randn(2, 8)
    before = net(x)
    with dl.linears_routed(net, "triton") as n:
        assert n == 2
        assert dl._ACTIVE == "triton"
        forwards = (net.a.forward, net.b.forward)
        inside = net(x)
    assert calls == [((16, 8), "triton"), ((4, 16), "triton")]
    assert torch.equal(inside, before)                     # fp32 on CPU: F.linear itself
    assert "forward" not in net.a.__dict__ and "forward" not in net.b.__dict__
    assert "forward" in net.hooked.__dict__ and dl._ACTIVE == "torch"
    with dl.linears_routed(net, "triton"):                 # the same function objects: no recompiles
        assert (net.a.forward, net.b.forward) == forwards
    with pytest.raises(RuntimeError):                      # restored when the block raises
        with dl.linears_routed(net, "auto"):
            raise RuntimeError("boom")
    assert "forward" not in net.a.__dict__ and dl._ACTIVE == "torch"
    # a deep copy (TRL's reference model) routes through its own weights, not the original's
    import copy

    twin = copy.deepcopy(net)
    with torch.no_grad():
        twin.a.weight.mul_(2)
    with dl.linears_routed(twin, "triton"):
        routed = twin.a(x)
    assert torch.equal(routed, F.linear(x, twin.a.weight, twin.a.bias))
    assert not torch.equal(routed, F.linear(x, net.a.weight, net.a.bias))
    with dl.linears_routed(net, "torch") as n:
        assert n == 0 and "forward" not in net.a.__dict__
    with pytest.raises(ValueError, match="decode GEMM mode"):
        with dl.linears_routed(net, "fast"):
            pass


@needs_kernel
@pytest.mark.skipif(CUDA, reason="the CPU interpreter wiring check (CUDA runs the graph test in tests/generation/test_fast.py)")
def test_fast_generate_through_the_kernel(monkeypatch):
    """A tiny bf16 SSE hybrid (fused decode projections included) decodes through the kernel: every decode
    step's linears run it, and the logits stay within bf16 rounding of the F.linear run."""
    from hybridize.generation.fast import FastGenConfig, FastGenerator
    from tests.rl.helpers import byte_tokenizer, left_padded_batch, tiny_hybrid

    model, _ = tiny_hybrid(mixer="sse")
    model = model.to(torch.bfloat16)
    pad = byte_tokenizer().pad_token_id
    ids, am = left_padded_batch()
    dl._kernel()
    op = dl._OP
    shapes = []

    def counting(x, w, b):
        shapes.append(tuple(w.shape))
        return op(x, w, b)

    monkeypatch.setattr(dl, "_OP", counting)
    outs = {}
    for mode in ("triton", "torch"):
        gen = FastGenerator(model, FastGenConfig(record_logits=True, exact_lengths=False, gemm=mode))
        outs[mode] = (gen(input_ids=ids, attention_mask=am, pad_token_id=pad, do_sample=False, max_new_tokens=4),
                      gen.last_logits)
        if mode == "triton":
            n_triton = len(shapes)
    assert n_triton > 0 and len(shapes) == n_triton           # used in the triton run only
    assert (model.lm_head.weight.shape[0], model.config.hidden_size) in shapes
    assert any(s[0] % 8 == 0 and s[0] > 4 * model.config.hidden_size for s in shapes)   # SSE's fused stage 1
    for a, b in zip(outs["triton"][1], outs["torch"][1]):
        assert torch.allclose(a, b, rtol=0.05, atol=0.05 * b.abs().max().item())


def test_pinned_choices_round_trip_and_are_not_timed_again(monkeypatch):
    """`pin_choices(choices())` in another process gives the same picks, and a pinned shape is not timed
    (`_picked` returns it); a label or a config name it cannot read is a ValueError naming it."""
    from hybridize.ops.decode_gemm import triton_gemm as kern

    monkeypatch.setattr(kern, "_CHOICE", {})
    monkeypatch.setattr(kern, "_TIMINGS", {})
    cfg = dict(BN=64, BK=128, SPLIT=2, num_warps=4, num_stages=4)
    kern._CHOICE.update({(48, 64, 4, torch.bfloat16, False): cfg, (96, 64, 1, torch.float16, True): "cublas"})
    shown = kern.choices()
    before = dict(kern._CHOICE)
    kern._CHOICE.clear()
    assert kern.pin_choices(shown) == 2 and kern._CHOICE == before
    monkeypatch.setattr(kern, "_choose", lambda *a: pytest.fail("a pinned shape was timed"))
    x, w = torch.randn(4, 64).bfloat16(), torch.randn(48, 64).bfloat16()
    assert kern._picked(x, w, None) == cfg
    for bad, match in (({"48x64 rows=4 bfloat16": {"choice": "cublas"}}, "choice label"),
                       ({"48x64 m=4 bfloat17": {"choice": "cublas"}}, "choice label"),
                       ({"48x64 m=4 bfloat16": {"choice": "BN64_BK128"}}, "config name")):
        with pytest.raises(ValueError, match=match):
            kern.pin_choices(bad)
