"""The embedded default teacher (SmolLM2-135M-Instruct) side by side with hybrids of it (converted,
distilled, ...): GSM8K (greedy, N problems), S-NIAH-1 at 1k-4k tokens, prefill/decode speed at 1k-8k.

Prints one markdown table with every model in its own column (and the per-task detail tables), writes
it to `<out>/results.md`, every task's raw files under `<out>/<task>/<model>/` and all numbers to
`<out>/results.json`; `--append benchmarks/RESULTS.md` appends the markdown there. Its command line is
`benchmarks/pipeline/eval_default.py` (`main(argv)` here), from the repo root:

    python -m benchmarks.pipeline.eval_default                           # teacher + in-process conversion
    python -m benchmarks.pipeline.eval_default --model converted=runs/conv --model distilled=runs/dist
    python -m benchmarks.pipeline.eval_default --model converted=convert --model distilled=runs/dist   # 'convert':
        converts the teacher in-process like `hybridize convert` (--plan, --mixer, output gains calibrated)
    python -m benchmarks.pipeline.eval_default --gsm8k-n 20 --niah-lengths 1k --speed-lengths 1k,2k   # quick

Made to fit a short GPU call: generation is batched (prompts sorted by length) and on CUDA runs the
static-buffer CUDA-graph decode loop of `hybridize.generation.fast` (same tokens as HF generate);
the tasks run cheapest first (speed, NIAH, GSM8K); progress lines carry timestamps and are flushed;
`--time-budget S` gives each remaining task / model a share of the time left and stops starting new
batches when its share is used (the table then says how many problems were done); the combined table
is printed after every task and on SIGTERM/SIGINT, so a run cut short still shows what finished.

The same numbers from the CLI, one task at a time:

    hybridize eval math -m teacher=default -d gsm8k --greedy --limit 200 --max-new-tokens 512
    hybridize eval niah -m teacher=default --task s-niah-1 --lengths 1k,2k,4k
    hybridize eval speed -m teacher=default -m hybrid=runs/conv --lengths 1k,2k,4k,8k
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import signal
import sys
import time
from pathlib import Path

import torch

from hybridize.convert.calibrate import calibration_inputs
from hybridize.convert.convert import convert_model
from hybridize.eval.common import load_model, parse_float_list, parse_int_list, resolve_generation
from hybridize.eval.math import MathEvalConfig, evaluate_math
from hybridize.eval.niah import NiahConfig, build_samples, evaluate_niah
from hybridize.eval.speed import SpeedConfig, resolve_decode, run_speed

TASKS = ("speed", "niah", "gsm8k")
WEIGHTS = {"speed": 0.15, "niah": 0.2, "gsm8k": 0.65}   # shares of the time budget (what is left rolls over)
RESERVE_S = 8.0   # kept free at the end of a budget for writing files and printing
DECODE_NOTE = {"fast": "static-buffer CUDA-graph loop of generation.fast", "loop": "HF forward per step"}


class TimeUp(Exception):
    """Raised by the SIGTERM/SIGINT handler: stop, print what there is."""


#: the command line `render` writes into the table's header
COMMAND = "python -m benchmarks.pipeline.eval_default"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", default="default", help="teacher: 'default' (embedded SmolLM2-135M-Instruct), a .gguf "
                                                       "file or a HF folder")
    p.add_argument("--model", action="append", default=[], metavar="NAME=SRC",
                   help="a model to compare with the teacher (repeatable): NAME=FOLDER, or NAME=convert for the "
                        "in-process conversion; default: converted=convert")
    p.add_argument("--hybrid", action="append", default=[], metavar="[NAME=]FOLDER",
                   help="same as --model (label 'hybrid' when no NAME=)")
    p.add_argument("--plan", default="5:1", help="layer plan of the in-process conversion")
    p.add_argument("--mixer", default="sse", help="mixer of the in-process conversion")
    p.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                   help="in-process conversion without the output-gain calibration of `hybridize convert`")
    p.add_argument("--tasks", default=",".join(TASKS), help="tasks in the order run (cheapest first by default)")
    p.add_argument("--skip", default="", help="comma-separated tasks to skip: gsm8k, niah, speed")
    p.add_argument("--gsm8k-n", type=int, default=200, help="GSM8K test problems (greedy)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="GSM8K generation budget")
    p.add_argument("--batch-size", type=int, default=None, help="GSM8K batch (default 64 on GPU, 8 on CPU)")
    p.add_argument("--generation", default="auto", help="fast | hf | auto (fast on CUDA)")
    p.add_argument("--niah-lengths", default="1k,2k,4k", help="S-NIAH-1 prompt lengths")
    p.add_argument("--niah-depths", default="0,0.25,0.5,0.75,1", help="S-NIAH-1 depths")
    p.add_argument("--niah-samples", type=int, default=4, help="prompts per (length, depth)")
    p.add_argument("--niah-batch-size", type=int, default=None, help="NIAH batch (default 32 on GPU, 4 on CPU)")
    p.add_argument("--speed-lengths", default="1k,2k,4k,8k", help="speed context lengths")
    p.add_argument("--speed-batch", default="1", help="speed batch sizes")
    p.add_argument("--decode-tokens", type=int, default=32, help="decode steps timed")
    p.add_argument("--speed-decode", default="auto", help="fast (CUDA-graph loop) | loop (HF forward per step) | auto")
    p.add_argument("--time-budget", type=float, default=None, help="seconds for the whole run (loading included); "
                                                                   "tasks stop early and partial tables are printed")
    p.add_argument("--dtype", default="auto", help="float32 / bfloat16 / auto (bf16 on GPU, fp32 on CPU)")
    p.add_argument("--device", default="auto", help="cpu / cuda / auto")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--out", default="runs/eval/default", help="output folder")
    p.add_argument("--append", default=None, help="append the markdown to this file (e.g. benchmarks/RESULTS.md)")
    return p.parse_args(argv)


# ---- logging and time -----------------------------------------------------------------------------

class Clock:
    """Timestamped, flushed progress lines and the time budget's deadlines."""

    def __init__(self, budget: float | None):
        self.t0 = time.time()
        self.end = self.t0 + budget - RESERVE_S if budget else None

    def log(self, msg: str) -> None:
        now = datetime.datetime.now().strftime("%H:%M:%S")
        print(f"[{now} +{time.time() - self.t0:6.1f}s] {msg}", flush=True)

    def left(self) -> float:
        return math.inf if self.end is None else self.end - time.time()

    def share(self, weight: float, total_weight: float) -> float | None:
        """Deadline (a `time.time()` value) giving `weight / total_weight` of the time left; None = no budget."""
        if self.end is None:
            return None
        return time.time() + max(self.left(), 0.0) * weight / max(total_weight, 1e-9)


# ---- models -----------------------------------------------------------------------------------------

def model_specs(args) -> list[tuple[str, str]]:
    """[(label, source)] of the models compared with the teacher; 'convert' = in-process conversion."""
    specs = []
    for s in args.model + args.hybrid:
        name, src = s.split("=", 1) if "=" in s and not Path(s).exists() else ("hybrid", s)
        if not name or not src:
            raise ValueError(f"--model {s!r}: write NAME=FOLDER or NAME=convert")
        specs.append((name, src))
    if not specs:
        specs = [("converted", "convert")]
    names = ["teacher"] + [n for n, _ in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"model labels must be distinct (and not 'teacher'): {names}")
    return specs


def load_models(args, clock: Clock):
    """{label: (model, tokenizer)}, the teacher first, and {label: description}."""
    clock.log(f"loading teacher {args.teacher} ...")
    teacher, tok = load_model(args.teacher, dtype=args.dtype, device=args.device)
    models, desc = {"teacher": (teacher, tok)}, {"teacher": f"`{args.teacher}`"}
    for name, src in model_specs(args):
        clock.log(f"loading {name} from {src} ...")
        if src == "convert":
            calib = calibration_inputs(teacher, tok) if args.calibrate else None
            m = convert_model(teacher, args.plan, mixer=args.mixer, teacher_source=args.teacher,
                              calibration_inputs=calib).eval()
            how = "calibrated" if args.calibrate else "no calibration"
            models[name], desc[name] = (m, tok), f"in-process conversion ({args.mixer}, {args.plan}, {how}, undistilled)"
        else:
            m, t = load_model(src, dtype=args.dtype, device=args.device)
            models[name], desc[name] = (m, t or tok), f"`{src}`"
    for name, (m, _) in models.items():
        kind = type(m).__name__
        clock.log(f"{name}: {kind}, {sum(p.numel() for p in m.parameters()) / 1e6:.1f}M parameters, "
                  f"{next(m.parameters()).dtype}, {next(m.parameters()).device}")
    return models, desc


def same_tokenizer(a, b) -> bool:
    return a is b or (a.get_vocab() == b.get_vocab() and getattr(a, "chat_template", None) == getattr(b, "chat_template", None))


# ---- tasks ------------------------------------------------------------------------------------------

def run_speed_task(args, models, res, clock, deadline):
    cfg = SpeedConfig(lengths=tuple(parse_int_list(args.speed_lengths)), batch_sizes=tuple(parse_int_list(args.speed_batch)),
                      decode_tokens=args.decode_tokens, decode=args.speed_decode)
    rows = run_speed({n: m for n, (m, _) in models.items()}, cfg, Path(args.out) / "speed", progress=False,
                     deadline=deadline, log=clock.log)
    res["speed"] = rows


def run_niah_task(args, models, res, clock, deadline):
    cfg = NiahConfig(task="s-niah-1", lengths=tuple(parse_int_list(args.niah_lengths)),
                     depths=tuple(parse_float_list(args.niah_depths)), samples=args.niah_samples,
                     batch_size=args.niah_batch_size, generation=args.generation)
    built: list[tuple] = []   # (tokenizer, samples): prompts are built once per distinct tokenizer
    res.setdefault("niah", {})
    names = list(models)
    for i, name in enumerate(names):
        m, tok = models[name]
        samples = next((s for t, s in built if same_tokenizer(t, tok)), None)
        if samples is None:
            t0 = time.time()
            samples = build_samples(tok, cfg)
            built.append((tok, samples))
            clock.log(f"niah: built {len(samples)} prompts in {time.time() - t0:.1f} s")
        dl = None if deadline is None else time.time() + max(deadline - time.time(), 0) / (len(names) - i)
        t0 = time.time()
        s = evaluate_niah(m, tok, cfg, Path(args.out) / "niah" / name, progress=False, samples=samples,
                          deadline=dl, log=clock.log)
        res["niah"][name] = s
        clock.log(f"niah {name}: accuracy {s['accuracy']:.3f} over {s['prompts']} prompts "
                  f"(lengths {s['lengths_done']}) in {time.time() - t0:.1f} s")


def run_gsm8k_task(args, models, res, clock, deadline):
    res.setdefault("gsm8k", {})
    names = list(models)
    for i, name in enumerate(names):
        m, tok = models[name]
        cfg = MathEvalConfig(dataset="gsm8k", greedy=True, limit=args.gsm8k_n, max_new_tokens=args.max_new_tokens,
                             batch_size=args.batch_size, generation=args.generation)
        dl = None if deadline is None else time.time() + max(deadline - time.time(), 0) / (len(names) - i)
        t0 = time.time()
        s = evaluate_math(m, tok, cfg, Path(args.out) / "gsm8k" / name, progress=False, deadline=dl, log=clock.log)
        res["gsm8k"][name] = s
        clock.log(f"gsm8k {name}: accuracy {s['avg@1']:.3f} on {s['problems']}/{s['problems_requested']} problems, "
                  f"boxed {s['format_rate']:.2f}, mean {s['mean_tokens']:.0f} tokens, in {time.time() - t0:.1f} s")


RUNNERS = {"speed": run_speed_task, "niah": run_niah_task, "gsm8k": run_gsm8k_task}


# ---- tables -----------------------------------------------------------------------------------------

def _f(v, digits=3) -> str:
    if v is None or (isinstance(v, float) and v != v):
        return "-"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.{digits}g}"
    return str(v)


def _k(L: int) -> str:
    return f"{L // 1024}k" if L % 1024 == 0 else str(L)


def combined_rows(res: dict, names: list[str]) -> list[list[str]]:
    """One row per metric, one column per model."""
    rows = []
    g = res.get("gsm8k", {})
    if g:
        def acc(s):   # greedy: one sample per problem, so avg@1 * problems = problems solved
            a, n = s["avg@1"], s["problems"]
            return f"{a:.3f} ({round(a * n)}/{n})" if n else "-"
        n = max(s["problems_requested"] for s in g.values())
        rows.append([f"GSM8K accuracy (greedy, {n} problems)"] + [acc(g[m]) if m in g else "-" for m in names])
        rows.append(["GSM8K boxed-answer rate"] + [_f(g[m]["format_rate"]) if m in g else "-" for m in names])
        rows.append(["GSM8K truncated rate"] + [_f(g[m]["truncated_rate"]) if m in g else "-" for m in names])
        rows.append(["GSM8K mean new tokens"] + [_f(g[m]["mean_tokens"]) if m in g else "-" for m in names])
    nh = res.get("niah", {})
    if nh:
        lengths = sorted({r["length"] for s in nh.values() for r in s["table"]})
        for L in lengths:
            cells = []
            for m in names:
                r = next((r for r in nh.get(m, {}).get("table", []) if r["length"] == L), None)
                cells.append(_f(r["mean"]) if r else "-")
            rows.append([f"S-NIAH-1 accuracy @ {_k(L)}"] + cells)
    sp = res.get("speed", [])
    if sp:
        cells = sorted({(r["length"], r["batch"]) for r in sp})
        multi_b = len({b for _, b in cells}) > 1
        for key, label in (("prefill_tok_s", "prefill tok/s"), ("decode_tok_s", "decode tok/s"),
                           ("decode_speedup", "decode speed vs teacher"), ("peak_MB", "peak MB"),
                           ("cache_MB", "cache MB")):
            if not any(r.get(key) is not None for r in sp):
                continue
            for L, B in cells:
                vals = []
                for m in names:
                    r = next((r for r in sp if r["model"] == m and r["length"] == L and r["batch"] == B), None)
                    vals.append("-" if r is None else ("OOM" if "error" in r else _f(r.get(key))))
                rows.append([f"{label} @ {_k(L)}" + (f", B={B}" if multi_b else "")] + vals)
    return rows


def md_table(header: list[str], rows: list[list[str]]) -> str:
    right = ["---"] + ["---:"] * (len(header) - 1)
    return "\n".join(["| " + " | ".join(header) + " |", "| " + " | ".join(right) + " |"]
                     + ["| " + " | ".join(r) + " |" for r in rows])


def render(args, res: dict, desc: dict, names: list[str], meta: dict, note: str = "") -> str:
    parts = [f"### Embedded default: teacher vs hybrids ({datetime.date.today()})", "",
             "; ".join(f"{n}: {desc[n]}" for n in names) + f"; device {meta['device']}; dtype {meta['dtype']}; "
             f"generation {meta['generation']}; command `{COMMAND} {meta['argv']}`", ""]
    if note:
        parts += [f"**{note}**", ""]
    rows = combined_rows(res, names)
    if rows:
        parts += [f"GSM8K test: greedy, first {args.gsm8k_n} problems, {args.max_new_tokens} new tokens max, boxed-answer "
                  f"instruction, math-verify. S-NIAH-1: pass-key in repeated noise, depths {args.niah_depths} x "
                  f"{args.niah_samples} samples per length. Speed: batch {args.speed_batch}, prefill of random "
                  f"tokens, then {args.decode_tokens} greedy decode steps ({DECODE_NOTE.get(meta['speed_decode'], '')}); "
                  "peak MB = the model's weights + the peak memory allocated above them during the cell (GPU only); "
                  "cache MB = bytes of the KV cache / mixer states at that context length.", "",
                  md_table(["metric"] + names, rows), ""]
    parts.append(f"Wall time {time.time() - meta['t0']:.0f} s; tasks with results: {', '.join(res) or 'none'}.")
    return "\n".join(parts) + "\n"


def write_outputs(args, res, desc, names, meta, note="") -> str:
    md = render(args, res, desc, names, meta, note)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(md, encoding="utf-8")
    (out / "results.json").write_text(json.dumps({"models": desc, "meta": meta, "results": res}, indent=2,
                                                 default=str) + "\n", encoding="utf-8")
    return md


# ---- main -------------------------------------------------------------------------------------------

def main(argv=None) -> str:
    args = parse_args(argv)
    clock = Clock(args.time_budget)
    if args.threads:
        torch.set_num_threads(args.threads)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    order = [t.strip() for t in args.tasks.split(",") if t.strip() and t.strip() not in skip]
    bad = [t for t in order + sorted(skip) if t not in TASKS]
    if bad:
        raise ValueError(f"unknown task(s) {bad}; choose from {', '.join(TASKS)}")
    model_specs(args)   # bad labels fail before the slow loading

    def on_signal(signum, frame):
        raise TimeUp(signal.Signals(signum).name)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    res: dict = {}
    desc, names, meta = {}, [], {}
    note = ""
    try:
        models, desc = load_models(args, clock)
        names = list(models)
        m0 = models["teacher"][0]
        dev = next(m0.parameters()).device
        meta = {"t0": clock.t0, "argv": " ".join(argv if argv is not None else sys.argv[1:]),
                "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else
                f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
                "dtype": str(next(m0.parameters()).dtype).replace("torch.", ""),
                "generation": resolve_generation(args.generation, dev), "speed_decode": resolve_decode(args.speed_decode, dev),
                "torch": torch.__version__}
        clock.log(f"tasks {order}; {len(names)} models; budget "
                  f"{'none' if args.time_budget is None else f'{args.time_budget:.0f} s ({clock.left():.0f} s left)'}")
        for i, task in enumerate(order):
            if clock.left() <= 1:
                clock.log(f"{task}: skipped, no time left")
                continue
            deadline = clock.share(WEIGHTS[task], sum(WEIGHTS[t] for t in order[i:]))
            t0 = time.time()
            clock.log(f"{task}: start" + ("" if deadline is None else f" (share {deadline - time.time():.0f} s)"))
            RUNNERS[task](args, models, res, clock, deadline)
            clock.log(f"{task}: done in {time.time() - t0:.1f} s")
            md = write_outputs(args, res, desc, names, meta)
            if i < len(order) - 1:
                print("\n" + md, flush=True)
    except TimeUp as e:
        note = f"Interrupted by {e} after {time.time() - clock.t0:.0f} s: partial results."
        clock.log(note)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if not meta:   # interrupted while loading
        print(note or "nothing measured", flush=True)
        return note
    md = write_outputs(args, res, desc, names, meta, note)
    print("\n" + md, flush=True)
    if args.append:
        with open(args.append, "a", encoding="utf-8") as f:
            f.write("\n" + md)
    clock.log(f"results written to {args.out}/ (results.md, results.json, per-task folders)")
    return md


if __name__ == "__main__":
    main()
