"""Issue 29: `hybridize distill sft` and `hybridize grpo` `--resume` under DeepSpeed never unpickle code. They
resume through the HF Trainer (`trainer.train(resume_from_checkpoint=...)`), whose DeepSpeed path calls
`engine.load_checkpoint` (`torch.load(weights_only=False)`) on `checkpoint-N/latest` + `global_step*/`, so
`checkpoint.check_trainer_resume` runs `check_deepspeed_pickles` on that folder first, skipping only
`training_args.bin` (a pickled TrainingArguments that no resume reads).

One subprocess (`python tests/distill/test_trainer_safe_resume.py worker DIR`; DeepSpeed initialises
torch.distributed for the whole process, see test_scale.py) runs a one-process ZeRO-2 SFT (TRL SFTTrainer)
and GRPO (TRL GRPOTrainer) on a tiny hybrid for one step, resumes each for a second, then plants a pickle whose
unpickling creates a marker file - in the checkpoint's DeepSpeed model states, and in a tag folder outside the
checkpoint that `latest` names - and resumes again. A control run with the check switched off shows the
Trainer's DeepSpeed resume does unpickle that payload (the refusal tests fail without the check).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from tests.distill.test_scale import HAS_DS, RECIPES, run_worker

STATES = "mp_rank_00_model_states.pt"
REMEDY = {"sft": "delete that checkpoint (or start the run over with --overwrite)",
          "grpo": "delete that checkpoint folder (or start over in another output_dir=)"}
pytestmark = pytest.mark.skipif(not HAS_DS, reason="deepspeed is not installed (pip install deepspeed)")


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    return run_worker(__file__, tmp_path_factory.mktemp("trainer_safe"), timeout=600)


@pytest.mark.parametrize("kind", ["sft", "grpo"])
def test_real_checkpoint_with_training_args_resumes(res, kind):
    """A real ZeRO-2 Trainer checkpoint (training_args.bin included) passes the check and resumes; without the
    skip, training_args.bin alone would be refused (it pickles a TrainingArguments)."""
    r = res[kind]
    assert r["payload_is_live"]
    assert r["steps"] == [1, 2], r
    assert "training_args.bin" in r["files"] and "latest" in r["files"], r["files"]
    assert r["deepspeed_unpickled"] == ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    assert r["unskipped"].startswith(f"refusing to load {r['checkpoint']}/training_args.bin: "), r["unskipped"]


@pytest.mark.parametrize("kind", ["sft", "grpo"])
@pytest.mark.parametrize("where", ["states", "latest_outside"])
def test_pickled_payload_is_refused_before_deepspeed_loads(res, kind, where):
    out, r = res[kind][where], res[kind]
    msg = out["error"]
    bad = f"{r['checkpoint']}/global_step2/{STATES}" if where == "states" else f"{out['outside']}/{STATES}"
    assert out["type"] == "UserError" and "\n" not in msg, out
    assert msg.startswith(f"refusing to load {bad}: it holds pickled objects other than tensors and plain data "
                          "(it builds io.open)"), msg
    assert msg.endswith(REMEDY[kind]), msg
    assert not out["marker"]  # the payload never ran
    assert out["loaded"] is False  # and DeepSpeed's loader never opened the checkpoint


@pytest.mark.parametrize("kind", ["sft", "grpo"])
def test_without_the_check_the_trainer_runs_the_payload(res, kind):
    """Control: with `check_trainer_resume` switched off, the Trainer's DeepSpeed resume unpickles the planted
    model states freely and the payload runs (so the refusal test above fails without the check)."""
    out = res[kind]["unchecked"]
    assert out["marker"] and out["loaded"], out


def _worker(tmp: Path) -> None:
    import deepspeed.comm.torch as ds_comm
    from transformers import AutoModelForCausalLM

    import hybridize.distill.sft as sft_mod
    import hybridize.rl.trainer as rl_mod
    from hybridize.distill.checkpoint import check_deepspeed_pickles
    from hybridize.distill.config import SFTStageConfig, load_config
    from hybridize.errors import UserError
    from hybridize.rl.config import load_grpo_config
    from tests.distill.test_lost_work import plant_payload, spy_free_unpickles
    from tests.rl.helpers import byte_tokenizer, tiny_hybrid, write_problems

    ds_comm.build_shm_op = lambda: None  # see test_scale._worker
    torch.set_num_threads(1)
    opened, _ = spy_free_unpickles()  # every file unpickled freely (DeepSpeed's loader)

    marker, live = plant_payload(tmp)

    tiny_hybrid(tmp / "m", mixer="sse")
    tok = byte_tokenizer()
    ds = str(RECIPES / "ds_zero2.json")
    (tmp / "t.jsonl").write_text("".join(json.dumps({"problem": f"What is {i}+{i}?", "solution": f"{2 * i}"}) + "\n"
                                         for i in range(8)))
    write_problems(tmp / "p.jsonl")

    def run_sft(steps, resume):
        cfg = load_config(SFTStageConfig, None, {
            "traces": str(tmp / "t.jsonl"), "max_length": 48, "batch_size": 2,
            "train": {"run_dir": str(tmp / "sft"), "max_steps": steps, "save_every": 1, "lr": 1e-2,
                      "progress": False, "warmup_steps": 0, "deepspeed": ds}})
        sft_mod.sft(AutoModelForCausalLM.from_pretrained(tmp / "m"), tok, cfg, resume=resume)

    def run_grpo(steps, resume):
        rl_mod.run_grpo(load_grpo_config(None, [
            f"model={tmp / 'm'}", f"output_dir={tmp / 'grpo'}", f"data.train=[{tmp / 'p.jsonl'}]",
            "grpo.num_generations=4", "grpo.per_device_train_batch_size=4", "grpo.max_completion_length=6",
            "progress=false", "save_steps=1", f"grpo.max_steps={steps}", "grpo.extra={deepspeed: %s}" % ds]),
            resume=resume)

    def attempt(fn):
        opened.clear()
        try:
            fn()
            out = {"type": "none", "error": ""}
        except Exception as e:  # noqa: BLE001 - the test reports what came out
            out = {"type": type(e).__name__, "error": str(e)}
        out.update(marker=marker.exists(), loaded=bool(opened))
        marker.unlink(missing_ok=True)
        return out

    kinds = (("sft", run_sft, tmp / "sft" / "checkpoints", sft_mod), ("grpo", run_grpo, tmp / "grpo", rl_mod))
    res = {}
    for kind, run, run_dir, _ in kinds:
        r = res[kind] = {"payload_is_live": live}
        run(1, False)  # writes checkpoint-1 (ZeRO-2)
        opened.clear()
        run(2, True)   # resumes from it: the check accepts a real checkpoint, training_args.bin included
        r["deepspeed_unpickled"] = sorted({Path(f).name for f in opened})
        rows = [json.loads(x) for x in (tmp / kind / "metrics.jsonl").read_text().splitlines()]
        r["steps"] = sorted({x["step"] for x in rows if "loss" in x or "reward" in x})
        ckpt = run_dir / "checkpoint-2"
        r["checkpoint"], r["files"] = str(ckpt), sorted(p.name for p in ckpt.iterdir())
        try:
            check_deepspeed_pickles(ckpt)  # no skip
            r["unskipped"] = "accepted"
        except UserError as e:
            r["unskipped"] = str(e)

        states = ckpt / "global_step2" / STATES
        original = states.read_bytes()
        shutil.copy(tmp / "payload.pt", states)
        r["states"] = attempt(lambda: run(3, True))
        states.write_bytes(original)

        outside = tmp / f"{kind}_elsewhere" / "global_step2"  # `latest` names a tag folder outside checkpoint-2
        shutil.copytree(ckpt / "global_step2", outside)
        shutil.copy(tmp / "payload.pt", outside / STATES)
        latest = (ckpt / "latest").read_text()
        (ckpt / "latest").write_text(os.path.relpath(outside, ckpt))
        r["latest_outside"] = {**attempt(lambda: run(3, True)), "outside": os.path.realpath(outside)}
        (ckpt / "latest").write_text(latest)

    for kind, run, run_dir, module in kinds:  # last: a payload that ran may leave DeepSpeed half-loaded
        states = run_dir / "checkpoint-2" / "global_step2" / STATES
        shutil.copy(tmp / "payload.pt", states)
        module.check_trainer_resume = lambda *a, **k: None  # the check switched off
        res[kind]["unchecked"] = attempt(lambda: run(3, True))
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "worker":
    _worker(Path(sys.argv[2]))
