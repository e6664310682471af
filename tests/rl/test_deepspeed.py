"""GRPO and SFT under DeepSpeed ZeRO-2 / ZeRO-3 (one process, CPU, no launcher): the trainer runs the same recipe with a
DeepSpeed config (`grpo.extra={deepspeed: recipes/accelerate/ds_zero{2,3}.json}`; the GRPO args set the rank-0
environment a launcher would), rollouts still take the fast path
(TRL gathers ZeRO-3's partitioned weights for generation), and the parameters change; under ZeRO-3 the final
folders of `run_grpo` and of SFT (`train.deepspeed`) hold the whole model, not empty shards, and a GRPO run
resumes from its ZeRO-3 checkpoint.

DeepSpeed initialises torch.distributed for the whole process, so the runs happen in a subprocess (this file
run as a script), as in tests/distill/test_scale.py."""
from __future__ import annotations

import gc
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HAS_DS = importlib.util.find_spec("deepspeed") is not None


def _max_diff(a: Path, b: Path) -> float:
    """Largest absolute weight difference between two saved models (shapes must match: a ZeRO-3 save of
    ungathered shards would hold empty tensors)."""
    from safetensors.torch import load_file

    # the files, not from_pretrained: in this process transformers would rebuild models under zero.Init
    read = lambda d: {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}  # noqa: E731
    sa, sb = read(a), read(b)
    assert sa and sa.keys() == sb.keys() and all(sa[k].shape == sb[k].shape for k in sa), "saved model is incomplete"
    return max((sa[k].float() - sb[k].float()).abs().max().item() for k in sa)


def _worker(tmp: Path) -> dict:
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM

    from hybridize.rl.config import load_grpo_config
    from hybridize.rl.data import build_records, to_dataset
    from hybridize.rl.trainer import HybridGRPOTrainer, build_grpo_args
    from tests.rl.helpers import byte_tokenizer, tiny_hybrid, write_problems
    from tests.rl.test_trainer import digit_reward

    torch.set_num_threads(1)
    tiny_hybrid(tmp / "m", mixer="sse")
    write_problems(tmp / "p.jsonl")
    tok = byte_tokenizer()
    out = {}
    for stage in ("2", "3"):
        ds = str(ROOT / "recipes" / "accelerate" / f"ds_zero{stage}.json")
        cfg = load_grpo_config(None, [
            f"model={tmp / 'm'}", f"output_dir={tmp / ('run' + stage)}", f"data.train=[{tmp / 'p.jsonl'}]",
            "grpo.num_generations=4", "grpo.per_device_train_batch_size=4", "grpo.max_completion_length=10",
            "grpo.max_steps=2", "grpo.learning_rate=0.01", "progress=false", "save_steps=0",
            "grpo.extra={deepspeed: %s}" % ds])
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tmp / "m")
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        recs = build_records(cfg.data.train, tok, instruction="Put the answer in \\boxed{}.")
        args = build_grpo_args(cfg, "cpu", torch.float32, [1.0])
        trainer = HybridGRPOTrainer(model=model, reward_funcs=[digit_reward], args=args,
                                    train_dataset=to_dataset(recs), processing_class=tok)
        trainer.train()
        logs = [r for r in trainer.state.log_history if "reward" in r]
        engine = trainer.model_wrapped
        params = list(model.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            changed = [n for n, p in params if not torch.equal(p.detach(), before[n])]
        out[stage] = {"engine": type(engine).__name__, "zero_stage": engine.zero_optimization_stage(),
                      "steps": len(logs), "fast": [r.get("rollout/fast") for r in logs],
                      "changed": len(changed), "params": len(params),
                      "mixer_changed": any(".self_attn." in n and "layers.0" in n for n in changed)}
        del trainer, engine, args
        gc.collect()
    # run_grpo under ZeRO-3: the final folder holds the whole trained model (the policy's shards gathered).
    # The recipe's math rewards are 0 for a random model, so no update: final/ must equal the start.
    from hybridize.rl.trainer import run_grpo
    # the ZeRO-3 trainer above leaves transformers' ZeRO-3 flag on in this process, so the hybrid below is built
    # under zero.Init (its mixers skip their own init into empty shards; the checkpoint fills them)
    ds3 = str(ROOT / "recipes" / "accelerate" / "ds_zero3.json")
    base = [f"model={tmp / 'm'}", f"output_dir={tmp / 'grpo3'}", f"data.train=[{tmp / 'p.jsonl'}]",
            "grpo.num_generations=4", "grpo.per_device_train_batch_size=4", "grpo.max_completion_length=6",
            "progress=false", "save_steps=1", "grpo.extra={deepspeed: %s}" % ds3]
    run_grpo(load_grpo_config(None, base + ["grpo.max_steps=1"]))              # writes checkpoint-1 (ZeRO-3)
    run_grpo(load_grpo_config(None, base + ["grpo.max_steps=2"]), resume=True)  # resumes from it
    out["grpo_steps"] = [json.loads(x).get("step") for x in (tmp / "grpo3" / "metrics.jsonl").read_text().splitlines()
                         if "reward" in json.loads(x)]
    out["grpo_final_vs_start"] = _max_diff(tmp / "grpo3" / "final", tmp / "m")
    # SFT (TRL SFTTrainer) under ZeRO-3 through train.deepspeed: trains, and final/ holds the whole model
    from hybridize.distill.config import SFTStageConfig, load_config
    from hybridize.distill.sft import sft
    rows = "".join(json.dumps({"problem": f"What is {i}+{i}?", "solution": f"{2 * i}"}) + "\n" for i in range(8))
    (tmp / "t.jsonl").write_text(rows)
    cfg = load_config(SFTStageConfig, None, {
        "traces": str(tmp / "t.jsonl"), "max_length": 48, "batch_size": 2,
        "train": {"run_dir": str(tmp / "sft3"), "max_steps": 2, "save_every": 0, "lr": 1e-2, "progress": False,
                  "warmup_steps": 0, "deepspeed": ds3}})
    _, trained = sft(AutoModelForCausalLM.from_pretrained(tmp / "m"), tok, cfg)
    out["sft_zero3"] = any(hasattr(p, "ds_id") for p in trained.parameters())   # really ran partitioned
    out["sft_final_vs_start"] = _max_diff(tmp / "sft3" / "final", tmp / "m")
    from hybridize.errors import UserError
    try:
        build_grpo_args(load_grpo_config(None, ["grpo.extra={deepspeed: no/such.json}"]), "cpu", torch.float32, [1.0])
        out["bad_path"] = "no error"
    except UserError as e:
        out["bad_path"] = str(e)
    return out


@pytest.mark.skipif(not HAS_DS, reason="deepspeed is not installed (pip install deepspeed)")
def test_grpo_under_zero2_and_zero3(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, __file__, str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(lines[-1][7:])
    assert res["bad_path"].startswith("grpo.extra.deepspeed: no such DeepSpeed config"), res["bad_path"]
    assert res["grpo_steps"] == [1, 2]                  # ZeRO-3 checkpoint written and resumed
    assert res["grpo_final_vs_start"] == 0.0            # gathered, whole, and unchanged (zero rewards)
    assert res["sft_zero3"] and res["sft_final_vs_start"] > 1e-4   # SFT ran under ZeRO-3, trained, final/ whole
    for stage in ("2", "3"):
        r = res[stage]
        assert r["engine"] == "DeepSpeedEngine" and r["zero_stage"] == int(stage), r
        assert r["steps"] == 2 and r["fast"] == [1.0, 1.0], r            # fast rollouts at every step
        assert r["mixer_changed"] and r["changed"] > r["params"] // 2, r   # the update reached the weights


if __name__ == "__main__":
    print("RESULT " + json.dumps(_worker(Path(sys.argv[1]))), flush=True)
