"""Stage C, SFT distillation on reasoning traces, through TRL's `SFTTrainer`.

Traces are (prompt, completion) rows: a dataset of worked solutions (`../shared/data/math_train`, GSM8K
`solution`s, a hub set) or the teacher's own completions written by `hybridize distill traces`
(`prompt_field=problem completion_field=completion`). Rows become TRL's conversational
prompt-completion format when the tokenizer has a chat template (plain strings otherwise), so the loss
is on completion tokens only. `packing=true` uses TRL's padding-free packing: `position_ids` restart per
example and the hybrid model splits its mixers' state at the same places.

Bookkeeping matches the other stages: resolved config, `trainable.json`, `metrics.jsonl`, `loss.png`.
HF's Trainer writes `checkpoint-N/` in place; a callback marks a checkpoint complete (`COMPLETE`
file) only after the Trainer has finished writing it, and `--resume` takes the newest marked one
(unmarked, i.e. interrupted, ones are ignored), which gives the atomicity of the other stages. The
Trainer's own resume restores model, optimizer, scheduler, RNG and the data position.

Failures are one line: rows without the prompt or completion text are counted and dropped with a
warning, or refused when none has it (`build_sft_dataset`); a non-finite loss, gradient or weight stops the
run naming the step and the last complete checkpoint, and nothing is saved from that state
(`guarded_sft_trainer`, `hybridize.distill.trainer_guard`).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from hybridize.errors import UserError
from hybridize.ops.common.options import with_run_kernel_options
from .checkpoint import check_trainer_resume
from .config import SFTStageConfig, save_config
from .data import load_rows, shared_data
from .loop import save_final
from .loop import check_deepspeed_file, deepspeed_engine, zero3_gathered
from .metrics import MetricsLog, plot_losses
from .models import apply_lora, load_student, select_trainable, trainable_summary
from .trainer_guard import GuardedTrainerMixin


COMPLETE = "COMPLETE"


def default_traces() -> str:
    p = shared_data("math_train/math_train.jsonl")
    if p is None:
        raise UserError("no traces given: set traces=<jsonl/parquet file or hub dataset> "
                        "(../shared/data/math_train is not present here)")
    return str(p)


def build_sft_dataset(cfg: SFTStageConfig, tokenizer):
    """A `datasets.Dataset` with `prompt`/`completion` columns (conversational when a chat template exists).

    A row whose `prompt_field` or `completion_field` is missing, empty or not a string cannot be trained on:
    some such rows are dropped with one warning line on stderr (per field: how many, the first row's number),
    all of them is a one-line error naming the file, the fields and the columns it does have."""
    import sys

    # deferred: datasets (pyarrow) is slow to import and only hub or parquet data needs it
    import datasets

    source = cfg.traces or default_traces()
    ds = load_rows(source, cfg.split, cfg.max_examples)
    chat = getattr(tokenizer, "chat_template", None) is not None
    rows = []
    missing = {cfg.prompt_field: [], cfg.completion_field: []}   # field -> row indices without it
    for i, r in enumerate(ds):
        p, c = r.get(cfg.prompt_field), r.get(cfg.completion_field)
        ok_p, ok_c = _text(p), _text(c)
        if not ok_p:
            missing[cfg.prompt_field].append(i)
        if not ok_c and cfg.completion_field != cfg.prompt_field:
            missing[cfg.completion_field].append(i)
        if not (ok_p and ok_c):
            continue
        if chat:
            prompt = ([{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []) + \
                     [{"role": "user", "content": p}]
            rows.append({"prompt": prompt, "completion": [{"role": "assistant", "content": c}]})
        else:
            rows.append({"prompt": (cfg.system_prompt + "\n" if cfg.system_prompt else "") + p + "\n",
                         "completion": c})
    roles = {cfg.prompt_field: "prompt_field", cfg.completion_field: "completion_field"}
    parts = [f"{len(idx)} with no text in {name!r} ({roles[name]}, first: row {idx[0] + 1})"
             for name, idx in missing.items() if idx]
    if not rows:
        if not len(ds):
            raise UserError(f"{source} holds no rows")
        raise UserError(f"{source}: none of its {len(ds)} rows can be trained on: {'; '.join(parts)}; its columns "
                        f"are {ds.column_names}: set prompt_field= / completion_field= to the ones that hold them")
    if parts:
        print(f"warning: {source}: dropped {len(ds) - len(rows)} of {len(ds)} rows: {'; '.join(parts)}",
              file=sys.stderr)
    return datasets.Dataset.from_list(rows)


def _text(value) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _scheduler(train) -> tuple[str, dict]:
    if train.scheduler == "cosine":
        return "cosine_with_min_lr", {"min_lr_rate": train.min_lr_ratio}
    if train.scheduler == "linear":
        return "linear", {}
    if train.scheduler == "constant":
        return "constant_with_warmup", {}
    raise UserError(f"train.scheduler must be cosine | linear | constant, got {train.scheduler!r}")


def trl_config(cfg: SFTStageConfig):
    # deferred: trl is slow to import and only this trainer needs it
    from trl import SFTConfig

    t = cfg.train
    name, kw = _scheduler(t)
    if t.deepspeed:
        check_deepspeed_file(t.deepspeed, "train.deepspeed")
    return SFTConfig(
        deepspeed=t.deepspeed or None,
        output_dir=str(Path(t.run_dir) / "checkpoints"), max_steps=t.max_steps, learning_rate=t.lr,
        lr_scheduler_type=name, lr_scheduler_kwargs=kw, warmup_steps=t.warmup_steps,
        gradient_accumulation_steps=t.grad_accum, max_grad_norm=t.max_grad_norm or 0.0,
        weight_decay=t.weight_decay, adam_beta1=t.adam_betas[0], adam_beta2=t.adam_betas[1],
        bf16=t.mixed_precision == "bf16", fp16=t.mixed_precision == "fp16",
        save_strategy="steps", save_steps=t.save_every or t.max_steps, save_total_limit=t.keep_checkpoints,
        logging_steps=t.log_every, seed=t.seed, data_seed=t.seed, per_device_train_batch_size=cfg.batch_size,
        max_length=cfg.max_length, packing=cfg.packing, report_to=[], disable_tqdm=not t.progress,
        gradient_checkpointing=False, dataset_num_proc=None, use_cpu=not torch.cuda.is_available(),
    )


def sft_callbacks(run_dir: Path):
    from transformers import TrainerCallback

    log = MetricsLog(run_dir / "metrics.jsonl")

    class Bookkeeping(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            log.truncate_after(state.global_step)

        def on_log(self, args, state, control, logs=None, **kw):
            if state.is_world_process_zero and logs:
                rec = {k: v for k, v in logs.items() if isinstance(v, (int, float))}
                log.write(step=state.global_step, **rec)

        def on_save(self, args, state, control, **kw):
            if state.is_world_process_zero:
                ck = Path(args.output_dir) / f"checkpoint-{state.global_step}"
                if ck.is_dir():
                    (ck / COMPLETE).write_text(str(state.global_step))

        def on_train_end(self, args, state, control, **kw):
            if state.is_world_process_zero:
                plot_losses(log.path, run_dir / "loss.png", keys=("loss",), title=f"sft: {run_dir.name}")

    return [Bookkeeping()]


def latest_complete(run_dir: Path) -> str | None:
    root = run_dir / "checkpoints"
    done = [p for p in root.glob("checkpoint-*") if (p / COMPLETE).is_file()] if root.is_dir() else []
    return str(max(done, key=lambda p: int(p.name.split("-")[1]))) if done else None


@functools.lru_cache(maxsize=None)
def guarded_sft_trainer():
    """TRL's SFTTrainer with the NaN guard (`trainer_guard`): a non-finite loss, gradient or weight stops the
    run with one line naming the step and the last complete checkpoint; nothing is saved from that state."""
    # deferred: trl is slow to import and only this trainer needs it
    from trl import SFTTrainer

    class GuardedSFTTrainer(GuardedTrainerMixin, SFTTrainer):
        stage = "sft"
        # on --resume the checkpoint's optimizer and LR schedule come back (check_resume_settings refuses a
        # new train.lr); max_grad_norm is read from the settings
        remedy = ("a row whose prompt fills max_length leaves no completion token (raise max_length), else rerun "
                  "with --resume and a lower train.max_grad_norm, or start over (--overwrite) with a lower train.lr")

        def last_good_checkpoint(self) -> str | None:
            return latest_complete(Path(self.args.output_dir).parent)

    return GuardedSFTTrainer


def sft(student, tokenizer, cfg: SFTStageConfig, resume: bool = False):
    """Run stage C on an in-memory student; returns (TrainOutput, trained model)."""
    run_dir = Path(cfg.train.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if cfg.params == "lora":
        student = apply_lora(student, cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.target_modules)
    select_trainable(student, cfg.params)
    summary = trainable_summary(student)
    (run_dir / "trainable.json").write_text(json.dumps(summary, indent=1))
    print(f"sft: training {summary['trainable']:,} of {summary['total']:,} parameters ({cfg.params})")
    dataset = build_sft_dataset(cfg, tokenizer)
    trainer = guarded_sft_trainer()(model=student, args=trl_config(cfg), train_dataset=dataset,
                                    processing_class=tokenizer, callbacks=sft_callbacks(run_dir))
    ckpt = latest_complete(run_dir) if resume else None
    if resume and ckpt is None:
        print(f"no complete checkpoint in {run_dir}/checkpoints: starting from step 0")
    if not ckpt:
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    check_trainer_resume(trainer, ckpt)  # under DeepSpeed, before its engine unpickles the checkpoint freely
    out = trainer.train(resume_from_checkpoint=ckpt)
    model = trainer.model
    # ZeRO-3 (train.deepspeed): the trained weights are shards until gathered
    with zero3_gathered(model, deepspeed_engine(trainer)):
        if cfg.params == "lora" and hasattr(model, "merge_and_unload"):
            model = model.merge_and_unload()
        if trainer.accelerator.is_main_process:
            save_final(model, tokenizer, run_dir / "final")
    return out, model


@with_run_kernel_options   # cfg.kernel_options in force for the run
def run_sft(cfg: SFTStageConfig, resume: bool = False):
    student, tok = load_student(cfg.student, cfg.train.dtype)
    return sft(student, tok, cfg, resume=resume)[0]
