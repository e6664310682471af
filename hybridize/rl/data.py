"""Math prompts for GRPO: problem/answer records from local JSONL or the hub, turned into chat prompts.

Sources (`load_problems(spec)`):
- a short name: `gsm8k` (GSM8K train), `math` (MATH train, 7.5k), `aime` (AIME 1983-2023), read from the
  shared data folder (`$HYBRIDIZE_DATA_DIR`, else `../shared/data` next to the repository) when present,
  else (GSM8K only) from the hub `openai/gsm8k`; `gsm8k-test` / `math500` / `aime24` ... (held-out sets, the
  evaluation's names) for scoring;
- generated arithmetic (`hybridize.eval.arith`): `arith:train`, `arith:train:L1-3`, ... (plain `arith` is
  the test split, as in the evaluation; train on `arith:train`);
- a JSONL file with `problem` (or `question`) and `answer` fields (extra fields are kept as columns);
- a hub dataset `owner/name[@config][:split]` with the same fields (GSM8K's `#### N` answers are cut to N).

Records are normalised by the evaluation's reader (`hybridize.eval.math`), so training and evaluation
agree on what the answer is. The prompt is the evaluation's: the problem, a new line, the boxed-answer
instruction, inside the chat template when the tokenizer has one (TRL applies the template itself to a
conversational `prompt` column; plain text is used without one).
"""
from __future__ import annotations

import random
from pathlib import Path

from hybridize.errors import UserError, read_jsonl
from hybridize.eval.arith import is_arith_spec
from hybridize.eval.common import data_file, has_chat_template
from hybridize.eval.math import DATASETS, _normalise_record, keep_answered, load_math_dataset

#: short name -> (path under the shared data folder, hub id, hub config, hub split)
TRAIN_SETS = {
    "gsm8k": ("gsm8k/train.jsonl", "openai/gsm8k", "main", "train"),
    "math": ("math_train/math_train.jsonl", None, None, "train"),
    "aime": ("aime_1983_2023/aime_1983_2023.jsonl", None, None, "train"),
    "gsm8k-test": ("gsm8k/test.jsonl", "openai/gsm8k", "main", "test"),
}
_ALIASES = {"gsm8k-train": "gsm8k", "math-train": "math", "math_train": "math", "aime_1983_2023": "aime"}


def _from_jsonl(path: Path) -> list[dict]:
    rows = read_jsonl(path)
    not_obj = [i for i, r in enumerate(rows) if not isinstance(r, dict)]
    if not_obj:
        raise UserError(f"{path}: {len(not_obj)} of {len(rows)} rows are not JSON objects (first: row "
                        f"{not_obj[0] + 1}, a {type(rows[not_obj[0]]).__name__}); expected one object with "
                        "'problem' and 'answer' fields per line")
    recs = [{**r, **_normalise_record(r, i)} for i, r in enumerate(rows)]
    return keep_usable(recs, str(path))


def keep_usable(recs: list[dict], where: str) -> list[dict]:
    """The records with both a problem and an answer. For each field, as `keep_answered` does for the answer:
    rows without it are dropped with one warning line (how many, the first row's number in the
    file), none with it is a one-line error."""
    import sys

    answered = keep_answered(recs, where)
    missing = [i for i, r in enumerate(recs) if not r["problem"]]
    if len(missing) == len(recs):
        raise UserError(f"{where}: none of its {len(recs)} rows has a 'problem' (or 'question') field, so there "
                        "is nothing to prompt with; add the problems")
    if missing:
        print(f"warning: {where}: dropped {len(missing)} of {len(recs)} rows with no 'problem' (or 'question') "
              f"field (first: row {missing[0] + 1})", file=sys.stderr)
    return [r for r in answered if r["problem"]]


def _from_hub(name: str, config: str | None, split: str) -> list[dict]:
    try:
        # deferred: datasets (pyarrow) is slow to import and only hub or parquet data needs it
        import datasets

        ds = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # offline, unknown name, ...
        raise UserError(f"cannot load hub dataset {name} ({type(e).__name__}); give a local JSONL with "
                        "problem/answer fields or set HYBRIDIZE_DATA_DIR") from e
    recs = [{**dict(r), **_normalise_record(dict(r), i)} for i, r in enumerate(ds)]
    return keep_usable(recs, name)


def parse_hub_spec(spec: str) -> tuple[str, str | None, str]:
    """`owner/name[@config][:split]` -> (name, config, split); split defaults to train."""
    name, _, split = spec.partition(":")
    name, _, config = name.partition("@")
    return name, config or None, split or "train"


def load_problems(spec: str) -> list[dict]:
    """Records with at least `problem`, `answer`, `id` (see the module docstring for `spec`)."""
    key = _ALIASES.get(spec.lower(), spec.lower())
    if Path(spec).is_file():
        return _from_jsonl(Path(spec))
    if key in TRAIN_SETS:
        rel, hub, config, split = TRAIN_SETS[key]
        local = data_file(rel)
        if local is not None:
            return _from_jsonl(local)
        if hub is None:
            raise UserError(f"{spec}: no local copy ({rel} under HYBRIDIZE_DATA_DIR or ../shared/data); "
                            "give a JSONL file with problem/answer or a hub owner/name[@config][:split]")
        return _from_hub(hub, config, split)
    if key in DATASETS or is_arith_spec(key):  # the evaluation's names: held-out sets, generated arith
        return load_math_dataset(key)
    if "/" in spec and not spec.endswith((".jsonl", ".json")):
        return _from_hub(*parse_hub_spec(spec))
    raise UserError(f"unknown prompt set {spec!r}: give one of {', '.join(TRAIN_SETS)}, "
                    f"{', '.join(DATASETS)}, arith:train[:L1-6] (generated arithmetic), a JSONL file with "
                    "problem/answer, or a hub owner/name[@config][:split]")


def use_chat(tokenizer, chat: str) -> bool:
    if chat not in ("auto", "on", "off"):
        raise UserError(f"data.chat must be auto, on or off, got {chat!r}")
    has = has_chat_template(tokenizer)
    if chat == "on" and not has:
        raise UserError("data.chat=on but the tokenizer has no chat template; use data.chat=off")
    return has if chat == "auto" else chat == "on"


def make_prompt(problem: str, instruction: str, system: str, chat: bool):
    """The `prompt` column: a message list (TRL applies the chat template) or plain text."""
    user = f"{problem}\n{instruction}" if instruction else problem
    if not chat:
        return (f"{system}\n\n" if system else "") + user
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]


def prompt_length(tokenizer, prompt, chat: bool, template_kwargs: dict | None = None) -> int:
    if chat:
        ids = tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True,
                                            **(template_kwargs or {}))
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        return len(ids)
    return len(tokenizer(prompt)["input_ids"])


def build_records(specs: list[str] | str, tokenizer, *, instruction: str, system: str = "", chat: str = "auto",
                  max_prompt_tokens: int = 0, limit: int = 0, seed: int = 0,
                  template_kwargs: dict | None = None) -> list[dict]:
    """Shuffled prompt records `{"prompt", "answer", "problem", "id", "source"}`, long prompts dropped.

    Stops tokenizing once `limit` prompts are accepted (GSM8K has 7.5k problems; a run may need 100)."""
    specs = [specs] if isinstance(specs, str) else list(specs)
    if not specs:
        raise UserError("data.train is empty: name at least one prompt set (e.g. gsm8k)")
    recs = []
    for spec in specs:
        recs += [{**r, "source": spec} for r in load_problems(spec)]
    random.Random(seed).shuffle(recs)
    is_chat = use_chat(tokenizer, chat)
    out, too_long = [], 0
    for r in recs:
        prompt = make_prompt(r["problem"], instruction, system, is_chat)
        if max_prompt_tokens and prompt_length(tokenizer, prompt, is_chat, template_kwargs) > max_prompt_tokens:
            too_long += 1
            continue
        out.append({"prompt": prompt, "answer": str(r["answer"]), "problem": r["problem"], "id": str(r["id"]),
                    "source": r["source"]})
        if limit and len(out) >= limit:
            break
    _report_too_long(too_long, len(out) + too_long, specs, max_prompt_tokens)
    return out


def _report_too_long(dropped: int, seen: int, specs: list[str], max_prompt_tokens: int) -> None:
    """Say how many prompts were dropped for length (stderr), or fail in one line when that left none.
    Rows without an answer were already dropped, and said so, by the loaders (`keep_answered`)."""
    import sys

    if dropped and dropped == seen:
        raise UserError(f"no prompts left from {specs}: all {seen} are longer than data.max_prompt_tokens="
                        f"{max_prompt_tokens} tokens (chat template included); raise data.max_prompt_tokens")
    if not seen:
        raise UserError(f"no prompts in {specs}")
    if dropped:
        print(f"warning: dropped {dropped} of {seen} prompts from {specs} longer than data.max_prompt_tokens="
              f"{max_prompt_tokens} tokens", file=sys.stderr)


def to_dataset(records: list[dict]):
    """A `datasets.Dataset` with the columns TRL needs (`prompt`) and the reward functions read (`answer`)."""
    # deferred: datasets (pyarrow) is slow to import and only hub or parquet data needs it
    import datasets

    return datasets.Dataset.from_list(records)
