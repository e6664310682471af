"""GRPO on math prompts with TRL's GRPOTrainer, plus fast rollouts for hybrids and run bookkeeping.

GRPO itself is TRL's (group-relative advantages, clipped ratio loss, optional KL to a reference). This
module adds:
- `HybridGRPOTrainer`: GRPOTrainer whose transformers-generate rollouts go through
  `hybridize.generation.fast` (static buffers, CUDA graphs; same tokens as `model.generate`), which
  logs rollout throughput (`rollout/tokens_per_s`, `rollout/seconds`, `rollout/fast`), and which stops on a
  non-finite loss, gradient or weight with one line and saves nothing from that state
  (`hybridize.distill.trainer_guard`);
- `run_grpo(cfg)`: model + tokenizer loading (`hybridize.generation.loading.load_model`: a hybrid folder,
  "default", a hub id), prompt dataset, reward functions, LoRA (peft) or full training, checkpoints
  (`checkpoint-N/`, TRL/Trainer format) and `--resume`, `metrics.jsonl` + `reward.png`, held-out
  scoring before and after (`scores.json`), the final model in `final/`; every reward function goes through
  `rewards.guard_reward` (a reward that fails on a whole call stops the run with one line naming the reward,
  the step and the last checkpoint to `--resume` from).

TRL facts this relies on: rollouts call `model.generate` on left-padded prompts
inside `unwrap_model_for_generation` (gradient checkpointing off there); with beta > 0 and no PEFT the
reference model is `from_pretrained(config._name_or_path)`, so the policy must be a saved checkpoint
whose class transformers can find: `_expose_model_class` makes `transformers.HybridForCausalLM`
resolvable (TRL looks the architecture up by name in the `transformers` namespace), and
`_ensure_reloadable` saves an in-memory model before training when needed.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from hybridize.distill.checkpoint import check_trainer_resume, latest_checkpoint
from hybridize.distill.loop import check_deepspeed_file, deepspeed_engine, zero3_gathered
from hybridize.distill.trainer_guard import GuardedTrainerMixin
from hybridize.errors import UserError
from hybridize.generation.fast import FastGenConfig, FastGenerator, fast_generate_installed, find_generator_model
from hybridize.generation.loading import load_model
from hybridize.ops.common.options import with_run_kernel_options
from hybridize.modeling import HybridForCausalLM
from hybridize.rl.config import GRPORunConfig, decode_compile_choice, save_config, to_dict
from hybridize.rl.data import build_records, to_dataset
from hybridize.rl.rewards import RewardError, combined_reward, guard_reward, reward_functions


def _expose_model_class() -> None:
    """TRL builds the reference model with `getattr(transformers, config.architectures[0])`."""
    import transformers

    if getattr(transformers, "HybridForCausalLM", None) is not HybridForCausalLM:
        setattr(transformers, "HybridForCausalLM", HybridForCausalLM)


# ---------------------------------------------------------------------------------------------
# the trainer
# ---------------------------------------------------------------------------------------------
class HybridGRPOTrainer(GuardedTrainerMixin, GRPOTrainer):
    """GRPOTrainer with fast rollouts and the NaN guard. Extra arguments: `fast_generation` (bool) and
    `fast_config` (`FastGenConfig`). Everything else is GRPOTrainer's."""

    # the NaN guard's line (hybridize.distill.trainer_guard); GRPO's loss sits near 0 and changes sign, so
    # the loss-spike test does not apply. --resume restores the optimizer and LR schedule of the checkpoint
    # (its learning rate included) but reads max_grad_norm from the settings.
    stage = "grpo"
    remedy = ("rerun with --resume and a lower grpo.max_grad_norm, or lower grpo.learning_rate in a new "
              "output_dir= (--resume keeps the checkpoint's learning rate); dtype=float32 if it ran in bfloat16")
    watch_loss_spikes = False

    def last_good_checkpoint(self) -> str | None:
        ckpt = latest_checkpoint(self.args.output_dir, layout="trainer")
        return str(ckpt) if ckpt is not None else None

    def __init__(self, *args, fast_generation: bool = True, fast_config: FastGenConfig | None = None, **kwargs):
        _expose_model_class()
        super().__init__(*args, **kwargs)
        self.fast_generation = fast_generation
        self.fast_config = fast_config or FastGenConfig()
        self._fast_gen: FastGenerator | None = None

    def _fast_generator(self) -> FastGenerator | None:
        target = find_generator_model(self.model)
        if target is None:
            return None
        if self._fast_gen is None or self._fast_gen.model is not target:
            self._fast_gen = FastGenerator(target, self.fast_config)
        return self._fast_gen

    def _generate_single_turn(self, prompt_ids, *args, **kwargs):
        plain = (self.use_vllm or getattr(self, "use_transformers_continuous_batching", False)
                 or not self.fast_generation)
        gen = None if plain else self._fast_generator()
        t0 = time.perf_counter()
        if gen is None:
            completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *args, **kwargs)
        else:
            with fast_generate_installed(self.model, gen):
                completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *args, **kwargs)
        dt = time.perf_counter() - t0
        n = sum(len(c) for c in completion_ids)
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["rollout/seconds"].append(dt)
        self._metrics[mode]["rollout/tokens_per_s"].append(n / dt if dt > 0 else 0.0)
        self._metrics[mode]["rollout/fast"].append(float(gen is not None and gen.last_fallback_reason is None))
        return completion_ids, logprobs


# ---------------------------------------------------------------------------------------------
# bookkeeping
# ---------------------------------------------------------------------------------------------
class MetricsCallback(TrainerCallback):
    """Appends every log line (with `step`) to `metrics.jsonl`; redraws `reward.png` on save and at the end."""

    def __init__(self, run_dir: str | Path):
        self.jsonl = Path(run_dir) / "metrics.jsonl"
        self.png = Path(run_dir) / "reward.png"

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        self.jsonl.parent.mkdir(parents=True, exist_ok=True)
        row = {"step": state.global_step, **{k: v for k, v in logs.items() if isinstance(v, (int, float, str))}}
        with self.jsonl.open("a") as f:
            f.write(json.dumps(row) + "\n")

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            plot_rewards(self.jsonl, self.png)

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            plot_rewards(self.jsonl, self.png)


def read_metrics(jsonl: str | Path) -> list[dict]:
    p = Path(jsonl)
    if not p.exists():
        return []
    return [json.loads(ln) for ln in p.read_text().splitlines() if ln.strip()]


def truncate_metrics(jsonl: str | Path, step: int) -> None:
    """Keep lines with `step <= step` (resuming from a checkpoint at `step`)."""
    p = Path(jsonl)
    if p.exists():
        keep = [r for r in read_metrics(p) if r.get("step", 0) <= step]
        p.write_text("".join(json.dumps(r) + "\n" for r in keep))


REWARD_KEYS = ("reward", "rewards/correctness_reward/mean", "rewards/format_reward/mean")


def plot_rewards(jsonl: str | Path, png: str | Path, keys=REWARD_KEYS) -> Path | None:
    """Reward curves against optimizer step from `metrics.jsonl`; None when nothing to draw."""
    rows = read_metrics(jsonl)
    series = {k: [(r["step"], r[k]) for r in rows if isinstance(r.get(k), (int, float)) and math.isfinite(r[k])]
              for k in keys}
    series = {k: v for k, v in series.items() if v}
    if not series:
        return None
    # deferred: matplotlib is slow to import and only the plots need it
    import matplotlib
    matplotlib.use("Agg")
    # deferred: matplotlib is slow to import and only the plots need it
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for k, pts in series.items():
        ax.plot(*zip(*pts), label=k, marker="o" if len(pts) < 30 else None)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean reward")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(Path(jsonl).parent.name + " (GRPO)")
    fig.tight_layout()
    Path(png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return Path(png)


# ---------------------------------------------------------------------------------------------
# scoring (reward before / after)
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def score_prompts(model, tokenizer, records: list[dict], *, max_new_tokens: int, batch_size: int = 16,
                  correct: float = 1.0, format: float = 0.1, greedy: bool = True, fast: bool = True,
                  template_kwargs: dict | None = None, seed: int = 0) -> dict:
    """Generate one completion per record (greedy by default) and return mean rewards plus throughput:
    `{"correct", "format", "reward", "n", "tokens_per_s", "mean_tokens"}`."""
    target = find_generator_model(model) or model
    device = next(target.parameters()).device
    was_training = target.training
    target.eval()
    gen = FastGenerator(target, FastGenConfig()) if fast else None
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = [tokenizer.eos_token_id] + [e for e in _as_list(getattr(target.generation_config, "eos_token_id", None))
                                      if e != tokenizer.eos_token_id]
    texts, n_tokens, t_gen = [], 0, 0.0
    torch.manual_seed(seed)
    for i in range(0, len(records), batch_size):
        chunk = records[i:i + batch_size]
        ids = [_encode_prompt(tokenizer, r["prompt"], template_kwargs) for r in chunk]
        T = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), T), pad, dtype=torch.long)
        mask = torch.zeros((len(ids), T), dtype=torch.long)
        for j, x in enumerate(ids):
            input_ids[j, T - len(x):] = torch.tensor(x)
            mask[j, T - len(x):] = 1
        kw = dict(max_new_tokens=max_new_tokens, do_sample=not greedy, pad_token_id=pad, eos_token_id=eos)
        if not greedy:
            kw.update(temperature=1.0, top_p=1.0, top_k=0)
        t0 = time.perf_counter()
        call = gen if gen is not None else target.generate
        out = call(input_ids=input_ids.to(device), attention_mask=mask.to(device), **kw)
        t_gen += time.perf_counter() - t0
        for row in out[:, T:].tolist():
            cut = next((k for k, t in enumerate(row) if t in eos), None)
            row = row[:cut + 1] if cut is not None else row
            n_tokens += len(row)
            texts.append(tokenizer.decode(row, skip_special_tokens=True))
    target.train(was_training)
    # the prompts pick each row's answer check (number-only prompts: the strict numeric one), as in training
    res = combined_reward(texts, [r["answer"] for r in records], correct=correct, format=format,
                          prompts=[r["prompt"] for r in records])
    return {**res, "n": len(records), "tokens_per_s": n_tokens / t_gen if t_gen > 0 else 0.0,
            "mean_tokens": n_tokens / max(1, len(records)), "greedy": greedy,
            "examples": [{"prompt": str(r["problem"])[:200], "completion": t[:400], "answer": r["answer"]}
                         for r, t in list(zip(records, texts))[:3]]}


def _as_list(x) -> list:
    return [] if x is None else ([x] if isinstance(x, int) else list(x))


def _encode_prompt(tokenizer, prompt, template_kwargs=None) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ids = tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True, **(template_kwargs or {}))
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------
def resolve_device_dtype(cfg: GRPORunConfig) -> tuple[str, torch.dtype]:
    device = cfg.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise UserError(f"device must be auto, cpu or cuda, got {cfg.device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("device=cuda but no CUDA GPU is visible; use device=cpu")
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if cfg.dtype == "auto":
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
    elif cfg.dtype in names:
        dtype = names[cfg.dtype]
    else:
        raise UserError(f"dtype must be auto, float32 or bfloat16, got {cfg.dtype!r}")
    return device, dtype


def build_grpo_args(cfg: GRPORunConfig, device: str, dtype: torch.dtype, reward_weights: list[float]) -> GRPOConfig:
    g = cfg.grpo
    kw = dict(
        output_dir=cfg.output_dir, seed=cfg.seed, report_to=[], use_cpu=device == "cpu",
        bf16=device == "cuda" and dtype == torch.bfloat16,
        num_generations=g.num_generations, max_completion_length=g.max_completion_length,
        per_device_train_batch_size=g.per_device_train_batch_size,
        gradient_accumulation_steps=g.gradient_accumulation_steps, num_iterations=g.num_iterations,
        learning_rate=g.learning_rate, lr_scheduler_type=g.lr_scheduler_type, warmup_steps=g.warmup_steps,
        weight_decay=g.weight_decay, max_grad_norm=g.max_grad_norm, max_steps=g.max_steps, beta=g.beta,
        epsilon=g.epsilon, scale_rewards=g.scale_rewards, temperature=g.temperature, top_p=g.top_p,
        top_k=g.top_k, gradient_checkpointing=g.gradient_checkpointing, reward_weights=reward_weights,
        logging_steps=cfg.logging_steps, save_strategy="steps" if cfg.save_steps else "no",
        save_steps=cfg.save_steps or 500, save_total_limit=cfg.save_total_limit,
        disable_tqdm=not cfg.progress, remove_unused_columns=False,
    )
    if g.steps_per_generation:
        kw["steps_per_generation"] = g.steps_per_generation
    if g.loss_type:
        kw["loss_type"] = g.loss_type
    kw.update(g.extra or {})
    if kw.get("deepspeed"):   # grpo.extra={deepspeed: recipes/accelerate/ds_zero2.json}
        check_deepspeed_file(str(kw["deepspeed"]), "grpo.extra.deepspeed")
    try:
        return GRPOConfig(**kw)
    except TypeError as e:
        raise UserError(f"grpo.extra: {e}") from None


def _lora_config(cfg: GRPORunConfig):
    # deferred: peft is slow to import and only LoRA runs need it
    from peft import LoraConfig

    lo = cfg.lora
    return LoraConfig(r=lo.r, lora_alpha=lo.alpha, lora_dropout=lo.dropout, target_modules=list(lo.target_modules),
                      modules_to_save=list(lo.modules_to_save) or None, task_type="CAUSAL_LM")


def load_policy(cfg: GRPORunConfig, dtype: torch.dtype):
    """(model on CPU in `dtype`, tokenizer); TRL/accelerate moves the model to the device."""
    if not cfg.model:
        raise UserError("no model: pass --model DIR (a converted hybrid), 'default', or set model= in the recipe")
    model, tok = load_model(cfg.model, dtype=dtype, device="cpu", need_tokenizer=False)
    if tok is None:
        raise UserError(f"{cfg.model} has no tokenizer; save one next to the model")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


def _ensure_reloadable(model, tokenizer, run_dir: Path) -> None:
    """TRL reloads the reference model from `config._name_or_path`: make sure that is a saved copy."""
    src = Path(str(getattr(model.config, "_name_or_path", "") or ""))
    if (src / "config.json").is_file():
        return
    ref = run_dir / "reference"
    if not (ref / "config.json").is_file():
        model.save_pretrained(ref)
        tokenizer.save_pretrained(ref)
    model.config._name_or_path = str(ref)


@with_run_kernel_options   # cfg.kernel_options in force for the run
def run_grpo(cfg: GRPORunConfig, resume: bool | str = False, callbacks: list | None = None) -> dict:
    """Train; returns the summary also written to `<output_dir>/summary.json`."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    run_dir = Path(cfg.output_dir)
    ckpt = None
    if resume:
        ckpt = Path(resume) if isinstance(resume, str) else latest_checkpoint(run_dir, layout="trainer")
        if ckpt is None or not (ckpt / "trainer_state.json").is_file():
            raise UserError(f"--resume: no checkpoint-N folder with trainer_state.json in {resume if isinstance(resume, str) else run_dir}")
    elif run_dir.is_dir() and latest_checkpoint(run_dir, layout="trainer") is not None:
        raise UserError(f"{run_dir} already holds checkpoints: pass --resume to continue, or another output_dir=")
    device, dtype = resolve_device_dtype(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")

    model, tok = load_policy(cfg, dtype)
    funcs, weights = reward_functions(cfg.rewards.correct, cfg.rewards.format)
    funcs = [guard_reward(f) for f in funcs]
    args = build_grpo_args(cfg, device, dtype, weights)
    template_kwargs = dict(getattr(args, "chat_template_kwargs", None) or {})
    d = cfg.data
    records = build_records(d.train, tok, instruction=d.instruction, system=d.system, chat=d.chat,
                            max_prompt_tokens=d.max_prompt_tokens, limit=d.limit, seed=d.shuffle_seed,
                            template_kwargs=template_kwargs)
    held_out = None
    if d.eval:
        held_out = build_records(d.eval, tok, instruction=d.instruction, system=d.system, chat=d.chat,
                                 max_prompt_tokens=d.max_prompt_tokens, limit=d.eval_limit, seed=d.shuffle_seed,
                                 template_kwargs=template_kwargs)
    if cfg.grpo.beta > 0 and not cfg.lora.enabled:
        _ensure_reloadable(model, tok, run_dir)
    model.generation_config.pad_token_id = tok.pad_token_id

    scores_path = run_dir / "scores.json"
    scores = json.loads(scores_path.read_text()) if scores_path.is_file() else {}
    score_kw = dict(max_new_tokens=d.eval_max_new_tokens or cfg.grpo.max_completion_length,
                    correct=cfg.rewards.correct, format=cfg.rewards.format, fast=cfg.fast_generation,
                    template_kwargs=template_kwargs)
    if held_out and "before" not in scores:
        model.to(device)
        scores["before"] = score_prompts(model, tok, held_out, **score_kw)
        scores_path.write_text(json.dumps(scores, indent=1))

    if ckpt is not None:
        state = json.loads((ckpt / "trainer_state.json").read_text())
        truncate_metrics(run_dir / "metrics.jsonl", int(state.get("global_step", 0)))
    compile_mode, why = decode_compile_choice(cfg, device)
    print(f"grpo: compiled decode {compile_mode} ({why})")
    trainer = HybridGRPOTrainer(
        model=model, reward_funcs=funcs, args=args, train_dataset=to_dataset(records), processing_class=tok,
        peft_config=_lora_config(cfg) if cfg.lora.enabled else None,
        callbacks=[MetricsCallback(run_dir), *(callbacks or [])],
        fast_generation=cfg.fast_generation, fast_config=FastGenConfig(cuda_graphs=cfg.cuda_graphs,
                                                                   compile=compile_mode,
                                                                   gemm=cfg.decode_gemm,
                                                                   prefill_tokens=cfg.prefill_tokens))
    # under DeepSpeed, before its engine unpickles the checkpoint freely
    check_trainer_resume(trainer, ckpt, remedy="delete that checkpoint folder (or start over in another "
                                              "output_dir=)")
    t0 = time.perf_counter()
    try:
        trainer.train(resume_from_checkpoint=str(ckpt) if ckpt is not None else None)
    except RewardError as e:   # raised at the reward call, before that step's update: nothing saved from it
        last = trainer.last_good_checkpoint()
        where = (f"the last checkpoint, saved before it, is {last}: fix the reward, then rerun with --resume"
                 if last is not None else f"no checkpoint was saved before it (save_steps={cfg.save_steps})")
        raise RewardError(f"{e}; {where}") from e.__cause__
    train_s = time.perf_counter() - t0

    final = run_dir / "final"
    policy = trainer.model
    main = trainer.accelerator.is_main_process
    # under ZeRO-3 the trained weights are shards: save and score inside a gather (the LoRA merge included)
    with zero3_gathered(policy, deepspeed_engine(trainer)):
        if cfg.lora.enabled:
            if main:
                policy.save_pretrained(final / "adapter")
            policy = policy.merge_and_unload()
        if main:
            policy.save_pretrained(final)
            tok.save_pretrained(final)
        if held_out:
            scores["after"] = score_prompts(policy, tok, held_out, **score_kw)
            scores_path.write_text(json.dumps(scores, indent=1))
    rows = read_metrics(run_dir / "metrics.jsonl")
    rewards = [r["reward"] for r in rows if "reward" in r]
    tps = [r["rollout/tokens_per_s"] for r in rows if "rollout/tokens_per_s" in r]
    summary = {"steps": trainer.state.global_step, "train_seconds": train_s, "device": device,
               "compile_decode": {"mode": compile_mode, "why": why},
               "dtype": str(dtype).replace("torch.", ""), "prompts": len(records),
               "reward_first": rewards[0] if rewards else None, "reward_last": rewards[-1] if rewards else None,
               "rollout_tokens_per_s": sum(tps) / len(tps) if tps else None,
               "scores": {k: {kk: vv for kk, vv in v.items() if kk != "examples"} for k, v in scores.items()},
               "final": str(final), "config": to_dict(cfg)}
    plot_rewards(run_dir / "metrics.jsonl", run_dir / "reward.png")
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


__all__ = ["HybridGRPOTrainer", "MetricsCallback", "plot_rewards", "run_grpo", "score_prompts"]
