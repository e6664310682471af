#!/usr/bin/env bash
# Issue 28: the stages the recovery and reasoning issues added, on 2 GPUs under DeepSpeed ZeRO-2 / ZeRO-3 through
# `accelerate launch` with the shipped configs, beside one GPU. Model: a random-weight SmolLM2-135M teacher (the
# embedded default's config and tokenizer) and its 5:1 SSE conversion; speed and sharding do not depend on the
# weights' values, and random weights give zero math rewards, so GRPO here shows wiring, not learning.
#
#   bash benchmarks/pipeline/two_gpu_stages.sh OUT [STEP ...]     (repo root; default steps: setup long sft grpo)
#
#   setup  the random teacher (from TEACHER_CONFIG: a folder with config.json + tokenizer) and the 5:1 SSE student
#   long   the long-context stage (recipe smollm2-135m/long) at 8k from step 0, SSE's varlen path on packed
#          documents (the built-in python-source text): one GPU (grad_accum 2), 2 GPUs ZeRO-2, 2 GPUs ZeRO-3, the
#          same data per optimizer step; loss per step, tokens/s and peak memory per GPU ($OUT/long_summary.md)
#   sft    stage C (TRL SFTTrainer) on the worked solutions of arith:train (setup writes them), 2 GPUs, ZeRO-2 and
#          ZeRO-3: SFT_STEPS steps with a checkpoint each step, stopped, resumed for one step more, then
#          `hybridize export` of the checkpoint to a plain HF folder that loads
#   grpo   GRPO (recipe smollm2-135m/grpo: arith:train, fast rollouts), 2 GPUs, ZeRO-2 and ZeRO-3: GRPO_STEPS steps
#          with a checkpoint each step, resumed for one step more, reward and rollout/fast logged per step, final/
#          a plain HF folder that loads, and `hybridize export` of the last TRL checkpoint
#
# Env: WORK (/root/two_gpu: models and runs), TEACHER_CONFIG (.c28/smollm2), LONG_STEPS (6), LONG_SEQ (8192),
#   LONG_TOKENS (16384 tokens per GPU per micro-batch), LONG_RUNS ("ref_1gpu zero2_2gpu zero3_2gpu"), SFT_STEPS (2),
#   GRPO_STEPS (1), RUN_TIMEOUT (240 s per launch; past it the run gets SIGABRT and faulthandler prints every
#   thread's stack), DEADLINE (epoch seconds: no launch starts after it; default none).
# Needs 2 GPUs, deepspeed, trl and accelerate installed, the project importable. Every run's log is under $OUT.
# On the lent device (its image has torch, accelerate and transformers 5.17), carry a folder .c28 (listed in
# .git/info/exclude) made here, as the 2026-11-28 session did:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_17_x86_64 -d .c28 \
#     trl==1.16.0 datasets==5.2.0 dill multiprocess hjson pydantic pydantic_core annotated_types typing_inspection \
#     math-verify latex2sympy2_extended antlr4-python3-runtime==4.13.2 gguf
#   DS_BUILD_OPS=0 pip wheel --no-deps --no-build-isolation deepspeed==0.19.8 -w .c28   (PyPI has only its sdist)
#   python -c "from transformers import AutoConfig, AutoTokenizer; from hybridize.convert.sources import \
#     default_gguf_path as g; p = g(); [c.from_pretrained(p.parent, gguf_file=p.name).save_pretrained('.c28/smollm2') \
#     for c in (AutoConfig, AutoTokenizer)]"                  (config + tokenizer of the embedded default)
# and start the call with `pip install --no-index --no-deps --target /usr/local/lib/hyb-site .whl/*.whl .c28/*.whl`
# (.whl: transformers 5.23 and fla-core) and PYTHONPATH=/usr/local/lib/hyb-site:$PWD.
set -uo pipefail
OUT=${1:?output folder}; shift
STEPS_=("$@"); [ ${#STEPS_[@]} -eq 0 ] && STEPS_=(setup long sft grpo)
WORK=${WORK:-/root/two_gpu}; TEACHER_CONFIG=${TEACHER_CONFIG:-.c28/smollm2}
LONG_STEPS=${LONG_STEPS:-6}; LONG_SEQ=${LONG_SEQ:-8192}; LONG_TOKENS=${LONG_TOKENS:-16384}
LONG_RUNS=${LONG_RUNS:-ref_1gpu zero2_2gpu zero3_2gpu}; SFT_STEPS=${SFT_STEPS:-2}; GRPO_STEPS=${GRPO_STEPS:-1}; RUN_TIMEOUT=${RUN_TIMEOUT:-240}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONFAULTHANDLER=1 PYTHONWARNINGS=ignore
mkdir -p "$OUT" "$WORK"
TEACHER=$WORK/teacher; STUDENT=$WORK/student
say() { echo "== $(date +%T) $*"; }

launch() {  # launch NAME CONFIG PROCESSES ARGS...: `accelerate launch` of a hybridize command, log in $OUT/NAME.log
  local name=$1 cfg=$2 n=$3; shift 3
  if [ -n "${DEADLINE:-}" ] && [ "$(date +%s)" -ge "$DEADLINE" ]; then say "$name: not started (DEADLINE)"; return 3; fi
  say "$name: $cfg on $n GPU(s)"
  local t0=$SECONDS
  CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) timeout -s ABRT "$RUN_TIMEOUT" accelerate launch \
    --config_file "recipes/accelerate/$cfg.yaml" --num_processes "$n" -m hybridize.cli "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "   $name: exit $rc in $((SECONDS - t0)) s"
  [ $rc -eq 0 ] || tail -15 "$OUT/$name.log"
  return $rc
}

newest() {  # newest sft|grpo RUN: the run's newest complete checkpoint, found as its --resume finds it
  python3 -c "import sys; from pathlib import Path; from hybridize.distill.checkpoint import latest_checkpoint; \
from hybridize.distill.sft import latest_complete; run = Path(sys.argv[2]); \
print((latest_complete(run) if sys.argv[1] == 'sft' else latest_checkpoint(run, layout='trainer')) or '')" "$1" "$2"
}

load_check() {  # load_check FOLDER: a plain HF folder that loads whole, and how many of its tensors the run changed
  python3 - "$1" "$STUDENT" <<'PY' || { echo "   $1 does not load"; return 1; }
import sys
import hybridize  # noqa: F401  (registers the hybrid model classes)
from transformers import AutoModelForCausalLM
m, start = (dict(AutoModelForCausalLM.from_pretrained(d).named_parameters()) for d in sys.argv[1:3])
if m.keys() != start.keys() or any(m[k].shape != start[k].shape for k in m):
    sys.exit(f"   {sys.argv[1]}: its tensors are not the student's (names or shapes differ)")
diff = {k: (m[k].detach().float() - start[k].detach().float()).abs().max().item() for k in m}
print(f"   {sys.argv[1]} loads: {sum(p.numel() for p in m.values()):,} parameters in {m[next(iter(m))].dtype}; "
      f"{sum(d > 0 for d in diff.values())} of {len(m)} tensors differ from the student's, by at most "
      f"{max(diff.values()):.3g}")
PY
}

export_check() {  # export_check NAME CHECKPOINT: `hybridize export` to a plain HF folder, then load it
  local name=$1 ckpt=$2
  [ -n "$ckpt" ] || { echo "   $name: no checkpoint to export"; return 1; }
  python3 -m hybridize.cli export --checkpoint "$ckpt" --out "$WORK/${name}_hf" --overwrite > "$OUT/${name}_export.log" 2>&1 \
    || { echo "   export of $ckpt FAILED"; tail -5 "$OUT/${name}_export.log"; return 1; }
  load_check "$WORK/${name}_hf"
}

for s in "${STEPS_[@]}"; do
  case $s in
    setup)
      say "setup: random teacher from $TEACHER_CONFIG, 5:1 SSE student"
      [ -f "$TEACHER/config.json" ] || python3 - "$TEACHER_CONFIG" "$TEACHER" <<'PY'
import sys
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
torch.manual_seed(0)
AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(sys.argv[1])).save_pretrained(sys.argv[2])
AutoTokenizer.from_pretrained(sys.argv[1]).save_pretrained(sys.argv[2])
PY
      [ -f "$WORK/arith_train.jsonl" ] || python3 -c "import json, sys; from hybridize.eval.arith import generate; \
open(sys.argv[1], 'w').writelines(json.dumps(r) + '\n' for r in generate('train'))" "$WORK/arith_train.jsonl"
      [ -f "$STUDENT/config.json" ] || python3 -m hybridize.cli convert --src "$TEACHER" --out "$STUDENT" --layers 5:1 \
        --mixer sse --samples 1 > "$OUT/convert.log" 2>&1 || { echo "convert FAILED"; tail -15 "$OUT/convert.log"; exit 1; }
      python3 -c "import torch, deepspeed, accelerate, trl; n = torch.cuda.device_count(); \
print(n, 'x', torch.cuda.get_device_name(0) if n else 'no GPU', 'torch', torch.__version__, 'deepspeed', \
deepspeed.__version__, 'accelerate', accelerate.__version__, 'trl', trl.__version__)" ;;
    long)
      LONG=(distill e2e -r smollm2-135m/long student="$STUDENT" teacher="$TEACHER" data.train=[python-source]
            "data.seq_len_schedule=[[0, $LONG_SEQ]]" data.batch_tokens="$LONG_TOKENS" train.max_steps="$LONG_STEPS"
            train.warmup_steps=2 train.save_every=0 train.progress=false train.seed=0)
      for r in $LONG_RUNS; do
        case $r in
          ref_1gpu) launch long_$r single_gpu 1 "${LONG[@]}" train.run_dir="$WORK/long/$r" train.grad_accum=2 --overwrite ;;
          zero2_2gpu|zero3_2gpu) launch long_$r "${r%_2gpu}" 2 "${LONG[@]}" train.run_dir="$WORK/long/$r" --overwrite ;;
          *) echo "unknown long run $r (ref_1gpu | zero2_2gpu | zero3_2gpu)"; exit 2 ;;
        esac
      done
      python3 -m benchmarks.pipeline.multi_gpu_summary "$WORK/long" --out "$OUT/long_summary.md" ;;
    sft)
      for z in 2 3; do
        SFT=(distill sft -r smollm2-135m/sft student="$STUDENT" traces="$WORK/arith_train.jsonl" completion_field=solution
             max_length=256 train.run_dir="$WORK/sft_zero$z" train.save_every=1 train.progress=false)
        launch sft_zero${z}_2gpu zero$z 2 "${SFT[@]}" train.max_steps="$SFT_STEPS" --overwrite \
          && launch sft_zero${z}_2gpu_resume zero$z 2 "${SFT[@]}" train.max_steps=$((SFT_STEPS + 1)) --resume \
          && python3 -m benchmarks.pipeline.multi_gpu_summary "$WORK/sft_zero$z" --steps \
          && export_check sft_zero$z "$(newest sft "$WORK/sft_zero$z")"
      done ;;
    grpo)
      for z in 2 3; do
        GRPO=(grpo --model "$STUDENT" --recipe smollm2-135m/grpo --output-dir "$WORK/grpo_zero$z" save_steps=1
              grpo.max_completion_length=64 grpo.per_device_train_batch_size=16 data.eval_limit=16 progress=false)
        launch grpo_zero${z}_2gpu zero$z 2 "${GRPO[@]}" grpo.max_steps="$GRPO_STEPS" \
          && launch grpo_zero${z}_2gpu_resume zero$z 2 "${GRPO[@]}" grpo.max_steps=$((GRPO_STEPS + 1)) --resume \
          && python3 -m benchmarks.pipeline.multi_gpu_summary "$WORK/grpo_zero$z" --steps \
          && load_check "$WORK/grpo_zero$z/final" \
          && export_check grpo_zero$z "$(newest grpo "$WORK/grpo_zero$z")"
      done ;;
    *) echo "unknown step $s (setup | long | sft | grpo)"; exit 2 ;;
  esac
done
say done
