"""Configs of the distillation stages: dataclasses with `help` metadata, filled from a YAML recipe and then
from `key=value` overrides (dotted keys reach nested sections: `train.lr=3e-4`, `data.seq_len=512`).

Resolution order: dataclass defaults < YAML recipe < command-line overrides. The resolved config is
written to `<run_dir>/config.yaml` by every stage, so a run can be repeated from its own directory.

Kernel options (`hybridize.ops.common.options`): every stage takes `kernel_options.<field>=value` (e.g.
`kernel_options.kernels=torch`), in force for the whole run over the `HYBRIDIZE_*` environment (explicit >
environment > defaults); config.yaml records every option in force, set or not (`save_config`), and a
`--resume` may change them.
"""
from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hybridize.convert.fingerprint import recorded_source
from hybridize.errors import UserError, read_yaml
from hybridize.ops.common.options import check_overrides, resolve_kernel_options


def _f(default, help: str, min: float | None = None):
    """A dataclass field with a help string (lists/dicts get a factory); `min`: the smallest value accepted,
    checked when a recipe or an override sets it (a negative step count must fail at parse time, not train
    for 0 steps)."""
    meta = {"help": help} if min is None else {"help": help, "min": min}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


#: help of the `kernel_options` setting every stage has
KERNEL_OPTIONS_HELP = ("kernel switches for this run, e.g. kernel_options.kernels=torch (fields and help: "
                       "hybridize/ops/common/options.py); unset fields: the HYBRIDIZE_* environment, then the defaults; "
                       "config.yaml records all of them")


# ---- shared sections ----------------------------------------------------------------------------

@dataclass
class TrainArgs:
    """Optimisation and bookkeeping shared by every hand-written training loop (align, e2e)."""

    run_dir: str = _f("runs/distill", "output folder: checkpoints/, metrics.jsonl, loss.png, config.yaml, data.json, final/")
    seed: int = _f(0, "seed of model init noise, data order and dropout")
    max_steps: int = _f(100, "optimizer steps", min=1)
    lr: float = _f(1e-3, "peak learning rate", min=0)
    min_lr_ratio: float = _f(0.0, "cosine schedule floor as a fraction of lr", min=0)
    weight_decay: float = _f(0.0, "AdamW weight decay", min=0)
    adam_betas: list = _f([0.9, 0.95], "AdamW betas")
    scheduler: str = _f("cosine", "learning-rate schedule: cosine | linear | constant")
    warmup_steps: int = _f(10, "linear warm-up steps", min=0)
    grad_accum: int = _f(1, "micro-batches per optimizer step (per process)", min=1)
    max_grad_norm: float = _f(1.0, "gradient clipping norm (0 = off)", min=0)
    mixed_precision: str = _f("no", "accelerate autocast: no | bf16 | fp16")
    dtype: str = _f("float32", "dtype the models are loaded in: float32 | bfloat16")
    save_every: int = _f(50, "checkpoint every N optimizer steps (0 = only at the end)", min=0)
    keep_checkpoints: int = _f(2, "how many recent checkpoints to keep", min=1)
    log_every: int = _f(1, "write a metrics line every N steps", min=1)
    threads: int = _f(0, "torch CPU threads (0 = the idle cores, re-picked when a step slows down: hybridize/cpu.py)",
                      min=0)
    nan_policy: str = _f("error", "non-finite loss: error (stop, naming the last checkpoint saved before the "
                                  "divergence) | skip (drop the batch, max 10 times)")
    progress: bool = _f(True, "show a progress bar")
    max_minutes: float = _f(0.0, "wall-clock budget: stop after this many minutes with a checkpoint (--resume goes "
                                 "on) and final/ (the model so far); 0 = none", min=0)
    deepspeed: str = _f("", "DeepSpeed JSON config (e.g. recipes/accelerate/ds_zero3.json) for a ONE-process run "
                            "without `accelerate launch` (ZeRO-offload on one GPU, CPU tests); under "
                            "`accelerate launch --config_file ...` leave empty: the launch config decides")


@dataclass
class DataArgs:
    """Where training text comes from and how it is packed."""

    train: typing.Union[str, list] = _f("", "local .jsonl/.json/.txt/.parquet file or folder, or a hub dataset "
                                            "name, or a list of them (YAML list, or data.train=[a,b]); empty: "
                                            "../shared/data/general_text when present")
    split: str = _f("train", "dataset split (hub datasets)")
    text_field: str = _f("text", "column holding the text")
    text_template: str = _f("", "Python format string over row columns, e.g. '{problem}\\n{solution}' "
                                "(overrides text_field)")
    max_docs: int = _f(0, "use at most this many documents (0 = all; per source)", min=0)
    txt_document: str = _f("line", "what one document of a local .txt file is: line | paragraph | file | "
                                   "wikitext (whole articles, split at ' = Title = ' headings)")
    seq_len: int = _f(256, "packed row length in tokens", min=1)
    seq_len_schedule: list = _f([], "context-length schedule [[step, seq_len], ...] (overrides seq_len)")
    batch_tokens: int = _f(1024, "tokens per micro-batch per process (rows = batch_tokens // seq_len)", min=1)
    add_eos: bool = _f(True, "append EOS to every document before packing")
    recall_drills: float = _f(0.0, "recall drills (hybridize/distill/recall_drills.py): the chance that each "
                                   "recall_reach characters of training text get a record planted and stated again "
                                   "later, so the teacher's copying is distilled (0 = none, 1 = every span)", min=0.0)
    recall_reach: int = _f(6000, "recall drills: the most characters between a record and its restatement "
                                 "(about 4 characters per token of English)", min=100)
    eval: str = _f("", "held-out text for perplexity (same formats as train; empty = none)")
    eval_tokens: int = _f(4096, "held-out tokens used for perplexity", min=1)
    eval_every: int = _f(0, "held-out perplexity every N steps (0 = start and end only)", min=0)


@dataclass
class LoraArgs:
    r: int = _f(16, "LoRA rank", min=1)
    alpha: int = _f(32, "LoRA alpha")
    dropout: float = _f(0.0, "LoRA dropout")
    target_modules: list = _f(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                              "module names LoRA wraps")


# ---- stages -------------------------------------------------------------------------------------

@dataclass
class AlignConfig:
    """Stage A: attention transfer, each converted layer reproduces its teacher layer's attention output."""

    student: str = _f("", "converted checkpoint folder (hybridize convert --out)")
    teacher: str = _f("", "teacher source for load_model ('default', a folder, a hub name); "
                          "empty: the source recorded in the student's config")
    loss: str = _f("nmse", "per-layer loss: mse | nmse (MSE / mean square of the teacher output)")
    params: str = _f("mixer", "what trains: mixer (all mixer params) | mixer_new (params the teacher lacks) "
                              "| comma-separated globs over parameter names")
    layers: list = _f([], "converted layer indices to train (empty = all)")
    balance_weight: float = _f(1.0, "multiplier on the mixers' auxiliary (SSE balance) losses")
    layers_per_step: int = _f(0, "train only this many layers per step, rotating through them (0 = all): "
                                 "the losses are layer-local, so this only divides the per-step cost", min=0)
    gradient_checkpointing: bool = _f(False, "recompute each layer's activations in the backward: the memory of "
                                             "one layer instead of all of them, for about one more forward")
    train: TrainArgs = field(default_factory=lambda: TrainArgs(run_dir="runs/align", lr=1e-3))
    data: DataArgs = field(default_factory=DataArgs)
    kernel_options: dict = _f({}, KERNEL_OPTIONS_HELP)


@dataclass
class E2EConfig:
    """Stage B: end-to-end distillation / long-context continual training."""

    student: str = _f("", "student checkpoint folder (converted or after align)")
    teacher: str = _f("", "teacher source (empty: the source in the student's config; 'none': CE only)")
    kl_weight: float = _f(1.0, "weight of KL(teacher || student) on the logits")
    ce_weight: float = _f(0.1, "weight of next-token cross-entropy")
    temperature: float = _f(1.0, "softmax temperature of the KL term (scaled back by T^2)")
    balance_weight: float = _f(1.0, "multiplier on the model's auxiliary (SSE balance) loss when present")
    hidden_weight: float = _f(0.0, "weight of the relative error of the hidden states entering the student's softmax "
                                   "layers (what their queries and keys read) against the teacher's; `hybridize eval "
                                   "needle-attention` shows retrieval lost there", min=0)
    attn_weight: float = _f(0.0, "weight of KL(teacher || student) between the attention maps of the student's "
                                 "softmax layers and the teacher's same layers, on sampled query rows", min=0)
    attn_queries: int = _f(128, "query rows per micro-batch row that the attention term compares", min=1)
    attn_rows: str = _f("all", "which query rows the attention term draws: all (any position) | repeats (positions "
                               "whose token occurred earlier in the document, where a model can copy what followed it)")
    params: str = _f("all", "what trains: all | mixer | mixer_new | lora (LoRA + mixer params) | globs")
    pretrained_lr_scale: float = _f(1.0, "learning-rate multiplier for trainable parameters outside the converted "
                                         "mixers (MLPs, embeddings, norms, softmax layers): below 1 lets the new "
                                         "mixers move fast while the teacher's weights drift less")
    lora: LoraArgs = field(default_factory=LoraArgs)
    gradient_checkpointing: bool = _f(False, "recompute activations in backward to save memory")
    train: TrainArgs = field(default_factory=lambda: TrainArgs(run_dir="runs/e2e", lr=1e-4))
    data: DataArgs = field(default_factory=DataArgs)
    kernel_options: dict = _f({}, KERNEL_OPTIONS_HELP)


@dataclass
class SFTStageConfig:
    """Stage C: supervised fine-tuning of the student on reasoning traces (TRL SFTTrainer)."""

    student: str = _f("", "student checkpoint folder")
    traces: str = _f("", "traces: .jsonl/.json/.parquet file or hub name (empty: ../shared/data/math_train)")
    split: str = _f("train", "dataset split")
    prompt_field: str = _f("problem", "column with the prompt")
    completion_field: str = _f("solution", "column with the completion (trace)")
    system_prompt: str = _f("", "optional system message")
    max_examples: int = _f(0, "use at most this many rows (0 = all)", min=0)
    max_length: int = _f(1024, "truncate prompt+completion to this many tokens", min=1)
    params: str = _f("all", "what trains: all | mixer | mixer_new | lora | globs")
    lora: LoraArgs = field(default_factory=LoraArgs)
    batch_size: int = _f(1, "per-device batch size", min=1)
    packing: bool = _f(False, "TRL packing of examples (padding-free, position_ids restart per example)")
    train: TrainArgs = field(default_factory=lambda: TrainArgs(run_dir="runs/sft", lr=1e-5))
    kernel_options: dict = _f({}, KERNEL_OPTIONS_HELP)


@dataclass
class TracesConfig:
    """`hybridize distill traces`: the teacher writes completions for prompts (JSONL, resumable)."""

    teacher: str = _f("default", "teacher source for load_model")
    prompts: str = _f("", "prompts: .jsonl/.json/.parquet, hub name, or generated arithmetic arith[:train|test]"
                          "[:L1-6][:n=N][:seed=S] (split default: `split`) (empty: ../shared/data/gsm8k/train.jsonl)")
    split: str = _f("train", "dataset split")
    prompt_field: str = _f("problem", "column with the prompt")
    system_prompt: str = _f("", "optional system message")
    out: str = _f("runs/traces/traces.jsonl", "output JSONL (appended; rows already there are skipped)")
    num_prompts: int = _f(16, "how many prompts (0 = all)")
    samples_per_prompt: int = _f(1, "completions per prompt")
    max_new_tokens: int = _f(256, "generation length")
    temperature: float = _f(0.0, "0 = greedy")
    top_p: float = _f(1.0, "nucleus sampling")
    batch_size: int = _f(4, "prompts per generate call")
    seed: int = _f(0, "sampling seed")
    generation: str = _f("auto", "fast (our static-buffer engine, CUDA graphs on a GPU; the same greedy tokens as HF) "
                                 "| hf (model.generate) | auto (fast on CUDA, hf on CPU)")
    dtype: str = _f("float32", "teacher dtype")
    device: str = _f("auto", "auto (cuda when available) | cpu | cuda | cuda:N")
    threads: int = _f(0, "torch CPU threads (0 = leave as is)")
    answer_format: str = _f("boxed", "boxed | number: the instruction in generated arithmetic prompts (the `prompt` "
                                     "column) and the checker that keep=correct applies")
    keep: str = _f("all", "all | correct: rejection sampling, only completions the checker grades correct against "
                          "the row's `answer` are written (the others go to <out>.rejected.jsonl, so a rerun "
                          "skips them too)")
    kernel_options: dict = _f({}, KERNEL_OPTIONS_HELP)


@dataclass
class LongQuestionsConfig:
    """`hybridize distill long-questions`: prompts that ask a question after a long text, for `distill traces`."""

    texts: typing.Union[str, list] = _f("", "the documents: a local file or folder, a hub dataset, a built-in text, "
                                            "or a list of them (texts=[a,b]); training sources only, never "
                                            "evaluation text")
    txt_document: str = _f("wikitext", "what one document of a local .txt file is (as data.txt_document)")
    out: str = _f("runs/traces/long_questions.jsonl", "output JSONL (columns problem, answer, kind, chars)")
    num_prompts: int = _f(240, "how many prompts", min=1)
    min_chars: int = _f(4000, "shortest text before the question, in characters (about 4 per token)", min=1)
    max_chars: int = _f(28000, "longest text before the question (28,000 characters is about 6,700 tokens, "
                               "so prompt and answer fit an 8k context)", min=1)
    record_fraction: float = _f(0.6, "share of prompts with 1-3 planted records, one of which the question asks "
                                     "for; the rest ask about the text itself", min=0.0)
    seed: int = _f(0, "seed of the lengths, records and questions")


@dataclass
class DemoConfig:
    """`hybridize demo`: convert + stage A + stage B on the embedded default, on CPU, budgets in steps."""

    out: str = _f("runs/demo", "output folder")
    teacher: str = _f("default", "teacher source")
    layers: str = _f("5:1", "layer plan (5 converted : 1 softmax)")
    mixer: str = _f("sse", "mixer of the converted layers")
    mixer_settings: dict = _f({"chunk_size": 16}, "mixer settings for the converter (chunk 16 is the fastest "
                                                   "CPU chunk size for SSE at head_dim 64; numerically the same)")
    train_text: str = _f("", "training text: a local file/folder or hub dataset (empty: the standard library's "
                             "docstrings + the teacher's answers to the demo's chat prompts)")
    heldout_text: str = _f("", "held-out text, never trained on (empty: Python's Language Reference topics, "
                               "pydoc_data)")
    chat_samples: int = _f(2, "teacher answers per chat prompt in the built-in training text", min=0)
    chat_tokens: int = _f(160, "longest teacher answer in tokens", min=1)
    chat_batch: int = _f(48, "prompts per generate call", min=1)
    eval_tokens: int = _f(2048, "held-out tokens for perplexity", min=1)
    eval_seq_len: int = _f(512, "perplexity window", min=1)
    align_steps: int = _f(300, "stage A optimizer steps", min=1)
    align_lr: float = _f(4e-3, "stage A learning rate", min=0)
    e2e_steps: int = _f(80, "stage B optimizer steps", min=1)
    e2e_lr: float = _f(6e-4, "stage B learning rate", min=0)
    e2e_params: str = _f("mixer", "what trains in stage B (see distill e2e params)")
    e2e_pretrained_lr_scale: float = _f(1.0, "stage B learning-rate multiplier outside the mixers "
                                             "(see distill e2e pretrained_lr_scale)", min=0)
    seq_len: int = _f(128, "training row length", min=1)
    batch_tokens: int = _f(128, "tokens per micro-batch", min=1)
    threads: int = _f(0, "torch CPU threads (0 = the cores idle at the start of each stage)", min=0)
    seed: int = _f(0, "seed")
    device: str = _f("auto", "auto (cuda when available) | cpu | cuda | cuda:N")
    mixed_precision: str = _f("no", "training autocast: no | bf16")
    kernel_options: dict = _f({}, KERNEL_OPTIONS_HELP)


# ---- loading ------------------------------------------------------------------------------------

def _is_dataclass_type(tp) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _build(cls, data: dict[str, Any], where: str):
    """Make `cls` from a nested dict, rejecting unknown keys with the list of known ones."""
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(data) - set(known)
    if unknown:
        raise UserError(f"unknown setting(s) {sorted(unknown)} in {where or cls.__name__}; "
                        f"known: {sorted(known)}")
    kwargs = {}
    for name, value in data.items():
        tp = hints[name]
        if _is_dataclass_type(tp):
            if not isinstance(value, dict):
                raise UserError(f"{where}{name} must be a mapping, got {value!r}")
            kwargs[name] = _build(tp, value, f"{where}{name}.")
        else:
            kwargs[name] = _coerce(value, tp, f"{where}{name}")
            _check_min(kwargs[name], known[name], f"{where}{name}")
    obj = cls()
    for k, v in kwargs.items():
        if _is_dataclass_type(hints[k]):
            # merge into the default section so partial sections keep the stage's own defaults
            v = dataclasses.replace(getattr(obj, k), **{f.name: getattr(v, f.name) for f in dataclasses.fields(v)
                                                        if f.name in data[k]})
        setattr(obj, k, v)
    return obj


class _Yaml12Loader(yaml.SafeLoader):
    """YAML with the 1.2 core schema's scalars: only true/false are booleans (`mixed_precision: no` stays
    the string "no"; bool fields still accept yes/no/on/off through `_coerce`), and no base-60 numbers
    (`layers=5:1` stays "5:1", not 301); `1e-4` is a float."""


_CORE = {"tag:yaml.org,2002:bool": r"^(?:true|True|TRUE|false|False|FALSE)$",
         "tag:yaml.org,2002:int": r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$",
         "tag:yaml.org,2002:float": r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
                                    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"}
_Yaml12Loader.yaml_implicit_resolvers = {
    k: [(tag, rx) for tag, rx in v if tag not in _CORE]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
for _tag, _rx in _CORE.items():
    _Yaml12Loader.add_implicit_resolver(_tag, re.compile(_rx), list("-+0123456789.tTfFi"))


def load_yaml(text: str):
    return yaml.load(text, Loader=_Yaml12Loader)


def _coerce(value, tp, where: str):
    origin = typing.get_origin(tp) or tp
    if value is None:
        return value
    try:
        if origin is bool and not isinstance(value, bool):
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if origin in (int, float, str) and not isinstance(value, origin):
            if origin is int and isinstance(value, float) and not value.is_integer():
                raise ValueError
            return origin(value)
        if origin is list and not isinstance(value, list):
            # "a,b" on the command line -> ["a", "b"]
            return [load_yaml(v) for v in str(value).split(",") if v != ""]
    except (TypeError, ValueError):
        raise UserError(f"{where}: cannot use {value!r} as {getattr(origin, '__name__', origin)}") from None
    return value


def _check_min(value, f: dataclasses.Field, where: str) -> None:
    """Reject a number below the field's `min` (0 or negative step counts, sizes, rates)."""
    low = f.metadata.get("min")
    if low is None or value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if not value >= low:  # NaN fails too
        raise UserError(f"{where} must be >= {low:g}, got {value!r}")


def _set_dotted(d: dict, key: str, value) -> None:
    parts = key.split(".")
    for p in parts[:-1]:
        d = d.setdefault(p, {})
        if not isinstance(d, dict):
            raise UserError(f"override {key}: {p} is not a section")
    d[parts[-1]] = value


def parse_overrides(overrides: list[str] | None) -> dict:
    """`["train.lr=1e-4", "layers=[1,2]"]` -> nested dict; values are parsed as YAML scalars/lists."""
    out: dict = {}
    for item in overrides or []:
        if "=" not in item:
            raise UserError(f"override {item!r} is not key=value (e.g. train.lr=3e-4)")
        key, raw = item.split("=", 1)
        _set_dotted(out, key.strip(), load_yaml(raw) if raw.strip() else "")
    return out


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


#: the recipes shipped inside the package (`recipes/` at the repository root links here)
RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"


def find_recipe(name: str) -> Path:
    """A recipe path, or a name under the shipped recipes (`smollm2-135m/align`; `hybridize recipes` lists them)."""
    p = Path(name)
    if p.is_file():
        return p
    for cand in (RECIPES_DIR / name, RECIPES_DIR / f"{name}.yaml"):
        if cand.is_file():
            return cand
    raise UserError(f"recipe {name!r} not found (as a file or under {RECIPES_DIR})")


def load_config(cls, recipe: str | None = None, overrides: list[str] | dict | None = None):
    """Defaults < recipe YAML < overrides. Unknown keys and bad values raise UserError."""
    data: dict = {}
    if recipe:
        path = find_recipe(recipe)
        loaded = read_yaml(path, load_yaml) or {}
        if not isinstance(loaded, dict):
            raise UserError(f"recipe {path} must be a YAML mapping")
        data = loaded
    ov = overrides if isinstance(overrides, dict) else parse_overrides(overrides)
    cfg = _build(cls, _merge(data, ov), "")
    if isinstance(getattr(cfg, "kernel_options", None), dict):
        cfg.kernel_options = check_overrides(cfg.kernel_options)   # unknown field / bad value: one line
    return cfg


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg, path: str | Path) -> None:
    """`cfg` as YAML; its `kernel_options` section holds every kernel option in force (the current ones with
    the config's explicit fields), so the file records which kernels the run used."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = to_dict(cfg)
    if "kernel_options" in data:
        data["kernel_options"] = resolve_kernel_options(data["kernel_options"]).to_dict()
    path.write_text(yaml.safe_dump(data, sort_keys=False))


#: train.* settings a `--resume` may change, by the stage's trainer: the hand-written loop (align, e2e)
#: applies them to the restored optimizer and LR schedule (which keeps its position); TRL's trainer (sft)
#: restores the old lr, betas and weight decay, so there only bookkeeping and the step budget may change
RESUMABLE = {
    "loop": ("lr", "min_lr_ratio", "scheduler", "warmup_steps", "max_steps", "weight_decay", "adam_betas",
             "max_grad_norm", "nan_policy", "save_every", "keep_checkpoints", "log_every", "threads", "progress",
             "max_minutes"),
    "sft": ("max_steps", "max_grad_norm", "save_every", "keep_checkpoints", "log_every", "threads", "progress"),
}


def _short(value, limit: int = 60) -> str:
    """A value for a one-line message: long ones keep their end (where two paths differ)."""
    text = str(value)
    return text if len(text) <= limit else "..." + text[-(limit - 3):]


def changed_settings(old: dict, new: dict, prefix: str = "") -> list[str]:
    """`key: old -> new` for every setting of `new` whose value differs in `old` (keys `old` lacks - written
    by an older version - do not count)."""
    out = []
    for key, value in new.items():
        if key not in old:
            continue
        if isinstance(value, dict) and isinstance(old[key], dict):
            out += changed_settings(old[key], value, f"{prefix}{key}.")
        elif old[key] != value:
            out.append(f"{prefix}{key}: {_short(old[key])!r} -> {_short(value)!r}")
    return out


def _resume_teacher(old: str, new: str, student: str) -> str:
    """The teacher setting `new` as config.yaml records it (`run_align` / `run_e2e` store the source they
    loaded, resolved), for comparing with the run's `old` one: empty stands for the teacher the student's
    config.json records, and a path is made absolute (`teacher=./t` from the run's folder is the same
    teacher). Whether its weights are still those the run started with is checked when it is about to load
    (`models.check_run_teacher`)."""
    import json

    if new == old:
        return new
    if new == "":
        try:
            new = json.loads((Path(student) / "config.json").read_text()).get("teacher_source") or ""
        except (OSError, ValueError, AttributeError):
            return old  # no readable record: the stage itself says so
        if not new:
            return old
    try:
        return recorded_source(new)
    except UserError:
        return new


def check_resume_settings(cfg, saved: str | Path, trainer: str = "loop") -> None:
    """On `--resume`: refuse, in one line, settings that differ from the run's `saved` config.yaml and that
    the restored state would silently ignore or break on (all but RESUMABLE[trainer])."""
    saved = Path(saved)
    if not saved.is_file():
        return
    old = yaml.safe_load(saved.read_text()) or {}
    new = to_dict(cfg)
    if "teacher" in new and isinstance(old.get("teacher"), str):
        new["teacher"] = _resume_teacher(old["teacher"], new["teacher"], str(new.get("student", "")))
    allowed = {f"train.{k}" for k in RESUMABLE[trainer]}
    fixed = [c for c in changed_settings(old, new) if c.split(":")[0] not in allowed
             and not c.startswith("kernel_options.")]   # kernel switches may change (another machine)
    if fixed:
        raise UserError(f"--resume: settings differ from {saved}: {'; '.join(fixed)}; these cannot change "
                        f"mid-run: set them back to continue, or pass --overwrite to start over (--resume may "
                        f"change train.{{{', '.join(RESUMABLE[trainer])}}})")


def describe(cls, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(key, default, help) of every setting, nested keys dotted: the CLI prints this as help."""
    rows = []
    hints = typing.get_type_hints(cls)
    obj = cls()
    for f in dataclasses.fields(cls):
        if _is_dataclass_type(hints[f.name]):
            sub = getattr(obj, f.name)
            for k, _, h in describe(type(sub), f"{prefix}{f.name}."):
                rows.append((k, getattr(sub, k.split(".")[-1]), h))
        else:
            rows.append((f"{prefix}{f.name}", getattr(obj, f.name), f.metadata.get("help", "")))
    return rows
