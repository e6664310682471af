"""`hybridize eval recovery`: how much of the teacher a converted / distilled model recovers, side by side.
The teacher and every `--model` run on one fixed suite; `recovery.json` is rewritten
(temp file + `os.replace`) after EACH row, `recovery.md` holds the table and `recovery.png` the bars
(teacher = 1.0, one bar group per model).

Rows (each tagged with its capability):
- `ppl:python-reference`: held-out perplexity on the built-in `python-reference` text (Python's Language
  Reference). No training mix the project ships contains it: the e2e recipes in `hybridize/recipes/` train on
  `python-docs` (stdlib docstrings; `python-source`, stdlib source files, is offered beside it, filtered the same
  way) and name `python-reference` only as their held-out `data.eval`, and the
  demo (`hybridize/distill/demo.py`) trains on stdlib docstrings and the teacher's answers to its chat
  prompts, keeping the Language Reference topics as its held-out text.
- `ppl:wikitext2`: wikitext-2 test from ../shared/data; where that is missing the row is written as
  "skipped: no ../shared/data". Both ppl rows reuse `perplexity.evaluate_ppl` (one context length).
- `kl:chat` and `agree:chat`: KL(teacher || model), mean per token, and top-1 agreement of the next-token
  predictions on the PROMPT tokens of the 64 `HELDOUT_CHAT_PROMPTS` (chat template applied when the tokenizer has
  one; no generation, so the row is cheap and deterministic). The prefix every prompt shares (system prompt and
  template, 24 tokens for SmolLM2) gives the same predictions in every prompt, so it is scored once, on the first
  prompt (`shared_prefix`); counted per prompt, it was 72 of three prompts' 112 predictions (RESULTS.md,
  "(xiii)"). The rows record the prompts (`samples`) and the predictions scored (`tokens`).
- `kl:answers` and `agree:answers`: the same two measures on the ANSWER tokens: the teacher answers each
  held-out prompt greedily (`chat_answer_tokens` new tokens at most), and both models read prompt + that answer,
  teacher-forced; only the predictions of the answer's tokens count. This is what a user of the chat model
  sees, where the prompt rows mostly measure the template.
- `niah:s-niah-K:L`: S-NIAH-1/2/3 at each length, generation-scored by `niah.evaluate_niah` on prompts built
  once by `niah.build_samples` (python-reference haystack when the shared essays are missing). Each model's
  answers beside the expected ones go to `needles/<task>_<L>/<model>/samples.jsonl`, and recovery.md ends with
  how they are formed (value first, right or wrong; numbered list; other: `needle_forms.py`).
- `arith:test`: accuracy (greedy, answer_format=number) by `math.evaluate_math` on `arith:test:n=N`.

Ratios: 1.0 = parity and higher is better everywhere. Accuracies and agreement: model / teacher.
Perplexity: teacher_ppl / model_ppl. KL (the teacher's own KL is 0): exp(-KL). The pass/fail rows (needles,
arithmetic) also record their prompt count (`samples`) and `p`, Fisher's exact test of each model's count against the
teacher's, shown beside the ratio in recovery.md: at 40 prompts a 0.9x ratio of 36 against 40 has p = 0.12.
Every row records what it was scored on (`scored_on`: prompts, or a perplexity row's context and token budget); a
resumed or merged report scores a row again where that differs from the run's settings.

Departures from the issue: all models are loaded at once (fine for the small models this targets); a row
whose teacher value is 0 or NaN gets ratio NaN; S-NIAH puts the needle at depth 0.5 only (`--needle-samples`
prompts per length, no depth sweep), and a prompt whose answer would pass the teacher's context is shortened so
that both fit (the row's `prompt_tokens` says how long it was); the arith row asks 'Answer with the number
only.' with a short budget (greedy) rather than \\boxed{}.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from hybridize.builtin_text import HELDOUT_CHAT_PROMPTS
from hybridize.errors import UserError
from . import arith, needle_forms
from .common import build_prompt, data_file, encode, generate, has_chat_template, model_device, plt
from .math import MathEvalConfig, evaluate_math
from .niah import NiahConfig, answer_tokens, build_samples, evaluate_niah
from .perplexity import PplConfig, evaluate_ppl


NIAH_TASKS = ("s-niah-1", "s-niah-2", "s-niah-3")


@dataclass
class RecoveryConfig:
    lengths: tuple[int, ...] = field(default=(1024, 2048, 4096, 8192), metadata={"help": "S-NIAH prompt lengths"})
    needle_samples: int = field(default=4, metadata={"help": "S-NIAH prompts per length"})
    arith_samples: int = field(default=10, metadata={"help": "arith:test problems per level"})
    ppl_length: int = field(default=1024, metadata={"help": "perplexity context length"})
    ppl_tokens: int = field(default=8192, metadata={"help": "tokens scored per perplexity row"})
    arith_max_new_tokens: int = field(default=32, metadata={"help": "answer budget of the arith row"})
    chat_answer_tokens: int = field(default=48, metadata={"help": "the teacher's greedy answer length for kl:answers"})
    time_budget: float | None = field(default=None, metadata={"help": "seconds; no row starts after it"})
    overwrite: bool = field(default=False, metadata={"help": "redo rows already in recovery.json"})
    generation: str = field(default="auto", metadata={"help": "fast | hf | auto"})
    niah_tasks: tuple[str, ...] = field(default=NIAH_TASKS, metadata={"help": "S-NIAH tasks to run"})


def parse_model_spec(spec: str) -> tuple[str, str]:
    """'NAME=DIR' -> (NAME, DIR); anything else is a UserError."""
    name, eq, src = spec.partition("=")
    if not eq or not name.strip() or not src.strip():
        raise UserError(f"--model {spec!r}: write NAME=DIR (e.g. --model hybrid=runs/q-sse)")
    return name.strip(), src.strip()


def check_tokenizer(name: str, teacher_tok, tok) -> None:
    probes = ["The capital of France is Paris.", "def f(x):\n    return x ** 2", "1234567 + 89 = ?"]
    if len(teacher_tok) != len(tok) or any(teacher_tok(p)["input_ids"] != tok(p)["input_ids"] for p in probes):
        raise UserError(f"--model {name}: its tokenizer differs from the teacher's (vocab {len(tok)} vs "
                        f"{len(teacher_tok)} or different encodings); recovery needs the same tokenizer")


def check_lengths(teacher, cfg: RecoveryConfig) -> None:
    ctx = getattr(teacher.config, "max_position_embeddings", None)
    if ctx and max(cfg.lengths) > ctx:
        raise UserError(f"--lengths {max(cfg.lengths)} is over the teacher's context ({ctx} tokens); use shorter lengths")


def niah_config(task: str, length: int, teacher, cfg: RecoveryConfig) -> NiahConfig:
    """The S-NIAH run of one row. Its prompts are `length` tokens, or fewer where the prompt and its answer
    would pass the teacher's context (`max_position_embeddings`): past it a RoPE model reads positions it never
    trained on, and the teacher itself fails (the default at 8k: S-NIAH-2 0.025 against 0.975 at 4k)."""
    nc = NiahConfig(task=task, lengths=(length,), depths=(0.5,), samples=cfg.needle_samples,
                    generation=cfg.generation)
    ctx = getattr(teacher.config, "max_position_embeddings", None)
    if ctx and length + answer_tokens(nc) > ctx:
        nc.lengths = (ctx - answer_tokens(nc),)
    return nc


def row_ids(cfg: RecoveryConfig) -> list[str]:
    return (["ppl:python-reference", "ppl:wikitext2", "kl:chat", "agree:chat", "kl:answers", "agree:answers"]
            + [f"niah:{t}:{L}" for t in cfg.niah_tasks for L in cfg.lengths] + ["arith:test"])


#: needle tasks run after the task scored by generation: the UUID task (S-NIAH-3) is outside the recovery target
#: (S-NIAH-1 and -2 and the task at 0.9x the teacher), so a --time-budget cuts it before the arithmetic row
LATE_TASKS = ("s-niah-3",)


def run_order(cfg: RecoveryConfig) -> list[str]:
    """`row_ids` in the order they run (the report keeps `row_ids`' order): the rows of `LATE_TASKS` last."""
    ids = row_ids(cfg)
    late = [r for r in ids if r.split(":")[0] == "niah" and r.split(":")[1] in LATE_TASKS]
    return [r for r in ids if r not in late] + late


def shared_prefix(prompts: list[list[int]]) -> int:
    """How many leading tokens every prompt shares: the positions whose predictions are the same in all of them."""
    k = 0
    while all(len(p) > k and p[k] == prompts[0][k] for p in prompts):
        k += 1
    return k


@torch.no_grad()
def chat_logprobs(model, tokenizer) -> list[torch.Tensor]:
    """Log-softmax of the next-token logits `[T_i, V]` (fp32, cpu) per held-out chat prompt: every position of the
    first prompt, and of each other prompt the positions after the prefix they all share (its predictions are the
    first prompt's again)."""
    chat = has_chat_template(tokenizer)
    prompts = [encode(tokenizer, build_prompt(tokenizer, p, chat=chat), chat) for p in HELDOUT_CHAT_PROMPTS]
    k = shared_prefix(prompts)
    out = []
    for i, ids in enumerate(prompts):
        x = torch.tensor([ids], device=model_device(model))
        out.append(torch.log_softmax(model(input_ids=x).logits[0].float(), -1)[0 if i == 0 else k:].cpu())
    return out


@torch.no_grad()
def teacher_answers(teacher, tokenizer, max_new_tokens: int, generation: str) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids) per held-out chat prompt: the teacher's greedy answer tokens, cut before its end of
    turn (an empty answer is dropped)."""
    chat = has_chat_template(tokenizer)
    prompts = [encode(tokenizer, build_prompt(tokenizer, p, chat=chat), chat) for p in HELDOUT_CHAT_PROMPTS]
    outs = generate(teacher, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=len(prompts),
                    progress=False, generation=generation)
    return [(p, o[0]["token_ids"]) for p, o in zip(prompts, outs) if o[0]["token_ids"]]


@torch.no_grad()
def answer_logprobs(model, pairs: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
    """Log-softmax `[len(answer), V]` (fp32, cpu) of the model's predictions of each answer token, reading the
    prompt and the answer teacher-forced."""
    out = []
    for p, a in pairs:
        x = torch.tensor([p + a], device=model_device(model))
        logits = model(input_ids=x).logits[0, len(p) - 1:len(p) + len(a) - 1]
        out.append(torch.log_softmax(logits.float(), -1).cpu())
    return out


def kl_agreement(teacher_lp: list[torch.Tensor], model_lp: list[torch.Tensor]) -> tuple[float, float, int]:
    """(mean per-token KL(teacher || model) in nats, top-1 agreement, tokens scored)."""
    kl, agree, n = 0.0, 0.0, 0
    for t, m in zip(teacher_lp, model_lp):
        kl += (t.exp() * (t - m)).sum(-1).clamp_min(0).sum().item()
        agree += (t.argmax(-1) == m.argmax(-1)).sum().item()
        n += t.shape[0]
    return (kl / n, agree / n, n) if n else (float("nan"), float("nan"), 0)


def arith_spec(cfg: RecoveryConfig) -> str:
    """The generated problems of the `arith:test` row (`hybridize.eval.arith`)."""
    return f"arith:test:n={cfg.arith_samples}"


def ratio(row_id: str, teacher: float, value: float) -> float:
    if value is None or teacher is None or (isinstance(value, float) and math.isnan(value)):
        return float("nan")
    if row_id.startswith("ppl:"):
        return teacher / value if value > 0 else float("nan")
    if row_id.startswith("kl:"):
        return math.exp(-value)
    return value / teacher if teacher and not math.isnan(teacher) else float("nan")


def fisher_p(k1: int, n1: int, k2: int, n2: int) -> float:
    """Two-sided p-value of Fisher's exact test that k1 of n1 and k2 of n2 successes share one rate: the summed
    probability, with the margins fixed, of every table no likelier than the one observed."""
    total, hits = n1 + n2, k1 + k2
    denom = math.comb(total, n1)

    def prob(x: int) -> float:
        return math.comb(hits, x) * math.comb(total - hits, n1 - x) / denom

    seen = prob(k1)
    lo, hi = max(0, hits - n2), min(hits, n1)
    return min(1.0, sum(p for p in (prob(x) for x in range(lo, hi + 1)) if p <= seen * (1 + 1e-9)))


def compare(row: dict) -> dict:
    """A row's `ratios` to the teacher and, for a row of `samples` pass/fail prompts (needles, arithmetic), `p`:
    Fisher's exact test of each model's count against the teacher's, so that a ratio off 1.0 can be told from the
    noise of a few dozen prompts (at 40 prompts, 36 against 40 right gives p = 0.12)."""
    vals, rid = row["values"], row["row"]
    out = {"ratios": {n: ratio(rid, vals["teacher"], v) for n, v in vals.items() if n != "teacher"}}
    n = row.get("samples") if rid.split(":")[0] in ("niah", "arith") else None
    if n and vals.get("teacher") is not None and not math.isnan(vals["teacher"]):
        k0 = round(vals["teacher"] * n)
        out["p"] = {m: round(fisher_p(round(v * n), n, k0, n), 4) for m, v in vals.items()
                    if m != "teacher" and v is not None and not math.isnan(v)}
    return out


def _atomic_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str), encoding="utf-8")
    os.replace(tmp, path)


#: what a row was scored on (`scored_on`, and the chat rows' predictions): two reports' values of a row sit
#: together only where these agree
SCORED_KEYS = ("samples", "context", "ppl_tokens", "tokens")


def merge_reports(paths: list[str | Path], out_path: str | Path) -> dict:
    """Several `recovery.json` (e.g. one model each, run side by side on one GPU) -> one at `out_path`, which
    `run_recovery` then resumes: each row's values united (the first file's value wins where two hold the same
    model, the teacher's included), ratios recomputed; a row skipped in any file stays skipped. A row counts the
    prompts or tokens of the first file that holds it: the values of a file that scored it on others
    (`SCORED_KEYS`) are left out, to be computed again."""
    reports = [json.loads(Path(p).read_text(encoding="utf-8")) for p in paths]
    models = list(dict.fromkeys(n for r in reports for n in r.get("models", [])))
    rows: dict[str, dict] = {}
    for rep in reports:
        for r in rep.get("rows", []):
            row = rows.setdefault(r["row"], {k: v for k, v in r.items() if k not in ("values", "ratios", "p")})
            if r.get("skipped"):
                row["skipped"] = r["skipped"]
                continue
            if any(row.get(k) != r.get(k) for k in SCORED_KEYS):
                continue
            vals = row.setdefault("values", {})
            for n, v in r.get("values", {}).items():
                vals.setdefault(n, v)
    for row in rows.values():
        if "teacher" in row.get("values", {}):
            row.update(compare(row))
    merged = {"models": models, "ratio_rule": reports[0].get("ratio_rule", "") if reports else "",
              "rows": list(rows.values()), "not_run": []}
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_json(out_path, merged)
    return merged


def samples_of(row_id: str, cfg: RecoveryConfig) -> int | None:
    """How many prompts a needle, arithmetic or chat row scores under `cfg` (None for the perplexity rows)."""
    if row_id.startswith("niah:"):
        return cfg.needle_samples
    if row_id.startswith("arith:"):
        return len(arith.load(arith_spec(cfg)))
    if row_id.split(":")[0] in ("kl", "agree"):
        return len(HELDOUT_CHAT_PROMPTS)
    return None


def scored_on(row_id: str, cfg: RecoveryConfig) -> dict:
    """What a row's values were computed on under `cfg`, written into the row: the prompt count (`samples`) of the
    needle, arithmetic and chat rows; the context and token budget of the perplexity rows."""
    if row_id.startswith("ppl:"):
        return {"context": cfg.ppl_length, "ppl_tokens": cfg.ppl_tokens}
    return {"samples": samples_of(row_id, cfg)}


def _stale(row: dict, cfg: RecoveryConfig, log: Callable[[str], None]) -> bool:
    """A kept row scored on other prompts or tokens than `cfg` asks for (`scored_on`), or on unknown ones (a report
    written before rows carried them; the chat rows' before they scored 64 prompts): its values (the teacher's
    included) cannot sit beside new ones, so every model's is computed again."""
    if row.get("skipped"):
        return False
    want = scored_on(row["row"], cfg)
    have = {k: row.get(k) for k in want}
    if have == want:
        return False
    said = ", ".join(f"{k} {v}" for k, v in have.items() if v is not None) or "an unknown number of prompts or tokens"
    log(f"recovery: {row['row']} was scored on {said}, not {', '.join(f'{k} {v}' for k, v in want.items())}: "
        "computed again")
    return True


def run_recovery(models: dict, tokenizer, cfg: RecoveryConfig, out_dir: str | Path,
                 log: Callable[[str], None] = print) -> dict:
    """`models`: {name: model}, the teacher first under the name 'teacher'. Returns the report dict."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "recovery.json"
    old = json.loads(path.read_text(encoding="utf-8")) if path.is_file() and not cfg.overwrite else {}
    earlier = {r["row"]: r for r in old.get("rows", []) if not _stale(r, cfg, log)}
    done = {k: r for k, r in earlier.items() if set(models) <= set(r.get("values", {})) or r.get("skipped")}
    deadline = time.time() + cfg.time_budget if cfg.time_budget is not None else None
    rows: dict[str, dict] = dict(done)
    report = {"models": list(models), "ratio_rule": "1.0 = parity, higher is better: model/teacher for accuracy and "
              "agreement, teacher_ppl/model_ppl for perplexity, exp(-KL) for KL", "rows": [], "not_run": []}
    cache: dict = {}

    def metric(row_id: str, name: str, m):
        if row_id.startswith("ppl:"):
            text = row_id.split(":", 1)[1]
            c = PplConfig(text=text, lengths=(cfg.ppl_length,), tokens=cfg.ppl_tokens)
            return evaluate_ppl(m, tokenizer, c, progress=False)["rows"][0]["ppl"]
        if row_id in ("kl:chat", "agree:chat"):
            if name not in cache:
                if "teacher_lp" not in cache:
                    cache["teacher_lp"] = chat_logprobs(models["teacher"], tokenizer)
                cache[name] = kl_agreement(cache["teacher_lp"], chat_logprobs(m, tokenizer))
            return cache[name][0 if row_id == "kl:chat" else 1]
        if row_id in ("kl:answers", "agree:answers"):
            key = ("answers", name)
            if key not in cache:
                if "answers" not in cache:
                    cache["answers"] = teacher_answers(models["teacher"], tokenizer, cfg.chat_answer_tokens,
                                                       cfg.generation)
                    cache["teacher_alp"] = answer_logprobs(models["teacher"], cache["answers"])
                cache[key] = kl_agreement(cache["teacher_alp"], answer_logprobs(m, cache["answers"]))
            return cache[key][0 if row_id == "kl:answers" else 1]
        if row_id.startswith("niah:"):
            _, task, L = row_id.split(":")
            nc = niah_config(task, int(L), models["teacher"], cfg)
            key = ("niah", task, L)
            if key not in cache:
                try:
                    cache[key] = build_samples(tokenizer, nc)
                except ValueError as e:   # a length shorter than the prompt without haystack
                    raise UserError(f"{row_id}: {e}; use longer --lengths") from None
            # each model's greedy answers beside the expected ones (needles/<task>_<L>/<model>/samples.jsonl):
            # a score of 0 says nothing of whether the model copied badly, answered in another form or not at all
            return evaluate_niah(m, tokenizer, nc, progress=False, samples=cache[key],
                                 out_dir=out / "needles" / f"{task}_{L}" / name)["accuracy"]
        mc = MathEvalConfig(dataset=arith_spec(cfg), greedy=True, answer_format="number",
                            max_new_tokens=cfg.arith_max_new_tokens, generation=cfg.generation)
        return evaluate_math(m, tokenizer, mc, progress=False)["avg@1"]

    def write():
        report["rows"] = [rows[r] for r in row_ids(cfg) if r in rows]
        _atomic_json(path, report)

    for row_id in run_order(cfg):
        if row_id in done:
            log(f"recovery: {row_id} already in {path}, skipped (--overwrite to redo)")
            continue
        if deadline is not None and time.time() >= deadline:
            report["not_run"].append(row_id)
            continue
        capability = row_id.split(":")[0]
        row = {"row": row_id, "capability": capability}
        if row_id == "ppl:wikitext2" and data_file("wikitext2/test.txt") is None:
            row["skipped"] = "skipped: no ../shared/data"
        else:
            t0 = time.time()
            vals = dict(earlier.get(row_id, {}).get("values", {}))  # a model added later: only it runs
            vals.update({n: metric(row_id, n, m) for n, m in models.items() if n not in vals})
            row.update(values=vals, seconds=round(time.time() - t0, 2))
            if capability == "niah":
                _, task, L = row_id.split(":")
                row["prompt_tokens"] = niah_config(task, int(L), models["teacher"], cfg).lengths[0]
            row.update(scored_on(row_id, cfg))
            teacher_lp = cache.get({"kl:chat": "teacher_lp", "agree:chat": "teacher_lp", "kl:answers": "teacher_alp",
                                    "agree:answers": "teacher_alp"}.get(row_id))
            if teacher_lp is not None:   # the predictions scored: the teacher's positions
                row["tokens"] = sum(t.shape[0] for t in teacher_lp)
            row.update(compare(row))
        rows[row_id] = row
        log(f"recovery: {row_id} done")
        write()
    write()
    write_md(out / "recovery.md", report)
    write_forms(out / "recovery.md", out)
    if len(models) > 1:   # bars of ratios: none without a model beside the teacher
        save_bars(out / "recovery.png", report)
    return report


def write_forms(path: Path, out: Path) -> None:
    """Append to recovery.md how the kept needle answers under `out`/needles are formed (`needle_forms`)."""
    cells = needle_forms.collect(out)
    if cells:
        with path.open("a", encoding="utf-8") as f:
            f.write("\n## needle answers by form\n\n" + needle_forms.EXPLAIN + "\n\n" + needle_forms.markdown(cells)
                    + "\n")


def write_md(path: Path, report: dict) -> None:
    names = [n for n in report["models"] if n != "teacher"]
    lines = ["# recovery", "", f"ratio: {report['ratio_rule']}.", "",
             "| capability | row | teacher | " + " | ".join(f"{n} | {n} ratio" for n in names) + " |",
             "| --- | --- | --- | " + " | ".join("--- | ---" for _ in names) + " |"]
    for r in report["rows"]:
        if r.get("skipped"):
            lines.append(f"| {r['capability']} | {r['row']} | {r['skipped']} |" + " |" * (2 * len(names)))
            continue
        v, q, p = r["values"], r["ratios"], r.get("p", {})
        lines.append(f"| {r['capability']} | {r['row']} | {v['teacher']:.4g} | "
                     + " | ".join(f"{v.get(n, float('nan')):.4g} | {q.get(n, float('nan')):.3f}"
                                  + (f" (p {p[n]:.2g})" if n in p else "") for n in names) + " |")
    if any(r.get("p") for r in report["rows"]):
        lines += ["", "p: Fisher's exact test of the model's pass count against the teacher's on the row's prompts "
                      "(needles, arithmetic); a small p says the difference is not the noise of that many prompts."]
    counted = [f"{r['row']} {r['tokens']:,}" for r in report["rows"] if r.get("tokens")]
    if counted:
        lines += ["", "predictions scored (kl, agree rows; the prefix every chat prompt shares counted once): "
                  + ", ".join(counted)]
    if report["not_run"]:
        lines += ["", "not run (time budget): " + ", ".join(report["not_run"])]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def save_bars(path: Path, report: dict) -> None:
    pyplot = plt()
    names = [n for n in report["models"] if n != "teacher"]
    rows = [r for r in report["rows"] if not r.get("skipped")]
    fig, ax = pyplot.subplots(figsize=(max(6, 0.6 * len(rows) * max(1, len(names))), 4))
    w = 0.8 / max(1, len(names))
    for i, n in enumerate(names):
        ax.bar([j + i * w for j in range(len(rows))], [r["ratios"].get(n, float("nan")) for r in rows], w, label=n)
    ax.axhline(1.0, color="k", lw=1, ls="--", label="teacher")
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(rows))], [r["row"] for r in rows], rotation=60, ha="right",
                  fontsize=7)
    ax.set_ylabel("ratio to teacher (1.0 = parity)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot.close(fig)
