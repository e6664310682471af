"""Settings of `hybridize grpo`: dataclasses with `help` metadata, filled from a YAML recipe and then from
`key=value` overrides (dotted keys reach sections: `grpo.num_generations=8`, `lora.enabled=true`).

Resolution order and loading are the distillation stages' (`hybridize.distill.config`): dataclass defaults
< recipe < overrides, unknown keys rejected with the list of known ones. The `grpo` section holds the
TRL `GRPOConfig` fields we choose defaults for; `grpo.extra` passes any other GRPOConfig field through.
Defaults follow the SSE paper's RL setting where it states one (8 samples per prompt).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hybridize.distill.config import (  # noqa: F401 (re-exported)
    _f, describe, find_recipe, load_config, load_yaml, save_config, to_dict)
from hybridize.errors import UserError, read_yaml
from hybridize.eval.math import BOXED_INSTRUCTION
from hybridize.generation.fast import CUDA_GRAPH_MODES


@dataclass
class DataArgs:
    """Math prompts: where they come from and how they are turned into chat prompts."""

    train: list = _f(["gsm8k"], "prompt sets: gsm8k | math | aime (the ../shared/data copies), generated "
                                "arithmetic (arith:train, arith:train:L1-3; plain arith is the test split), a "
                                "JSONL file with problem/answer, or a hub dataset owner/name[@config][:split]")
    limit: int = _f(0, "use at most this many prompts after shuffling and length filtering (0 = all)", min=0)
    shuffle_seed: int = _f(0, "seed of the prompt order")
    max_prompt_tokens: int = _f(512, "drop prompts longer than this many tokens (chat template included)", min=1)
    instruction: str = _f(BOXED_INSTRUCTION, "appended to every problem (on its own line)")
    system: str = _f("", "system message (empty = none)")
    chat: str = _f("auto", "use the tokenizer's chat template: auto (when it has one) | on | off")
    eval: str = _f("", "held-out prompts (same forms as train, e.g. gsm8k-test, math500, arith, arith:test:L3) "
                       "scored before and after training (empty = none)")
    eval_limit: int = _f(64, "held-out prompts scored", min=0)
    eval_max_new_tokens: int = _f(0, "generation budget of the held-out scoring (0 = grpo.max_completion_length)",
                                  min=0)


@dataclass
class RewardArgs:
    """Reward = correct * [math-verify says the boxed answer equals the reference] + format * [a boxed answer]."""

    correct: float = _f(1.0, "weight of the verified-correctness reward")
    format: float = _f(0.1, "weight of the format reward (a closed, non-empty \\boxed{} answer)")


@dataclass
class LoraArgs:
    enabled: bool = _f(False, "train LoRA adapters (peft) instead of all weights")
    r: int = _f(16, "LoRA rank", min=1)
    alpha: int = _f(32, "LoRA alpha")
    dropout: float = _f(0.0, "LoRA dropout")
    target_modules: list = _f(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                              "module names LoRA wraps (mixers keep the attention's q/k/v/o names)")
    modules_to_save: list = _f([], "modules trained in full next to the adapters (e.g. a mixer's new gates)")


@dataclass
class GRPOArgs:
    """TRL GRPOConfig fields (same names); `extra` holds any other GRPOConfig field."""

    num_generations: int = _f(8, "completions per prompt (the group; SSE paper: 8)", min=2)
    max_completion_length: int = _f(512, "generation budget per completion, tokens", min=1)
    per_device_train_batch_size: int = _f(8, "completions per device per micro-batch (a multiple of the group "
                                             "across devices and accumulation)", min=1)
    gradient_accumulation_steps: int = _f(1, "micro-batches per optimizer step", min=1)
    steps_per_generation: int = _f(0, "optimizer steps per generation batch (0 = TRL default)", min=0)
    num_iterations: int = _f(1, "PPO-style epochs per generation batch (mu)", min=1)
    learning_rate: float = _f(1e-6, "peak learning rate", min=0)
    lr_scheduler_type: str = _f("constant", "transformers scheduler name")
    warmup_steps: int = _f(0, "linear warm-up steps", min=0)
    weight_decay: float = _f(0.0, "AdamW weight decay", min=0)
    max_grad_norm: float = _f(1.0, "gradient clipping norm", min=0)
    max_steps: int = _f(100, "optimizer steps (a value <= 0 would make TRL train whole epochs instead)", min=1)
    beta: float = _f(0.0, "KL coefficient to the reference model (0 = no reference model)")
    epsilon: float = _f(0.2, "PPO clip range")
    loss_type: str = _f("", "TRL loss type (empty = TRL default)")
    scale_rewards: str = _f("group", "advantage scaling: group | batch | none")
    temperature: float = _f(1.0, "rollout sampling temperature")
    top_p: float = _f(1.0, "rollout nucleus p")
    top_k: int = _f(0, "rollout top-k (0 = off)", min=0)
    gradient_checkpointing: bool = _f(True, "recompute activations in the backward (TRL default)")
    extra: dict = _f({}, "any other GRPOConfig field, e.g. {chat_template_kwargs: {enable_thinking: false}}")


@dataclass
class GRPORunConfig:
    """`hybridize grpo`: GRPO on math prompts with verified rewards, through TRL's GRPOTrainer."""

    model: str = _f("", "model folder (a hybrid from `hybridize convert` / distill), 'default', or a hub id")
    output_dir: str = _f("runs/grpo", "run folder: checkpoint-N/, metrics.jsonl, reward.png, config.yaml, final/")
    seed: int = _f(0, "seed (TRL makes it device-specific)")
    dtype: str = _f("auto", "training dtype: auto (bfloat16 on GPU, float32 on CPU) | float32 | bfloat16")
    device: str = _f("auto", "auto | cpu | cuda")
    fast_generation: bool = _f(True, "rollouts through hybridize.generation.fast (static buffers, CUDA graphs); "
                                     "falls back to model.generate for settings it does not support")
    cuda_graphs: str = _f("auto", "CUDA graphs in the fast path: auto | on | off")
    compile_decode: str = _f("auto", "torch.compile the fast path's decode step: auto | on | off. auto turns it on "
                                     "on CUDA when the run can decode at least compile_min_decode_steps steps "
                                     "(decode_compile_choice). Measured in a GRPO run of the default's hybrid on an "
                                     "H100: rollouts 2.1x faster, 31 s of compilation once, paid back after about "
                                     "10,300 decode steps (benchmarks/RESULTS.md, \"Compiled decode in GRPO\")")
    compile_min_decode_steps: int = _f(16000, "compile_decode=auto: the fewest decode steps the run can take (generate "
                                              "calls x max_completion_length) for which compiling is worth it",
                                       min=0)
    decode_gemm: str = _f("auto", "linear layers in the fast path's decode steps: auto (per weight shape the faster "
                                  "of cuBLAS and our Triton weight-streaming GEMM, timed on first use; CUDA, "
                                  "16-bit) | torch (cuBLAS)")
    prefill_tokens: int = _f(0, "the fast path's prefill: at most this many prompt tokens (rows x prompt length) per "
                                "forward, the rows of a group loaded straight into the static buffers (less memory "
                                "for large rollout batches of long prompts); 0 = the whole batch in one forward",
                             min=0)
    save_steps: int = _f(50, "checkpoint every N optimizer steps (0 = only the final model)", min=0)
    save_total_limit: int = _f(2, "checkpoints kept", min=1)
    logging_steps: int = _f(1, "metrics line every N optimizer steps", min=1)
    threads: int = _f(0, "torch CPU threads (0 = leave as is)", min=0)
    progress: bool = _f(True, "progress bar")
    kernel_options: dict = _f({}, "kernel switches for this run, e.g. kernel_options.kernels=torch (fields and help: "
                                  "hybridize/ops/common/options.py); unset fields: the HYBRIDIZE_* environment, then "
                                  "the defaults; config.yaml records all of them")
    data: DataArgs = field(default_factory=DataArgs)
    rewards: RewardArgs = field(default_factory=RewardArgs)
    lora: LoraArgs = field(default_factory=LoraArgs)
    grpo: GRPOArgs = field(default_factory=GRPOArgs)


def load_grpo_config(recipe: str | None = None, overrides: list[str] | dict | None = None) -> GRPORunConfig:
    """Defaults < recipe (a path or a name under recipes/, e.g. `smollm2-135m/grpo`) < overrides."""
    if recipe:
        check_recipe(recipe)
    cfg = load_config(GRPORunConfig, recipe, overrides)
    # decode_gemm: FastGenConfig.gemm without "triton", which only forces the kernel for CPU interpreter tests
    for name, allowed in (("cuda_graphs", CUDA_GRAPH_MODES), ("compile_decode", ("auto", "on", "off")),
                          ("decode_gemm", ("auto", "torch"))):
        if getattr(cfg, name) not in allowed:
            raise UserError(f"{name} must be one of {' | '.join(allowed)}, got {getattr(cfg, name)!r}")
    return cfg


def decode_compile_choice(cfg: GRPORunConfig, device: str) -> tuple[str, str]:
    """The fast path's `compile` setting for this run ("on" | "off") and why. `compile_decode=auto` compiles when the
    run can pay for it: on CUDA (the compiled step runs in the CUDA graph; on the CPU it is not measured), with fast
    rollouts, and when the run's decode steps can reach `compile_min_decode_steps`. That count is an upper bound:
    TRL generates once per `steps_per_generation` x `num_iterations` micro-batches (steps_per_generation defaults to
    gradient_accumulation_steps), each call decoding at most `max_completion_length` steps (fewer when every
    completion ends early). Measured on one H100 (benchmarks/RESULTS.md, "Compiled decode in GRPO"): in a GRPO run of
    the default's 5:1 hybrid, 32 completions x 256 tokens a step, compiled rollouts took 0.68 s against 1.46 s and the
    compile 31 s once, paid back after 40 steps, about 10,300 decode steps (13,400 against the slower of two
    uncompiled baselines); 16,000 leaves a margin for early stops. The speed table agrees: 1.9-2.6 ms saved per step
    at batch 1-8 at the default's and the 1.7B shape, 8-24 s for the first compile at a batch size."""
    if cfg.compile_decode != "auto":
        return cfg.compile_decode, "set by compile_decode"
    if device != "cuda" or not cfg.fast_generation:
        return "off", "auto: compiled decode runs only on the fast path on CUDA"
    g = cfg.grpo
    per_call = (g.steps_per_generation or g.gradient_accumulation_steps) * g.num_iterations
    calls = -(-g.max_steps * g.gradient_accumulation_steps // per_call)
    steps = calls * g.max_completion_length
    if steps >= cfg.compile_min_decode_steps:
        return "on", f"auto: up to {steps:,} decode steps ({calls} generate calls) >= {cfg.compile_min_decode_steps:,}"
    return "off", f"auto: at most {steps:,} decode steps ({calls} generate calls) < {cfg.compile_min_decode_steps:,}"


def check_recipe(recipe: str) -> None:
    """A recipe that is not UTF-8 or not valid YAML stops here with one line naming its file, line and
    column (the shared loader lets the YAML parser's multi-line error escape as a stack trace)."""
    read_yaml(find_recipe(recipe), load_yaml)
