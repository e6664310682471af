"""GRPO reasoning fine-tuning (TRL GRPOTrainer) with verified math rewards and fast hybrid rollouts.

- `config`: the `hybridize grpo` settings (recipe YAML + key=value overrides)
- `data`: math prompts from local JSONL or the hub, chat template + boxed-answer instruction
- `rewards`: verified correctness (math-verify) and format rewards in TRL's reward-function form
- `trainer`: `HybridGRPOTrainer` (GRPOTrainer + fast rollouts through `hybridize.generation.fast`) and `run_grpo`
- `cli`: the `grpo` command

Imports are lazy so `hybridize --help` stays fast.
"""
from __future__ import annotations

_EXPORTS = {
    "GRPORunConfig": "hybridize.rl.config",
    "load_grpo_config": "hybridize.rl.config",
    "correctness_reward": "hybridize.rl.rewards",
    "format_reward": "hybridize.rl.rewards",
    "HybridGRPOTrainer": "hybridize.rl.trainer",
    "run_grpo": "hybridize.rl.trainer",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = list(_EXPORTS)
