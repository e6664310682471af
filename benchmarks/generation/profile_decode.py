"""Where the time of one fast-path decode step goes: kernels (ops) per step per layer type, top ops.

Builds a (teacher, hybrid) pair with `benchmarks/generation/rollouts.py`'s `build_pair` (random weights;
`--layers` shrinks the model), prefills a batch like `rollouts.py` does (one left-padded row), runs the hybrid
through `hybridize.generation.fast.FastGenerator` (the same config and call as `rollouts.py`), and profiles N
decode steps with `torch.profiler` (`hybridize.generation.profile`: what is counted, the two profiles - CUDA
graph replays and eager steps per layer type - and the CPU stand-in for the Triton SSE decode kernel).

    python -m benchmarks.generation.profile_decode                         # CPU: qwen3-tiny, 6 layers
    python -m benchmarks.generation.profile_decode --shape qwen3-1.7b --prompt-len 16384 --batch 8 --steps 16  # GPU
    python -m benchmarks.generation.profile_decode --json out.json         # also write the numbers
    python -m benchmarks.generation.profile_decode --model teacher ...     # the teacher on the same engine

`--model teacher` profiles the pair's teacher (every layer softmax attention) through the same engine and settings,
so a cell where the hybrid is slower than its teacher can be compared kernel by kernel.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.generation import rollouts
from hybridize.generation.profile import profile_model, report

#: shapes for CPU runs, added to rollouts.SHAPES (qwen3 family: q/k norms, as the real target)
EXTRA_SHAPES = {
    "qwen3-tiny": ("qwen3", dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 max_position_embeddings=4096, tie_word_embeddings=True)),
}


def build(args, device, dtype, settings: dict):
    for name, spec in EXTRA_SHAPES.items():
        rollouts.SHAPES.setdefault(name, spec)
    family, kw = rollouts.SHAPES[args.shape]
    if args.layers:
        saved = rollouts.SHAPES[args.shape]
        rollouts.SHAPES[args.shape] = (family, {**kw, "num_hidden_layers": args.layers})
    try:
        teacher, hybrid = rollouts.build_pair(args.shape, args.plan, args.mixer, dtype, device, settings)
    finally:
        if args.layers:
            rollouts.SHAPES[args.shape] = saved
    if args.model == "teacher":
        return teacher
    del teacher
    return hybrid


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default=None, help="a rollouts.py shape or qwen3-tiny (default: qwen3-1.7b on "
                                                  "CUDA, qwen3-tiny on CPU)")
    ap.add_argument("--layers", type=int, default=0, help="override the layer count (0: the shape's)")
    ap.add_argument("--model", default="hybrid", choices=["hybrid", "teacher"],
                    help="which of the pair to profile (the teacher: no layer converted, on the same engine)")
    rollouts.add_plan_args(ap)
    ap.add_argument("--batch", type=int, default=None, help="default 8 on CUDA, 2 on CPU")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 16384 on CUDA, 32 on CPU")
    ap.add_argument("--steps", type=int, default=8, help="profiled decode steps")
    ap.add_argument("--attention", default="auto", help="FastGenConfig.attention: auto | triton | sdpa")
    ap.add_argument("--compile", default="off", choices=["off", "on"],
                    help="FastGenConfig.compile (the graph replay then runs the compiled step's kernels)")
    ap.add_argument("--gemm", default="auto", choices=["auto", "torch"],
                    help="FastGenConfig.gemm: the Triton decode GEMM (auto, on CUDA) or F.linear (torch)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="CUDA dtype (CPU: fp32)")
    ap.add_argument("--no-graphs", dest="graphs", action="store_false", help="CUDA: skip the graph-replay profile")
    ap.add_argument("--decode-kernel", default="emulate", choices=["emulate", "torch"],
                    help="CPU only: 'emulate' runs the SSE and window steps' GPU paths with PyTorch stand-ins for "
                         "the Triton kernels (counted as one kernel each); 'torch' their CPU paths")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads")
    ap.add_argument("--json", default="", help="also write the numbers here")
    args = ap.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    if not cuda:
        torch.set_num_threads(args.threads)
    args.shape = args.shape or ("qwen3-1.7b" if cuda else "qwen3-tiny")
    args.batch = args.batch or (8 if cuda else 2)
    args.prompt_len = args.prompt_len or (16384 if cuda else 32)
    dtype = getattr(torch, args.dtype) if cuda else torch.float32
    settings = rollouts.plan_settings(args)
    model = build(args, device, dtype, settings)
    which = "the teacher" if args.model == "teacher" else f"plan {args.plan}, mixer {args.mixer} {settings or ''}"
    header = (f"device: {torch.cuda.get_device_name() if cuda else 'CPU'}; torch {torch.__version__}; "
              f"shape {args.shape} ({len(model.model.layers)} layers), {which}; "
              f"dtype {str(dtype).replace('torch.', '')}; batch {args.batch}, prompt {args.prompt_len}")
    res = profile_model(model, args, device)
    print(report(res, header))
    if args.json:
        Path(args.json).write_text(json.dumps({"header": header, "args": vars(args), **res}, indent=1))


if __name__ == "__main__":
    main()
