"""Scale-out plumbing on CPU: the accelerate/DeepSpeed recipes parse, `hybridize export` turns stage A/B
checkpoints (plain and DeepSpeed ZeRO-2/3) back into HF folders with the trained weights, and a
one-process DeepSpeed ZeRO-2 / ZeRO-3 (+ gradient checkpointing, frozen parameters) stage B run on a
converted SSE hybrid takes the same steps as the plain run.

References: the in-memory trained model (export round trip), the plain accelerate run of the same data
(ZeRO runs; fp32 everywhere, so only summation-order noise is allowed). The DeepSpeed runs happen in a
subprocess (`python tests/distill/test_scale.py worker DIR`): DeepSpeed initialises torch.distributed
and accelerate's process-wide state, which must not leak into other tests. They skip without deepspeed.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes" / "accelerate"
CONFIGS = ["single_gpu", "ddp", "zero2", "zero2_offload", "zero3", "zero3_offload"]
HAS_DS = importlib.util.find_spec("deepspeed") is not None
FP32 = 1e-5  # relative tolerance of fp32 results computed in another order


def run_worker(script: str, tmp: Path, timeout: int = 300) -> dict:
    """Run `python SCRIPT worker TMP` in a fresh process (DeepSpeed initialises torch.distributed and
    accelerate's process-wide state, so each DeepSpeed test file runs its worker alone, with no launcher
    variables) and return the JSON of its last `RESULT ` line."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, script, "worker", str(tmp)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][7:])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


# ---- helpers (also used by the worker process) ------------------------------------------------------

def make_student_folder(path: Path, mixer: str = "sse") -> Path:
    """A converted tiny hybrid saved like `hybridize convert --out`, with a small fast tokenizer."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    from hybridize.convert.convert import convert_model
    from tests.distill.helpers import VOCAB, tiny_llama

    student = convert_model(tiny_llama(1), "2:1", mixer=mixer)  # layers 0, 1 converted, 2 softmax
    student.save_pretrained(path)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<pad>")),
                                  eos_token="</s>", pad_token="<pad>", bos_token="<s>")
    tok.save_pretrained(path)
    return path


def e2e_config(tmp: Path, name: str, student: Path, steps: int = 2, **over):
    from hybridize.distill.config import E2EConfig, load_config
    from tests.distill.helpers import write_texts

    data = write_texts(tmp / "texts.jsonl")
    base = {"student": str(student),
            "train": {"run_dir": str(tmp / name), "max_steps": steps, "progress": False, "save_every": 0,
                      "warmup_steps": 1, "lr": 3e-3},
            "data": {"train": str(data), "seq_len": 24, "batch_tokens": 48}}
    for k, v in over.items():
        base.setdefault(k, {}).update(v) if isinstance(v, dict) else base.__setitem__(k, v)
    return load_config(E2EConfig, None, base)


def run_e2e(cfg, resume: bool = False, stop_after: int | None = None):
    """Stage B on the saved student and the tiny teacher; returns (losses by step, trained model)."""
    from hybridize.distill.e2e import e2e
    from hybridize.distill.models import load_student
    from tests.distill.helpers import ToyTokenizer, tiny_llama

    student, _ = load_student(cfg.student)
    _, model = e2e(student, tiny_llama(0), ToyTokenizer(), cfg, resume=resume, stop_after=stop_after)
    rows = [json.loads(x) for x in (Path(cfg.train.run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}, model


def logits_of(model, seed: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 96, (2, 11), generator=g)
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits.float()


def load_hf(path: Path):
    import hybridize  # noqa: F401  (registers the hybrid model type)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


# ---- tests --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", CONFIGS)
def test_accelerate_configs_parse(name):
    """Each recipe loads with accelerate's own config reader, and its DeepSpeed file is valid JSON with
    only the keys hybridize fills itself or accelerate fills ("auto") left open."""
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = load_config_from_file(str(RECIPES / f"{name}.yaml"))
    assert cfg.compute_environment.value == "LOCAL_MACHINE"
    if "zero" not in name:
        assert cfg.distributed_type.value in ("NO", "MULTI_GPU")
        return
    assert cfg.distributed_type.value == "DEEPSPEED"
    ds_file = ROOT / cfg.deepspeed_config["deepspeed_config_file"]
    ds = json.loads(ds_file.read_text())
    assert ds["zero_optimization"]["stage"] == int(name[4])
    assert "optimizer" not in ds and "scheduler" not in ds  # ours come from train.*
    offload = ds["zero_optimization"].get("offload_optimizer", {}).get("device")
    assert (offload == "cpu") == name.endswith("offload")
    assert not cfg.deepspeed_config.get("zero3_init_flag", False)  # the teacher must load whole, see README


def test_export_round_trip_stage_b(tmp_path):
    """Train 2 steps (params=mixer: frozen tensors must come back too), export the final checkpoint,
    reload it with AutoModelForCausalLM: same logits as the model in memory, and != the start."""
    from hybridize.cli import app
    from typer.testing import CliRunner

    folder = make_student_folder(tmp_path / "student")
    cfg = e2e_config(tmp_path, "b", folder, params="mixer")
    _, trained = run_e2e(cfg)
    res = CliRunner().invoke(app, ["export", "--checkpoint", str(tmp_path / "b" / "checkpoints" / "step-000002"),
                                   "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "out" / "tokenizer.json").is_file() and (tmp_path / "out" / "model.safetensors").is_file()
    back = load_hf(tmp_path / "out")
    ref = logits_of(trained)
    assert _rel(logits_of(back), ref) < FP32
    assert _rel(logits_of(load_hf(folder)), ref) > 1e-4  # training moved the weights: the test can fail


def test_export_round_trip_stage_a_and_lora(tmp_path):
    """Stage A checkpoints hold only the LayerAligner's adapters, LoRA runs the peft wrapper: export
    puts both back into the full model (LoRA merged)."""
    from hybridize.distill.align import align
    from hybridize.distill.config import AlignConfig, load_config
    from hybridize.distill.export import export_checkpoint
    from hybridize.distill.models import load_student
    from tests.distill.helpers import ToyTokenizer, tiny_llama, write_texts

    folder = make_student_folder(tmp_path / "student")
    data = write_texts(tmp_path / "texts.jsonl")
    cfg = load_config(AlignConfig, None, {
        "student": str(folder), "train": {"run_dir": str(tmp_path / "a"), "max_steps": 2, "progress": False,
                                          "save_every": 0, "warmup_steps": 1, "lr": 3e-3},
        "data": {"train": str(data), "seq_len": 24, "batch_tokens": 48}})
    student, _ = load_student(str(folder))
    align(student, tiny_llama(0), ToyTokenizer(), cfg)
    out = export_checkpoint(tmp_path / "a", tmp_path / "out_a")  # a run folder: its newest checkpoint
    assert _rel(logits_of(load_hf(out)), logits_of(student)) < FP32

    cfg = e2e_config(tmp_path, "lora", folder, params="lora", lora={"r": 4, "alpha": 8})
    _, merged = run_e2e(cfg)
    out = export_checkpoint(tmp_path / "lora" / "checkpoints" / "step-000002", tmp_path / "out_l")
    back = load_hf(out)
    assert not any("lora_A" in n or "base_layer" in n for n, _ in back.named_parameters())  # peft merged away
    assert _rel(logits_of(back), logits_of(merged)) < FP32


def test_export_errors(tmp_path):
    from hybridize.distill.export import export_checkpoint
    from hybridize.errors import UserError

    with pytest.raises(UserError, match="does not exist"):
        export_checkpoint(tmp_path / "nope", tmp_path / "out")
    (tmp_path / "run").mkdir()
    with pytest.raises(UserError, match="neither a checkpoint"):
        export_checkpoint(tmp_path / "run", tmp_path / "out")


@pytest.mark.skipif(not HAS_DS, reason="deepspeed is not installed (pip install deepspeed)")
def test_deepspeed_zero2_zero3_single_process(tmp_path):
    """One-process DeepSpeed runs (train.deepspeed=ds_zero{2,3}.json) of stage B on a converted SSE hybrid:
    ZeRO-2 with params=all, ZeRO-3 with params=mixer (frozen, partitioned tensors), gradient
    checkpointing, 2 micro-batches per step and the long-context stage's growing rows (seq_len_schedule). Losses of every step equal the plain run's within fp32
    noise; a run stopped after step 1 and resumed repeats the uninterrupted one; the final/ folder
    (ZeRO-3 shards gathered) and `export` of the DeepSpeed checkpoint (zero_to_fp32) give the same model."""
    res = run_worker(__file__, tmp_path)
    for stage in ("2", "3"):
        plain, ds = res[f"plain{stage}"], res[f"zero{stage}"]
        assert sorted(ds) == sorted(plain) == ["1", "2", "3"]
        for step in plain:
            assert abs(ds[step] - plain[step]) <= FP32 * abs(plain[step]), (stage, step, ds, plain)
        assert res[f"resume{stage}"] == ds, (stage, res[f"resume{stage}"], ds)  # same steps after a resume
        assert res[f"export_vs_final{stage}"] < FP32
        assert res[f"final_vs_plain{stage}"] < 1e-4  # 3 AdamW steps from the same start, fp32
        assert res[f"export_vs_start{stage}"] > 1e-4


def _worker(tmp: Path) -> None:
    """Runs in a fresh process: plain and DeepSpeed stage B runs, exports; prints one RESULT line."""
    import deepspeed.comm.torch as ds_comm

    from hybridize.distill.export import export_checkpoint
    # the shared-memory all-reduce op is for several CPU ranks; building it takes ~1.5 min on first use
    ds_comm.build_shm_op = lambda: None
    from accelerate.state import AcceleratorState

    torch.set_num_threads(1)
    folder = make_student_folder(tmp / "student")
    res = {}
    for stage, over in (("2", {"params": "all"}),
                        # the long-context stage's mechanism: rows grow from 24 to 48 tokens at step 3 (and the
                        # resume after step 1 crosses that change)
                        ("3", {"params": "mixer", "gradient_checkpointing": True, "train": {"grad_accum": 2},
                               "data": {"seq_len_schedule": [[0, 24], [2, 48]]}})):
        plain, _ = run_e2e(e2e_config(tmp, f"plain{stage}", folder, steps=3, **over))
        AcceleratorState._reset_state(True)
        train = {**over.pop("train", {}), "deepspeed": str(RECIPES / f"ds_zero{stage}.json")}
        ds_cfg = e2e_config(tmp, f"zero{stage}", folder, steps=3, train=train, **over)
        ds, _ = run_e2e(ds_cfg)
        AcceleratorState._reset_state(True)
        # killed after step 1 (checkpoint), resumed: the DeepSpeed state comes back exactly
        re_cfg = e2e_config(tmp, f"resume{stage}", folder, steps=3, train=dict(train), **over)
        run_e2e(re_cfg, stop_after=1)
        AcceleratorState._reset_state(True)
        resumed, _ = run_e2e(re_cfg, resume=True)
        AcceleratorState._reset_state(True)
        res[f"resume{stage}"] = resumed
        out = export_checkpoint(tmp / f"zero{stage}", tmp / f"export{stage}")
        exported, final = logits_of(load_hf(out)), logits_of(load_hf(tmp / f"zero{stage}" / "final"))
        plain_final = logits_of(load_hf(tmp / f"plain{stage}" / "final"))
        res.update({f"plain{stage}": plain, f"zero{stage}": ds, f"export_vs_final{stage}": _rel(exported, final),
                    f"final_vs_plain{stage}": _rel(final, plain_final),
                    f"export_vs_start{stage}": _rel(exported, logits_of(load_hf(folder)))})
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "worker":
    _worker(Path(sys.argv[2]))
