"""`hybridize export`: a training checkpoint of stage A or B back to a plain Hugging Face folder.

A checkpoint (`<run_dir>/checkpoints/step-N/`, written by `accelerator.save_state`) holds only what the
stage prepared: the whole student (stage B), the peft-wrapped student (stage B, `params=lora`), or the
LayerAligner with the converted layers' adapters (stage A). Its weights are either

- plain accelerate: `model.safetensors` (or `pytorch_model.bin`), the unwrapped module's state dict, or
- DeepSpeed (any ZeRO stage, any number of ranks): `pytorch_model/*model_states.pt` plus the optimizer
  shards, merged into full fp32 weights with DeepSpeed's `zero_to_fp32` utilities (fp32 master weights,
  not the bf16 copies the ranks computed with); every pickle in the checkpoint is first opened with a
  weights-only loader (`check_deepspeed_pickles`), since `zero_to_fp32` unpickles freely.

Export rebuilds the module the stage trained around the run's starting student (`student` in
`<run_dir>/config.yaml`, the folder written by `hybridize convert` / a previous stage), loads the
checkpoint into it (strictly: every trained tensor must find its place), merges LoRA when present, and
writes config + safetensors + tokenizer with `save_pretrained`; the result loads with
`AutoModelForCausalLM.from_pretrained(out)` after `import hybridize`. A folder that already is a HF
checkpoint (TRL's stage C `checkpoint-N/`) is re-saved as is.

`--out` is never half-written and never loses work: the export goes to a hidden sibling folder and is
renamed into place; an existing `--out` is replaced only when it is empty, an earlier export (it holds
export.json) or `--overwrite` is given, and never when it holds the current directory, the checkpoint
or the student folder.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.nn as nn
import yaml

from hybridize.errors import UserError
from .align import LayerAligner
from .checkpoint import check_deepspeed_pickles, latest_checkpoint
from .loop import save_final
from .models import apply_lora, converted_layers, load_student, torch_dtype


# files next to a converted checkpoint that record its teacher (see models.teacher_source_of)
_REPORTS = ("conversion_report.json", "report.json", "convert_report.json")


def resolve_checkpoint(path: str | Path) -> Path:
    """`path` itself when it is a checkpoint, or the newest complete checkpoint of a run folder."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"checkpoint {path} does not exist (expected RUN_DIR/checkpoints/step-N)")
    if (path / "trainer_state.json").is_file() or (path / "config.json").is_file():
        return path
    found = latest_checkpoint(path)
    if found is None:
        raise UserError(f"{path} is neither a checkpoint (no trainer_state.json) nor a run folder with "
                        f"checkpoints/step-N inside")
    return found


def deepspeed_tag(ckpt: Path) -> str | None:
    """The DeepSpeed tag (sub-folder with `*model_states.pt`) of a checkpoint, None for plain ones."""
    tags = sorted(d.name for d in ckpt.iterdir() if d.is_dir() and any(d.glob("*model_states.pt")))
    if not tags:
        return None
    # accelerate names the first prepared model's folder `pytorch_model` (then pytorch_model_1, ...)
    return "pytorch_model" if "pytorch_model" in tags else tags[0]


def checkpoint_state_dict(ckpt: Path) -> dict[str, torch.Tensor]:
    """Full fp32-or-saved-dtype weights of the module a checkpoint holds, whatever wrote it."""
    tag = deepspeed_tag(ckpt)
    if tag is not None:
        try:
            # deferred: deepspeed is optional (DeepSpeed runs only)
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        except ImportError:
            raise UserError(f"{ckpt} is a DeepSpeed checkpoint: pip install deepspeed to export it") from None
        check_deepspeed_pickles(ckpt)  # zero_to_fp32 unpickles freely: refuse anything but plain data first
        return dict(get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag=tag))
    if (ckpt / "model.safetensors").is_file():
        from safetensors.torch import load_file
        return load_file(str(ckpt / "model.safetensors"))
    if (ckpt / "pytorch_model.bin").is_file():
        return torch.load(ckpt / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise UserError(f"no model weights in {ckpt} (expected model.safetensors or a DeepSpeed pytorch_model/ folder)")


def _run_config(ckpt: Path) -> dict:
    cfg_file = ckpt.parent.parent / "config.yaml"
    if not cfg_file.is_file():
        raise UserError(f"{cfg_file} not found: export needs the run's config.yaml next to checkpoints/")
    return yaml.safe_load(cfg_file.read_text()) or {}


def _stage(cfg: dict) -> str:
    if "kl_weight" in cfg:
        return "e2e"
    if "layers_per_step" in cfg:
        return "align"
    raise UserError("the run's config.yaml is neither stage A (align) nor stage B (e2e); stage C (sft) "
                    "checkpoints are HF folders: load them directly")


def load_into(module: nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    """Strict load, except tensors tied to another one (e.g. lm_head to the embeddings) may be absent."""
    own = module.state_dict()
    unexpected = sorted(set(state) - set(own))
    if unexpected:
        raise UserError(f"the checkpoint does not fit the {what}: unexpected tensors {unexpected[:4]}... "
                        f"(wrong --student?)")
    missing = sorted(set(own) - set(state))
    ptrs = {own[k].data_ptr() for k in state if k in own}
    untied = [k for k in missing if own[k].data_ptr() not in ptrs]
    if untied:
        raise UserError(f"the checkpoint lacks tensors of the {what}: {untied[:4]}... (wrong --student?)")
    for k, v in state.items():
        if own[k].shape != v.shape:
            raise UserError(f"{k}: checkpoint shape {tuple(v.shape)} != model shape {tuple(own[k].shape)}")
    module.load_state_dict(state, strict=False)


def rebuild_trained(student: nn.Module, cfg: dict, stage: str) -> tuple[nn.Module, nn.Module]:
    """(module the stage prepared, model to save) around a freshly loaded student."""
    if stage == "align":
        conv = converted_layers(student)
        layers = sorted(int(i) for i in cfg.get("layers") or []) or sorted(conv)
        return LayerAligner({i: conv[i] for i in layers}, cfg.get("loss", "nmse")), student
    if cfg.get("params") == "lora":
        lora = cfg.get("lora") or {}
        wrapped = apply_lora(student, lora.get("r", 16), lora.get("alpha", 32), lora.get("dropout", 0.0),
                             lora.get("target_modules", ["q_proj", "k_proj", "v_proj", "o_proj"]))
        return wrapped, wrapped
    return student, student


def _inside(path: Path, folder: Path) -> bool:
    """`path` is `folder` or lies somewhere below it (both resolved)."""
    return path == folder or folder in path.parents


def is_export(path: Path) -> bool:
    """A folder written by `hybridize export` (its export.json names the checkpoint it came from)."""
    try:
        return "checkpoint" in json.loads((path / "export.json").read_text())
    except (OSError, ValueError, TypeError):
        return False


def check_out(out: Path, overwrite: bool, keep: dict[str, Path]) -> None:
    """Refuse an `--out` whose replacement would lose work: a file, a non-empty folder that is not an earlier
    export (unless `overwrite`), or - even with `overwrite` - a folder holding the current directory or
    one of `keep` (name -> path: the checkpoint, the student)."""
    for what, path in {"the current directory": Path.cwd(), **keep}.items():
        if path and _inside(Path(path).resolve(), out):
            raise UserError(f"--out {out} holds {what} ({path}): export into a new folder instead")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file: choose a folder")
    if out.is_dir() and any(out.iterdir()) and not is_export(out) and not overwrite:
        raise UserError(f"--out {out} already exists and is not an earlier export: pass --overwrite to replace it "
                        f"(its contents are deleted), or choose another folder")


def swap_into(staged: Path, out: Path) -> None:
    """Put the finished `staged` folder at `out` with renames only (the old `out`, if any, is moved aside
    first and deleted last), so `out` is never half-written."""
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    os.replace(staged, out)
    shutil.rmtree(old, ignore_errors=True)


def export_checkpoint(checkpoint: str | Path, out: str | Path, student: str = "", dtype: str = "",
                      overwrite: bool = False) -> Path:
    """Write a plain HF checkpoint of `checkpoint` into `out`; returns `out`.

    The export is written to a hidden sibling of `out` and renamed into place when complete. An existing
    `out` is replaced only when it is empty, an earlier export, or `overwrite` is set (see check_out)."""
    ckpt, out = resolve_checkpoint(checkpoint), Path(out).resolve()
    cfg = None if (ckpt / "config.json").is_file() else _run_config(ckpt)
    src = "" if cfg is None else (student or cfg.get("student") or "")
    check_out(out, overwrite, {"the checkpoint": ckpt.resolve(), "the student folder": src and Path(src)})
    out.parent.mkdir(parents=True, exist_ok=True)
    staged = out.with_name(f".{out.name}.export-tmp")
    shutil.rmtree(staged, ignore_errors=True)
    try:
        info = _write_export(ckpt, cfg, src, dtype, staged)
        (staged / "export.json").write_text(json.dumps({"checkpoint": str(ckpt), **info}, indent=1))
        swap_into(staged, out)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return out


def _write_export(ckpt: Path, cfg: dict | None, src: str, dtype: str, staged: Path) -> dict:
    """Rebuild the trained model of `ckpt` and save it into `staged`; returns what export.json records."""
    if cfg is None:  # already a HF checkpoint (TRL's stage C)
        model, tok = load_student(str(ckpt), dtype or "float32")
        save_final(model, tok, staged)
        _check_written(staged)
        return {"stage": "hf"}
    stage = _stage(cfg)
    if not src:
        raise UserError("the run's config.yaml names no student folder: pass --student <the folder the run started from>")
    model, tok = load_student(src, "float32")
    trained, to_save = rebuild_trained(model, cfg, stage)
    load_into(trained, checkpoint_state_dict(ckpt), f"stage {stage} module built from {src}")
    if hasattr(to_save, "merge_and_unload"):  # LoRA: fold the adapters into the weights
        to_save = to_save.merge_and_unload()
    to_save.to(torch_dtype(dtype or (cfg.get("train") or {}).get("dtype", "float32")))
    save_final(to_save, tok, staged)
    _check_written(staged)
    for name in _REPORTS:  # keep the record of the teacher next to the weights
        if (Path(src) / name).is_file():
            shutil.copy(Path(src) / name, staged / name)
    if tok is None:
        print(f"warning: {src} has no tokenizer files: the export has none either")
    return {"stage": stage, "student": str(src)}


def _check_written(staged: Path) -> None:
    if not (staged / "config.json").is_file():
        raise UserError(f"export failed: the model could not be saved (nothing written to {staged})")
