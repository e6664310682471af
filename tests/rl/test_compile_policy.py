"""The GRPO run's compiled-decode policy (`compile_decode=auto`, rl/config.decode_compile_choice): on only on CUDA
with fast rollouts and when the run's decode steps can pay for the compile; explicit settings kept."""
from __future__ import annotations

import pytest

from hybridize.rl.config import decode_compile_choice, load_grpo_config


def cfg(*overrides):
    return load_grpo_config("smollm2-135m/grpo", list(overrides))


def test_auto_is_the_default_and_the_recipe_run_compiles_on_cuda_only():
    c = cfg()
    assert c.compile_decode == "auto"
    mode, why = decode_compile_choice(c, "cuda")   # 100 steps x 256 tokens = 25,600 decode steps at most
    assert mode == "on" and "25,600" in why and "100 generate calls" in why
    assert decode_compile_choice(c, "cpu")[0] == "off"
    assert decode_compile_choice(cfg("fast_generation=false"), "cuda")[0] == "off"


@pytest.mark.parametrize("overrides, steps, mode", [
    (["grpo.max_steps=10"], 2_560, "off"),                                   # a short run: not worth compiling
    (["grpo.max_steps=62"], 15_872, "off"),                                  # just under the threshold
    (["grpo.max_steps=63"], 16_128, "on"),
    (["grpo.num_iterations=2"], 12_800, "off"),                             # one generate call per 2 passes
    (["grpo.gradient_accumulation_steps=4"], 25_600, "on"),                  # steps_per_generation follows it
    (["grpo.gradient_accumulation_steps=4", "grpo.steps_per_generation=1"], 102_400, "on"),
    (["grpo.max_steps=10", "compile_min_decode_steps=2000"], 2_560, "on"),
])
def test_auto_counts_the_generate_calls(overrides, steps, mode):
    got, why = decode_compile_choice(cfg(*overrides), "cuda")
    assert got == mode and f"{steps:,} decode steps" in why


def test_explicit_settings_are_kept_everywhere():
    for mode in ("on", "off"):
        for device in ("cpu", "cuda"):
            assert decode_compile_choice(cfg(f"compile_decode={mode}", "grpo.max_steps=1"), device)[0] == mode


def test_the_benchmarks_break_even_is_the_first_steps_extra_over_the_saving():
    from benchmarks.generation.grpo_compile import break_even

    rows = [{"mode": "off", "first_rollout_s": 90.0, "median_rollout_s": 1.0},   # the warm-up run (autotuning)
            {"mode": "on", "first_rollout_s": 14.0, "median_rollout_s": 0.5},
            {"mode": "off", "first_rollout_s": 2.2, "median_rollout_s": 1.1}]
    got = break_even(rows, tokens=256)   # extra 14 - 2.2 = 11.8 s, saving 1.1 - 0.5 = 0.6 s per step
    assert got == {"extra_first_step_s": 11.8, "saving_per_step_s": 0.6, "steps": 19.7, "decode_steps": 5035}
    rows[1]["median_rollout_s"] = 1.3   # compiled steps no faster: never pays back
    assert break_even(rows, 256)["steps"] is None
    assert break_even(rows[:2], 256) is None   # no uncompiled run after the compiled one
