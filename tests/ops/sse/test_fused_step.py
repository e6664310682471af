"""The one-kernel SSE-on-GLA decode step (`ops/sse/triton_fused_step.py`) against the separate path and its reference.

The mixer decodes a few tokens after a prefill twice: through the one-kernel step (writable state, the fast
engine's case) and through the separate path (`fused_inputs` + the PyTorch recurrent reference). Outputs
and both states must agree (fp32: rel. error < 1e-5), the states are written in place, and partitions no
token selected stay bit-identical. The one-kernel step runs as the Triton kernel and as its PyTorch reference
(`ops/sse/fused_step.py`; on any machine), and the kernel is also compared with the reference op by op on random
inputs. The kernel's tests need triton and CUDA, or TRITON_INTERPRET=1 on the CPU:

    TRITON_INTERPRET=1 PYTHONPATH=/work/triton-site python -m pytest tests/ops/sse/test_fused_step.py
"""
from __future__ import annotations

import importlib.util
import os
from contextlib import contextmanager

import pytest
import torch

from hybridize.generation import profile as pd
from hybridize.mixers.sse import SSE, SSEGDN, SSEState
from hybridize.ops.common.options import use_kernel_options
from tests.rl.test_decode_ops import _mixer, _rope, rel

cuda = torch.cuda.is_available()
triton_ok = importlib.util.find_spec("triton") is not None
runs = triton_ok and (cuda or os.environ.get("TRITON_INTERPRET") == "1")
needs_kernel = pytest.mark.skipif(not runs, reason="needs triton and CUDA (or TRITON_INTERPRET=1)")
DEVICE = "cuda" if cuda else "cpu"


@contextmanager
def _path(path: str):
    """"kernel": the Triton step (CUDA or the interpreter); "reference": the one-kernel path with the kernel's PyTorch
    reference in its place (`generation.profile.emulated_decode_kernel`; runs anywhere); "separate": the separate
    path (the PyTorch recurrent reference on the CPU)."""
    if path == "kernel":
        with use_kernel_options(force_triton=not cuda, sse_fused_step=True):
            yield
    elif path == "reference":
        with pd.emulated_decode_kernel(), use_kernel_options(sse_fused_step=True):
            yield
    else:
        with use_kernel_options(sse_fused_step=False):
            yield


def _decode(m, x, path: str, steps: int = 3):
    """Prefill 5 tokens (separate path), then `steps` decode tokens with a writable state; returns the
    outputs `[B, steps, hidden]`, the final state and the states after the prefill."""
    B = x.shape[0]
    rope = m.config.use_rope
    fused = path != "separate"

    def pe(t, T=1):
        return None if not rope else tuple(a.expand(B, T, -1).to(x.device) for a in _rope(B, m.config.head_dim, t))
    with torch.no_grad():
        st = m(x[:, :5], position_embeddings=pe(0, 5), output_state=True).state
        st = SSEState(sparse=st.sparse.float().contiguous(), shared=st.shared.float().contiguous())
        st.writable = True
        first = SSEState(sparse=st.sparse.clone(), shared=st.shared.clone())
        outs, given = [], (st.sparse, st.shared)
        with _path(path):
            for t in range(5, 5 + steps):
                assert m.fused_step_ok(x[:, t:t + 1], st, None, pe(t)) == fused
                out = m(x[:, t:t + 1], state=st, position_embeddings=pe(t), output_state=True)
                if fused:   # written in place: the cache's own tensors come back
                    assert out.state.sparse.data_ptr() == given[0].data_ptr()
                    assert out.state.shared.data_ptr() == given[1].data_ptr()
                st = out.state
                st.writable = True
                outs.append(out.hidden)
    return torch.cat(outs, 1), st, first


CASES = [
    {},
    dict(qk_norm=True, use_rope=True, qkv_bias=True),                     # Qwen3-like: norms, RoPE, GQA
    dict(q_map="softmax", v_map="identity", k_map="silu"),
    dict(output_gate=False, emulq=False),
    dict(emulk=False, num_partitions=4, use_rope=True),
]


def _check_against_separate(kw, path, merged=False, finish=True, in_step=False):
    m = _mixer(SSE, **kw).to(DEVICE)
    _nonzero_ups(m)
    x = torch.randn(3, 9, 24, device=DEVICE)
    with use_kernel_options(sse_merged_lowrank="on" if merged else "off", sse_step_finish=finish,
                            sse_step_lowrank=in_step):
        o_f, s_f, first = _decode(m, x, path, steps=4)
    assert ("_merged_cache" in m.__dict__) == merged                                   # the path asked for ran
    assert list(m.__dict__["_step_layouts"]) == [(merged, finish, in_step and not merged)]
    o_g, s_g, _ = _decode(m, x, "separate", steps=4)
    assert rel(o_f, o_g) < 1e-5
    assert rel(s_f.shared, s_g.shared) < 1e-5 and rel(s_f.sparse, s_g.sparse) < 1e-5
    # partitions no decode token selected: bit-identical to the prefill's (never read or written)
    touched = (s_g.sparse - first.sparse).abs().flatten(2).amax(-1) > 0                # [B, P]
    assert (~touched).any(), "every partition was selected: pick other seeds"
    assert torch.equal(s_f.sparse[~touched], first.sparse[~touched])


def test_merged_lowrank_auto_merges_when_the_extra_weight_is_small(monkeypatch):
    """sse_merged_lowrank="auto" merges when the merged rows add at most MERGE_MAX_EXTRA_BYTES per layer: the
    test mixer's few hundred bytes do; with the limit below them they do not; "on" / "off" decide alone."""
    from hybridize.mixers import sse as sse_mod

    m = _mixer(SSE)
    ups = m._stage2()
    extra = (sum(u.out_features for u in ups) * 24 - sum(u.weight.numel() for u in ups)) * 4
    for choice, limit, want in [("auto", extra, True), ("auto", extra - 1, False), ("on", 0, True),
                                ("off", 1 << 40, False)]:
        monkeypatch.setattr(sse_mod, "MERGE_MAX_EXTRA_BYTES", limit)
        with use_kernel_options(sse_merged_lowrank=choice):
            assert m.merged_lowrank() == want, (choice, limit)


def test_refresh_builds_the_merged_stage_only_where_the_step_runs(monkeypatch):
    """The decode loop's refresh builds the merged stage-1 weight where the one-kernel step runs (CUDA; here the
    check patched), not on the CPU, where nothing reads it."""
    from hybridize.ops.sse import reference as sse_ops

    m = _mixer(SSE)
    with use_kernel_options(sse_merged_lowrank="on"):
        m.refresh_decode_weights()
        assert "_merged_cache" not in m.__dict__
        monkeypatch.setattr(sse_ops, "fused_step_applies", lambda x: True)
        m.refresh_decode_weights()
        assert "_merged_cache" in m.__dict__


def _nonzero_ups(m):
    """LoRA and gate up-projections away from their init (LoRA B = 0, gate weights 0), so the deltas and the
    data-dependent gates the step computes are tested, not zeros."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for lin in [m.lora_q.up, m.lora_k.up] + [gate.up for gate in m.lowrank_gates()]:
            lin.weight.copy_(0.3 * torch.randn(lin.weight.shape, generator=g))


VARIANTS = pytest.mark.parametrize("merged,finish,in_step", [(False, True, False), (True, True, False),
                                                             (False, False, False), (False, True, True),
                                                             (False, False, True)],
                                   ids=["two-stage", "merged", "unfinished", "in-step", "in-step-unfinished"])


@needs_kernel
@VARIANTS
@pytest.mark.parametrize("kw", CASES)
def test_fused_step_kernel_equals_separate_path(kw, merged, finish, in_step):
    _check_against_separate(kw, "kernel", merged, finish, in_step)


@VARIANTS
@pytest.mark.parametrize("kw", CASES)
def test_fused_step_reference_equals_separate_path(kw, merged, finish, in_step):
    """The kernel's PyTorch reference, in the mixer's one-kernel path (no triton needed): the contract the kernel
    is tested against below, wired as the mixer uses it. merged: kernel option sse_merged_lowrank, the LoRA and gate
    up-projections merged into the stage-1 matmul (u is y); finish: option sse_step_finish, the output norm and gate
    in the step (off: the mixer's `finish` applies them after it); in_step: option sse_step_lowrank, the step applies
    the up-projections to stage 1's low-rank columns itself (no stage-2 matmul)."""
    _check_against_separate(kw, "reference", merged, finish, in_step)


def test_step_lowrank_auto_applies_the_ups_in_the_step_up_to_8_rows():
    """sse_step_lowrank="auto": the step kernel applies the up-projections at batches up to STEP_LOWRANK_MAX_ROWS (the
    sizes it was timed at), the stage-2 GEMM above; "on" / "off" (and booleans) force it."""
    from hybridize.mixers.sse import STEP_LOWRANK_MAX_ROWS

    m = _mixer(SSE)
    for choice, rows, want in [("auto", 1, True), ("auto", STEP_LOWRANK_MAX_ROWS, True),
                               ("auto", STEP_LOWRANK_MAX_ROWS + 1, False), ("on", 64, True), ("off", 1, False),
                               (True, 64, True), (False, 1, False)]:
        with use_kernel_options(sse_step_lowrank=choice):
            assert m.lowrank_in_step(rows) == want, (choice, rows)


def test_merged_stage_wins_over_the_step_lowrank_option():
    """Both options on: the merged stage 1 runs (its u already holds the up-projections), the step does not apply them."""
    _check_against_separate({}, "reference", merged=True, in_step=True)


@needs_kernel
@pytest.mark.parametrize("finish,bv", [(None, None), ("norm", None), ("norm+gate", None), ("norm+gate", 4),
                                       ("norm", 8)], ids=["plain", "norm", "norm+gate", "norm+gate-split4", "norm-split2"])
@pytest.mark.parametrize("norm,rope,maps,heads", [(True, True, ("silu", "softmax", "silu"), (4, 2)),
                                                   (False, False, ("softmax", "silu", "identity"), (3, 3)),
                                                   (True, False, ("identity", "identity", "silu"), (8, 2))])
@pytest.mark.parametrize("ups", [False, True], ids=["u", "ups-in-step"])
def test_fused_step_kernel_equals_its_reference(norm, rope, maps, heads, finish, bv, ups):
    """Op level, random inputs: outputs and both states (every partition) against `sse_gla_step_reference`. finish:
    the step also applies the output norm (and the silu gate); bv < D splits a head over programs, the last of which
    finishes it (twice in a row: the per-head counters must be left at zero for the next step). ups: the step applies
    the LoRA and gate up-projections to y's low-rank columns itself (ranks that are not powers of two, gate biases)."""
    _check_step_kernel(norm, rope, maps, heads, finish, bv, ups)


@needs_kernel
@pytest.mark.parametrize("finish,bv", [("norm+gate", None), ("norm+gate", 4), ("norm", 8)],
                         ids=["whole", "split4", "norm-split2"])
@pytest.mark.parametrize("ups", [False, True], ids=["u", "ups-in-step"])
def test_fused_step_kernel_with_a_program_per_partition_equals_its_reference(finish, bv, ups):
    """paths=2: the shared and the selected partition in programs of their own, the head's last program summing
    both outputs; whole heads and heads split over value blocks, both up-projection paths."""
    _check_step_kernel(True, True, ("silu", "softmax", "silu"), (4, 2), finish, bv, ups, paths=2)


@pytest.mark.skipif(not triton_ok, reason="needs triton (the kernel's module imports it)")
def test_a_program_per_partition_needs_the_finishing_step():
    from hybridize.ops.sse.fused_step import StepLayout
    from hybridize.ops.sse.triton_fused_step import step_launch

    L = StepLayout(heads=2, kv_heads=2, head_dim=16, partitions=4, v_col=64, router_col=96, gate_col=100,
                   delta_col=64, q_map="identity", k_map="identity", v_map="identity", gate_normalizer=16.0,
                   norm_eps=None, emulq=True, emulk=True)
    y = torch.zeros(1, 1, 200)
    with pytest.raises(ValueError, match=r"\(paths=2\) only when it finishes the heads"):
        step_launch(y, y, torch.zeros(1, 2, 16, 16), torch.zeros(1, 4, 2, 16, 16), L, paths=2)


@needs_kernel
def test_fused_step_kernel_at_the_1p7b_head_shape_batch_1_takes_its_launch_rules():
    """16 heads of 128 at batch 1, the launch left to the rules (`block_v`, `step_paths`: 32-wide blocks, a program
    per partition), against the reference."""
    from hybridize.ops.sse.fused_step import block_v, step_paths

    assert step_paths(1, 128) == 2 and block_v(1, 16, 128, finish=True) == 32
    _check_step_kernel(True, True, ("silu", "softmax", "silu"), (16, 8), "norm+gate", None, True, D=128, B=1)


def _check_step_kernel(norm, rope, maps, heads, finish, bv, ups, paths=None, D=16, B=4):
    import dataclasses

    from hybridize.ops.sse.fused_step import StepLayout, StepUps, sse_gla_step_reference
    from hybridize.ops.sse.triton_fused_step import sse_gla_step

    H, Hk, P = *heads, 5
    n = (H + Hk) * D
    g = torch.Generator().manual_seed(7)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(DEVICE)  # noqa: E731
    gate_col = L_end = n + 3 + Hk * D + P + 5            # the output gate's columns after the router's in y
    L = StepLayout(heads=H, kv_heads=Hk, head_dim=D, partitions=P, v_col=n + 3, router_col=n + 3 + Hk * D,
                   gate_col=2 * n + 3, delta_col=n + 3, q_map=maps[0], k_map=maps[1], v_map=maps[2],
                   gate_normalizer=16.0,
                   norm_eps=1e-6 if norm else None, emulq=True, emulk=True,
                   out_norm_eps=1e-5 if finish else None, out_gate_col=gate_col if finish == "norm+gate" else None)
    y, u = rnd(B, 1, L_end + H * D), rnd(B, 1, 2 * n + 3 + 2 * H * D)   # the delta at an odd column
    up = None
    if ups:   # low-rank columns at an odd column of y (in the v block: any columns will do for the op)
        r, rg = 5, 3
        L = dataclasses.replace(L, low_col=n + 1, lora_rank=r, gate_rank=rg)
        up = StepUps(q=rnd(H * D, r), k=rnd(Hk * D, r), gate_shared=rnd(H * D, rg), gate_sparse=rnd(H * D, rg),
                     bias_shared=rnd(H * D), bias_sparse=rnd(H * D))
    wn = rnd(H + Hk, D) if norm else None
    wo = rnd(D) if finish else None
    ang = rnd(B, 1, D)
    cos, sin = (ang.cos(), ang.sin()) if rope else (None, None)
    states = [(rnd(B, H, D, D), rnd(B, P, H, D, D)) for _ in range(2)]
    states[1] = (states[0][0].clone(), states[0][1].clone())
    for _ in range(2):
        with use_kernel_options(force_triton=not cuda):
            o = sse_gla_step(y, u, *states[0], L, wn, cos, sin, bv=bv, out_weight=wo, ups=up, paths=paths)
        o_ref = sse_gla_step_reference(y, u, *states[1], L, wn, cos, sin, out_weight=wo, ups=up)
        assert rel(o, o_ref) < 1e-5
        assert rel(states[0][0], states[1][0]) < 1e-5 and rel(states[0][1], states[1][1]) < 1e-5


def test_fused_step_taken_only_where_it_applies():
    """Settings the kernel does not cover keep the separate path (checked without running a kernel)."""
    x = torch.randn(2, 1, 24)
    def state():
        return SSEState(sparse=torch.zeros(2, 3, 4, 8, 8), shared=torch.zeros(2, 4, 8, 8))
    m = _mixer(SSE)
    s = state()
    s.writable = True
    with torch.no_grad(), use_kernel_options(force_triton=triton_ok):
        assert m.fused_step_ok(x, s, None, None) == triton_ok
        assert not m.fused_step_ok(x, state(), None, None)                            # a state nobody owns
        assert not m.fused_step_ok(x, s, torch.ones(2, 1, dtype=torch.bool), None)    # a padding mask
        assert not _mixer(SSE, top_k=2).fused_step_ok(x, s, None, None)
        assert not _mixer(SSEGDN).fused_step_ok(x, s, None, None)
        assert not _mixer(SSE, use_rope=True).fused_step_ok(x, s, None, None)         # no cos / sin given
        with use_kernel_options(sse_fused_step=False):
            assert not m.fused_step_ok(x, s, None, None)
    with use_kernel_options(force_triton=triton_ok):
        assert not m.fused_step_ok(x, s, None, None)                                  # gradients on


def test_finishing_step_launch_rules():
    """`block_v`: a step that finishes its heads runs a head of at most 64 value columns in one program (no last-program
    handshake), and a 128-wide head too at 65-128 rows x heads (the 1.7B shape at batch 8); otherwise wider heads
    split as the plain step does. `step_warps`: 8 warps for 128-wide heads up to 8 rows. `step_paths`: a program per
    partition for 128-wide heads at batch 1, whose finishing step then takes 32-wide blocks."""
    from hybridize.ops.sse.fused_step import block_v, step_paths, step_warps

    assert block_v(1, 9, 64, finish=True) == 64 and block_v(1, 9, 64) == 16
    assert block_v(8, 16, 128, finish=True) == 128 and block_v(8, 16, 128) == 32
    assert block_v(1, 16, 128, finish=True) == 32 and block_v(1, 16, 128) == 16
    assert block_v(2, 16, 128, finish=True) == block_v(2, 16, 128) == 16
    assert block_v(32, 16, 128, finish=True) == block_v(32, 16, 128) == 64
    assert (step_warps(1, 128), step_warps(8, 128), step_warps(32, 128), step_warps(8, 64)) == (8, 8, 4, 4)
    assert (step_paths(1, 128), step_paths(2, 128), step_paths(8, 128), step_paths(1, 64)) == (2, 1, 1, 1)


@pytest.mark.skipif(not triton_ok, reason="needs triton")
def test_decode_kernels_are_opaque_to_torch_compile():
    """The decode kernels that write states in place (and the split-KV attention, whose Python scalars dynamo would
    re-type) are `torch.compiler.disable`d: a compiled step calls them as they are. (A refactor once moved the
    decorator off `sse_gla_step` onto the class above it.)"""
    from hybridize.ops.attn_decode.triton_split_kv import attn_decode
    from hybridize.ops.attn_decode.triton_window_step import window_step
    from hybridize.ops.sse.triton_fused_step import StepLaunch, sse_gla_step

    for fn in (sse_gla_step, window_step, attn_decode):
        assert getattr(fn, "_torchdynamo_disable", False), f"{fn.__name__} is traced by torch.compile"
    assert not getattr(StepLaunch, "_torchdynamo_disable", False)
