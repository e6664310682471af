"""Does `FastGenConfig(compile="auto")` pay for itself? (issue 24 item 3: the default settings and the warm-up)

A job of `--calls` generate calls of one shape (prompt `--prompt-len`, batch `--batch`, `--new-tokens` greedy tokens
to the budget, random weights: speed does not depend on them), run once per `compile` setting of our engine
(`--modes off,auto,on`), each mode with a fresh generator and dynamo's caches reset, so every mode pays its own
compile. Per call: wall seconds (CUDA-synchronised), decode ms per step, whether the step ran compiled. Per mode: the
job's seconds, the call at which the step first ran compiled and the compile's extra seconds on that call (its
wall time over the median of the uncompiled calls before it, or of the compiled calls after it when it is the first),
the median step after it. The "regret" column is
the mode's seconds over the faster of off and on in this job: ski rental promises auto at most about 2x, and about
1x once the job is much longer than `--compile-after-s`.

Before the modes, one uncompiled call at the shape absorbs what every mode would pay once per process (Triton
kernels' compilation, fla's autotuning).

    python -m benchmarks.generation.compile_auto --shape qwen3-1.7b --model hybrid --prompt-len 16384 --batch 8 \
        --new-tokens 512 --calls 16 --out $OUT/compile_auto.json      # as measured: RESULTS.md, "compile=auto"
    python -m benchmarks.generation.compile_auto --shape tiny --prompt-len 64 --new-tokens 8 --calls 3 \
        --dtype float32 --out /tmp/compile_auto.json                   # CPU smoke run (auto: the exact path never compiles)

Prints a markdown table (device, dtype, shape in the header) and writes `--out` JSON after each mode, with the decode
GEMM picks of the process (`gemm_choices`); `--gemm-choices EARLIER.json` runs those picks instead of timing new ones,
so the rows of an A/B do not differ in them; `--kernel-options K=V,...` runs the process under those kernel switches
(over the environment's; recorded in the JSON's `kernel_options`).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.generation.rollouts import SHAPES, add_plan_args, build_pair, plan_settings
from benchmarks.timing import free_memory, md_table, sync
from hybridize.errors import UserError
from hybridize.ops.common.options import check_overrides, current_kernel_options, use_kernel_options
from hybridize.ops.decode_gemm import triton_gemm   # imports without triton too (then nothing is ever picked)


def args_parser():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-1.7b", choices=sorted(SHAPES))
    ap.add_argument("--model", default="hybrid", choices=["hybrid", "teacher"])
    add_plan_args(ap)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--calls", type=int, default=24, help="generate calls per mode (one job)")
    ap.add_argument("--modes", default="off,auto,on")
    ap.add_argument("--compile-after-s", type=float, default=None,
                    help="FastGenConfig.compile_after_s for auto (default: the config's own default)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--stack-mlp", default="on", choices=["on", "off"],
                    help="FastGenConfig.stack_mlp: the MLPs' gate and up as one decode GEMM (on, the default) or two")
    ap.add_argument("--stack-qkv", default="on", choices=["on", "off"],
                    help="FastGenConfig.stack_qkv: attention's q, k and v as one decode GEMM (on, the default) or three")
    ap.add_argument("--gemm-choices", default=None, metavar="JSON",
                    help="use the decode GEMM picks of an earlier run (its --out JSON, `gemm_choices`) instead of "
                         "timing them: two rows of an A/B then run the same GEMM kernels")
    ap.add_argument("--kernel-options", default="", metavar="K=V,...",
                    help="kernel options for the process over the environment's, e.g. pdl=false "
                         "(hybridize.ops.common.options: their names and help)")
    ap.add_argument("--out", default="compile_auto.json")
    return ap


def parse_kernel_options(text: str) -> dict:
    """'k=v,k2=v2' -> {k: v, k2: v2}, checked against the kernel options (a bad name or value: one line)."""
    pairs = [p.strip() for p in text.split(",") if p.strip()]
    if any("=" not in p for p in pairs):
        raise SystemExit(f"--kernel-options takes name=value pairs separated by commas, got {text!r}")
    try:
        return check_overrides(dict(p.split("=", 1) for p in pairs), "--kernel-options")
    except UserError as e:
        raise SystemExit(str(e)) from None


def summarize(mode: str, calls: list[dict]) -> dict:
    """A mode's job: total seconds, the first compiled call (1-based, None if none), that call's extra seconds (over
    the median uncompiled call before it, or when it is the first call, over the median compiled call after it), and
    the median decode step of the calls after it (of all calls when none compiled)."""
    first = next((i for i, c in enumerate(calls) if c["compiled"]), None)
    after = calls[first + 1:] if first is not None else calls
    ref = [c["wall_s"] for c in (calls[:first] or after)] if first is not None else []
    extra = calls[first]["wall_s"] - statistics.median(ref) if ref else None
    steady = statistics.median(c["decode_ms"] for c in after) if after else None
    return {"mode": mode, "job_s": round(sum(c["wall_s"] for c in calls), 2),
            "first_compiled_call": None if first is None else first + 1,
            "compile_extra_s": None if extra is None else round(extra, 2),
            "steady_decode_ms": None if steady is None else round(steady, 3), "calls": calls}


def add_regret(rows: list[dict]) -> None:
    """Each row's job seconds over the faster of the off and on jobs (when both ran)."""
    base = [r["job_s"] for r in rows if r["mode"] in ("off", "on")]
    for r in rows:
        r["regret"] = round(r["job_s"] / min(base), 3) if len(base) == 2 else None


def one_mode(model, mode: str, ids, mask, args) -> dict:
    from hybridize.generation.fast import FastGenConfig, FastGenerator

    torch._dynamo.reset()   # every mode compiles from scratch
    kw = {} if args.compile_after_s is None else {"compile_after_s": args.compile_after_s}
    gen = FastGenerator(model, FastGenConfig(fallback=False, compile=mode, stack_mlp=args.stack_mlp == "on",
                                             stack_qkv=args.stack_qkv == "on", **kw))
    calls = []
    for i in range(args.calls):
        sync()
        t0 = time.perf_counter()
        gen(input_ids=ids, attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=False,
            eos_token_id=None, pad_token_id=0)
        sync()
        st = gen.stats
        calls.append({"call": i + 1, "wall_s": round(time.perf_counter() - t0, 3), "prefill_s": round(st["prefill_s"], 3),
                      "decode_ms": round(1e3 * st["decode_s"] / max(1, st["steps"] - 1), 3),
                      "compiled": bool(st["compiled"])})
        print(f"  {mode} call {i + 1}: {calls[-1]}", flush=True)
    del gen
    return summarize(mode, calls)


def pin_gemm_choices(path: str) -> int:
    """Load the `gemm_choices` of an earlier run's JSON as this process's picks (`triton_gemm.pin_choices`)."""
    try:
        shown = json.loads(Path(path).read_text())["gemm_choices"]
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"--gemm-choices {path}: not a compile_auto JSON with gemm_choices ({e})") from None
    try:
        return triton_gemm.pin_choices(shown)
    except ValueError as e:
        raise SystemExit(f"--gemm-choices {path}: {e}") from None


def main(argv=None):
    args = args_parser().parse_args(argv)
    with use_kernel_options(parse_kernel_options(args.kernel_options)):   # the environment's, with these over them
        run(args)


def run(args):
    if args.gemm_choices:
        print(f"decode GEMM picks pinned from {args.gemm_choices}: {pin_gemm_choices(args.gemm_choices)} shapes",
              flush=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    if device.type == "cuda":
        from hybridize.ops import gpu
        gpu.activate()
    settings = plan_settings(args)
    teacher, hybrid = build_pair(args.shape, args.plan, args.mixer, dtype, device, settings)
    model = hybrid if args.model == "hybrid" else teacher
    del teacher, hybrid
    free_memory(device)
    torch.manual_seed(1)
    B, T = args.batch, args.prompt_len
    ids = torch.randint(10, model.config.vocab_size - 10, (B, T), device=device)
    mask = torch.ones_like(ids)
    mask[0, :T // 8] = 0   # one left-padded row, as in GRPO batches
    header = (f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'} | torch {torch.__version__}"
              f" | {args.shape} {args.model} (plan {args.plan} {args.mixer} {settings or ''}) | {args.dtype} | prompt {T} x batch {B},"
              f" {args.new_tokens} new tokens x {args.calls} calls")
    print(header, flush=True)
    t0 = time.perf_counter()
    warm = one_mode(model, "off", ids, mask, argparse.Namespace(**{**vars(args), "calls": 1}))
    print(f"process warm-up (one uncompiled call): {time.perf_counter() - t0:.1f} s", flush=True)
    rows = []
    for mode in args.modes.split(","):
        rows.append(one_mode(model, mode, ids, mask, args))
        add_regret(rows)
        Path(args.out).write_text(json.dumps({"header": header, "args": vars(args), "warmup": warm, "modes": rows,
                                              "kernel_options": current_kernel_options().to_dict(),
                                              # the decode GEMM picks of this process (timed at first use in
                                              # each: two processes of one code can pick differently)
                                              "gemm_choices": triton_gemm.choices()}, indent=1))
    cols = ["mode", "job_s", "regret", "first_compiled_call", "compile_extra_s", "steady_decode_ms"]
    print(header)
    print(md_table(cols, [[r[c] for c in cols] for r in rows]))


if __name__ == "__main__":
    main()
