"""One model loader and one dtype table for every stage: `load_model(src, dtype, device) -> (model, tokenizer)`.

Where a model comes from (the embedded SmolLM2 default, a .gguf file, a local Hugging Face or hybrid
checkpoint folder, a hub id, an alias or a family name) is decided by `hybridize.convert.sources`, which
also dequantises and caches the GGUF default; this module adds what the stages share on top of it:
dtype names (`DTYPES`, plus "auto": bf16 on a GPU, fp32 on CPU), device "auto" (CUDA when present),
an already-loaded `(model, tokenizer)` pair passed through unchanged (what the tests hand in), eval mode,
and the check that a tokenizer came with the model.
"""
from __future__ import annotations

import torch

from hybridize.convert import sources

#: dtype names accepted by every command (`--dtype`, recipe `dtype=`) -> torch dtypes
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64}


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """A name of `DTYPES` -> its torch dtype; a torch dtype or None as is; "auto" -> None (chosen by device)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return None
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}, auto")
    return DTYPES[dtype]


def resolve_device(device: str | torch.device | None) -> str | torch.device:
    """None or "auto" -> "cuda" when a GPU is present, else "cpu"; anything else as is."""
    if device is None or device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def model_device(model) -> torch.device:
    """The device of the model's first parameter (where its inputs go)."""
    return next(model.parameters()).device


def load_model(src, dtype: str | torch.dtype | None = "float32", device: str | torch.device | None = "auto", *,
               need_tokenizer: bool = True):
    """Return `(model, tokenizer)`, the model in eval mode on `device` in `dtype`.

    `src`: an already-loaded `(model, tokenizer)` pair (returned as is) or anything
    `hybridize.convert.sources.load_model` understands ("default", a .gguf file, a local folder, a hub id,
    an alias, a family name). `dtype`: a torch dtype, a name of `DTYPES` or "auto" (bf16 on CUDA, else fp32).
    With `need_tokenizer` a model saved without a tokenizer is an error (one line); otherwise the
    tokenizer may be None."""
    if isinstance(src, tuple) and len(src) == 2:
        return src
    device = resolve_device(device)
    dt = resolve_dtype(dtype)
    if dt is None:
        dt = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    model, tok = sources.load_model(str(src), dtype=dt, device=device)   # looked up per call (tests patch it)
    if tok is None and need_tokenizer:
        raise ValueError(f"{src}: no tokenizer found next to the model; save one into the checkpoint folder")
    model.eval()
    return model, tok


__all__ = ["DTYPES", "resolve_dtype", "resolve_device", "model_device", "load_model"]
