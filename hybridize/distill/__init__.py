"""Distillation of a converted hybrid from its teacher.

Stages (the seeds' recipe order is convert -> long-context continual training -> SFT distillation -> GRPO):
- `align` (stage A): attention transfer, layer-local (`hybridize.distill.align`);
- `e2e` (stage B): KL + CE on packed variable-length rows with a context schedule (`hybridize.distill.e2e`);
- `sft` (stage C): TRL SFTTrainer on reasoning traces (`hybridize.distill.sft`);
- `traces`: teacher completions as JSONL (`hybridize.distill.traces`);
- `demo`: convert + A + B on the embedded default, with perplexities (`hybridize.distill.demo`).
Shared: configs (`config`), data packing (`data`), losses (`losses`), the training loop with atomic
checkpoints and exact resume (`loop`, `checkpoint`), metrics (`metrics`), model helpers (`models`).
"""
