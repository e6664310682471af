"""Stages A + B of the embedded default on one GPU, in phases that each fit one 10-minute device call.

The measured run of the distillation issue (teacher vs student wikitext-2 test perplexity before and
after each stage, tokens, tokens/s, peak memory). State lives in `--work` (outside the repository copy,
so it survives between back-to-back calls on a warm machine):

    python -m benchmarks.pipeline.distill_default_gpu prepare --teacher /root/smollm2.gguf   # convert + stage A
    python -m benchmarks.pipeline.distill_default_gpu sweep                                  # short stage-B variants
    python -m benchmarks.pipeline.distill_default_gpu train --minutes 4 --total-minutes 12   # best sweep variant
    python -m benchmarks.pipeline.distill_default_gpu train --minutes 8 --total-minutes 12   # resumes
    python -m benchmarks.pipeline.distill_default_gpu report          # markdown table (also written to <work>/report.md)

Training text: a mix built from the data folder (`HYBRIDIZE_DATA_DIR` or ../shared/data): the
general_text demo files, wikitext-2 *valid* articles, MATH train and GSM8K train solutions. Held-out:
the first `--eval-tokens` tokens of wikitext-2 *test*, windows of `--eval-seq-len`, each from an empty
state (the same protocol as `hybridize demo`).
"""
from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import torch

# Stage-B variants compared by `sweep`: what trains, peak lr, lr multiplier outside the mixers.
VARIANTS = {
    "mixer": {"params": "mixer", "lr": 3e-4, "pretrained_lr_scale": 1.0},
    "all_scaled": {"params": "all", "lr": 3e-4, "pretrained_lr_scale": 0.1},
    "all": {"params": "all", "lr": 1e-4, "pretrained_lr_scale": 1.0},
}


def args_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("phase", choices=["prepare", "sweep", "train", "report"])
    p.add_argument("--work", default="/root/distill-default", help="state folder (checkpoints, logs, results.json)")
    p.add_argument("--teacher", default="default", help="teacher source (the embedded default or its GGUF path; "
                                                        "later phases reuse the one `prepare` recorded)")
    p.add_argument("--layers", default="5:1")
    p.add_argument("--mixer", default="sse")
    p.add_argument("--eval-tokens", type=int, default=40_000)
    p.add_argument("--eval-seq-len", type=int, default=2048)
    p.add_argument("--seq-len", type=int, default=1024, help="training row length (stage A, sweep)")
    p.add_argument("--final-seq-len", type=int, default=2048, help="training row length of the final stage B")
    p.add_argument("--batch-tokens", type=int, default=8192)
    p.add_argument("--align-steps", type=int, default=600)
    p.add_argument("--align-minutes", type=float, default=3.5)
    p.add_argument("--sweep-steps", type=int, default=120)
    p.add_argument("--sweep-minutes", type=float, default=2.0, help="budget of each sweep variant")
    p.add_argument("--variant", default="best", choices=["best", *sorted(VARIANTS)],
                   help="stage-B variant of `train` (best: the lowest perplexity of the sweep)")
    p.add_argument("--minutes", type=float, default=8.5, help="wall-clock budget of THIS train call")
    p.add_argument("--total-minutes", type=float, default=17.0, help="planned stage-B minutes over all calls "
                                                                     "(sets max_steps from the measured speed)")
    return p


def data_root() -> Path:
    from hybridize.eval.common import data_dir
    root = data_dir()
    if root is None:
        raise SystemExit("no data folder: set HYBRIDIZE_DATA_DIR or put ../shared/data beside the repository")
    return root


def training_mix(out: Path) -> Path:
    """One JSONL of {"text"} documents from the local data folder (written once)."""
    path = out / "train_mix.jsonl"
    if path.exists():
        return path
    root, docs = data_root(), []
    for f in sorted((root / "general_text").glob("*.jsonl")):
        docs += [json.loads(line)["text"] for line in f.read_text().splitlines() if line.strip()]
    valid = root / "wikitext2" / "valid.txt"
    if valid.exists():  # articles start at top-level headings " = Title = "
        docs += [a for a in re.split(r"\n(?= = [^=].* = \n)", valid.read_text()) if a.strip()]
    for rel, q, a in (("math_train/math_train.jsonl", "problem", "solution"),
                      ("gsm8k/train.jsonl", "problem", "solution")):
        f = root / rel
        if f.exists():
            rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
            docs += [f"{r[q]}\n\n{r[a]}" for r in rows]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        for d in docs:
            fh.write(json.dumps({"text": d}) + "\n")
    print(f"[data] {len(docs)} documents, {path.stat().st_size / 1e6:.1f} MB -> {path}", flush=True)
    return path


def heldout(tok, n_tokens: int) -> torch.Tensor:
    from hybridize.distill.data import heldout_ids
    text = (data_root() / "wikitext2" / "test.txt").read_text()[:400_000]
    return heldout_ids(tok, [text], n_tokens)


def results_file(work: Path) -> Path:
    return work / "results.json"


def record(work: Path, key: str, value) -> dict:
    res = json.loads(results_file(work).read_text()) if results_file(work).exists() else {}
    res[key] = value
    results_file(work).write_text(json.dumps(res, indent=1))
    print(f"[result] {key}: {json.dumps(value)}", flush=True)
    return res


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"   # CPU only for a smoke test of the script


def ppl(model, held, win) -> float:
    from hybridize.distill.metrics import perplexity
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=DEVICE == "cuda"):
        return round(perplexity(model, held, win), 3)


def peak_gb() -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 1) if DEVICE == "cuda" else None


def reset_peak() -> None:
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()


def load_teacher_gpu(source: str):
    from hybridize.distill.models import load_teacher
    teacher, tok = load_teacher(source, "float32")
    return teacher.to(DEVICE).eval().requires_grad_(False), tok


def stage_cfg(cls, work: Path, name: str, train: dict, **over):
    from hybridize.distill.config import load_config
    base = {"progress": False, "save_every": 0, "keep_checkpoints": 1, "seed": 0,
            "mixed_precision": "bf16" if DEVICE == "cuda" else "no",
            "log_every": 10, "run_dir": str(work / name)}
    return load_config(cls, None, {**over, "train": {**base, **train}})


def run_prepare(a, work: Path):
    from hybridize.convert.calibrate import calibration_inputs
    from hybridize.convert.convert import convert_model
    from hybridize.distill.align import align, save_final
    from hybridize.distill.config import AlignConfig

    t0 = time.perf_counter()
    teacher, tok = load_teacher_gpu(a.teacher)
    mix = training_mix(work)
    held = heldout(tok, a.eval_tokens)
    record(work, "setup", {"teacher": a.teacher, "layers": a.layers, "mixer": a.mixer, "train_text": str(mix),
                           "heldout_tokens": int(held.numel()), "eval_seq_len": a.eval_seq_len,
                           "device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu", "torch": torch.__version__})
    record(work, "teacher", {"ppl": ppl(teacher, held, a.eval_seq_len)})
    tc = time.perf_counter()
    student = convert_model(teacher, a.layers, mixer=a.mixer, mixer_settings={"chunk_size": 64},
                            teacher_source=a.teacher, calibration_inputs=calibration_inputs(teacher, tok))
    record(work, "converted", {"ppl": ppl(student, held, a.eval_seq_len), "seconds": round(time.perf_counter() - tc, 1)})
    save_final(student, tok, work / "converted")   # the undistilled hybrid, for the evaluation table
    cfg = stage_cfg(AlignConfig, work, "align", {"max_steps": a.align_steps, "lr": 2e-3,
                                                  "warmup_steps": a.align_steps // 10, "max_minutes": a.align_minutes},
                    params="mixer", loss="nmse", data={"train": str(mix), "seq_len": a.seq_len,
                                                       "batch_tokens": a.batch_tokens})
    reset_peak()
    r = align(student, teacher, tok, cfg)
    save_final(student, tok, work / "after_align")
    record(work, "after_align", {"ppl": ppl(student, held, a.eval_seq_len), "steps": r.step, "tokens": r.tokens,
                                 "seconds": round(r.seconds, 1), "tok_per_s": round(r.tokens / r.seconds),
                                 "peak_gb": peak_gb()})
    print(f"[prepare] {time.perf_counter() - t0:.0f} s", flush=True)


def run_b(a, work: Path, teacher, tok, name: str, variant: str, steps: int, minutes: float, seq_len: int,
          resume: bool):
    """Stage B of one variant from the stage-A checkpoint; returns (LoopResult, trained student)."""
    from hybridize.distill.config import E2EConfig
    from hybridize.distill.e2e import e2e
    from hybridize.distill.models import load_student

    student, _ = load_student(str(work / "after_align"), "float32")
    v = VARIANTS[variant]
    cfg = stage_cfg(E2EConfig, work, name, {"max_steps": steps, "lr": v["lr"], "warmup_steps": max(1, steps // 20),
                                             "min_lr_ratio": 0.1, "max_minutes": minutes},
                    params=v["params"], pretrained_lr_scale=v["pretrained_lr_scale"], kl_weight=1.0, ce_weight=0.1,
                    data={"train": str(training_mix(work)), "seq_len": seq_len, "batch_tokens": a.batch_tokens})
    reset_peak()
    return e2e(student, teacher, tok, cfg, resume=resume)


def run_sweep(a, work: Path):
    teacher, tok = load_teacher_gpu(a.teacher)
    held = heldout(tok, a.eval_tokens)
    out = {}
    for name in VARIANTS:
        r, student = run_b(a, work, teacher, tok, f"sweep-{name}", name, a.sweep_steps, a.sweep_minutes, a.seq_len,
                           resume=False)
        out[name] = {"ppl": ppl(student, held, a.eval_seq_len), "steps": r.step, "tokens": r.tokens,
                     "tok_per_s": round(r.tokens / r.seconds), **VARIANTS[name]}
        record(work, "sweep", out)
        del student
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


def run_train(a, work: Path):
    res = json.loads(results_file(work).read_text())
    plan = res.get("train_plan")
    if plan is None:  # first call: size the cosine schedule to the planned minutes at the measured speed
        if a.variant == "best":
            if "sweep" not in res:
                raise SystemExit("--variant best needs a finished `sweep` (or name a variant)")
            a.variant = min(res["sweep"], key=lambda k: res["sweep"][k]["ppl"])
        speed = res.get("sweep", {}).get(a.variant, {}).get("tok_per_s") or res["after_align"]["tok_per_s"]
        steps = int(speed * 60 * a.total_minutes * 0.95 / a.batch_tokens)
        plan = record(work, "train_plan", {"variant": a.variant, "max_steps": steps, "seq_len": a.final_seq_len,
                                           "speed_estimate": speed})["train_plan"]
    run_dir = work / "e2e"
    resume = (run_dir / "checkpoints").exists()
    teacher, tok = load_teacher_gpu(a.teacher)
    r, student = run_b(a, work, teacher, tok, "e2e", plan["variant"], plan["max_steps"], a.minutes, plan["seq_len"],
                       resume)
    held = heldout(tok, a.eval_tokens)
    from hybridize.distill.align import save_final
    save_final(student, tok, work / "distilled")   # whatever the step: the evaluation and GRPO use it
    calls = res.get("after_e2e", {}).get("calls", 0) + 1
    record(work, "after_e2e", {"ppl": ppl(student, held, a.eval_seq_len), "steps": r.step, "max_steps": plan["max_steps"],
                               "tokens": r.tokens, "seconds_this_call": round(r.seconds, 1),
                               "tok_per_s_this_call": round(r.tokens / max(r.seconds, 1e-9)) if not resume else None,
                               "peak_gb": peak_gb(), "calls": calls,
                               **VARIANTS[plan["variant"]]})


def run_report(work: Path) -> str:
    res = json.loads(results_file(work).read_text())
    t = res["teacher"]["ppl"]
    rows = ["| model | wikitext-2 test ppl | vs teacher | steps | tokens | tokens/s | peak GB |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
            f"| teacher | {t:.2f} | 1.00x | - | - | - | - |",
            f"| converted, before distillation | {res['converted']['ppl']:.2f} | {res['converted']['ppl'] / t:.2f}x | - | - | - | - |"]
    for key, label in (("after_align", "after stage A"), ("after_e2e", "after stage B")):
        if key in res:
            r = res[key]
            rows.append(f"| {label} | {r['ppl']:.2f} | {r['ppl'] / t:.2f}x | {r['steps']} | {r['tokens']:,} | "
                        f"{r.get('tok_per_s') or r.get('tok_per_s_this_call') or '-'} | {r.get('peak_gb', '-')} |")
    text = "\n".join(rows)
    if "sweep" in res:
        text += "\n\nStage-B variants (same start, same data, short runs):\n\n| variant | params | lr | lr x outside mixers | steps | ppl | tokens/s |\n| --- | --- | ---: | ---: | ---: | ---: | ---: |\n"
        text += "\n".join(f"| {k} | {v['params']} | {v['lr']} | {v['pretrained_lr_scale']} | {v['steps']} | {v['ppl']:.2f} | {v['tok_per_s']} |"
                          for k, v in res["sweep"].items())
    (work / "report.md").write_text(text + "\n")
    print(text, flush=True)
    return text


def main(argv=None):
    a = args_parser().parse_args(argv)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    if a.phase != "prepare" and a.teacher == "default" and results_file(work).exists():
        a.teacher = json.loads(results_file(work).read_text()).get("setup", {}).get("teacher", a.teacher)
    if a.phase == "report":
        run_report(work)
        return
    if DEVICE != "cuda":
        print("warning: no CUDA GPU - running on CPU (only useful as a smoke test with tiny settings)", flush=True)
    {"prepare": run_prepare, "sweep": run_sweep, "train": run_train}[a.phase](a, work)
    run_report(work)


if __name__ == "__main__":
    main()
