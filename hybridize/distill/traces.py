"""`hybridize distill traces`: the teacher writes completions ("reasoning traces") for prompts, as JSONL
that stage C reads (`prompt_field=problem completion_field=completion`). `prompts=arith:train` (and the
other names of `hybridize.eval.arith`) generates arithmetic problems; their `prompt` column adds the
boxed-answer instruction to `problem`.

Each output line keeps the prompt row's columns and adds `completion`, `sample` (0..k-1), `prompt_index`,
`teacher` and `text`: the whole conversation as the model reads it (chat template with the assistant's turn, or
prompt then completion), so the file is also a chat-formatted training text for stages A and B
(`data.train=[..., traces.jsonl]`, whose rows are read from `text`; a prompt row's own `text` column is kept
as `source_text`). `keep=correct` is rejection sampling (stage C of the SSE paper's recipe keeps only correct
traces): a completion the checker of `answer_format` grades wrong against the row's `answer` goes to
`<out>.rejected.jsonl` instead; sample k > 1 completions per prompt at a temperature to keep more prompts. Lines are appended and flushed per batch; rerunning the same command skips
(prompt_index, sample) pairs already in the file, so an interrupted run loses at most one batch.
Generation: chat template when the tokenizer has one, left padding, greedy at temperature 0, else
sampling with `temperature`/`top_p` from a seeded generator; `generation=auto` runs it on our static-buffer
engine on a GPU (HF's own decode loop is host-bound there) and through `model.generate` on CPU.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from hybridize.errors import UserError, read_jsonl
from hybridize.ops.common.options import with_run_kernel_options
from hybridize.eval.arith import as_dataset as arith_dataset, is_arith_spec
from hybridize.eval.formats import ANSWER_FORMATS
from hybridize.eval.math import grade
from hybridize.generation.batched import GENERATION_MODES, generate as batched_generate, resolve_generation
from hybridize.generation.loading import model_device, resolve_device

from .config import TracesConfig, save_config
from .data import load_rows, shared_data
from .models import load_teacher


def default_prompts() -> str:
    p = shared_data("gsm8k/train.jsonl")
    if p is None:
        raise UserError("no prompts given: set prompts=<jsonl/parquet file or hub dataset> "
                        "(../shared/data/gsm8k is not present here)")
    return str(p)


def render_prompt(tokenizer, text: str, system: str = "") -> str:
    if getattr(tokenizer, "chat_template", None):
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return (system + "\n" if system else "") + text + "\n"


def render_conversation(tokenizer, prompt: str, completion: str, system: str = "") -> str:
    """The conversation (system, user prompt, assistant completion) as one text, in the chat template when the
    tokenizer has one (the turn's end marker included), else `render_prompt`'s text followed by the completion."""
    if getattr(tokenizer, "chat_template", None):
        msgs = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        return tokenizer.apply_chat_template(msgs, tokenize=False)
    return render_prompt(tokenizer, prompt, system) + completion


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, generation: str = "hf", seed: int = 0) -> list[str]:
    """Completions of already-rendered prompts (left-padded batch). `generation`: 'hf' (`model.generate`),
    'fast' (`hybridize.generation.batched`: our static-buffer engine, CUDA graphs on a GPU, the same greedy
    tokens; `seed` seeds its sampling) or 'auto' (fast on CUDA)."""
    if resolve_generation(generation, model_device(model)) == "fast":
        ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        outs = batched_generate(model, tokenizer, ids, max_new_tokens=max_new_tokens, temperature=temperature,
                                top_p=top_p, batch_size=len(ids), seed=seed, progress=False, generation="fast")
        return [o[0]["text"] for o in outs]
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    kw = dict(max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id)
    kw.update(dict(do_sample=True, temperature=temperature, top_p=top_p) if temperature > 0 else dict(do_sample=False))
    out = model.generate(**enc, **kw)
    return tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def pending(cfg: TracesConfig):
    """(prompt rows, the (prompt_index, sample) pairs not yet in `cfg.out` or its rejected file), after checking
    the settings and saving them beside the output: everything a run needs to know before the teacher loads."""
    if cfg.keep not in ("all", "correct"):
        raise UserError(f"keep={cfg.keep!r}: use keep=all or keep=correct")
    if cfg.answer_format not in ANSWER_FORMATS:
        raise UserError(f"answer_format={cfg.answer_format!r}: use one of {', '.join(ANSWER_FORMATS)}")
    if cfg.generation not in GENERATION_MODES:
        raise UserError(f"generation={cfg.generation!r}: use one of {', '.join(GENERATION_MODES)}")
    fmt = cfg.answer_format
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out.with_suffix(".config.yaml"))
    source = cfg.prompts or default_prompts()
    if is_arith_spec(source):   # generated arithmetic: split from the name, else `split`
        ds = arith_dataset(source, default_split=cfg.split, max_rows=cfg.num_prompts, instruction=ANSWER_FORMATS[fmt])
    else:
        ds = load_rows(source, cfg.split, cfg.num_prompts)
    if cfg.prompt_field not in ds.column_names:
        raise UserError(f"prompts have no column {cfg.prompt_field!r}; columns: {ds.column_names}")
    if cfg.keep == "correct" and "answer" not in ds.column_names:
        raise UserError(f"keep=correct needs an `answer` column to check against; columns: {ds.column_names}")
    rejected = out.with_suffix(".rejected.jsonl")
    done = {(r.get("prompt_index"), r.get("sample")) for r in [*read_jsonl(out, partial=True), *read_jsonl(rejected, partial=True)]}
    return ds, [(i, k) for i in range(len(ds)) for k in range(cfg.samples_per_prompt) if (i, k) not in done]


def write_traces(model, tokenizer, cfg: TracesConfig, teacher_name: str = "", plan=None) -> Path:
    """Generate and append the completions still missing from `cfg.out` (`plan`: `pending(cfg)`, when the caller
    has it already)."""
    ds, todo = plan or pending(cfg)
    fmt, out = cfg.answer_format, Path(cfg.out)
    rejected = out.with_suffix(".rejected.jsonl")
    if not todo:
        print(f"traces: all {len(ds) * cfg.samples_per_prompt} completions already in {out}")
        return out
    torch.manual_seed(cfg.seed)
    t0, n_tok, n_kept = time.perf_counter(), 0, 0
    from tqdm.auto import tqdm
    bar = tqdm(total=len(todo), desc="traces", dynamic_ncols=True)
    for b in range(0, len(todo), cfg.batch_size):
        chunk = todo[b:b + cfg.batch_size]
        rows = [ds[i] for i, _ in chunk]
        bad = [i for (i, _), r in zip(chunk, rows) if not isinstance(r.get(cfg.prompt_field), str)]
        if bad:
            print(f"warning: prompt rows {bad} have no string {cfg.prompt_field!r}; skipped")
        keep = [(c, r) for c, r in zip(chunk, rows) if isinstance(r.get(cfg.prompt_field), str)]
        if not keep:
            continue
        prompts = [render_prompt(tokenizer, r[cfg.prompt_field], cfg.system_prompt) for _, r in keep]
        texts = generate(model, tokenizer, prompts, cfg.max_new_tokens, cfg.temperature, cfg.top_p,
                         generation=cfg.generation, seed=cfg.seed * 1_000_003 + b)
        lines = {True: [], False: []}   # kept, rejected
        for ((i, k), r), t in zip(keep, texts):
            cols = {("source_text" if c == "text" else c): v for c, v in r.items()
                    if isinstance(v, (str, int, float, bool, type(None)))}
            rec = {**cols, "completion": t, "sample": k, "prompt_index": i, "teacher": teacher_name,
                   "text": render_conversation(tokenizer, r[cfg.prompt_field], t, cfg.system_prompt)}
            good = cfg.keep == "all" or (r.get("answer") is not None and grade(t, str(r["answer"]), fmt))
            lines[good].append(json.dumps(rec) + "\n")
            n_tok += len(tokenizer(t, add_special_tokens=False)["input_ids"])
        n_kept += len(lines[True])
        with out.open("a") as f:
            f.writelines(lines[True])
        if lines[False]:
            with rejected.open("a") as f:
                f.writelines(lines[False])
        bar.update(len(chunk))
        bar.set_postfix(tok_s=f"{n_tok / (time.perf_counter() - t0):.1f}", kept=n_kept)
    bar.close()
    kept = "" if cfg.keep == "all" else f", {n_kept} graded correct and kept ({n_kept / len(todo):.1%}; the rest in {rejected})"
    print(f"traces: wrote {len(todo)} completions ({n_tok} tokens, {time.perf_counter() - t0:.0f} s){kept} to {out}")
    return out


@with_run_kernel_options   # cfg.kernel_options in force for the run
def run_traces(cfg: TracesConfig) -> Path:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    plan = pending(cfg)
    if not plan[1]:   # a finished file: said, and the teacher (a minute to load on a GPU machine) never loaded
        return write_traces(None, None, cfg, cfg.teacher, plan)
    model, tok = load_teacher(cfg.teacher, cfg.dtype, resolve_device(cfg.device))
    if tok is None:
        raise UserError(f"teacher {cfg.teacher!r} came without a tokenizer")
    return write_traces(model, tok, cfg, cfg.teacher, plan)
