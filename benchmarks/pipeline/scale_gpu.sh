#!/usr/bin/env bash
# Stage B (e2e distillation) of the embedded default (SmolLM2-135M, 5:1 SSE hybrid) on 1 GPU (reference) and
# on 2 GPUs with DeepSpeed ZeRO-2 and ZeRO-3 (the measured run of issue 8). Same data per optimizer step in
# all three: the reference takes grad_accum=2 micro-batches, the 2-GPU runs one per GPU, and the loop logs
# the mean loss over ranks. Prints, per config: loss of the first steps, tokens/s per GPU, peak GPU memory
# per rank; writes everything under $OUT.
#
# Usage (repo root, a machine with >= 2 GPUs, deepspeed + accelerate installed, the project installed):
#   bash benchmarks/pipeline/scale_gpu.sh OUT [TEACHER] [TRAIN_TEXT]
#     TEACHER: hybridize source of the teacher (default: "default", the embedded SmolLM2 GGUF; a .gguf path)
#     TRAIN_TEXT: training text (default: the recipe default, ../shared/data/general_text)
# Env: STEPS (30), SEQ (2048), TOKENS (16384 tokens per GPU per step), MIXED (bf16),
#   RUNS (default "ref_1gpu zero2_2gpu zero3_2gpu"; also "zero2_1proc": ZeRO-2 in ONE process on one GPU through
#   train.deepspeed, no launcher - the same-regime control for the 1-GPU reference; runs ending in _2gpu need 2 GPUs),
#   RUN_TIMEOUT (seconds per run, 0 = none; a run past it gets SIGABRT, and faulthandler prints every thread's stack).
set -euo pipefail
OUT=${1:?output folder}; TEACHER=${2:-default}; TEXT=${3:-}
STEPS=${STEPS:-30}; SEQ=${SEQ:-2048}; TOKENS=${TOKENS:-16384}; MIXED=${MIXED:-bf16}
RUNS=${RUNS:-ref_1gpu zero2_2gpu zero3_2gpu}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONFAULTHANDLER=1
RUN_TIMEOUT=${RUN_TIMEOUT:-0}
mkdir -p "$OUT"
python3 -c "import torch, deepspeed, accelerate; print(torch.cuda.device_count(), 'x', torch.cuda.get_device_name(0), \
'torch', torch.__version__, 'deepspeed', deepspeed.__version__, 'accelerate', accelerate.__version__)"
if [[ " $RUNS" == *_2gpu* ]]; then
  [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ] || { echo "RUNS has 2-GPU runs: needs 2 GPUs"; exit 2; }
fi

STUDENT="$OUT/student"
[ -f "$STUDENT/config.json" ] || python3 -m hybridize.cli convert --src "$TEACHER" --out "$STUDENT" --layers 5:1 \
  --mixer sse --samples 1 > "$OUT/convert.log" 2>&1

COMMON=(student="$STUDENT" teacher="$TEACHER" params=all gradient_checkpointing=true
        train.max_steps="$STEPS" train.lr=3e-4 train.warmup_steps=5 train.save_every=0 train.progress=false
        train.mixed_precision="$MIXED" train.seed=0 data.seq_len="$SEQ" data.batch_tokens="$TOKENS")
[ -n "$TEXT" ] && COMMON+=(data.train="$TEXT")

run() {  # name, accelerate config, processes, extra overrides...
  local name=$1 cfg=$2 n=$3; shift 3
  echo "== $name: $cfg on $n GPU(s)"
  CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) timeout -s ABRT "$RUN_TIMEOUT" accelerate launch --config_file "recipes/accelerate/$cfg.yaml" \
    --num_processes "$n" -m hybridize.cli distill e2e "${COMMON[@]}" train.run_dir="$OUT/$name" "$@" \
    > "$OUT/$name.log" 2>&1 || { echo "$name FAILED (tail of $OUT/$name.log):"; tail -20 "$OUT/$name.log"; }
}
run_one_process() {  # name, DeepSpeed JSON, extra overrides... (no launcher: train.deepspeed)
  local name=$1 ds=$2; shift 2
  echo "== $name: $ds in one process on 1 GPU"
  CUDA_VISIBLE_DEVICES=0 timeout -s ABRT "$RUN_TIMEOUT" python3 -m hybridize.cli distill e2e "${COMMON[@]}" train.run_dir="$OUT/$name" \
    train.deepspeed="recipes/accelerate/$ds.json" "$@" > "$OUT/$name.log" 2>&1 \
    || { echo "$name FAILED (tail of $OUT/$name.log):"; tail -20 "$OUT/$name.log"; }
}
for r in $RUNS; do
  case $r in
    ref_1gpu) run ref_1gpu single_gpu 1 train.grad_accum=2 ;;
    zero2_1proc) run_one_process zero2_1proc ds_zero2 train.grad_accum=2 ;;
    zero2_2gpu) run zero2_2gpu zero2 2 ;;
    zero3_2gpu) run zero3_2gpu zero3 2 ;;
    *) echo "unknown run $r"; exit 2 ;;
  esac
done
if [[ " $RUNS " == *" zero3_2gpu "* ]]; then
  # the ZeRO-3 checkpoint back to a HF folder (also checks the export path on real shards)
  python3 -m hybridize.cli export --checkpoint "$OUT/zero3_2gpu" --out "$OUT/zero3_export" > "$OUT/export.log" 2>&1 \
    && echo "export of the ZeRO-3 checkpoint: ok" || { echo "export FAILED"; tail -5 "$OUT/export.log"; }
fi

python3 -m benchmarks.pipeline.multi_gpu_summary "$OUT" --out "$OUT/scale_summary.md"
