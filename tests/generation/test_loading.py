"""`hybridize.generation.loading`: the one dtype table and the one model loader every stage calls.

- dtype names: every alias maps to its torch dtype, "auto"/None mean "chosen by device", an unknown name
  is one line listing the accepted names; distill's `torch_dtype` and convert's `--dtype` read the same table;
- `load_model`: an already-loaded `(model, tokenizer)` pair comes back as is; a local folder loads in
  the asked dtype, in eval mode, with its tokenizer; a folder saved without a tokenizer is one line
  (`need_tokenizer=True`, what eval wants) or `(model, None)` (what convert, distill and GRPO handle).
Tiny random Llama on CPU.
"""
from __future__ import annotations

import pytest
import torch

from hybridize.convert import cli as convert_cli
from hybridize.distill import models as distill_models
from hybridize.generation.loading import DTYPES, load_model, resolve_device, resolve_dtype
from tests.rl.helpers import byte_tokenizer, tiny_teacher


def test_dtype_names():
    assert resolve_dtype("bf16") is torch.bfloat16 and resolve_dtype("float32") is torch.float32
    assert resolve_dtype("auto") is None and resolve_dtype(None) is None
    assert resolve_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError, match="unknown dtype 'fp8'; use one of float32, fp32, .*, auto"):
        resolve_dtype("fp8")
    assert distill_models.DTYPES is DTYPES and convert_cli.DTYPES is DTYPES
    assert distill_models.torch_dtype("fp16") is torch.float16
    assert convert_cli._torch_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="choose one of float32, bfloat16, float16"):
        convert_cli._torch_dtype("fp32")   # convert's --dtype takes the three long names only
    assert resolve_device("cpu") == "cpu"


def test_pair_passes_through():
    pair = (object(), object())
    assert load_model(pair) is pair


def test_local_folder(tmp_path):
    teacher = tiny_teacher()
    teacher.save_pretrained(tmp_path / "bare")
    teacher.save_pretrained(tmp_path / "full")
    byte_tokenizer().save_pretrained(tmp_path / "full")

    model, tok = load_model(str(tmp_path / "full"), dtype="bf16", device="cpu")
    assert tok is not None and not model.training
    assert next(model.parameters()).dtype is torch.bfloat16

    with pytest.raises(ValueError, match="no tokenizer found"):
        load_model(str(tmp_path / "bare"), dtype="float32", device="cpu")
    model, tok = load_model(str(tmp_path / "bare"), dtype=torch.float32, device="cpu", need_tokenizer=False)
    assert tok is None and next(model.parameters()).dtype is torch.float32
