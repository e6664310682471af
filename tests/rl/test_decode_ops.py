"""The SSE decode step stays lean and exact.

- the fused no-gradient front end (`SSE.fused_inputs`: one matmul for every projection of x, one for the LoRA
  and gate up-projections, shared + sparse q/k normalised together) gives the generic path's outputs and
  states (fp32, rel. error < 1e-5), for SSE and SSEGDN with q/k norms, RoPE, GQA, biases, padding masks,
  no output gate, no shared partition, in decode steps and in prefills (both layouts, a packed batch); and after
  an in-place parameter update (the cache refreshes);
- a state marked writable (what the fast path's cache does) is updated in place on the GPU path (run on
  CPU with `hybridize.generation.profile`'s PyTorch stand-in for the Triton kernel), with the same values;
- op budget: one decode step of a small SSE hybrid (qwen3-tiny, 6 layers, 5:1) costs at most
  `MAX_SSE_OPS` ops per SSE layer (CPU profiler, `hybridize.generation.profile` counting, decode kernel
  emulated as one op) and no state copies. Before this change it was 77 (91 on the CPU reference path).
"""
from __future__ import annotations

from types import SimpleNamespace

import importlib.util
import os

import pytest
import torch

from hybridize.generation import profile as pd
from hybridize.mixers.sse import SSE, SSEGDN, SSEConfig, SSEGDNConfig, SSEState
from hybridize.ops.sse import reference as sse_reference

#: the mixer tests run on CPU tensors: the q/k front end's kernel only under the interpreter here (on CUDA,
#: tests/ops/sse/test_qk_front.py checks the kernel and the fast engine's tests the mixers that take it)
needs_interpreter = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs the Triton kernel on CPU tensors: needs triton and TRITON_INTERPRET=1")

#: ops per SSE layer per decode step (measured after the change: 30 at qwen3-tiny, fp32 CPU)
MAX_SSE_OPS = 32
#: ... with the one-kernel step (`ops/sse/triton_fused_step.py`) emulated: 4 measured, the output norm and gate in the
#: step (7 without them, 25 on the separate path)
MAX_FUSED_SSE_OPS = 4


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def _mixer(cls, **kw):
    cfg_cls = SSEConfig if cls is SSE else SSEGDNConfig
    base = dict(hidden_size=24, num_heads=4, num_kv_heads=2, head_dim=8, lora_rank=4, num_partitions=3)
    if cls is SSE:
        base["gate_rank"] = 4
    m = cls(cfg_cls(**{**base, **kw})).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in m.parameters():   # perturb identity-like inits (zero LoRA ups, unit norms, zero gates)
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return m


def _rope(B, D, pos):
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    ang = torch.full((B, 1), float(pos))[..., None] * inv
    emb = torch.cat([ang, ang], -1)
    return emb.cos(), emb.sin()


def _steps(m, fused: bool, x, mask=None, steps=3):
    """Prefill 5 tokens, then `steps` single-token decode steps; outputs and the final state."""
    B = x.shape[0]
    m.fuse_decode = fused
    try:
        with torch.no_grad():
            pe = _rope(B, m.config.head_dim, 0) if m.config.use_rope else None
            pe_pre = None if pe is None else tuple(t.expand(B, 5, -1) for t in pe)
            out = m(x[:, :5], position_embeddings=pe_pre, output_state=True)
            st, outs = out.state, []
            for t in range(5, 5 + steps):
                pe = _rope(B, m.config.head_dim, t) if m.config.use_rope else None
                am = None if mask is None else mask[:, t:t + 1]
                o = m(x[:, t:t + 1], state=st, attention_mask=am, position_embeddings=pe, output_state=True)
                st = o.state
                outs.append(o.hidden)
    finally:
        m.fuse_decode = True
    return torch.cat(outs, 1), st


CASES = [
    (SSE, {}),
    (SSE, dict(qk_norm=True, q_map="softmax", v_map="identity")),
    (SSE, dict(qk_norm=True, use_rope=True, qkv_bias=True, top_k=2)),
    (SSE, dict(output_gate=False, shared_partition=False, k_map="silu")),
    (SSEGDN, {}),
    (SSEGDN, dict(qk_norm=True, use_rope=True, qkv_bias=True, top_k=2)),
]


@pytest.mark.parametrize("cls,kw", CASES)
def test_fused_decode_equals_generic(cls, kw):
    m = _mixer(cls, **kw)
    x = torch.randn(2, 8, 24)
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[1, 6] = False                                  # one padded decode token
    with torch.no_grad():
        assert m._fused_ok()
    for am in (None, mask):
        o_f, s_f = _steps(m, True, x, am)
        o_g, s_g = _steps(m, False, x, am)
        real = torch.ones_like(o_f[..., 0], dtype=torch.bool) if am is None else am[:, 5:8]
        assert rel(o_f[real], o_g[real]) < 1e-5
        for a, b in zip(s_f.tensors(), s_g.tensors()):
            assert rel(a, b) < 1e-5


@pytest.mark.parametrize("cls,kw", CASES)
@pytest.mark.parametrize("layout", ["masking", "varlen"])
@pytest.mark.parametrize("qk_kernel", [False, pytest.param(True, marks=needs_interpreter)])
def test_fused_prefill_equals_generic(cls, kw, layout, qk_kernel, monkeypatch):
    """Without gradient a prefill (chunk mode, any T) takes the fused front end too: the same outputs and states as
    `features` + `route` (fp32), with a left-padded row, and for a packed batch (`cu_seqlens`); with the q/k front
    end's one kernel (`ops/sse/triton_qk_front.py`; interpreter on the CPU) too."""
    if qk_kernel:
        monkeypatch.setattr(sse_reference, "qk_front_applies", lambda x: True)
    m = _mixer(cls, layout=layout, **kw)
    B, T = 2, 37
    x = torch.randn(B, T, 24)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, :6] = False
    D = m.config.head_dim

    def rope_at(pos):   # pos [N, L] -> (cos, sin) [N, L, D]
        ang = pos.float()[..., None] / (10000 ** (torch.arange(0, D, 2).float() / D))
        emb = torch.cat([ang, ang], -1)
        return emb.cos(), emb.sin()

    use = m.config.use_rope
    pe = rope_at(torch.arange(T).expand(B, T)) if use else None
    cu = torch.tensor([0, 15, B * T])                    # two packed documents of 15 and 59 tokens
    packed = x.reshape(1, B * T, 24)
    pe_packed = rope_at(torch.cat([torch.arange(15), torch.arange(B * T - 15)])[None]) if use else None
    outs = {}
    for fused in (True, False):
        m.fuse_decode = fused
        try:
            with torch.no_grad():
                outs[fused] = [m(x, attention_mask=am, position_embeddings=pe, output_state=True)
                               for am in (None, mask)]
                outs[fused].append(m(packed, cu_seqlens=cu, position_embeddings=pe_packed, output_state=True))
        finally:
            m.fuse_decode = True
    for (a, b), real in zip(zip(outs[True], outs[False]), (torch.ones_like(mask), mask, None)):
        ha, hb = (a.hidden, b.hidden) if real is None else (a.hidden[real], b.hidden[real])
        assert rel(ha, hb) < 1e-5
        for sa, sb in zip(a.state.tensors(), b.state.tensors()):
            assert rel(sa, sb) < 1e-5


def test_fused_weights_follow_in_place_updates():
    m = _mixer(SSE, qk_norm=True)
    x = torch.randn(2, 8, 24)
    _steps(m, True, x)
    W1 = m._fused_weights()[0]
    with torch.no_grad():
        m.lora_q.up.weight.mul_(-2.0)                    # an optimizer-style in-place update
        m.q_norm.weight.add_(0.5)
        m.router.weight.mul_(3.0)
    m.refresh_decode_weights()
    assert m._fused_weights()[0].data_ptr() == W1.data_ptr()   # same buffer: a captured graph stays valid
    o_f, _ = _steps(m, True, x)
    o_g, _ = _steps(m, False, x)
    assert rel(o_f, o_g) < 1e-5


def test_generic_path_kept_with_grad_and_wrapped_projections():
    m = _mixer(SSE)
    with torch.no_grad():
        assert m._fused_ok()
    assert not m._fused_ok()                             # gradients on: the generic path
    m.q_proj.register_forward_hook(lambda *a: None)
    with torch.no_grad():
        assert not m._fused_ok()                         # a hooked (e.g. PEFT-wrapped) projection


@pytest.mark.parametrize("cls", [SSE, SSEGDN])
def test_writable_state_updated_in_place_on_gpu_path(cls):
    m = _mixer(cls, qk_norm=True)
    x = torch.randn(2, 6, 24)
    with torch.no_grad():
        st = m(x[:, :5], output_state=True).state
        ref = m(x[:, 5:6], state=st, output_state=True)            # CPU reference path, copies
        with pd.emulated_decode_kernel():
            st2 = SSEState(sparse=st.sparse.clone(), shared=st.shared.clone())
            st2.writable = True
            out = m(x[:, 5:6], state=st2, output_state=True)
    assert out.state.sparse.data_ptr() == st2.sparse.data_ptr()
    assert out.state.shared.data_ptr() == st2.shared.data_ptr()
    assert rel(out.hidden, ref.hidden) < 1e-5
    assert rel(st2.sparse, ref.state.sparse) < 1e-5 and rel(st2.shared, ref.state.shared) < 1e-5


def test_fast_path_cache_marks_its_states_writable():
    from hybridize.generation.fast import StaticMixerLayer

    layer = StaticMixerLayer(SSEState(sparse=torch.zeros(1, 2, 1, 2, 2)))
    assert layer.state.writable
    layer.update_state(SSEState(sparse=torch.ones(1, 2, 1, 2, 2)), 1)
    assert layer.state.writable and layer.state.sparse.sum() == 8
    assert not getattr(layer.state.map(lambda t: t.clone()), "writable", False)   # copies are not marked


def _tiny_qwen3_hybrid(layers: int, plan: str, mixer: str, settings: dict | None = None):
    """A random-weight hybrid of a tiny Qwen3 (q/k norms, as the real target), fp32 on CPU; `settings`: the
    converter's mixer settings (e.g. {"swa.window": 8})."""
    from transformers import AutoConfig

    from hybridize.convert.convert import build_hybrid_config
    from hybridize.convert.plan import parse_plan
    from hybridize.modeling import HybridForCausalLM

    cfg = AutoConfig.for_model("qwen3", vocab_size=512, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               max_position_embeddings=4096, tie_word_embeddings=True)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hcfg = build_hybrid_config(cfg, parse_plan(plan, layers, mixer), settings)
    return HybridForCausalLM(hcfg).float().eval()


def _op_budget_profile(fused: bool, merged: str = "auto", finish: bool = True, in_step: bool = True):
    from hybridize.ops.common.options import use_kernel_options

    torch.set_num_threads(1)
    args = SimpleNamespace(shape="qwen3-tiny", layers=6, plan="5:1", mixer="sse", batch=2, prompt_len=16,
                           steps=3, attention="auto", top=5, graphs=False, decode_kernel="emulate",
                           compile="off", gemm="auto")
    model = _tiny_qwen3_hybrid(args.layers, args.plan, args.mixer)
    with use_kernel_options(sse_fused_step=fused, sse_merged_lowrank=merged, sse_step_finish=finish,
                            sse_step_lowrank=in_step):
        res = pd.profile_model(model, args, torch.device("cpu"))
    rows = {r["layer_type"]: r for r in res["eager"]["by_layer_type"]}
    pieces = {r["piece"]: r["kernels_per_layer"] for r in res["eager"]["sse_pieces"]}
    assert rows["sse"]["layers"] == 5
    assert pieces.get("sse.state_update", 0) == 0, pieces       # states updated in place: no copy back
    assert not res["eager"]["host_syncs_per_step"]
    return rows["sse"]["kernels_per_layer"], pieces


def test_decode_step_op_budget():
    """The separate path (`sse_fused_step=False`): the fused projections, front-end ops, two decode-kernel calls."""
    n, pieces = _op_budget_profile(fused=False)
    assert n <= MAX_SSE_OPS, pieces
    assert "sse.fused_step" not in pieces
    assert pieces["sse.naive_recurrent_sse"] <= 3.5, pieces          # 2 kernel calls + 1 sum (+ a cached index once)


@pytest.mark.parametrize("finish", [True, False], ids=["finished", "unfinished"])
@pytest.mark.parametrize("merged,in_step,matmuls", [("off", False, 2), ("off", True, 1), ("on", False, 1),
                                                    ("on", True, 1), ("auto", True, 1)])
def test_fused_decode_step_op_budget(merged, in_step, matmuls, finish):
    """The GPU's default path, one kernel after the projection matmuls (emulated on the CPU by its PyTorch
    reference): the step is stage 1's matmul, the stage-2 matmul of the low-rank up-projections unless they are
    merged into stage 1 ("auto" does at this small shape) or applied in the kernel (option sse_step_lowrank), the
    kernel and o_proj; with option sse_step_finish off the output norm, silu and gate multiply run between the
    kernel and o_proj."""
    n, pieces = _op_budget_profile(fused=True, merged=merged, finish=finish, in_step=in_step)
    assert pieces["sse.fused_step"] == matmuls + (2 if finish else 5), pieces
    assert "sse.naive_recurrent_sse" not in pieces and "sse.fused_inputs" not in pieces
    assert n <= MAX_FUSED_SSE_OPS + (0 if finish else 3), pieces


def test_fused_weights_built_in_inference_mode_refresh_outside_it():
    """An evaluation under `torch.inference_mode` builds the fused weights first; a later no-gradient call after a
    weight update (the fast engine in a GRPO run) must refresh them in place, which inference tensors refuse."""
    m = _mixer(SSE, qk_norm=True)
    x = torch.randn(2, 6, 24)
    with torch.inference_mode():
        m(x)
    W1 = m._fused_weights()[0]
    assert not W1.is_inference()
    with torch.no_grad():
        m.lora_q.up.weight.mul_(-2.0)
        fused = m(x).hidden
        m.fuse_decode = False
        try:
            generic = m(x).hidden
        finally:
            m.fuse_decode = True
    assert m._fused_weights()[0].data_ptr() == W1.data_ptr() and rel(fused, generic) < 1e-5


def test_fused_prefill_option_keeps_the_per_projection_path(monkeypatch):
    """Kernel option `sse_fused_prefill=False` (benchmarks' A/B): a no-gradient prefill runs `features`, while a
    decode step keeps the fused front end."""
    from hybridize.ops.common.options import use_kernel_options

    m = _mixer(SSE)
    calls = []
    for name in ("features", "fused_inputs"):
        real = getattr(SSE, name)
        monkeypatch.setattr(SSE, name, lambda self, *a, _n=name, _r=real, **k: calls.append(_n) or _r(self, *a, **k))
    x = torch.randn(1, 9, 24)
    with torch.no_grad():
        out = m(x, output_state=True)
        m(x[:, -1:], state=out.state)
        assert calls == ["fused_inputs", "fused_inputs"]
        calls.clear()
        with use_kernel_options(sse_fused_prefill=False):
            out = m(x, output_state=True)
            m(x[:, -1:], state=out.state)
        assert calls == ["features", "fused_inputs"]
