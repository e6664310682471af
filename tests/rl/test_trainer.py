"""GRPO through TRL on a tiny hybrid on CPU: rewards computed, parameters change, fast rollouts used,
checkpoints + resume, metrics JSONL + reward PNG, LoRA."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridize.errors import UserError
from hybridize.rl.config import load_grpo_config
from hybridize.rl.data import build_records, to_dataset
from hybridize.rl.rewards import correctness_reward, format_reward
from hybridize.rl.trainer import HybridGRPOTrainer, build_grpo_args, read_metrics, run_grpo
from tests.rl.helpers import tiny_hybrid, write_problems


def digit_reward(completions, **kwargs) -> list[float]:
    """A dense toy reward (share of digits) so that a random model's group has non-zero advantages."""
    from hybridize.rl.rewards import completion_text

    texts = [completion_text(c) for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(1, len(t)) for t in texts]


def _cfg(tmp_path, *extra):
    return load_grpo_config(None, [
        f"model={tmp_path / 'm'}", f"output_dir={tmp_path / 'run'}", f"data.train=[{tmp_path / 'p.jsonl'}]",
        "grpo.num_generations=4", "grpo.per_device_train_batch_size=4", "grpo.max_completion_length=10",
        "grpo.max_steps=2", "grpo.learning_rate=0.01", "progress=false", "save_steps=1", *extra])


@pytest.fixture
def setup(tmp_path):
    tiny_hybrid(tmp_path / "m", mixer="gla")
    write_problems(tmp_path / "p.jsonl")
    return tmp_path


def test_two_grpo_steps_change_parameters(setup):
    tmp_path = setup
    cfg = _cfg(tmp_path, "grpo.beta=0.04")   # beta > 0: TRL reloads the reference from the saved hybrid
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    from tests.rl.helpers import byte_tokenizer

    tok = byte_tokenizer()
    recs = build_records(cfg.data.train, tok, instruction="Put the answer in \\boxed{}.")
    args = build_grpo_args(cfg, "cpu", torch.float32, [1.0, 0.1, 1.0])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = HybridGRPOTrainer(model=model, reward_funcs=[correctness_reward, format_reward, digit_reward],
                                args=args, train_dataset=to_dataset(recs), processing_class=tok)
    trainer.train()
    logs = [r for r in trainer.state.log_history if "reward" in r]
    assert len(logs) == 2
    for r in logs:
        assert "rewards/correctness_reward/mean" in r and "rewards/format_reward/mean" in r
        assert r["rollout/fast"] == 1.0 and r["rollout/tokens_per_s"] > 0
    assert trainer.ref_model is not None
    changed = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert any(".self_attn." in n and "layers.0" in n for n in changed), changed   # a mixer layer trained
    assert len(changed) > len(before) // 2


def test_run_grpo_checkpoints_resume_and_outputs(setup):
    tmp_path = setup
    cfg = _cfg(tmp_path, f"data.eval={tmp_path / 'p.jsonl'}", "data.eval_limit=4")
    s = run_grpo(cfg)
    run = tmp_path / "run"
    assert s["steps"] == 2 and (run / "checkpoint-2").is_dir() and (run / "reward.png").is_file()
    assert {"before", "after"} <= set(s["scores"]) and s["reward_first"] is not None
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if "reward" in r] == [1, 2]
    with pytest.raises(UserError, match="already holds checkpoints"):
        run_grpo(cfg)
    cfg3 = _cfg(tmp_path, f"data.eval={tmp_path / 'p.jsonl'}", "data.eval_limit=4", "grpo.max_steps=3")
    s3 = run_grpo(cfg3, resume=True)
    assert s3["steps"] == 3
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if "reward" in r] == [1, 2, 3]
    kept = json.loads((run / "scores.json").read_text())["before"]   # not recomputed on resume
    assert kept["correct"] == s["scores"]["before"]["correct"] and kept["n"] == 4
    reloaded = AutoModelForCausalLM.from_pretrained(run / "final")
    assert type(reloaded).__name__ == "HybridForCausalLM"


def test_lora_run(setup):
    tmp_path = setup
    s = run_grpo(_cfg(tmp_path, "lora.enabled=true", "lora.r=2", "grpo.max_steps=1", "save_steps=0"))
    assert s["steps"] == 1
    assert (tmp_path / "run" / "final" / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "run" / "final" / "config.json").is_file()   # merged model


def test_resume_without_checkpoint_is_one_line_error(setup):
    with pytest.raises(UserError, match="no checkpoint-N"):
        run_grpo(_cfg(setup), resume=True)


def test_fast_path_settings_reach_the_generator(setup, monkeypatch):
    """cuda_graphs / compile_decode / decode_gemm / prefill_tokens from the run config are what the trainer's
    generator gets."""
    import hybridize.rl.trainer as tr

    class Built(Exception):
        pass

    seen = []

    def record(**kw):
        seen.append(kw)
        raise Built

    monkeypatch.setattr(tr, "FastGenConfig", record)
    with pytest.raises(Built):
        run_grpo(_cfg(setup, "decode_gemm=torch", "compile_decode=on", "cuda_graphs=off", "prefill_tokens=4096",
                      "data.eval="))
    assert seen == [dict(cuda_graphs="off", compile="on", gemm="torch", prefill_tokens=4096)]
    with pytest.raises(Built):   # compile_decode=auto, the default, is off on the CPU
        run_grpo(_cfg(setup, "data.eval="))
    assert seen[-1]["compile"] == "off"
