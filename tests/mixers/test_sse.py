"""SSE mixers (hybridize/mixers/sse.py): SSE on GLA ("sse") and on Gated DeltaNet ("sse_gdn")."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridize.ops.gla.reference import naive_recurrent_gla
from hybridize.ops.sse.reference import route
from hybridize.mixers import build_mixer
from hybridize.mixers.sse import SSE, SSEGDN, SSEState
from tests.mixers.helpers import (call, check_backward, check_chunk_equals_recurrent, check_left_padding,
                                  check_padding_keeps_state, check_prefill_then_steps, check_runs_in_dtype,
                                  check_varlen_equals_separate, make_mixer, random_hidden, rel_err)

NAMES = ["sse", "sse_gdn"]
LAYOUTS = ["masking", "varlen"]


def mixer(name, layout="masking", **settings):
    m = make_mixer(name, **{"num_partitions": 3, "lora_rank": 4, **settings})
    m.config.layout = layout
    return m.eval()


def random_state(m, n_seq, seed=7):
    c = m.config
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen) * 0.3  # noqa: E731
    return SSEState(sparse=r(n_seq, c.num_partitions, c.num_heads, c.head_dim, c.head_dim),
                    shared=r(n_seq, c.num_heads, c.head_dim, c.head_dim) if c.shared_partition else None)


def test_registry_and_config_errors():
    assert isinstance(build_mixer("sse", {"num_partitions": 2}, hidden_size=16, num_heads=2, num_kv_heads=1,
                                  head_dim=8), SSE)
    assert isinstance(build_mixer("sse_gdn", hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=8), SSEGDN)
    with pytest.raises(ValueError, match="top_k"):
        make_mixer("sse", num_partitions=2, top_k=3)
    with pytest.raises(ValueError, match="layout"):
        make_mixer("sse", layout="sorted")
    with pytest.raises(ValueError, match="k_map"):
        make_mixer("sse", k_map="relu")


# ---- chunk == recurrent, varlen, prefill ------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("T", [1, 63, 130])
def test_chunk_equals_recurrent(name, layout, T):
    m = mixer(name, layout, top_k=2 if T == 63 else 1)
    x = random_hidden(2, T, m.config.hidden_size)
    check_chunk_equals_recurrent(m, x)
    check_chunk_equals_recurrent(m, x, state=random_state(m, 2))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("settings", [dict(shared_partition=False), dict(short_conv=True, use_rope=True),
                                      dict(qk_norm=True, num_kv_heads=2, emulq=False),
                                      dict(k_map="softmax", q_map="identity", v_map="identity", emulk=False)])
def test_chunk_equals_recurrent_options(name, settings):
    for layout in LAYOUTS:
        m = mixer(name, layout, **settings)
        check_chunk_equals_recurrent(m, random_hidden(2, 37, m.config.hidden_size))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mode_layout", [("chunk", "masking"), ("chunk", "varlen"), ("recurrent", None)])
def test_cu_seqlens_equals_separate(name, mode_layout):
    mode, layout = mode_layout
    m = mixer(name, layout or "masking", short_conv=True)
    lengths = [7, 1, 40, 19]
    check_varlen_equals_separate(m, lengths, mode=mode)
    check_varlen_equals_separate(m, lengths, mode=mode, initial_state=random_state(m, len(lengths)))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_prefill_then_steps_equals_full(name, layout):
    m = mixer(name, layout, short_conv=True, top_k=2)
    check_prefill_then_steps(m, random_hidden(2, 45, m.config.hidden_size), split=33)


# ---- the two layouts ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("top_k", [1, 2])
def test_masking_varlen_recurrent_agree_on_outputs_and_gradients(name, top_k):
    m = mixer(name, top_k=top_k).train()
    x = random_hidden(2, 50, m.config.hidden_size)
    res = {}
    for mode, layout in (("chunk", "masking"), ("chunk", "varlen"), ("recurrent", None)):
        m.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        out = m(xi, state=random_state(m, 2), output_state=True, mode=mode, layout=layout)
        loss = out.hidden.pow(2).sum() + out.state.sparse.pow(2).sum() + out.state.shared.sum() + out.aux_loss
        loss.backward()
        res[layout or mode] = (out, xi.grad, {n: p.grad.clone() for n, p in m.named_parameters()
                                              if p.grad is not None})
    a, ga, pa = res["masking"]
    assert "router.weight" in pa
    for other in ("varlen", "recurrent"):
        b, gb, pb = res[other]
        assert rel_err(a.hidden, b.hidden) < 1e-5 and rel_err(a.state.sparse, b.state.sparse) < 1e-5, other
        assert rel_err(ga, gb) < 1e-5, other
        assert pa.keys() == pb.keys(), other
        for n in pa:
            assert rel_err(pa[n], pb[n]) < 1e-5, (other, n)


# ---- reduction, router, balance loss --------------------------------------------------------------

def test_reduces_to_gla_with_softmax_keys():
    """N = K = 1, LoRA zero, no shared partition: one GLA state with softmax keys, SiLU q/v."""
    m = mixer("sse", num_partitions=1, top_k=1, shared_partition=False)
    with torch.no_grad():
        m.lora_q.up.weight.zero_()
        m.lora_k.up.weight.zero_()
    c = m.config
    x = random_hidden(2, 41, c.hidden_size)
    B, T, _ = x.shape
    with torch.no_grad():
        q = F.silu(m.q_proj(x).view(B, T, c.num_heads, c.head_dim))
        k = m.k_proj(x).view(B, T, c.num_kv_heads, c.head_dim).softmax(-1).repeat_interleave(2, dim=2)
        v = F.silu(m.v_proj(x).view(B, T, c.num_kv_heads, c.head_dim)).repeat_interleave(2, dim=2)
        g = F.logsigmoid(m.gates["sparse"](x).view(B, T, c.num_heads, c.head_dim)) / 16
        o, _ = naive_recurrent_gla(q.double(), k.double(), v.double(), g.double())
        o = o / o.pow(2).mean(-1, keepdim=True).add(c.rms_norm_eps).sqrt() * m.o_norm.weight.double()
        o = o * F.silu(m.g_proj(x).double()).view(B, T, c.num_heads, c.head_dim)
        ref = o.reshape(B, T, -1) @ m.o_proj.weight.double().T
        for layout in LAYOUTS:
            for mode in ("chunk", "recurrent"):
                assert rel_err(m(x, mode=mode, layout=layout).hidden, ref) < 1e-5, (layout, mode)


@pytest.mark.parametrize("name", NAMES)
def test_router_gets_gradient_from_main_loss_at_k1(name):
    x = random_hidden(1, 30, 16)
    for emul, expect in ((dict(), True), (dict(emulq=False, emulk=False), False)):
        m = mixer(name, top_k=1, **emul).eval()                    # eval: no aux loss in the graph
        out = m(x, mode="chunk")
        assert out.aux_loss is None
        out.hidden.pow(2).sum().backward()
        grad = m.router.weight.grad
        got = grad is not None and grad.abs().max().item() > 0
        assert got == expect, f"router gradient present={got} with {emul or 'emulq=emulk=True'}"


def test_balance_loss_returned_in_training_only():
    m = mixer("sse", num_partitions=3, top_k=2).train()
    x = random_hidden(2, 20, 16)
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[0, :5] = False
    aux = m(x, attention_mask=mask).aux_loss
    with torch.no_grad():
        p = m.router(x).softmax(-1)[mask]                       # [M, 3], real tokens only
        sel = torch.zeros_like(p).scatter_(-1, p.topk(2, -1).indices, 1.0)
        ref = 0.01 * 3 / 2 * (sel.mean(0) * p.mean(0)).sum()
    assert aux.item() == pytest.approx(ref.item(), rel=1e-6)
    aux.backward()
    assert m.router.weight.grad.abs().max() > 0
    assert m.eval()(x).aux_loss is None


# ---- padding, decode ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mode_layout", [("chunk", "masking"), ("chunk", "varlen"), ("recurrent", None)])
def test_left_padding(name, mode_layout):
    mode, layout = mode_layout
    m = mixer(name, layout or "masking", short_conv=True)
    check_left_padding(m, [9, 4, 1], T=12, mode=mode)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_padding_keeps_state(name, mode):
    m = mixer(name)
    check_padding_keeps_state(m, random_hidden(2, 10, 16), mode=mode)


@pytest.mark.parametrize("name", NAMES)
def test_decode_step_leaves_unselected_partitions_bit_identical(name):
    m = mixer(name, num_partitions=4)
    x = random_hidden(3, 12, 16)
    with torch.no_grad():
        pre = m(x[:, :-1], output_state=True, mode="chunk")
        step = m(x[:, -1:], state=pre.state, output_state=True)          # T == 1 with state: recurrent
        sel = route(m.router(x[:, -1:]), 1).selected[:, 0]                # [B, N]
    for b in range(3):
        for i in range(4):
            same = torch.equal(step.state.sparse[b, i], pre.state.sparse[b, i])
            assert same != bool(sel[b, i]), (b, i)


# ---- dtypes, gradients, init ------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bf16_runs_and_tracks_fp32(name, layout):
    m = mixer(name, layout)
    x = random_hidden(2, 33, 16)
    with torch.no_grad():
        ref = m(x, mode="chunk").hidden
    out = check_runs_in_dtype(m, x, torch.bfloat16)
    assert rel_err(out, ref) < 0.1


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_backward_reaches_every_parameter(name, layout):
    m = mixer(name, layout, short_conv=True).train()
    check_backward(m, random_hidden(2, 21, 16))


@pytest.mark.parametrize("name", NAMES)
def test_init_sparse_path_equals_shared_path(name):
    """LoRA B = 0 at init: with N = K = 1, router prob 1, the sparse partition reproduces the shared one
    (both paths also start with the same gates)."""
    torch.manual_seed(0)
    m = build_mixer(name, dict(num_partitions=1, lora_rank=4), hidden_size=16, num_heads=2, num_kv_heads=1,
                    head_dim=8).eval()
    x = random_hidden(1, 9, 16)
    sh, sp, _ = m.features(x)
    for a, b in ((sh.q, sp.q), (sh.k, sp.k), (sh.g, sp.g)):
        assert torch.equal(a, b)
    with torch.no_grad():
        st = m(x, output_state=True).state
    assert rel_err(st.sparse[:, 0], st.shared) < 1e-6


def test_init_router_from_keys_separates_clusters():
    m = mixer("sse", num_partitions=4)
    gen = torch.Generator().manual_seed(3)
    centers = torch.randn(4, 16, generator=gen) * 4
    x = (centers.repeat_interleave(50, 0) + 0.3 * torch.randn(200, 16, generator=gen))
    assign = m.init_router_from_keys(x)
    top = m.router(x).argmax(-1)
    assert torch.equal(top, assign)
    per_cluster = top.view(4, 50)
    assert all(len(row.unique()) == 1 for row in per_cluster)        # one partition per cluster
    assert len(per_cluster[:, 0].unique()) == 4                      # and all four used
