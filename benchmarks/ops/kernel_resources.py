"""Registers and spills of SSE's one-kernel decode step, compiled offline for a GPU target: no GPU needed.

    python -m benchmarks.ops.kernel_resources                          # sm_90 (H100 / H200), both shapes, batches 1, 8, 32
    python -m benchmarks.ops.kernel_resources --warps 4,8 --out resources.json
    python -m benchmarks.ops.kernel_resources --shapes qwen3-1.7b --batches 8 --bv 32,64,128 --warps 4,8,16

Why: a Triton kernel that needs many registers a thread fits fewer programs on an SM, and past 255 it spills to local
memory; either can slow a decode step without changing a number it computes, so no CPU test sees it. (f56ffe1 moved
loads of SSE's step before its shared-state update, which took the step at the SmolLM2-135M shape from 128 to 167
registers a thread; a98be38 moved them back.) The specialisation matters: compiled without the launcher's 16-byte
divisibility hints the same kernel took 255 registers and spilled 300-1,000 bytes a thread, which the launched kernel
does not.

Per shape and batch this builds the SSE mixer (random weights, bf16, on the CPU), takes the step's arguments for the
path the kernel options pick (`SSE.step_inputs`: the up-projections merged into stage 1, applied in the step, or a
stage-2 matmul) and the kernel's launch (`triton_fused_step.step_launch`, PDL on as on Hopper), specialises the
arguments as Triton's launcher does (16-byte divisibility of pointers and integers, integers equal to 1 as
constants), compiles for the target and reads the cubin's registers, stack (spill) bytes and shared memory with the
`cuobjdump` bundled in Triton's NVIDIA backend. Prints a markdown table and writes `--out` JSON.

    python -m benchmarks.ops.kernel_resources --kernels gla                   # the pieces GLA's passes, every config
    python -m benchmarks.ops.kernel_resources --kernels gla --gla-passes dk,dv  # those passes only (seconds)

`--kernels gla`: the same for the five passes of the pieces GLA (`ops/gla/triton_fwd.py`, `triton_bwd.py`: piece
states, output, dq, dk, dv) on SSE's layout as training reads it (`--gla-layout shared`: the shared path in place, the
sparse rows packed; `both`: both paths in place with the router scale; `plain`: a plain GLA call), bf16, every config
of each pass's autotune list, with each compiled pass's layout conversions, shared-memory allocations and barriers
(`ir_counts`). The arguments are placeholders of the right dtype and alignment (only those specialise
the compile); the kernels' parameters are checked against them, so a renamed or new one fails here in one line.
(The dq pass taking the backward's piece sums took the config it picks on SSE's 16k layout from 238 to 255
registers, and five of its ten configs now spill, against one of seven before: benchmarks/RESULTS.md.)
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch

SHAPES = ("qwen3-1.7b", "smollm2-135m")


def bundled_cuobjdump() -> Path | None:
    """Where Triton's NVIDIA backend keeps its cuobjdump, or None without triton."""
    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def cuobjdump() -> Path:
    """The cuobjdump of Triton's NVIDIA backend (SystemExit with what to install when absent)."""
    path = bundled_cuobjdump()
    if path is None:
        raise SystemExit("benchmarks/ops/kernel_resources.py needs triton (pip install triton)")
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("benchmarks/ops/kernel_resources.py compiles kernels: unset TRITON_INTERPRET")
    if not path.exists():
        raise SystemExit(f"no cuobjdump at {path}: this triton has no bundled NVIDIA tools")
    return path


def parse_usage(text: str) -> dict:
    """{registers, stack, shared} from `cuobjdump --dump-resource-usage` output (its last `Function` line)."""
    lines = [ln for ln in text.splitlines() if "REG:" in ln]
    if not lines:
        raise ValueError(f"no resource line in cuobjdump's output: {text[-300:]!r}")
    fields = dict(re.findall(r"(\w+)(?:\[\d+\])?:(\d+)", lines[-1]))
    return {"registers": int(fields["REG"]), "stack": int(fields["STACK"]), "shared": int(fields["SHARED"])}


def ir_counts(ttgir: str, ptx: str) -> dict:
    """How often a compiled kernel moves values between register layouts: `convert_layout` ops and shared-memory
    allocations (`local_alloc`, the products' operands among them) in its TTGIR, barriers (`bar.sync`) in its PTX.
    Each conversion is a trip through shared memory, which the pieces GLA's passes wait on most."""
    return {"convert_layout": ttgir.count("ttg.convert_layout"), "local_alloc": ttgir.count("ttg.local_alloc"),
            "barriers": ptx.count("bar.sync")}


def specialise(fn, launch) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) of `launch` for `fn`, as Triton's launcher builds them from the arguments."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    kwargs = {k: v for k, v in launch.kwargs.items() if k != "launch_pdl"}
    args = iter(launch.args)
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        if p.is_constexpr:
            signature[p.name], constexprs[(i,)] = "constexpr", kwargs[p.name]
            continue
        arg = next(args)
        kind, key = native_specialize_impl(BaseBackend, arg, False, not p.do_not_specialize,
                                           not p.do_not_specialize_on_alignment)
        signature[p.name] = kind
        if kind == "constexpr":
            constexprs[(i,)] = arg
        elif isinstance(key, str):
            attrs[(i,)] = BaseBackend.parse_attr(key)
    return signature, constexprs, attrs


def compile_usage(fn, launch, arch: int, num_warps: int, num_stages: int | None = None) -> dict:
    """Compile `launch` of `fn` for sm_<arch> and read the cubin's resource usage, and `ir_counts`."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs = specialise(fn, launch)
    options = {"num_warps": num_warps} | ({} if num_stages is None else {"num_stages": num_stages})
    kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", arch, 32),
                            options=options)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "kernel.cubin"
        path.write_bytes(kernel.asm["cubin"])
        out = subprocess.run([str(cuobjdump()), "--dump-resource-usage", str(path)], capture_output=True, text=True,
                             check=True).stdout
    return parse_usage(out) | ir_counts(kernel.asm["ttgir"], kernel.asm["ptx"])


def _choices(arg: str) -> list:
    """A comma list of ints, or [None] for "launch" (the launch's own rule)."""
    return [None] if arg == "launch" else [int(x) for x in arg.split(",")]


def step_launch_for(m, B: int, pdl: bool = True, bv: int | None = None):
    """The step kernel's launch for one token of batch B through mixer m (CPU tensors), on the path the kernel options
    pick, with `pdl` as on a Hopper GPU; `bv` as `step_launch` takes it (None: `block_v`'s choice)."""
    from hybridize.mixers.sse import SSEState
    from hybridize.ops.sse.triton_fused_step import step_launch

    c, dtype = m.config, next(m.parameters()).dtype
    st = SSEState(sparse=torch.zeros(B, c.num_partitions, c.num_heads, c.head_dim, c.head_dim),
                  shared=torch.zeros(B, c.num_heads, c.head_dim, c.head_dim))
    x = torch.randn(B, 1, c.hidden_size, dtype=dtype)
    ang = torch.rand(B, 1, c.head_dim) * 6.28
    with torch.no_grad():
        inputs = m.step_inputs(x, st, (ang.cos().to(dtype), ang.sin().to(dtype)))
        launch = step_launch(**inputs, bv=bv)
    launch.kwargs.update(PDL=pdl, launch_pdl=pdl)
    path = ("merged" if m.merged_lowrank() else "in step" if inputs["ups"] is not None else "stage 2")
    return launch, path


#: the pieces GLA's runtime pointer arguments by name: their dtype (placeholders; only dtype and alignment specialise)
_GLA_POINTERS = {torch.bfloat16: ("q", "k", "v", "do", "q_sp", "k_sp", "v_sp", "do_sp", "o", "dq", "dk", "dv", "a_out",
                                   "a_in", "anchors"),
                 torch.float32: ("g", "g_sp", "starts", "rstarts", "l_out", "d_out", "d_own", "dgq", "off", "dg"),
                 torch.int64: ("order", "seg")}
GLA_LAYOUTS = ("shared", "both", "plain")


def gla_launches(layout: str = "shared", T: int = 16384, H: int = 16, K: int = 128, V: int = 128,
                 only: tuple[str, ...] = ()):
    """(pass, kernel, config, launch) for every config of the pieces GLA's five passes (or those named in `only`) on
    SSE's layout of T tokens (2T rows; `T` rows for `plain`), with the constexprs `forward_pieces` /
    `backward_pieces` give them."""
    import triton

    from hybridize.ops.common.triton_utils import tune_buckets
    from hybridize.ops.gla import triton_bwd as tb, triton_fwd as tf

    runtime = {name: torch.empty(16, dtype=dt) for dt, names in _GLA_POINTERS.items() for name in names}
    gather = None if layout == "plain" else tf.Gather(
        *(runtime[n] for n in ("q_sp", "k_sp", "v_sp", "g_sp", "order")), torch.empty(16) if layout == "both" else None,
        1, T, True, True, packed=layout == "shared")
    (*_, wsc, L0), gather_flags = tf._gather_args(*(runtime[n] for n in "qkvg"), gather)   # as the passes get them
    runtime |= dict(wsc=wsc, L0=L0, scale=K ** -0.5, **tune_buckets(2 * T if gather else T, 1024 * H))
    flags = dict(H=H, K=K, V=V, PREC=tf._precision(torch.bfloat16), G_MIN=tf.G_MIN, PROD=tb._products(torch.bfloat16),
                 ANCHOR=tb._dg_anchor(), **gather_flags)
    full_k, full_v = dict(BK=triton.next_power_of_2(K)), dict(BV=triton.next_power_of_2(V))
    passes = [("piece states", tf._piece_state_kernel, tf._state_configs, {}),
              ("output", tf._output_kernel, tf._out_configs, full_k | dict(KEEP_A=True)),   # as in training
              ("dq", tb._dq_kernel, tb._dq_configs, full_v),
              ("dk", tb._dk_kernel, tb._row_configs, full_v), ("dv", tb._dv_kernel, tb._col_configs, full_k)]
    names = [p[0] for p in passes]
    if set(only) - set(names):
        raise SystemExit(f"kernel_resources: --gla-passes takes {', '.join(names)}; got {', '.join(only)}")
    for name, kernel, configs, fixed in passes:
        if only and name not in only:
            continue
        for cfg in configs():
            const = flags | fixed | cfg.kwargs
            unknown = [p.name for p in kernel.params if p.name not in (const if p.is_constexpr else runtime)]
            if unknown:
                raise SystemExit(f"kernel_resources: {kernel.fn.__name__} takes {unknown}, which gla_launches does not "
                                 "give: add them to _GLA_POINTERS or its constants")
            args = [runtime[p.name] for p in kernel.params if not p.is_constexpr]
            kwargs = {p.name: const[p.name] for p in kernel.params if p.is_constexpr}
            yield name, kernel, cfg, SimpleNamespace(args=args, kwargs=kwargs)


def gla_main(args) -> None:
    from benchmarks.timing import md_table

    rows, out = [], []
    only = tuple(p.strip() for p in args.gla_passes.split(",") if p.strip())
    for name, kernel, cfg, launch in gla_launches(args.gla_layout, only=only):
        usage = compile_usage(kernel, launch, args.arch, cfg.num_warps, cfg.num_stages)
        tiles = ", ".join(f"{k}={v}" for k, v in cfg.kwargs.items())
        rec = dict(layout=args.gla_layout, kernel=name, tiles=tiles, warps=cfg.num_warps, stages=cfg.num_stages,
                   **usage)
        out.append(rec)
        rows.append([name, tiles, cfg.num_warps, cfg.num_stages, usage["registers"], usage["stack"],
                     usage["convert_layout"], usage["local_alloc"], usage["barriers"]])
        print(rec, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"arch": args.arch, "rows": out}, indent=1))
    print(f"\nThe pieces GLA's passes (ops/gla/triton_fwd.py, triton_bwd.py) on SSE's layout ({args.gla_layout}), "
          f"compiled for sm_{args.arch}, bf16, K=V=128, every autotune config")
    print(md_table(["pass", "tiles", "warps", "stages", "registers", "stack (spill) B", "convert_layout",
                    "local_alloc", "bar.sync"], rows))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help="SSE layer shapes of benchmarks/ops/sse_step.py")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--warps", default="launch", help="the step's num_warps to compile with, comma-separated; "
                                                      "launch: its own (`fused_step.step_warps`). --kernels gla "
                                                      "compiles each config with that config's warps")
    ap.add_argument("--bv", default="launch", help="the step's value columns per program, comma-separated; launch: "
                                                   "its own (`fused_step.block_v`)")
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10: 90 = H100 / H200")
    ap.add_argument("--out", default=None, help="also write the rows as JSON")
    ap.add_argument("--kernels", default="step", choices=["step", "gla"],
                    help="step: SSE's decode step; gla: the pieces GLA's five passes, every autotune config")
    ap.add_argument("--gla-layout", default="shared", choices=GLA_LAYOUTS,
                    help="with --kernels gla: shared (training's default), both (both paths in place), plain")
    ap.add_argument("--gla-passes", default="", help="with --kernels gla: only these passes, comma-separated "
                                                     "(piece states, output, dq, dk, dv; default all)")
    args = ap.parse_args(argv)
    cuobjdump()
    if args.kernels == "gla":
        return gla_main(args)
    from benchmarks.ops.sse_step import build
    from benchmarks.timing import md_table
    from hybridize.ops.sse.triton_fused_step import _sse_gla_step_kernel

    rows, out = [], []
    for shape in args.shapes.split(","):
        m = build(shape, torch.device("cpu"), torch.bfloat16)
        for B in (int(b) for b in args.batches.split(",")):
            for bv in _choices(args.bv):
                if bv is not None and bv > m.config.head_dim:
                    continue
                launch, path = step_launch_for(m, B, bv=bv)
                for w in ([launch.kwargs["num_warps"]] if args.warps == "launch" else
                          [int(x) for x in args.warps.split(",")]):
                    usage = compile_usage(_sse_gla_step_kernel, launch, args.arch, w)
                    nb, _, H = launch.grid
                    rec = dict(shape=shape, batch=B, path=path, bv=launch.kwargs["BV"], programs=nb * B * H,
                               warps=w, **usage)
                    out.append(rec)
                    rows.append([shape, B, path, rec["bv"], rec["programs"], w, usage["registers"], usage["stack"],
                                 usage["shared"]])
                    print(rec, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"arch": args.arch, "rows": out}, indent=1))
    print(f"\nSSE's one-kernel decode step (ops/sse/triton_fused_step.py), compiled for sm_{args.arch}, bf16, "
          f"the kernel options in force")
    print(md_table(["shape", "batch", "up-projections", "BV", "programs", "warps", "registers", "stack (spill) B",
                    "shared B"], rows))


if __name__ == "__main__":
    main()
