"""Gated MLPs with gate and up as one GEMM in decode steps (`ops/decode_gemm/stacked.py`).

On CPU mode "triton" without the interpreter runs the stacked GEMM through `F.linear`, so these tests check the
wiring (which MLPs change, which rows run stacked, the cache and its refresh) without triton; the GEMM kernel itself
is tested in test_decode_linear.py. The stacked product in fp32 is the same dot products as the two GEMMs, so
outputs agree to fp32 rounding.
"""
from __future__ import annotations

import importlib
import inspect

import pytest
import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from hybridize.ops.decode_gemm import stacked as st
from tests.ops.decode_gemm.helpers import stacked_run_agrees

GATED_FORM = "self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))"


def _module_of(cls_name: str):
    """The transformers modeling module that defines `cls_name` (e.g. Qwen3MoeMLP -> qwen3_moe), or None."""
    import transformers.models as tm
    import pkgutil

    stem = cls_name[:-3].lower()
    for info in pkgutil.iter_modules(tm.__path__):
        if info.name.replace("_", "") == stem:
            try:
                return importlib.import_module(f"transformers.models.{info.name}.modeling_{info.name}")
            except ImportError:
                return None
    return None


@pytest.mark.parametrize("name", sorted(st.GATED_MLPS))
def test_every_listed_class_has_the_gated_forward(name):
    """A listed class whose forward is no longer the gated form would be run wrongly: the list is checked against
    transformers' own source."""
    mod = _module_of(name)
    if mod is None or not hasattr(mod, name):
        pytest.skip(f"{name} is not in this transformers")
    src = "".join(inspect.getsource(getattr(mod, name).forward).split())
    assert "".join(GATED_FORM.split()) in src


def _mlp(bias: bool = False, seed: int = 0) -> LlamaMLP:
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=24, intermediate_size=40, num_attention_heads=4, mlp_bias=bias, hidden_act="silu")
    mlp = LlamaMLP(cfg)
    if bias:
        for p in (mlp.gate_proj.bias, mlp.up_proj.bias, mlp.down_proj.bias):
            nn.init.normal_(p)
    return mlp.eval()


class _Block(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.mlp = _mlp(**kw)
        self.other = nn.Linear(24, 24)

    def forward(self, x):
        return self.mlp(self.other(x))


@pytest.mark.parametrize("bias", [False, True])
def test_stacked_forward_equals_the_mlp_on_decode_rows(bias):
    block = _Block(bias=bias)
    mlp = block.mlp
    x = torch.randn(3, 1, 24)
    ref = mlp(x)
    with torch.no_grad(), st.mlps_stacked(block, "triton") as n:
        assert n == 1 and "forward" in mlp.__dict__ and "forward" not in block.other.__dict__
        out = mlp(x)
        W, b = mlp.__dict__[st._CACHE][1:]
    assert W.shape == (80, 24) and (b is not None) == bias
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
    assert "forward" not in mlp.__dict__                      # restored
    with torch.no_grad():
        assert torch.equal(mlp(x), ref)


def test_prefill_rows_and_cpu_auto_keep_the_mlps_own_forward():
    mlp = _mlp()
    x_long = torch.randn(2, st.MAX_ROWS, 24)                  # 32 rows: a prefill
    x_dec = torch.randn(4, 1, 24)
    with torch.no_grad():
        ref_long, ref_dec = mlp(x_long), mlp(x_dec)
        with st.mlps_stacked(mlp, "triton"):
            assert torch.equal(mlp(x_long), ref_long)
        with st.mlps_stacked(mlp, "auto"):                    # CPU tensors under auto: HF's bits
            assert torch.equal(mlp(x_dec), ref_dec)
    assert st._CACHE not in mlp.__dict__                      # nothing stacked, nothing cached


def test_cache_follows_in_place_updates_in_the_same_buffer():
    """GRPO updates parameters in place between rollouts; a replayed CUDA graph reads the cached buffer, so a
    refresh must rewrite that buffer, not allocate another."""
    mlp = _mlp()
    x = torch.randn(2, 1, 24)
    with torch.no_grad(), st.mlps_stacked(mlp, "triton"):
        mlp(x)
        W0 = mlp.__dict__[st._CACHE][1]
        mlp.up_proj.weight.mul_(3)                            # an optimizer step
        st.refresh(mlp)
        W1 = mlp.__dict__[st._CACHE][1]
        assert W1.data_ptr() == W0.data_ptr()
        assert torch.equal(W1[40:], mlp.up_proj.weight)
        mlp.gate_proj.weight = nn.Parameter(torch.randn(40, 24))   # a new tensor (load without copy)
        out = mlp(x)
    with torch.no_grad():
        assert torch.allclose(out, mlp(x), rtol=1e-5, atol=1e-6)


def test_stack_built_in_inference_mode_refreshes_outside_it():
    """A stack first built under `torch.inference_mode` is a normal tensor, so a refresh outside it (after an
    optimizer step) rewrites it in place instead of failing."""
    mlp = _mlp()
    x = torch.randn(2, 1, 24)
    with st.mlps_stacked(mlp, "triton"):
        with torch.inference_mode():
            mlp(x)
        W = mlp.__dict__[st._CACHE][1]
        assert not W.is_inference()
        with torch.no_grad():
            mlp.up_proj.weight.mul_(2)
            out = mlp(x)
        assert mlp.__dict__[st._CACHE][1].data_ptr() == W.data_ptr()
    with torch.no_grad():
        assert torch.allclose(out, mlp(x), rtol=1e-5, atol=1e-6)


def test_hooked_wrapped_or_unknown_mlps_are_left_alone():
    hooked = _mlp()
    hooked.gate_proj.register_forward_hook(lambda *a: None)
    wrapped = _mlp()
    wrapped.up_proj = nn.Sequential(wrapped.up_proj)          # as an adapter wrapper would
    own = _mlp()
    own.forward = lambda x: x                                 # someone else's forward override

    class CustomMLP(nn.Module):                               # not a listed class: its forward is unknown
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(8, 4)
            self.act_fn = nn.SiLU()

    for m in (hooked, wrapped, own, CustomMLP()):
        assert not st.stackable(m)
        with st.mlps_stacked(m, "triton") as n:
            assert n == 0
    assert st.stackable(_mlp())
    with st.mlps_stacked(_mlp(), "triton", on=False) as n:
        assert n == 0


def test_same_forward_object_across_blocks():
    """A compiled decode step that traced the forward is not recompiled by the next call's block."""
    mlp = _mlp()
    with st.mlps_stacked(mlp, "triton"):
        first = mlp.forward
    with st.mlps_stacked(mlp, "triton"):
        assert mlp.forward is first


@pytest.mark.parametrize("mixer", ["sse", "swa"])
def test_fast_generate_with_stacked_mlps_matches_two_gemms(mixer):
    """A tiny hybrid decodes the same tokens with every MLP stacked (the teacher's kept layers and the mixer
    layers' MLPs alike), its logits within fp32 rounding; then after an in-place weight update (a GRPO step) the
    stacked run follows the new weights."""
    from hybridize.generation.fast import FastGenConfig, FastGenerator
    from tests.rl.helpers import byte_tokenizer, left_padded_batch, tiny_hybrid

    model, _ = tiny_hybrid(mixer=mixer)
    pad = byte_tokenizer().pad_token_id
    ids, am = left_padded_batch()
    run = stacked_run_agrees(model, "stack_mlp")

    first = run()
    mlps = [layer.mlp for layer in model.model.layers]
    assert all(st._CACHE in m.__dict__ for m in mlps) and all("forward" not in m.__dict__ for m in mlps)
    with torch.no_grad():
        mlps[0].up_proj.weight.mul_(-2)
    second = run()
    assert not torch.allclose(first[-1], second[-1])
    exact = FastGenerator(model, FastGenConfig(gemm="triton"))   # the exact path keeps HF's ops: nothing stacked
    for m in mlps:
        m.__dict__.pop(st._CACHE)
    exact(input_ids=ids, attention_mask=am, pad_token_id=pad, do_sample=False, max_new_tokens=3)
    assert not any(st._CACHE in m.__dict__ for m in mlps)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compile_", ["off", "on"])
def test_cuda_graph_replays_read_the_refreshed_stack(compile_):
    """On the GPU a captured (and compiled) decode step reads the stacked buffer: after an in-place update of the
    weights (GRPO's optimizer step) the reused graph decodes what the uncompiled masked path decodes with the new
    weights, and the same tokens as two GEMMs."""
    from hybridize.generation.fast import FastGenConfig, FastGenerator
    from tests.rl.helpers import byte_tokenizer, left_padded_batch, tiny_hybrid

    model, _ = tiny_hybrid(mixer="sse")
    model = model.cuda()
    pad = byte_tokenizer().pad_token_id
    ids, am = (t.cuda() for t in left_padded_batch())
    kw = dict(input_ids=ids, attention_mask=am, pad_token_id=pad, do_sample=False, max_new_tokens=12)
    graphs = FastGenerator(model, FastGenConfig(cuda_graphs="on", bucket=16, compile=compile_))
    eager = FastGenerator(model, FastGenConfig(cuda_graphs="off", exact_lengths=False, bucket=16, compile="off"))
    two = FastGenerator(model, FastGenConfig(cuda_graphs="off", exact_lengths=False, bucket=16, compile="off",
                                             stack_mlp=False))
    for step in range(2):
        out = graphs(**kw)
        assert graphs.stats["graphs"]
        assert torch.equal(out, eager(**kw)) and torch.equal(out, two(**kw)), step
        assert all(st._CACHE in layer.mlp.__dict__ for layer in model.model.layers)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.up_proj.weight.mul_(-1.5)
    assert len(graphs._sessions) == 1


def test_decode_weights_are_built_after_the_prefill_cache_is_freed(monkeypatch):
    """The derived decode weights (the stacked MLPs, SSE's fused projections) must not add to the prefill's peak:
    they are built once the prefill's cache has been copied into the decode buffers and freed."""
    import gc
    import weakref

    from hybridize.generation import fast
    from hybridize.generation.fast import FastGenConfig, FastGenerator
    from tests.rl.helpers import byte_tokenizer, left_padded_batch, tiny_hybrid

    model, _ = tiny_hybrid(mixer="sse")
    ids, am = left_padded_batch()
    caches, alive = [], []
    real_prefill, real_refresh = FastGenerator._prefill, fast._refresh_decode_weights

    def prefill(self, *a, **kw):
        logits, cache = real_prefill(self, *a, **kw)
        caches.append(weakref.ref(cache))
        return logits, cache

    def refresh(m):
        gc.collect()
        alive.append(sum(r() is not None for r in caches))
        real_refresh(m)

    monkeypatch.setattr(FastGenerator, "_prefill", prefill)
    monkeypatch.setattr(fast, "_refresh_decode_weights", refresh)
    gen = FastGenerator(model, FastGenConfig(exact_lengths=False, gemm="triton", prefill_tokens=2 * ids.shape[1]))
    gen(input_ids=ids, attention_mask=am, pad_token_id=byte_tokenizer().pad_token_id, do_sample=False,
        max_new_tokens=3)
    assert len(caches) == 2 and alive == [0]          # two row groups prefilled, both caches gone before the build
    assert all(st._CACHE in layer.mlp.__dict__ for layer in model.model.layers)
