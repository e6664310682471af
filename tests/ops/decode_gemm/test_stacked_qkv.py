"""Attention's q, k and v as one GEMM in decode steps (`ops/decode_gemm/stacked_qkv.py`).

On CPU mode "triton" without the interpreter runs the stacked GEMM through `F.linear`, so these tests check the
wiring: which modules change, which rows run stacked, that k and v are taken only for the input q saw, the cache
and its refresh, tracing by dynamo, and the fast engine's tokens with and without it. The stacked product in fp32
is the same dot products as the three GEMMs, so outputs agree to fp32 rounding.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, Qwen2Config, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

from hybridize.ops.decode_gemm import stacked_qkv as sq
from hybridize.ops.decode_gemm.stacked import _CACHE
from tests.ops.decode_gemm.helpers import stacked_run_agrees

FAMILIES = {"llama": (LlamaConfig, LlamaAttention), "qwen2": (Qwen2Config, Qwen2Attention),   # qwen2: q/k/v biases
            "qwen3": (Qwen3Config, Qwen3Attention)}                                         # qwen3: q/k norms


def _attn(family: str = "qwen3", seed: int = 0):
    torch.manual_seed(seed)
    cfg_cls, attn_cls = FAMILIES[family]
    cfg = cfg_cls(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
                  num_hidden_layers=1)
    cfg._attn_implementation = "sdpa"
    attn = attn_cls(cfg, layer_idx=0).eval()
    for p in attn.parameters():          # biases (qwen2) and norm gains random too: a swapped part would show
        nn.init.normal_(p, std=0.3)
    return attn, LlamaRotaryEmbedding(cfg)


def _call(attn, rope, x):
    pos = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
    return attn(x, position_embeddings=rope(x, pos), attention_mask=None)[0]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_stacked_forward_equals_three_products_on_decode_rows(family):
    attn, rope = _attn(family)
    x = torch.randn(3, 1, 32)
    with torch.no_grad():
        ref = _call(attn, rope, x)
        with sq.qkv_stacked(attn, "triton") as n:
            assert n == 1 and all("forward" in getattr(attn, p).__dict__ for p in sq.PARTS)
            out = _call(attn, rope, x)
            W, b = attn.__dict__[_CACHE][1:]
        assert W.shape == (8 * (4 + 2 + 2), 32) and (b is not None) == (family == "qwen2")
        assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
        assert all("forward" not in getattr(attn, p).__dict__ for p in sq.PARTS)   # restored
        assert torch.equal(_call(attn, rope, x), ref)


def test_k_and_v_are_taken_only_for_the_input_q_saw_and_only_once():
    """The outputs never depend on the call order: k or v called first, with another input, or twice each get
    their own product."""
    attn, _ = _attn("qwen2")
    x, y = torch.randn(2, 1, 32), torch.randn(2, 1, 32)
    from_stack = lambda t: t._base is not None and t._base.shape[-1] == 64   # noqa: E731  a view of [.., q|k|v]
    q, k, v = (getattr(attn, n) for n in sq.PARTS)
    with torch.no_grad():
        ref = {n: (getattr(attn, n)(x), getattr(attn, n)(y)) for n in sq.PARTS}
        with sq.qkv_stacked(attn, "triton"):
            assert torch.allclose(k(x), ref["k_proj"][0], atol=1e-6)      # before q: its own product
            assert torch.allclose(q(x), ref["q_proj"][0], atol=1e-6)      # leaves k and v for x
            assert torch.allclose(v(y), ref["v_proj"][1], atol=1e-6)      # another input: not x's v
            front_k = k(x)
            assert torch.allclose(front_k, ref["k_proj"][0], atol=1e-6)
            assert from_stack(front_k)                                    # taken from the stacked product
            again = k(x)                                                  # taken already: its own product
            assert not from_stack(again) and torch.allclose(again, ref["k_proj"][0], atol=1e-6)
            assert torch.allclose(v(x), ref["v_proj"][0], atol=1e-6)


def test_prefill_rows_and_cpu_auto_keep_three_products():
    attn, rope = _attn()
    x_long = torch.randn(2, sq.MAX_ROWS, 32)                   # 32 rows: a prefill
    x_dec = torch.randn(4, 1, 32)
    with torch.no_grad():
        ref_long, ref_dec = _call(attn, rope, x_long), _call(attn, rope, x_dec)
        with sq.qkv_stacked(attn, "triton"):
            assert torch.equal(_call(attn, rope, x_long), ref_long)
        with sq.qkv_stacked(attn, "auto"):                     # CPU tensors under auto: HF's bits
            assert torch.equal(_call(attn, rope, x_dec), ref_dec)
    assert _CACHE not in attn.__dict__                         # nothing stacked, nothing cached


def test_cache_follows_in_place_updates_in_the_same_buffer():
    attn, rope = _attn()
    x = torch.randn(2, 1, 32)
    with torch.no_grad(), sq.qkv_stacked(attn, "triton"):
        _call(attn, rope, x)
        W0 = attn.__dict__[_CACHE][1]
        attn.v_proj.weight.mul_(3)                             # an optimizer step
        sq.refresh(attn)
        W1 = attn.__dict__[_CACHE][1]
        assert W1.data_ptr() == W0.data_ptr() and torch.equal(W1[48:], attn.v_proj.weight)
        out = _call(attn, rope, x)
    with torch.no_grad():
        assert torch.allclose(out, _call(attn, rope, x), rtol=1e-5, atol=1e-6)


def test_wrapped_hooked_or_foreign_modules_are_left_alone():
    hooked, _ = _attn()
    hooked.k_proj.register_forward_hook(lambda *a: None)
    wrapped, _ = _attn()
    wrapped.q_proj = nn.Sequential(wrapped.q_proj)             # as an adapter wrapper would
    mixed, _ = _attn()
    mixed.v_proj.to(torch.float64)

    class MyAttention(nn.Module):                              # not transformers': its forward is unknown
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(4, 2)

    for m in (hooked, wrapped, mixed, MyAttention()):
        assert not sq.stackable(m)
        with sq.qkv_stacked(m, "triton") as n:
            assert n == 0
    assert sq.stackable(_attn()[0])
    with sq.qkv_stacked(_attn()[0], "triton", on=False) as n:
        assert n == 0


def test_same_forwards_across_blocks_and_dynamo_traces_them_whole():
    """A compiled decode step that traced the forwards is not recompiled by the next call's block, and dynamo traces
    the hand-over through the front without a graph break."""
    attn, rope = _attn()
    xs = [torch.randn(2, 1, 32) for _ in range(2)]
    with torch.no_grad():
        refs = [_call(attn, rope, x) for x in xs]              # three products, no block
    with sq.qkv_stacked(attn, "triton"):
        first = attn.q_proj.forward
    with torch.no_grad(), sq.qkv_stacked(attn, "triton"):
        assert attn.q_proj.forward is first
        torch._dynamo.reset()
        compiled = torch.compile(lambda t: _call(attn, rope, t), backend="eager", fullgraph=True)
        for x, ref in zip(xs, refs):                           # the second call replays the traced hand-over
            assert torch.allclose(compiled(x), ref, rtol=1e-5, atol=1e-6)
    assert attn.__dict__[_CACHE][1].shape == (64, 32)           # the traced q_proj ran the stacked product


@pytest.mark.parametrize("mixer", ["sse", "swa"])
def test_fast_generate_with_stacked_qkv_matches_three_gemms(mixer):
    """A tiny hybrid decodes the same tokens with q/k/v stacked in its kept softmax layers, its logits within fp32
    rounding; after an in-place weight update (a GRPO step) the stacked run follows the new weights."""
    from tests.rl.helpers import tiny_hybrid

    model, _ = tiny_hybrid(mixer=mixer)
    run = stacked_run_agrees(model, "stack_qkv")

    first = run()
    stacked = [m for m in model.modules() if _CACHE in m.__dict__ and hasattr(m, "q_proj")]
    assert stacked and all(sq.stackable(m) for m in stacked)
    assert all("forward" not in getattr(m, p).__dict__ for m in stacked for p in sq.PARTS)
    with torch.no_grad():
        stacked[0].k_proj.weight.mul_(-2)
    second = run()
    assert not torch.allclose(first[-1], second[-1])


def test_exact_path_keeps_three_products():
    """The CPU's exact path exists to give HF's bits: nothing is stacked there, even when asked."""
    from hybridize.generation.fast import FastGenConfig, FastGenerator
    from tests.rl.helpers import byte_tokenizer, left_padded_batch, tiny_hybrid

    model, _ = tiny_hybrid(mixer="swa")
    ids, am = left_padded_batch()
    FastGenerator(model, FastGenConfig(gemm="triton", stack_qkv=True))(
        input_ids=ids, attention_mask=am, pad_token_id=byte_tokenizer().pad_token_id, do_sample=False,
        max_new_tokens=3)
    assert not any(_CACHE in m.__dict__ for m in model.modules() if hasattr(m, "q_proj"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compile_", ["off", "on"])
def test_cuda_graph_replays_read_the_refreshed_qkv_stack(compile_):
    """On the GPU a captured (and compiled) decode step reads the stacked q/k/v buffer: after an in-place update of
    the weights (GRPO's optimizer step) the reused graph decodes what three GEMMs decode, uncompiled and masked."""
    from hybridize.generation.fast import FastGenConfig, FastGenerator
    from tests.rl.helpers import byte_tokenizer, left_padded_batch, tiny_hybrid

    model, _ = tiny_hybrid(mixer="swa")
    model = model.cuda()
    pad = byte_tokenizer().pad_token_id
    ids, am = (t.cuda() for t in left_padded_batch())
    kw = dict(input_ids=ids, attention_mask=am, pad_token_id=pad, do_sample=False, max_new_tokens=12)
    graphs = FastGenerator(model, FastGenConfig(cuda_graphs="on", bucket=16, compile=compile_, stack_qkv=True))
    three = FastGenerator(model, FastGenConfig(cuda_graphs="off", exact_lengths=False, bucket=16, compile="off"))
    stacked = [m for m in model.modules() if sq.stackable(m)]
    assert stacked
    for step in range(2):
        out = graphs(**kw)
        assert graphs.stats["graphs"]
        assert torch.equal(out, three(**kw)), step
        assert all(_CACHE in m.__dict__ for m in stacked)
        with torch.no_grad():
            for m in stacked:
                m.v_proj.weight.mul_(-1.5)
    assert len(graphs._sessions) == 1
