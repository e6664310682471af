"""Math benchmarks (AIME24/25, MATH-500, AMC23, OlympiadBench, GSM8K, the generated `arith` levels of
`hybridize.eval.arith`, or any JSONL of problem/answer): prompting, sampling, answer checking with
math-verify, avg@k and unbiased pass@k, per-problem JSONL; accuracy per level when the rows have a `level`.

Protocol (SSE paper, section 5.2): chat template + "put your final answer within \\boxed{}",
temperature 1.0, top-p 0.7, avg@32 on AIME; greedy (temperature 0, one sample) is the other mode.
Generation goes through `common.generate` (batches by prompt length, 64 on a GPU; the fast CUDA-graph
decode loop on CUDA); `evaluate_math(deadline=...)` reports the problems done when time runs out.

The reward-usable, model-free pieces are at the top and are pure functions (no torch):
`extract_boxed`, `extract_answer`, `format_ok`, `is_correct`, `pass_at_k`. GRPO rewards reuse them.

Answer checking: the model's answer is the content of its LAST `\\boxed{}` (also `\\fbox`,
`\\framebox`); it is compared with the reference by math-verify (symbolic equality, sets, intervals,
tuples, rounding to 6 digits). With `require_boxed=False` (used only to check the checker on
reference solutions), a GSM8K-style `#### N` line or "the answer is X" is accepted too, and
failing that math-verify's own extraction on the whole text.

Equations: against a reference that is not an equation, math-verify compares only an answer
equation's right side, so `\\boxed{2+2=3}` would pass for 3. An answer equation therefore counts only
when it names a lone variable (`x = 3`, `AB = 5`) or is a true numeric identity (`5+7 = 12`). The rule
is not applied to math-verify's own extraction from a whole reference solution (it takes the text's last
equation, e.g. `N / M = 2^{k-n}`).

Answer format "number" (`MathEvalConfig.answer_format`, for small models): the prompt asks "Answer with
the number only." and `is_correct_number` takes the first number after the last "=", else the last number,
of the completion (of its last box when it has one) and wants it equal to the reference exactly.

`check_checker` validates all of that on a dataset without a model: its reference answers, boxed,
must score ~100%; its reference solutions (where present) close to that; answers of other problems
(a derangement) ~0% (exactly the rate at which two problems share an answer).
"""
from __future__ import annotations

import functools
import math as _m
import random
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from hybridize.errors import UserError, read_jsonl
from . import arith
from .common import (
    build_prompt,
    data_file,
    default_batch_size,
    encode,
    generate,
    has_chat_template,
    model_device,
    write_json,
    write_jsonl,
)
from .formats import ANSWER_FORMATS, BOXED_INSTRUCTION, NUMBER_INSTRUCTION  # noqa: F401  (re-exported)

# ---- answer extraction and checking (pure) ------------------------------------------------------

_BOX_CMDS = ("\\boxed", "\\fbox", "\\framebox")


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` / `\\framebox{...}` (nested braces
    matched), or of `\\boxed x` (brace-less form); None when there is none or it is unclosed."""
    if not text:
        return None
    best, best_pos = None, -1
    for cmd in _BOX_CMDS:
        pos = text.rfind(cmd)
        while pos != -1:
            got = _box_content(text, pos + len(cmd))
            if got is not None:
                if pos > best_pos:
                    best, best_pos = got, pos
                break
            pos = text.rfind(cmd, 0, pos)
    return best.strip() if best is not None else None


def _box_content(text: str, i: int) -> str | None:
    # skip optional "[...]" (\framebox[width]{..}) and spaces
    while i < len(text) and text[i] == " ":
        i += 1
    if i < len(text) and text[i] == "[":
        j = text.find("]", i)
        if j == -1:
            return None
        i = j + 1
    if i < len(text) and text[i] == "{":
        depth = 0
        for j in range(i, len(text)):
            if text[j] == "{" and (j == 0 or text[j - 1] != "\\"):
                depth += 1
            elif text[j] == "}" and text[j - 1] != "\\":
                depth -= 1
                if depth == 0:
                    return text[i + 1:j]
        return None
    if i < len(text) and text[i - 1] == " ":   # "\boxed 5"
        m = re.match(r"([^\s$]+)", text[i:])
        return m.group(1) if m else None
    return None


_HASH_RE = re.compile(r"####\s*([^\n]+)")
_ANSWER_IS_RE = re.compile(r"answer is[:\s]*\$?([^$\n]+?)\$?\s*(?:\.|$)", re.IGNORECASE | re.MULTILINE)


def extract_answer(text: str, fallback: bool = False) -> str | None:
    """The final answer of a completion: its last boxed content; with `fallback`, else the GSM8K
    `#### N` line, else the last "the answer is X". None when nothing is found."""
    boxed = extract_boxed(text)
    if boxed is not None or not fallback:
        return boxed
    m = _HASH_RE.findall(text or "")
    if m:
        return m[-1].strip().replace(",", "")
    m = _ANSWER_IS_RE.findall(text or "")
    return m[-1].strip() if m else None


def format_ok(text: str) -> bool:
    """Format reward: the completion holds a closed, non-empty boxed answer."""
    a = extract_boxed(text)
    return a is not None and a != ""


def _timeout() -> int | None:
    # math-verify's timeouts use SIGALRM, which only works in the main thread
    return 5 if threading.current_thread() is threading.main_thread() else None


@functools.lru_cache(maxsize=4096)
def _parse_boxed(expr: str):
    # deferred: math_verify (sympy) is slow to import and only grading needs it
    from math_verify import parse

    return parse("\\boxed{" + expr + "}", parsing_timeout=_timeout())


def _parse_text(text: str):
    # deferred: math_verify (sympy) is slow to import and only grading needs it
    from math_verify import parse

    return parse(text, parsing_timeout=_timeout())


def is_correct(completion: str, reference: str, require_boxed: bool = True) -> bool:
    """True when the completion's final answer equals `reference` (math-verify equivalence).

    `require_boxed`: only a boxed answer counts (the evaluation and reward rule). Without it, the
    fallbacks of `extract_answer` and then math-verify's extraction on the whole text are tried."""
    # deferred: math_verify (sympy) is slow to import and only grading needs it
    from math_verify import verify

    if reference is None:
        raise ValueError("reference answer is None; drop problems without an answer")
    gold = _parse_boxed(str(reference).strip())
    if not gold:
        return False
    pred_text = extract_answer(completion, fallback=not require_boxed)
    if pred_text is not None:
        pred = _parse_boxed(pred_text)
    elif require_boxed:
        return False
    else:
        pred = _parse_text(completion or "")
    if not pred:
        return False
    if pred_text is not None and _equations(pred) and not _equations(gold) and not _answer_equations_ok(pred):
        return False
    try:
        return bool(verify(gold, pred, timeout_seconds=_timeout()))
    except Exception:  # math-verify raises on a few exotic sympy objects: count as wrong
        return False


def _equations(parsed) -> list:
    """Every sympy equality inside math-verify's parse result (nested in sets, tuples, chains too)."""
    from sympy import Basic, preorder_traversal
    from sympy.core.relational import Equality

    return [e for obj in parsed if isinstance(obj, Basic)
            for e in preorder_traversal(obj) if isinstance(e, Equality)]


def _is_name(e) -> bool:
    """A lone variable: `x`, `a_n`, `\\theta`, `AB` (a product of letters), `|AB|`, `(x, y)`, `P(A)`;
    no number and no operator other than the juxtaposition of letters."""
    from sympy import Abs, Mul, Symbol, Tuple
    from sympy.core.function import AppliedUndef

    if isinstance(e, Symbol):
        return True
    if isinstance(e, (Mul, Tuple, AppliedUndef, Abs)):
        return all(_is_name(a) for a in e.args)
    return False


def _is_true_identity(e) -> bool:
    """`5+7 = 12`: both sides free of variables and exactly equal (a worked step, not a claim to game)."""
    try:
        if e.free_symbols:
            return False
        d = e.lhs - e.rhs
        return d.is_zero is True or (d.count_ops() <= 64 and d.simplify() == 0)
    except Exception:  # sets, intervals, ... on one side
        return False


def _answer_equations_ok(parsed) -> bool:
    """For a reference that is not an equation, every equation in the answer must name a lone variable
    (`x = 3`) or be a true numeric identity (`5+7 = 12`, a link of `x = 2+1 = 3`). `\\boxed{2+2=3}` for 3,
    or another problem's `5x - 7y + 11z + 4 = 0` for 0, would otherwise pass: math-verify then compares
    the right side alone."""
    return all(_is_name(e.lhs) or _is_true_identity(e) for e in _equations(parsed))


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - _m.comb(n - c, k) / _m.comb(n, k)


def pass_ks(n: int) -> list[int]:
    """k values reported for n samples: 1, 2, 4, ... up to n (and n itself)."""
    ks = [1 << i for i in range(n.bit_length()) if (1 << i) <= n]
    return ks + ([n] if ks[-1] != n else [])


_NUMBER_RE = re.compile(r"(?:(?<![\w)\]}])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def extract_number(text: str) -> str | None:
    """The answer of a number-only completion: inside the last box when there is one, else in the whole
    text, the first number after the last "=" ("5+7=12"), failing that the last number ("The answer is
    12."). Thousands commas are dropped; a "-" right before the digits counts unless it follows a word or
    a closing bracket ("9-4" holds 9 and 4). None when there is no number."""
    if not text:
        return None
    boxed = extract_boxed(text)
    text = boxed if boxed is not None else text
    eq = text.rfind("=")
    after = _NUMBER_RE.search(text, eq + 1) if eq != -1 else None
    nums = [after.group(0)] if after else _NUMBER_RE.findall(text)
    return nums[-1].replace(",", "") if nums else None


def _as_number(s: str):
    from decimal import Decimal, InvalidOperation

    try:
        return Decimal(str(s).strip().replace(",", ""))
    except (InvalidOperation, ValueError):
        return None


def is_correct_number(completion: str, reference: str) -> bool:
    """The strict numeric check of answer format "number": `extract_number(completion)` equals the
    reference exactly as a number ("12" and "12.0" for 12; not "12.5", "-12", "13"). A reference that is
    not a plain number falls back to `is_correct(completion, reference, require_boxed=False)`."""
    if reference is None:
        raise ValueError("reference answer is None; drop problems without an answer")
    ref = _as_number(reference)
    if ref is None:
        return is_correct(completion, reference, require_boxed=False)
    got = extract_number(completion)
    return got is not None and _as_number(got) == ref


def check_format(answer_format: str) -> str:
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer format must be one of {', '.join(ANSWER_FORMATS)}, got {answer_format!r}")
    return answer_format


def grade(completion: str, reference: str, answer_format: str = "boxed") -> bool:
    """Correctness by answer format: "boxed" is `is_correct` (the last box, math-verify), "number" is
    `is_correct_number` (the strict numeric rule)."""
    if check_format(answer_format) == "number":
        return is_correct_number(completion, reference)
    return is_correct(completion, reference)


def answer_format_ok(text: str, answer_format: str = "boxed") -> bool:
    """Format by answer format: a closed, non-empty box ("boxed"), a number anywhere ("number")."""
    if check_format(answer_format) == "number":
        return extract_number(text) is not None
    return format_ok(text)


def extract_final(text: str, answer_format: str = "boxed") -> str | None:
    """What `grade` compares: the last box's content ("boxed") or `extract_number` ("number")."""
    return extract_number(text) if check_format(answer_format) == "number" else extract_boxed(text)


# ---- datasets -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class MathDataset:
    local: str                       # path under the shared data dir
    hub: str                         # hub dataset id (used only when the local copy is missing)
    hub_config: str | None = None
    hub_split: str = "test"
    default_samples: int = 1         # avg@k of the SSE protocol


DATASETS: dict[str, MathDataset] = {
    "aime24": MathDataset("aime24/aime24.jsonl", "HuggingFaceH4/aime_2024", hub_split="train", default_samples=32),
    "aime25": MathDataset("aime25/aime25.jsonl", "math-ai/aime25", default_samples=32),
    "math500": MathDataset("math500/math500.jsonl", "HuggingFaceH4/MATH-500"),
    "amc23": MathDataset("amc23/amc23.jsonl", "math-ai/amc23"),
    "olympiadbench": MathDataset("olympiadbench/olympiadbench_oe_to_maths_en.jsonl", "Hothan/OlympiadBench",
                                 hub_config="OE_TO_maths_en_COMP", hub_split="train"),
    "gsm8k": MathDataset("gsm8k/test.jsonl", "openai/gsm8k", hub_config="main"),
}
_ALIASES = {"math-500": "math500", "math_500": "math500", "olympiad": "olympiadbench", "gsm8k-test": "gsm8k"}


def _normalise_record(r: dict, i: int) -> dict:
    problem = r.get("problem", r.get("question"))
    answer = r.get("answer", r.get("final_answer"))
    if isinstance(answer, list):
        answer = ",".join(str(a).replace("$", "") for a in answer)
    if isinstance(answer, str) and "####" in answer:  # hub GSM8K: the answer field is the solution
        r = {**r, "solution": answer}
        answer = answer.split("####")[-1].strip().replace(",", "")
    sol = r.get("solution")
    if isinstance(sol, list):
        sol = "\n".join(sol)
    rid = r.get("id", r.get("unique_id", r.get("idx", i)))
    rec = {"id": rid, "problem": problem, "answer": None if answer is None else str(answer), "solution": sol}
    if r.get("level") is not None:   # difficulty level (arith, or any JSONL that has one): per-level summary
        rec["level"] = r["level"]
    return rec


def load_math_dataset(name_or_path: str, limit: int | None = None) -> list[dict]:
    """Records `{"id", "problem", "answer", "solution"}` (solution may be None; `level` too where the
    rows have one).

    `name_or_path`: a known name (aime24, aime25, math500, amc23, olympiadbench, gsm8k; the local
    copy under the shared data dir first, else the hub), a generated set (`arith`, `arith:train`,
    `arith:test:L3`, ...: `hybridize.eval.arith`) or a JSONL file with problem/answer fields."""
    key = _ALIASES.get(name_or_path.lower(), name_or_path.lower())
    if Path(name_or_path).is_file():
        rows = read_jsonl(name_or_path)
    elif arith.is_arith_spec(key):
        rows = arith.load(key)
    elif key in DATASETS:
        spec = DATASETS[key]
        local = data_file(spec.local)
        if local is not None:
            rows = read_jsonl(local)
        else:
            rows = _load_hub(spec, name_or_path)
    else:
        raise ValueError(f"unknown math dataset {name_or_path!r}: give one of {', '.join(DATASETS)}, "
                         "arith[:train|test][:L1-6] or a JSONL file with 'problem' and 'answer' fields")
    recs = [_normalise_record(r, i) for i, r in enumerate(rows)]
    bad = [i for i, r in enumerate(recs) if not r["problem"]]
    if bad:
        raise ValueError(f"{name_or_path}: records {bad[:5]} have no 'problem' (or 'question') field")
    recs = keep_answered(recs, name_or_path)
    return recs[:limit] if limit else recs


def keep_answered(recs: list[dict], where: str) -> list[dict]:
    """The records with a non-empty answer. Rows without one cannot be graded, so they are dropped, and
    said so on stderr; when none has one, a one-line UserError
    names that cause (GRPO used to blame max_prompt_tokens)."""
    import sys

    kept = [r for r in recs if r["answer"] not in (None, "")]
    dropped = len(recs) - len(kept)
    if not recs:
        raise UserError(f"{where} holds no rows; expected JSON objects with 'problem' and 'answer' fields")
    if not kept:
        raise UserError(f"{where}: none of its {len(recs)} rows has an 'answer' (or 'final_answer') field, "
                        "so nothing can be graded; add the reference answers")
    if dropped:
        first = next(i for i, r in enumerate(recs) if r["answer"] in (None, ""))
        print(f"warning: {where}: dropped {dropped} of {len(recs)} rows with no 'answer' (or 'final_answer') "
              f"field (first: row {first + 1})", file=sys.stderr)
    return kept


def _load_hub(spec: MathDataset, name: str) -> list[dict]:
    try:
        # deferred: datasets (pyarrow) is slow to import and only hub or parquet data needs it
        import datasets

        ds = datasets.load_dataset(spec.hub, spec.hub_config, split=spec.hub_split)
    except Exception as e:  # offline, renamed, ...
        raise ValueError(f"no local copy of {name} and the hub load of {spec.hub} failed ({type(e).__name__}); "
                         "set HYBRIDIZE_DATA_DIR or pass a JSONL file") from e
    return [dict(r) for r in ds]


def make_prompt_text(tokenizer, problem: str, chat: bool | None = None, answer_format: str = "boxed") -> str:
    return build_prompt(tokenizer, f"{problem}\n{ANSWER_FORMATS[check_format(answer_format)]}", chat=chat)


# ---- the checker check --------------------------------------------------------------------------

def check_checker(records: Sequence[dict], seed: int = 0) -> dict:
    """Score the dataset's own references as completions (no model). Returns rates in [0, 1]:

    - `answers_boxed`: "... $\\boxed{answer}$." for each problem (should be ~1.0)
    - `answers_raw`: the bare answer string, boxed not required (informative)
    - `solutions`: the reference solution text, boxed not required (where present)
    - `shuffled`: boxed answers of a random derangement of the problems (should be ~0)
    - `shuffled_same_string`: share of shuffled pairs whose answers are the same string (the
      floor `shuffled` cannot go below)."""
    n = len(records)
    if n < 2:
        raise ValueError("check_checker needs at least 2 records")
    rng = random.Random(seed)
    perm = list(range(n))
    while any(i == p for i, p in enumerate(perm)):
        rng.shuffle(perm)
    boxed = [is_correct(f"So the final answer is $\\boxed{{{r['answer']}}}$.", r["answer"]) for r in records]
    raw = [is_correct(r["answer"], r["answer"], require_boxed=False) for r in records]
    sols = [is_correct(r["solution"], r["answer"], require_boxed=False) for r in records if r.get("solution")]
    shuf = [is_correct(f"$\\boxed{{{records[p]['answer']}}}$", records[i]["answer"]) for i, p in enumerate(perm)]
    same = [records[p]["answer"].strip() == records[i]["answer"].strip() for i, p in enumerate(perm)]
    out = {"n": n, "answers_boxed": sum(boxed) / n, "answers_raw": sum(raw) / n,
           "solutions": (sum(sols) / len(sols)) if sols else None, "n_solutions": len(sols),
           "shuffled": sum(shuf) / n, "shuffled_same_string": sum(same) / n,
           "failed_boxed_ids": [records[i]["id"] for i, ok in enumerate(boxed) if not ok][:20]}
    return out


# ---- running a model ----------------------------------------------------------------------------

@dataclass
class MathEvalConfig:
    dataset: str = field(default="aime24", metadata={"help": "dataset name or JSONL path"})
    samples: int | None = field(default=None, metadata={"help": "completions per problem (k of avg@k); default 32 for AIME, else 1"})
    greedy: bool = field(default=False, metadata={"help": "temperature 0 and one completion per problem"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature (SSE protocol: 1.0)"})
    top_p: float = field(default=0.7, metadata={"help": "nucleus sampling p (SSE protocol: 0.7)"})
    max_new_tokens: int = field(default=4096, metadata={"help": "generation budget per completion"})
    limit: int | None = field(default=None, metadata={"help": "first N problems only"})
    batch_size: int | None = field(default=None, metadata={
        "help": "sequences generated together (prompts sorted by length); default 64 on a GPU, 8 on CPU"})
    generation: str = field(default="auto", metadata={
        "help": "fast (static buffers + CUDA graphs) | hf (model.generate) | auto (fast on CUDA)"})
    chat: bool | None = field(default=None, metadata={"help": "use the chat template (default: when the tokenizer has one)"})
    seed: int = field(default=0, metadata={"help": "sampling seed"})
    answer_format: str = field(default="boxed", metadata={
        "help": "boxed: ask for \\boxed{} and check the last box with math-verify | number: ask 'Answer with "
                "the number only.' and check the number strictly (is_correct_number)"})


def evaluate_math(model, tokenizer, cfg: MathEvalConfig, out_dir: str | Path | None = None,
                  progress: bool = True, deadline: float | None = None, log=None) -> dict:
    """Generate, check, and (with `out_dir`) write `problems.jsonl` + `summary.json`. Returns the summary.

    `deadline` (a `time.time()` value): no generation batch starts after it; the summary then covers
    the problems done (`problems` < `problems_requested`, `partial` true). Batches go by prompt length,
    so a partial run is biased towards the shorter problems. `log(msg)`: progress lines."""
    fmt = check_format(cfg.answer_format)
    recs = load_math_dataset(cfg.dataset, cfg.limit)
    if not recs:
        raise ValueError(f"{cfg.dataset}: no problems with an answer")
    key = _ALIASES.get(cfg.dataset.lower(), cfg.dataset.lower())
    n = 1 if cfg.greedy else (cfg.samples or (DATASETS[key].default_samples if key in DATASETS else 1))
    temperature = 0.0 if cfg.greedy else cfg.temperature
    chat = has_chat_template(tokenizer) if cfg.chat is None else cfg.chat
    prompts = [encode(tokenizer, make_prompt_text(tokenizer, r["problem"], chat, fmt), chat) for r in recs]
    bs = cfg.batch_size or default_batch_size(model_device(model), gpu=64, cpu=8)
    gens = generate(model, tokenizer, prompts, max_new_tokens=cfg.max_new_tokens, temperature=temperature,
                    top_p=cfg.top_p, num_samples=n, batch_size=bs, seed=cfg.seed, desc=f"math {cfg.dataset}",
                    progress=progress, generation=cfg.generation, deadline=deadline, log=log)
    rows, ks = [], pass_ks(n)
    for r, g in zip(recs, gens):
        if any(c is None for c in g):   # not reached before the deadline
            continue
        correct = [grade(c["text"], r["answer"], fmt) for c in g]
        c = sum(correct)
        rows.append({"id": r["id"], "answer": r["answer"], **({"level": r["level"]} if "level" in r else {}),
                     "n": n, "correct": c, "avg": c / n, **{f"pass@{k}": pass_at_k(n, c, k) for k in ks},
                     "extracted": [extract_final(x["text"], fmt) for x in g], "is_correct": correct,
                     "num_tokens": [x["num_tokens"] for x in g], "finished": [x["finished"] for x in g],
                     "problem": r["problem"], "completions": [x["text"] for x in g]})
    summary = summarize(rows, n, ks, fmt)
    summary = {"dataset": cfg.dataset, "answer_format": fmt, "problems": len(rows), "problems_requested": len(recs),
               "partial": len(rows) < len(recs), "samples": n, "temperature": temperature,
               "top_p": cfg.top_p if temperature > 0 else None, "max_new_tokens": cfg.max_new_tokens, **summary}
    if out_dir is not None:
        write_jsonl(Path(out_dir) / "problems.jsonl", rows)
        write_json(Path(out_dir) / "summary.json", {**summary, "config": {**cfg.__dict__, "batch_size": bs}})
    return summary


def summarize(rows: Sequence[dict], n: int, ks: Sequence[int], answer_format: str = "boxed") -> dict:
    """avg@n, pass@k, format / truncation rates and mean length over per-problem rows (NaN when empty).

    When rows carry a `level`, `by_level` lists `{"level", "problems", "avg@n", "pass@k"...}` per level."""
    P = len(rows)
    if P == 0:
        nan = float("nan")
        return {f"avg@{n}": nan, **{f"pass@{k}": nan for k in ks}, "format_rate": nan, "mean_tokens": nan,
                "truncated_rate": nan}
    out = {f"avg@{n}": sum(r["avg"] for r in rows) / P,
           **{f"pass@{k}": sum(r[f"pass@{k}"] for r in rows) / P for k in ks},
           "format_rate": sum(answer_format_ok(c, answer_format) for r in rows for c in r["completions"]) / (P * n),
           "mean_tokens": sum(sum(r["num_tokens"]) for r in rows) / (P * n),
           "truncated_rate": sum(not f for r in rows for f in r["finished"]) / (P * n)}
    levels = sorted({r["level"] for r in rows if r.get("level") is not None}, key=lambda v: (str(type(v)), v))
    if levels:
        out["by_level"] = []
        for lv in levels:
            sub = [r for r in rows if r.get("level") == lv]
            out["by_level"].append({"level": lv, "problems": len(sub),
                                    f"avg@{n}": sum(r["avg"] for r in sub) / len(sub),
                                    **{f"pass@{k}": sum(r[f"pass@{k}"] for r in sub) / len(sub) for k in ks}})
    return out
