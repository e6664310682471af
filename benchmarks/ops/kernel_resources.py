"""Registers and spills of SSE's one-kernel decode step, compiled offline for a GPU target: no GPU needed.

    python -m benchmarks.ops.kernel_resources                          # sm_90 (H100 / H200), both shapes, batches 1, 8, 32
    python -m benchmarks.ops.kernel_resources --warps 4,8 --out resources.json

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


def compile_usage(fn, launch, arch: int, num_warps: int) -> dict:
    """Compile `launch` of `fn` for sm_<arch> and read the cubin's resource usage."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs = specialise(fn, launch)
    kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", arch, 32),
                            options={"num_warps": num_warps})
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "kernel.cubin"
        path.write_bytes(kernel.asm["cubin"])
        out = subprocess.run([str(cuobjdump()), "--dump-resource-usage", str(path)], capture_output=True, text=True,
                             check=True).stdout
    return parse_usage(out)


def step_launch_for(m, B: int, pdl: bool = True):
    """The step kernel's launch for one token of batch B through mixer m (CPU tensors), on the path the kernel options
    pick, with `pdl` as on a Hopper GPU."""
    from hybridize.mixers.sse import SSEState
    from hybridize.ops.sse.triton_fused_step import step_launch

    c, dtype = m.config, next(m.parameters()).dtype
    st = SSEState(sparse=torch.zeros(B, c.num_partitions, c.num_heads, c.head_dim, c.head_dim),
                  shared=torch.zeros(B, c.num_heads, c.head_dim, c.head_dim))
    x = torch.randn(B, 1, c.hidden_size, dtype=dtype)
    ang = torch.rand(B, 1, c.head_dim) * 6.28
    with torch.no_grad():
        inputs = m.step_inputs(x, st, (ang.cos().to(dtype), ang.sin().to(dtype)))
        launch = step_launch(**inputs)
    launch.kwargs.update(PDL=pdl, launch_pdl=pdl)
    path = ("merged" if m.merged_lowrank() else "in step" if inputs["ups"] is not None else "stage 2")
    return launch, path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help="SSE layer shapes of benchmarks/ops/sse_step.py")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--warps", default="4", help="num_warps to compile with, comma-separated (the launch uses 4)")
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10: 90 = H100 / H200")
    ap.add_argument("--out", default=None, help="also write the rows as JSON")
    args = ap.parse_args(argv)
    cuobjdump()
    from benchmarks.ops.sse_step import build
    from benchmarks.timing import md_table
    from hybridize.ops.sse.triton_fused_step import _sse_gla_step_kernel

    rows, out = [], []
    for shape in args.shapes.split(","):
        m = build(shape, torch.device("cpu"), torch.bfloat16)
        for B in (int(b) for b in args.batches.split(",")):
            launch, path = step_launch_for(m, B)
            for w in (int(x) for x in args.warps.split(",")):
                usage = compile_usage(_sse_gla_step_kernel, launch, args.arch, w)
                nb, _, H = launch.grid
                rec = dict(shape=shape, batch=B, path=path, bv=launch.kwargs["BV"], programs=nb * B * H, warps=w,
                           **usage)
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
