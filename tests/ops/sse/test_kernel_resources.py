"""`benchmarks/ops/kernel_resources.py`: the SSE step kernel compiled offline for sm_90, its registers and spills read
from the cubin; and `triton_fused_step.step_launch`, the launch it compiles, against the kernel's signature.

The compile needs triton with its bundled NVIDIA tools (no GPU); without them those tests skip.
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from benchmarks.ops import kernel_resources as kr

# the tool compiles Triton's JIT functions: under TRITON_INTERPRET=1 the kernels are interpreted functions instead
TRITON = importlib.util.find_spec("triton") is not None and os.environ.get("TRITON_INTERPRET") != "1"


def _tools() -> bool:
    path = kr.bundled_cuobjdump()
    return TRITON and path is not None and path.exists()


needs_triton = pytest.mark.skipif(not TRITON, reason="needs triton, not under TRITON_INTERPRET=1")
needs_tools = pytest.mark.skipif(not _tools(), reason="needs triton with its bundled NVIDIA tools (cuobjdump)")

SAMPLE = """
Resource usage:
 Common:
  GLOBAL:0
 Function _sse_gla_step_kernel:
  REG:167 STACK:16 SHARED:1024 LOCAL:0 CONSTANT[0]:752 TEXTURE:0 SURFACE:0 SAMPLER:0
"""


def test_ir_counts_count_conversions_allocations_and_barriers():
    ttgir = ("%1 = ttg.convert_layout %0 : tensor<16x32xf32, #mma> -> tensor<16x32xf32, #blocked>\n"
             "%2 = ttg.local_alloc %1 : ...\n%3 = ttg.convert_layout %2 ...\n")
    assert kr.ir_counts(ttgir, "bar.sync 0;\n\tbar.sync 0;\nbar.arrive 1;") == {
        "convert_layout": 2, "local_alloc": 1, "barriers": 2}


def test_parse_usage_reads_the_function_line():
    assert kr.parse_usage(SAMPLE) == {"registers": 167, "stack": 16, "shared": 1024}
    with pytest.raises(ValueError, match="no resource line"):
        kr.parse_usage("Resource usage:\n")


@needs_triton
@pytest.mark.parametrize("shape,B,path", [("smollm2-135m", 8, "merged"), ("qwen3-1.7b", 8, "in step"),
                                          ("qwen3-1.7b", 32, "stage 2")])
def test_step_launch_fills_the_kernel_signature(shape, B, path):
    """The launch the tool compiles is the mixer's own (`SSE.step_inputs`, `step_launch`): one runtime argument per
    non-constexpr parameter, every constexpr given, on the path the default options pick for the batch."""
    from benchmarks.ops.sse_step import build
    from hybridize.ops.sse.triton_fused_step import _sse_gla_step_kernel

    m = build(shape, torch.device("cpu"), torch.bfloat16)
    launch, got = kr.step_launch_for(m, B)
    assert got == path
    params = _sse_gla_step_kernel.params
    assert len(launch.args) == sum(not p.is_constexpr for p in params)
    assert {p.name for p in params if p.is_constexpr} <= set(launch.kwargs)
    assert launch.kwargs["PDL"] and launch.kwargs["launch_pdl"]
    assert launch.kwargs["UP"] == (path == "in step")
    assert launch.out.shape == (B, 1, m.config.num_heads, m.config.head_dim)


@needs_triton
def test_step_launch_takes_the_value_block_asked():
    """`--bv` compiles the launch at that block width (grid: D / bv programs per row and head); "launch" keeps the
    step's own rule."""
    from benchmarks.ops.sse_step import build

    m = build("qwen3-1.7b", torch.device("cpu"), torch.bfloat16)
    launch, _ = kr.step_launch_for(m, 8, bv=32)
    assert launch.kwargs["BV"] == 32 and launch.grid == (4, 8, 16)
    assert kr._choices("launch") == [None] and kr._choices("32,128") == [32, 128]


@needs_tools
def test_the_135m_step_compiles_without_spills():
    """SmolLM2-135M's SSE step at batch 8 (a whole 64-wide head per program, the widest block the step takes) compiles
    for sm_90 with no spill and at most 128 registers a thread (f56ffe1's early loads took it to 167), as launched:
    the launcher's divisibility hints are part of it."""
    from benchmarks.ops.sse_step import build
    from hybridize.ops.sse.triton_fused_step import _sse_gla_step_kernel

    launch, _ = kr.step_launch_for(build("smollm2-135m", torch.device("cpu"), torch.bfloat16), 8)
    signature, constexprs, attrs = kr.specialise(_sse_gla_step_kernel, launch)
    assert attrs[(0,)] == [["tt.divisibility", 16]]          # y, 16-byte aligned as allocated
    assert signature["y"] == "*bf16" and signature["st_sh"] == "*fp32"
    usage = kr.compile_usage(_sse_gla_step_kernel, launch, 90, 4)
    assert usage["stack"] == 0 and 0 < usage["registers"] <= 128


@needs_triton
@pytest.mark.parametrize("layout", kr.GLA_LAYOUTS)
def test_gla_launches_fill_every_pass_signature(layout):
    """`--kernels gla`: every config of the pieces GLA's five passes, each launch giving every parameter of its kernel
    (one runtime argument per non-constexpr parameter), the layout's flags and the config's tiles."""
    from hybridize.ops.gla import triton_bwd as tb, triton_fwd as tf

    launches = list(kr.gla_launches(layout))
    lists = {"piece states": tf._state_configs, "output": tf._out_configs, "dq": tb._dq_configs,
             "dk": tb._row_configs, "dv": tb._col_configs}
    assert [n for n, *_ in launches] == [n for n, f in lists.items() for _ in f()]
    for name, kernel, cfg, launch in launches:
        assert len(launch.args) == sum(not p.is_constexpr for p in kernel.params)
        assert set(launch.kwargs) == {p.name for p in kernel.params if p.is_constexpr}
        assert cfg.kwargs.items() <= launch.kwargs.items()
        assert launch.kwargs["GATHER"] == (layout != "plain") and launch.kwargs["PACKED"] == (layout == "shared")


@needs_triton
def test_gla_launches_take_only_the_passes_asked():
    """`--gla-passes dq,dv`: those passes' configs alone; a name that is not a pass fails in one line."""
    from hybridize.ops.gla import triton_bwd as tb

    names = [n for n, *_ in kr.gla_launches("shared", only=("dq", "dv"))]
    assert names == ["dq"] * len(tb._dq_configs()) + ["dv"] * len(tb._col_configs())
    with pytest.raises(SystemExit, match="--gla-passes takes piece states, output, dq, dk, dv; got dw"):
        list(kr.gla_launches("shared", only=("dw",)))


@needs_triton
def test_gla_launches_name_a_parameter_they_do_not_know(monkeypatch):
    """A pass parameter the tool has no placeholder for fails in one line that names it."""
    pointers = {dt: tuple(n for n in names if n != "dgq") for dt, names in kr._GLA_POINTERS.items()}
    monkeypatch.setattr(kr, "_GLA_POINTERS", pointers)
    with pytest.raises(SystemExit, match=r"_dq_kernel takes \['dgq'\]"):
        list(kr.gla_launches("shared"))


@needs_tools
def test_gla_passes_compile_for_sm90():
    """The first config of every pass compiles for sm_90 with the launcher's hints and reports its registers."""
    seen = set()
    for name, kernel, cfg, launch in kr.gla_launches("shared"):
        if name in seen:
            continue
        seen.add(name)
        usage = kr.compile_usage(kernel, launch, 90, cfg.num_warps, cfg.num_stages)
        assert 0 < usage["registers"] <= 255 and usage["stack"] >= 0
        assert usage["local_alloc"] > 0 and usage["barriers"] > 0 and usage["convert_layout"] >= 0
    assert seen == {"piece states", "output", "dq", "dk", "dv"}
