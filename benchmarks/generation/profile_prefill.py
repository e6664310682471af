"""Where a prefill's time goes, the teacher beside its hybrid: device time per layer type and top kernels.

Issue 24 item 4 asks the hybrid to prefill at least as fast as its teacher from 8k; this says which part of the
forward costs the difference. Builds a (teacher, hybrid) pair with `rollouts.build_pair` (random weights), runs the
fast engine's prefill (`FastGenerator._prefill`: the model's own forward with the prompt mask, a fresh cache and
`logits_to_keep=1`, as HF generate's first call) `--warmup` times, then profiles one more with `torch.profiler`.
Each decoder layer's attention (softmax or mixer) runs in a profiler scope (`hybridize.generation.profile.scopes`),
so the table splits the time into the layer types and "other" (embedding, norms, MLPs, head).

    python -m benchmarks.generation.profile_prefill                    # CPU smoke run: tiny shape, 256 tokens
    python -m benchmarks.generation.profile_prefill --shape qwen3-1.7b --prompt-len 8192 --batch 1 --json out.json

On the GPU "time" is the device time of the kernels each scope launched; on the CPU it is the CPU time of the
outermost aten ops that do work (a proxy). The prompt is the speed table's (`rollouts.bench_model`): one row left-padded
by an eighth, so the teacher's attention takes its masked path; `--no-pad` gives every row all its tokens.
Kernels the profiler does not tie to a launching CPU op (Triton launches) are the row "unattributed".
"""
from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.generation import rollouts
from hybridize.generation.fast import FastGenConfig, FastGenerator
from hybridize.generation.profile import (device_items, layer_kind, scopes, summarize_eager, table, top_ops,
                                          work_items)


def prefill_profile(model, ids, mask, warmup: int, top: int) -> dict:
    """Profile of one prefill of `ids` `[B, T]` (prompt mask `mask`) after `warmup` untimed ones: device (CPU) time
    per layer type and top kernels."""
    cuda = ids.device.type == "cuda"
    gen = FastGenerator(model, FastGenConfig(fallback=False))
    pos, am = gen._positions(ids, mask)

    def once():
        with torch.no_grad():
            gen._prefill(ids, am, pos)
        if cuda:
            torch.cuda.synchronize()

    walls = []
    for _ in range(max(1, warmup)):
        t0 = time.perf_counter()
        once()
        walls.append(time.perf_counter() - t0)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with scopes(model), profile(activities=acts) as prof:
        once()
    items = work_items(prof.events(), cuda)
    kinds = Counter(layer_kind(layer) for layer in model.model.layers)
    res = summarize_eager(items, 1, kinds)
    total = sum(t for *_, t in items)
    if cuda:   # every device event, attributed or not (Triton launches have no launching aten op)
        rest = sum(t for _, t in device_items(prof.events())) - total
        res["by_layer_type"].append({"layer_type": "unattributed", "layers": "-", "time_us_per_layer": rest,
                                     "time_us_per_step": rest, "kernels_per_layer": 0})
        total += rest
    return {"wall_s_last_warmup": walls[-1], "profiled_total_ms": total / 1e3,
            "tokens_per_s_wall": ids.numel() / walls[-1],
            "by_layer_type": [{"layer_type": r["layer_type"], "layers": r["layers"],
                               "ms_per_layer": r["time_us_per_layer"] / 1e3, "ms_all": r["time_us_per_step"] / 1e3,
                               "kernels_per_layer": r["kernels_per_layer"]} for r in res["by_layer_type"]],
            "sse_pieces": [{"piece": r["piece"], "ms_per_layer": r["time_us_per_layer"] / 1e3,
                            "kernels_per_layer": r["kernels_per_layer"]} for r in res["sse_pieces"]],
            "top_by_time": [{"op": r["op"], "per_call": r["per_step"], "ms": r["time_us_per_step"] / 1e3}
                            for r in top_ops(items, 1, top, "time")]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default=None, help="a rollouts.py shape (default: qwen3-1.7b on CUDA, tiny on CPU)")
    rollouts.add_plan_args(ap)
    ap.add_argument("--models", default="teacher,hybrid", help="which of the pair to profile, in this order")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=None, help="default 8192 on CUDA, 256 on CPU")
    ap.add_argument("--no-pad", dest="pad", action="store_false",
                    help="every row all its tokens (default: row 0 left-padded by T/8, as the speed table's prompts)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed prefills before the profiled one")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="CUDA dtype (CPU: fp32)")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--json", default="", help="also write the numbers here")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, args.dtype) if cuda else torch.float32
    shape = args.shape or ("qwen3-1.7b" if cuda else "tiny")
    T = args.prompt_len or (8192 if cuda else 256)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in models if m not in ("teacher", "hybrid")]
    if bad:
        ap.error(f"--models takes teacher and/or hybrid, got {bad}")
    teacher, hybrid = rollouts.build_pair(shape, args.plan, args.mixer, dtype, device, rollouts.plan_settings(args))
    pair = {"teacher": teacher, "hybrid": hybrid}
    torch.manual_seed(1)
    ids = torch.randint(10, teacher.config.vocab_size - 10, (args.batch, T), device=device)
    mask = torch.ones_like(ids)
    if args.pad:
        mask[0, :T // 8] = 0
    out = {"shape": shape, "plan": args.plan, "mixer": args.mixer, "batch": args.batch, "prompt_len": T, "pad": args.pad,
           "dtype": str(dtype), "device": torch.cuda.get_device_name() if cuda else "cpu", "models": {}}
    print(f"prefill profile: {shape}, {args.batch} x {T} ({'row 0 left-padded by T/8' if args.pad else 'no padding'}), "
          f"{dtype}, {out['device']}, plan {args.plan} ({args.mixer})")
    for name in models:
        res = prefill_profile(pair[name], ids, mask, args.warmup, args.top)
        out["models"][name] = res
        print(f"\n## {name}: {res['tokens_per_s_wall']:,.0f} tokens/s (wall, last warm-up), "
              f"{res['profiled_total_ms']:.1f} ms profiled {'device' if cuda else 'CPU'} time")
        print(table(res["by_layer_type"]))
        if res["sse_pieces"]:
            print(table(res["sse_pieces"]))
        print(table(res["top_by_time"]))
    if len(out["models"]) == 2:
        a, b = (out["models"][m] for m in ("teacher", "hybrid"))
        out["hybrid_over_teacher_wall"] = a["wall_s_last_warmup"] and b["wall_s_last_warmup"] / a["wall_s_last_warmup"]
        print(f"\nhybrid / teacher prefill time (wall): {out['hybrid_over_teacher_wall']:.3f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
