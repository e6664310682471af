#!/usr/bin/env bash
# Stages A + B of the embedded default on one GPU (the measured run of the distillation issue).
# Device-side usage (repo root; wheels in .whl/, the GGUF joined at $GGUF, data copied into .data/):
#   bash benchmarks/gpu_distill.sh $OUT /root/smollm2.gguf
set -euo pipefail
OUT=${1:?output folder}; GGUF=${2:?path of the SmolLM2 GGUF}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -c "import torch; print(torch.cuda.get_device_name(0), torch.__version__)"
hybridize_demo() { python3 -c "from hybridize.cli import main; main()" "$@"; }
hybridize_demo demo out=/root/demo teacher="$GGUF" \
  train_text=.data/general_text heldout_text=.data/wikitext2/test.txt \
  eval_tokens=40000 eval_seq_len=2048 seq_len=1024 batch_tokens=8192 \
  align_steps=600 align_lr=2e-3 align_minutes=3.5 e2e_steps=400 e2e_lr=3e-4 e2e_minutes=3 \
  mixed_precision=bf16 mixer_settings='{"chunk_size": 64}' 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" || true
cp /root/demo/summary.md "$OUT/summary.md" 2>/dev/null || true
cp /root/demo/summary.json "$OUT/summary.json" 2>/dev/null || true
