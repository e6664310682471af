"""Teacher vs converted (undistilled) hybrid of the embedded default (SmolLM2-135M-Instruct):
GSM8K (greedy, N problems), S-NIAH-1 at 1k-4k tokens, prefill/decode speed at 1k-8k, side by side.

Prints one markdown block (and writes it to `<out>/results.md`, with every task's raw files next to
it) ready to append to benchmarks/RESULTS.md (`--append benchmarks/RESULTS.md` does that).

    python benchmarks/eval_default.py                              # converts in-process (5:1, sse)
    python benchmarks/eval_default.py --hybrid runs/default-sse    # a saved `hybridize convert` output
    python benchmarks/eval_default.py --gsm8k-n 20 --niah-lengths 1k --speed-lengths 1k,2k   # quick

The same numbers from the CLI, one task at a time:

    hybridize eval math -m teacher=default -d gsm8k --greedy --limit 200 --max-new-tokens 512
    hybridize eval math -m hybrid=runs/default-sse -d gsm8k --greedy --limit 200 --max-new-tokens 512
    hybridize eval niah -m teacher=default --task s-niah-1 --lengths 1k,2k,4k   (and -m hybrid=...)
    hybridize eval speed -m teacher=default -m hybrid=runs/default-sse --lengths 1k,2k,4k,8k
"""
from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
from pathlib import Path

import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", default="default", help="teacher source (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--hybrid", default=None, help="saved hybrid checkpoint; default: convert the teacher in-process")
    p.add_argument("--plan", default="5:1", help="layer plan for the in-process conversion")
    p.add_argument("--mixer", default="sse", help="mixer for the in-process conversion")
    p.add_argument("--gsm8k-n", type=int, default=200, help="GSM8K test problems (greedy)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="GSM8K generation budget")
    p.add_argument("--batch-size", type=int, default=16, help="GSM8K generation batch size")
    p.add_argument("--niah-lengths", default="1k,2k,4k", help="S-NIAH-1 prompt lengths")
    p.add_argument("--niah-depths", default="0,0.25,0.5,0.75,1", help="S-NIAH-1 depths")
    p.add_argument("--niah-samples", type=int, default=4, help="prompts per (length, depth)")
    p.add_argument("--speed-lengths", default="1k,2k,4k,8k", help="speed context lengths")
    p.add_argument("--speed-batch", default="1", help="speed batch sizes")
    p.add_argument("--decode-tokens", type=int, default=32, help="decode steps timed")
    p.add_argument("--skip", default="", help="comma-separated tasks to skip: gsm8k, niah, speed")
    p.add_argument("--dtype", default="auto", help="float32 / bfloat16 / auto (bf16 on GPU, fp32 on CPU)")
    p.add_argument("--device", default="auto", help="cpu / cuda / auto")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--out", default="runs/eval/default", help="output folder")
    p.add_argument("--append", default=None, help="append the markdown to this file (e.g. benchmarks/RESULTS.md)")
    return p.parse_args(argv)


def load_pair(args):
    from hybridize.eval.common import load_model

    teacher, tok = load_model(args.teacher, dtype=args.dtype, device=args.device)
    if args.hybrid:
        hybrid, _ = load_model(args.hybrid, dtype=args.dtype, device=args.device)
        label = f"hybrid ({args.hybrid})"
    else:
        from hybridize.convert.convert import convert_model

        hybrid = convert_model(teacher, args.plan, mixer=args.mixer, teacher_source=args.teacher).eval()
        label = f"hybrid ({args.mixer}, {args.plan}, undistilled)"
    return teacher, hybrid, tok, label


def main(argv=None) -> str:
    from hybridize.eval.common import markdown_table, parse_float_list, parse_int_list
    from hybridize.eval.math import MathEvalConfig, evaluate_math
    from hybridize.eval.niah import NiahConfig, evaluate_niah
    from hybridize.eval.speed import SpeedConfig, run_speed

    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    out = Path(args.out)
    t_start = time.time()
    teacher, hybrid, tok, hybrid_label = load_pair(args)
    models = {"teacher": teacher, "hybrid": hybrid}
    dev = next(teacher.parameters()).device
    dtype = next(teacher.parameters()).dtype
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    parts = [f"### Embedded default: teacher vs converted hybrid ({datetime.date.today()})", "",
             f"teacher `{args.teacher}`; {hybrid_label}; device {device_name}; dtype {str(dtype).replace('torch.', '')}; "
             f"command `python benchmarks/eval_default.py {' '.join(argv if argv is not None else sys.argv[1:])}`", ""]

    if "gsm8k" not in skip:
        rows = []
        for name, m in models.items():
            cfg = MathEvalConfig(dataset="gsm8k", greedy=True, limit=args.gsm8k_n, max_new_tokens=args.max_new_tokens,
                                 batch_size=args.batch_size)
            s = evaluate_math(m, tok, cfg, out / "gsm8k" / name)
            rows.append({"model": name, "problems": s["problems"], "accuracy": s["avg@1"],
                         "boxed_rate": s["format_rate"], "mean_tokens": s["mean_tokens"],
                         "truncated_rate": s["truncated_rate"]})
        parts += [f"GSM8K test, greedy, first {args.gsm8k_n} problems, {args.max_new_tokens} new tokens max, "
                  "boxed-answer instruction, math-verify:", "", markdown_table(rows), ""]

    if "niah" not in skip:
        lengths = parse_int_list(args.niah_lengths)
        rows = []
        for name, m in models.items():
            cfg = NiahConfig(task="s-niah-1", lengths=tuple(lengths), depths=tuple(parse_float_list(args.niah_depths)),
                             samples=args.niah_samples)
            s = evaluate_niah(m, tok, cfg, out / "niah" / name)
            rows.append({"model": name, **{f"{L} tok": r["mean"] for L, r in zip(lengths, s["table"])},
                         "mean": s["accuracy"]})
        parts += [f"S-NIAH-1 (pass-key in repeated noise), accuracy over depths {args.niah_depths} x "
                  f"{args.niah_samples} samples per length:", "", markdown_table(rows), ""]

    if "speed" not in skip:
        cfg = SpeedConfig(lengths=tuple(parse_int_list(args.speed_lengths)),
                          batch_sizes=tuple(parse_int_list(args.speed_batch)), decode_tokens=args.decode_tokens)
        rows = run_speed(models, cfg, out / "speed")
        cols = ["model", "length", "batch", "prefill_tok_s", "decode_tok_s", "ms_per_step", "decode_speedup", "cache_MB"]
        if dev.type == "cuda":
            cols.append("peak_MB")
        parts += [f"Speed (prefill of the context, then {args.decode_tokens} greedy decode steps through the cache; "
                  "decode_speedup vs the teacher):", "", markdown_table(rows, cols), ""]

    parts.append(f"Total wall time {time.time() - t_start:.0f} s.")
    md = "\n".join(parts) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(md, encoding="utf-8")
    print(md)
    if args.append:
        with open(args.append, "a", encoding="utf-8") as f:
            f.write("\n" + md)
    return md


if __name__ == "__main__":
    main()
