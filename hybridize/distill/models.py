"""Model plumbing of the distillation stages: load teacher and student, find the converted layers,
choose (and report) which parameters train.

A converted layer is a decoder layer whose `self_attn` is a hybridize mixer (`hybridize.modeling`'s
`<Mixer>Slot`: the mixer itself with the attention call signature) or an adapter holding one at
`.mixer`; softmax layers keep the teacher's attention module.
"""
from __future__ import annotations

import contextlib
import fnmatch
import json
import os
from pathlib import Path

import torch
import torch.nn as nn

from hybridize.convert.fingerprint import check_recorded_teacher, fingerprint, recorded_source
from hybridize.errors import UserError
from hybridize.generation.loading import DTYPES, load_model
from hybridize.mixers.base import Mixer

from .checkpoint import latest_checkpoint


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise UserError(f"unknown dtype {name!r}; use one of {sorted(DTYPES)}")
    return DTYPES[name]


def load_teacher(source: str, dtype: str = "float32", device: str | torch.device = "cpu"):
    """(model, tokenizer) of a teacher: 'default' (embedded SmolLM2), a folder or a hub name."""
    model, tok = load_model(source, torch_dtype(dtype), device, need_tokenizer=False)
    model.eval().requires_grad_(False)
    return model, tok


def load_student(path: str, dtype: str = "float32", device: str | torch.device = "cpu"):
    """(model, tokenizer) of a saved (converted) checkpoint folder."""
    if not path:
        raise UserError("no student given: pass student=<folder written by `hybridize convert --out`>")
    if not Path(path).is_dir():
        raise UserError(f"student folder {path} does not exist (run `hybridize convert --out {path}` first)")
    model, tok = load_model(str(path), torch_dtype(dtype), device, need_tokenizer=False)
    model.train()
    return model, tok


def teacher_source_of(student) -> str:
    """The teacher source recorded in a converted model's config (empty when none).

    A recorded teacher must still resolve and, when the checkpoint records a fingerprint of the teacher's
    weight files, hold the same weights (a relative `--src` can resolve to another model elsewhere);
    otherwise one line (UserError) asks for an explicit teacher."""
    cfg = student.config
    folder = Path(getattr(cfg, "_name_or_path", "") or "")
    for key in ("teacher_source", "source", "source_model", "teacher"):
        v = getattr(cfg, key, None)
        if isinstance(v, str) and v:
            check_recorded_teacher(v, getattr(cfg, "teacher_fingerprint", None), f"student {folder}")
            return v
    # a conversion report next to the checkpoint (hybridize convert --out) names its source
    for name in ("conversion_report.json", "report.json", "convert_report.json"):
        f = folder / name
        if f.is_file():
            try:
                src = json.loads(f.read_text()).get("source", {})
            except (ValueError, AttributeError):
                continue
            v = (src.get("teacher") or src.get("src")) if isinstance(src, dict) else src
            if isinstance(v, str) and v:
                check_recorded_teacher(v, src.get("fingerprint") if isinstance(src, dict) else None,
                                       f"student {folder}")
                return v
    return ""


RUN_TEACHER = "teacher.json"


def check_run_teacher(run_dir: str | Path, src: str, resume: bool) -> str:
    """Before a stage loads its teacher: on `resume` from a checkpoint, stop with one line when `src` holds
    other weights than the teacher the run started with (the fingerprint in `<run_dir>/teacher.json`);
    otherwise (a fresh start, or nothing to resume) record it there. Returns the source as config.yaml
    records it (an absolute path; names stay names).

    Why: a resumed run that silently switched teachers (another folder of that name, a folder
    whose weights were replaced) trains its remaining steps towards another model."""
    record = {"teacher": recorded_source(src), "fingerprint": fingerprint(src)}
    path = Path(run_dir) / RUN_TEACHER
    if resume and path.is_file() and latest_checkpoint(run_dir) is not None:  # no checkpoint: starts at step 0
        try:
            old = json.loads(path.read_text())
        except ValueError:
            old = {}
        if old.get("fingerprint") and record["fingerprint"] and old["fingerprint"] != record["fingerprint"]:
            raise UserError(f"--resume: teacher {src!r} holds different weights than the teacher {run_dir} started "
                            f"with ({old.get('teacher', '?')}, fingerprint {old['fingerprint'][:19]}... != "
                            f"{record['fingerprint'][:19]}...); pass that teacher, or --overwrite to start over")
        return record["teacher"]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{RUN_TEACHER}.{os.getpid()}.tmp")  # every process of a launch writes the same record
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)
    return record["teacher"]


@contextlib.contextmanager
def attention_implementation(name: str, *models: nn.Module):
    """The models run transformers' attention implementation `name` inside the block and their own after it (a
    model trained or scored meanwhile is saved with the implementation it was loaded with)."""
    before = [m.config._attn_implementation for m in models]
    for m in models:
        m.set_attn_implementation(name)
    try:
        yield
    finally:
        for m, b in zip(models, before):
            m.set_attn_implementation(b)


def base_model(model: nn.Module) -> nn.Module:
    """Unwrap DDP/DeepSpeed (`.module`) and PEFT (`get_base_model`)."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    m = base_model(model)
    for path in ("model.layers", "model.model.layers", "layers", "transformer.h"):
        obj = m
        try:
            for p in path.split("."):
                obj = getattr(obj, p)
        except AttributeError:
            continue
        if isinstance(obj, nn.ModuleList):
            return obj
    raise UserError(f"cannot find the decoder layers of {type(m).__name__} (expected model.layers)")


def mixer_of(attn: nn.Module | None) -> nn.Module | None:
    """The mixer of a converted attention slot (the slot itself or its `.mixer`), else None."""
    if isinstance(attn, Mixer):
        return attn
    inner = getattr(attn, "mixer", None)
    return inner if isinstance(inner, nn.Module) else None


def converted_layers(model: nn.Module) -> dict[int, nn.Module]:
    """{layer index: attention slot} for every layer whose `self_attn` is (or holds) a mixer."""
    out = {}
    for i, layer in enumerate(decoder_layers(model)):
        attn = getattr(layer, "self_attn", None)
        if mixer_of(attn) is not None:
            out[i] = attn
    return out


def _qualified(model: nn.Module, module: nn.Module) -> str:
    for name, m in model.named_modules():
        if m is module:
            return name
    raise KeyError("module not found in model")


def mixer_parameter_names(model: nn.Module, conv: dict | None = None, new_only: bool = False) -> set[str]:
    """Qualified names of the converted layers' adapter parameters (`new_only`: only those the teacher
    attention did not have). `conv` restricts to some converted layers (default: all of them)."""
    chosen = set()
    for adapter in (converted_layers(model) if conv is None else conv).values():
        prefix = _qualified(model, adapter)
        mixer = mixer_of(adapter)
        mixer_prefix = _qualified(model, mixer)
        new = set(mixer.new_parameter_names()) if new_only and hasattr(mixer, "new_parameter_names") else None
        for n, _ in adapter.named_parameters():
            full = f"{prefix}.{n}"
            if new is not None:
                if not full.startswith(mixer_prefix + ".") or full[len(mixer_prefix) + 1:] not in new:
                    continue
            chosen.add(full)
    return chosen


def lr_scales_outside_mixers(model: nn.Module, scale: float) -> dict[str, float]:
    """{name: scale} for every parameter outside the converted mixers (empty when scale == 1)."""
    if scale == 1.0:
        return {}
    mixer = mixer_parameter_names(model)
    return {n: scale for n, _ in model.named_parameters() if n not in mixer}


def select_trainable(model: nn.Module, spec: str, layers: list[int] | None = None) -> list[str]:
    """Set `requires_grad` from a spec and return the names that train.

    spec: `all` | `mixer` (every parameter of the converted layers' adapters) | `mixer_new` (mixer
    parameters the teacher attention did not have) | `lora` (LoRA weights, plus all mixer parameters;
    call after peft wrapping) | comma-separated globs over parameter names (`*mixer.router*,*norm*`)."""
    spec = (spec or "all").strip()
    names = dict(model.named_parameters())
    conv = converted_layers(model)
    if layers:
        missing = sorted(set(layers) - set(conv))
        if missing:
            raise UserError(f"layers {missing} are not converted; converted layers: {sorted(conv)}")
        conv = {i: conv[i] for i in layers}

    if spec == "all":
        chosen = set(names)
    elif spec in ("mixer", "mixer_new"):
        if not conv:
            raise UserError(f"params={spec} but the model has no converted layers")
        chosen = mixer_parameter_names(model, conv, spec == "mixer_new")
    elif spec == "lora":
        chosen = {n for n in names if "lora_" in n} | mixer_parameter_names(model, conv)
        if not any("lora_" in n for n in names):
            raise UserError("params=lora but the model has no LoRA weights (wrap it with peft first)")
    else:
        pats = [p.strip() for p in spec.split(",") if p.strip()]
        chosen = {n for n in names if any(fnmatch.fnmatch(n, p) for p in pats)}
    if not chosen:
        raise UserError(f"params={spec!r} selects no parameter; examples of names: {list(names)[:5]}")
    for n, p in names.items():
        p.requires_grad_(n in chosen)
    return sorted(chosen)


def trainable_summary(model: nn.Module) -> dict:
    """Counts of trainable and frozen parameters, and the trainable names grouped by their module type
    (written to the run folder and printed, so what trains is never implicit)."""
    total = trainable = 0
    groups: dict[str, int] = {}
    for n, p in model.named_parameters():
        total += p.numel()
        if p.requires_grad:
            trainable += p.numel()
            key = ".".join(x for x in n.split(".") if not x.isdigit())
            groups[key] = groups.get(key, 0) + p.numel()
    return {"trainable": trainable, "total": total, "fraction": trainable / max(total, 1), "groups": groups}


def apply_lora(model: nn.Module, r: int, alpha: int, dropout: float, target_modules: list[str]):
    """Wrap with peft LoRA on the given module names (softmax attention, MLPs, and the mixers' projections
    share names, so one list reaches both)."""
    from peft import LoraConfig, get_peft_model   # deferred: peft is slow to import and only LoRA runs need it

    cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules),
                     bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, cfg)
