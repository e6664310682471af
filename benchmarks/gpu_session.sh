#!/usr/bin/env bash
# GPU checks and timings of the paths added for issues 5-8, as named steps that fit 10-minute device calls
# (device side, repo root):
#   bash benchmarks/gpu_session.sh $OUT                       # the default steps (session 2's call)
#   bash benchmarks/gpu_session.sh $OUT tests profile fp32    # chosen steps, in order
# Steps:
#   tests     CUDA tests of the GPU paths (SSE varlen/decode/graphs, CCQ Triton, decode attention, fast
#             generation, batched eval), failures and errors listed
#   speed     eval_default.py speed task: random SmolLM2-135M teacher vs its 5:1 SSE hybrid, 1k-8k
#   attn      the split-KV decode attention kernel alone
#   rollouts  rollouts.py fast path, sdpa vs Triton decode attention, Qwen3-1.7B and SmolLM2 shapes at 16k
#   sse       kernels.py: SSE varlen/masking vs chunk_gla, decode steps
#   ccq       ccq_triton.py: fused CCQ read at several piece lengths vs the GLA and GDN backbones, wall and
#             device time (CCQ_T, CCQ_SEGMENTS)
#   layers    layers.py: whole mixer layers (projections, gates, norms, o_proj around the op), CCQ-GLA vs GLA,
#             CCQ-GDN vs GDN, SSE n4k1 vs GLA, Q-Delta vs GDN, hidden 2048 (LAYER_T, LAYER_MIXERS)
#   qdelta    kernels.py delta section: Gated DeltaNet vs Q-Delta (fused erase direction), 4k-64k
#   profile   profile_decode.py at the Qwen3-1.7B shape, 16k, batch 8 (graph replay + per-layer eager split)
#   profile_compile  the same with FastGenConfig.compile=on (both profiles: GEMM=auto|torch, FastGenConfig.gemm)
#   profile_pair  the compiled step of the teacher and of the 5:1 SSE hybrid at the Qwen3-1.7B shape, PROMPT tokens
#             (default 2048) x BATCH (default 1), kernel by kernel ($OUT/profile_pair_<model>.json): item 4's cell
#   fp32      rollouts.py in float32 at the Qwen3-1.7B shape, 16k: fast path (Triton attention) vs HF tokens
#   compile   rollouts.py bf16, 16k, both shapes: fast path with and without FastGenConfig.compile
#             (COMPILE_MODES, default off,on; SHAPES, default qwen3-1.7b,smollm2-135m; GEMMS, FastGenConfig.gemm
#             settings, default auto)
#   gemm      decode_gemm.py: F.linear vs the Triton decode GEMM per weight shape, 8 rows (autotunes first)
#   sse_profile  profile_sse.py: SSE varlen n4k1, chunk_gla on T tokens and on SSE's 2T layout, device vs wall
#             time and top kernels, 4k/16k
#   sse_ab    profile_sse.py alternating between this tree and another commit's (BASE: a folder holding that tree,
#             e.g. `git archive <commit> hybridize benchmarks | tar -x -C .base` here, carried; or several such
#             folders, space-separated, each run in turn and named by its folder's name), ROUNDS times,
#             SSE only (--no-fla), at SSE_T (default 16384): a kernel change's A/B in one process pair per round;
#             every run's rows in $OUT/sse_ab.json
#   sse_env   profile_sse.py on this tree alternating between kernel-option settings (ENV_AB: `;`-separated
#             environment assignments), ROUNDS times, SSE only, at SSE_T; every run's rows in $OUT/sse_env.json
#   grad_error  gla_grad_error.py: the pieces GLA's gradients beside chunk_gla's against a float64 reference at
#             GRAD_T (default 4096) tokens, with the automatic pieces and pieces of each GRAD_SEGMENTS length
#             (default "2048 0"; 0: one piece); rows in $OUT/grad_error_<pieces>.json
#   scale     scale_gpu.sh on ONE GPU: plain accelerate vs ZeRO-2 in one process, in bf16 and in fp32 (the
#             same-regime control for the 2-GPU run)
#   grpo_ds   GRPO, 3 steps: plain vs ZeRO-2 / ZeRO-3 in one process (rollout tokens/s, fast path used)
# Needs .whl/ installed on PYTHONPATH and .tiny/smollm2 (config + tokenizer of the embedded default). Speed runs on
# random weights (speed does not depend on their values); `scale` reads $HYBRIDIZE_DATA_DIR/general_text.
set -uo pipefail
OUT=${1:?output folder}; shift
STEPS_=("$@")
[ ${#STEPS_[@]} -eq 0 ] && STEPS_=(tests speed attn rollouts sse ccq)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONWARNINGS=ignore
mkdir -p "$OUT"
step() { echo "== $(date +%T) $*"; }

random_teacher() {  # /root/rand-smollm2: random-weight SmolLM2-135M (seeded), once per machine
  [ -f /root/rand-smollm2/config.json ] && return
  python3 - <<'PY'
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
torch.manual_seed(0)
cfg = AutoConfig.from_pretrained(".tiny/smollm2")
AutoModelForCausalLM.from_config(cfg).save_pretrained("/root/rand-smollm2")
AutoTokenizer.from_pretrained(".tiny/smollm2").save_pretrained("/root/rand-smollm2")
PY
}

RUNS=$(mktemp -d)   # sse_run's per-run rows, merged into one file per step (a device call returns at most 8 files)
trap 'rm -rf "$RUNS"' EXIT

sse_run() {  # sse_run LABEL NAME DIR [VAR=VALUE ...]: profile_sse.py on the tree in DIR, SSE only, at SSE_T
  local label=$1 name=$2 dir=$3
  shift 3
  (cd "$dir" && env "$@" timeout 200 python3 -m benchmarks.ops.profile_sse --T "${SSE_T:-16384}" --no-fla \
     --out "$RUNS/$name.json" 2>&1 | grep -v Warning | tail -30) | sed "s/^/[$label] /"
}

summarize_runs() {  # summarize_runs STEP: one line per run and case of $OUT/STEP.json (device ms, top kernels)
  python3 - "$OUT/$1.json" <<'PY'
import json, sys
for run, rows in json.load(open(sys.argv[1])).items():
    for c in rows["cases"]:
        top = ", ".join(f"{t['kernel'].strip('_')[:14]} {t['ms']:.3f}" for t in c["top"][:5])
        print(f"{run:<22} {c['case']:<26} {c['T']:>6} {c['device_ms']:8.3f} ms  "
              f"peak {c.get('peak_mb', 0):6.0f} MiB  {top}")
PY
}

merge_runs() {  # merge_runs STEP: $OUT/STEP.json = {run name: its profile_sse rows} of the runs so far, in run order
  python3 - "$RUNS" "$OUT/$1.json" <<'PY'
import json, pathlib, sys
runs = sorted(pathlib.Path(sys.argv[1]).glob("*.json"), key=lambda p: p.stat().st_mtime_ns)
pathlib.Path(sys.argv[2]).write_text(json.dumps({p.stem: json.loads(p.read_text()) for p in runs}, indent=1))
PY
  rm -f "$RUNS"/*.json
}

for s in "${STEPS_[@]}"; do
  step "$s"
  case $s in
    tests)
      # the CUDA cases only (the CPU cases run in CI); ~45 s on an H100. Not under pytest-xdist: 8 workers
      # sharing the GPU hung past 300 s there
      timeout 300 python3 -m pytest -q -p no:cacheprovider tests/ops/sse/test_sse_gpu_paths.py \
        tests/ops/sse/test_gpu_sse_decode.py tests/ops/ccq/test_ccq_triton.py tests/ops/attn_decode/test_attn_decode.py \
        tests/generation/test_fast.py tests/eval/test_generate.py tests/ops/delta/test_erase.py tests/ops/ccq/test_ccq_clean.py -k "cuda or gpu" -rfE \
        2>&1 | tail -40 \
        | tee "$OUT/tests.log"
      # every case of the decode GEMM runs on the GPU when there is one (autotuning included)
      timeout 200 python3 -m pytest -q -p no:cacheprovider tests/ops/decode_gemm/test_decode_linear.py -rfE 2>&1 | tail -15 \
        | tee -a "$OUT/tests.log" ;;
    speed)
      random_teacher
      timeout 150 python3 -u -m benchmarks.pipeline.eval_default --teacher /root/rand-smollm2 --model converted=convert \
        --tasks speed --device cuda --dtype bfloat16 --speed-lengths 1k,2k,4k,8k --speed-batch 1,8 \
        --decode-tokens 32 --time-budget 140 --out "$OUT/speed" 2>&1 | tail -30 ;;
    attn)
      timeout 60 python3 -m hybridize.ops.attn_decode.triton_split_kv 2>&1 | tail -15 | tee "$OUT/attn_decode.log" ;;
    rollouts)
      timeout 120 python3 -m benchmarks.generation.rollouts --no-grpo --shapes qwen3-1.7b,smollm2-135m --prompt-lens 16384 \
        --batch 8 --new-tokens 48 --attention sdpa,triton --out "$OUT/rollouts_attn.json" 2>&1 | tail -20 ;;
    sse)
      timeout 110 python3 -m benchmarks.ops.kernels --T 4096,16384 --sections gla,sse,decode --sse-n 4 \
        --out "$OUT/bench_sse.json" 2>&1 | tail -30 ;;
    qdelta)
      timeout 300 python3 -m benchmarks.ops.kernels --T 4096,16384,32768,65536 --sections delta \
        --out "$OUT/bench_delta.json" 2>&1 | tail -20 ;;
    layers)
      timeout 400 python3 -m benchmarks.layers.layers --T ${LAYER_T:-4096,16384} --mixers ${LAYER_MIXERS:-ccq_gla,ccq_gdn,sse,qdelta} \
        --out "$OUT/layers.json" 2>&1 | tail -40 ;;
    ccq)
      timeout 300 python3 -m benchmarks.ops.ccq_triton --T ${CCQ_T:-4096,16384} --segments ${CCQ_SEGMENTS:-auto,0,128,256,512,1024} \
        --out "$OUT/ccq_triton.json" 2>&1 | tail -40 ;;
    profile|profile_compile)
      c=off; [ "$s" = profile_compile ] && c=on
      timeout 200 python3 -m benchmarks.generation.profile_decode --shape qwen3-1.7b --prompt-len 16384 --batch 8 --steps 16 \
        --compile $c --gemm ${GEMM:-auto} --json "$OUT/$s.json" 2>&1 | tail -70 | tee "$OUT/$s.log" ;;
    profile_pair)
      for m in teacher hybrid; do
        timeout 200 python3 -m benchmarks.generation.profile_decode --shape qwen3-1.7b --prompt-len "${PROMPT:-2048}" \
          --batch "${BATCH:-1}" --steps 16 --compile on --model $m --json "$OUT/profile_pair_$m.json" 2>&1 | tail -40
      done ;;
    fp32)
      timeout 200 python3 -m benchmarks.generation.rollouts --no-grpo --shapes qwen3-1.7b --prompt-lens 16384 --batch 8 \
        --new-tokens 48 --dtype float32 --attention triton --budget 190 --out "$OUT/rollouts_fp32.json" 2>&1 | tail -12 ;;
    compile)
      timeout 420 python3 -m benchmarks.generation.rollouts --no-grpo --shapes ${SHAPES:-qwen3-1.7b,smollm2-135m} --prompt-lens 16384 \
        --batch 8 --new-tokens 48 --attention triton --compile ${COMPILE_MODES:-off,on} --gemm ${GEMMS:-auto} --budget 400 \
        --out "$OUT/rollouts_compile.json" 2>&1 | tail -16 ;;
    gemm)
      timeout 200 python3 -m benchmarks.ops.decode_gemm --rows 8 --out "$OUT/decode_gemm.json" 2>&1 | tail -16 ;;
    sse_profile)
      timeout 200 python3 -m benchmarks.ops.profile_sse --T 4096,16384 --out "$OUT/profile_sse.json" 2>&1 | tail -120 ;;
    sse_ab)
      for r in $(seq 1 "${ROUNDS:-2}"); do
        sse_run "this $r" "sse_ab_this_$r" .
        read -ra BASES <<< "${BASE:?BASE: the other tree(s)}"
        for b in "${BASES[@]}"; do
          sse_run "$(basename "$b") $r" "sse_ab_$(basename "$b")_$r" "$b"
        done
      done
      merge_runs sse_ab
      summarize_runs sse_ab ;;
    sse_env)
      # the same tree under each kernel-option setting of ENV_AB (`;`-separated environment assignments, e.g.
      # "HYBRIDIZE_GLA_ROWS=512;HYBRIDIZE_GLA_ROWS=1024"), alternating, ROUNDS times
      IFS=';' read -ra SETS <<< "${ENV_AB:?ENV_AB: settings to alternate}"
      for r in $(seq 1 "${ROUNDS:-2}"); do
        for i in "${!SETS[@]}"; do
          # shellcheck disable=SC2086  # one setting may hold several assignments
          sse_run "${SETS[$i]} $r" "sse_env_${i}_$r" . ${SETS[$i]}
        done
      done
      merge_runs sse_env
      summarize_runs sse_env ;;
    grad_error)
      for seg in auto ${GRAD_SEGMENTS:-2048 0}; do
        arg=(); [ "$seg" != auto ] && arg=(--segment-len "$seg")
        timeout 120 python3 -m benchmarks.ops.gla_grad_error --T "${GRAD_T:-4096}" "${arg[@]}" \
          --out "$OUT/grad_error_$seg.json" 2>&1 | grep -v Warning | tail -4
      done ;;
    scale)
      random_teacher
      for mp in bf16 no; do
        RUNS="ref_1gpu zero2_1proc" STEPS=${SCALE_STEPS:-12} MIXED=$mp RUN_TIMEOUT=150 \
          bash benchmarks/pipeline/scale_gpu.sh "$OUT/scale_$mp" /root/rand-smollm2 "$HYBRIDIZE_DATA_DIR/general_text" 2>&1 | tail -25
      done ;;
    grpo_ds)
      # GRPO on one GPU: plain vs DeepSpeed ZeRO-2 / ZeRO-3 in one process (random-weight 5:1 SSE hybrid of the
      # SmolLM2 config, GSM8K train prompts from $HYBRIDIZE_DATA_DIR, 4 x 8 completions of 128 tokens, 3 steps)
      random_teacher
      [ -f /root/rand-hybrid/config.json ] || python3 -m hybridize.cli convert --src /root/rand-smollm2 \
        --out /root/rand-hybrid --layers 5:1 --mixer sse --samples 1 > "$OUT/grpo_convert.log" 2>&1
      for z in plain 2 3; do
        extra=(); [ $z != plain ] && extra=("grpo.extra={deepspeed: recipes/accelerate/ds_zero$z.json}")
        timeout 200 python3 -m hybridize.cli grpo --model /root/rand-hybrid --output-dir "$OUT/grpo_$z" \
          "data.train=[gsm8k]" grpo.num_generations=8 grpo.per_device_train_batch_size=32 \
          grpo.max_completion_length=128 grpo.max_steps=3 save_steps=0 progress=false "data.eval=" \
          "${extra[@]}" > "$OUT/grpo_$z.log" 2>&1 || { echo "grpo $z FAILED"; tail -15 "$OUT/grpo_$z.log"; }
        python3 - "$OUT/grpo_$z/metrics.jsonl" "$z" <<'PY'
import json, sys
rows = [json.loads(x) for x in open(sys.argv[1])] if __import__("os").path.exists(sys.argv[1]) else []
r = [x for x in rows if "rollout/tokens_per_s" in x]
print(f"grpo {sys.argv[2]}: steps {len(r)}, rollout tok/s {[round(x['rollout/tokens_per_s']) for x in r]}, "
      f"fast {[x.get('rollout/fast') for x in r]}, loss {[x.get('loss') for x in r]}")
PY
      done
      rm -rf "$OUT"/grpo_*/final "$OUT"/grpo_*/checkpoint-* ;;
    *) echo "unknown step $s" ;;
  esac
done
step done
