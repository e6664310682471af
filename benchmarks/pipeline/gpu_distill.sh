#!/usr/bin/env bash
# Stages A + B of the embedded default on one GPU (the measured run of the distillation issue), in the
# phases of benchmarks/pipeline/distill_default_gpu.py. Each phase fits one 10-minute device call; state lives in
# /root/distill-default, so back-to-back calls on a warm machine continue where the last one stopped.
# Device-side usage (repo root; wheels installed, the GGUF joined at $GGUF, HYBRIDIZE_DATA_DIR set):
#   bash benchmarks/pipeline/gpu_distill.sh $OUT $GGUF prepare     # convert + stage A           (~5 min)
#   bash benchmarks/pipeline/gpu_distill.sh $OUT $GGUF sweep       # three short stage-B variants (~9.5 min)
#   bash benchmarks/pipeline/gpu_distill.sh $OUT $GGUF train       # stage B, best variant        (~8 min)
set -euo pipefail
OUT=${1:?output folder}; GGUF=${2:?path of the SmolLM2 GGUF}; PHASE=${3:?prepare | sweep | train}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
case $PHASE in
  prepare) ARGS=(--align-minutes 3.5) ;;
  sweep) ARGS=(--sweep-steps 120 --sweep-minutes 1.2) ;;
  train) ARGS=(--variant best --minutes 7.2 --total-minutes 12.5) ;;
  *) echo "unknown phase $PHASE (prepare | sweep | train)"; exit 2 ;;
esac
python3 -m benchmarks.pipeline.distill_default_gpu "$PHASE" --teacher "$GGUF" "${ARGS[@]}" 2>&1 \
  | grep -v "Writing model\|Generating\|Loading weights\|de-quantizing" | tee "$OUT/$PHASE.log"
cp /root/distill-default/results.json /root/distill-default/report.md "$OUT/" 2>/dev/null || true
