#!/usr/bin/env bash
# One GPU call that checks and times the GPU paths added for issues 5-7 (device side, repo root):
#   bash benchmarks/gpu_session.sh $OUT
# Needs .whl/ installed on PYTHONPATH and .tiny/smollm2 (config + tokenizer of the embedded default,
# written by `python -c "..."` in benchmarks/README or any SmolLM2-135M folder). Speed runs on a
# random-weight SmolLM2-135M (speed does not depend on the weights' values) and its 5:1 SSE conversion.
set -uo pipefail
OUT=${1:?output folder}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONWARNINGS=ignore
step() { echo "== $(date +%T) $*"; }
step "CUDA tests of the new paths"
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_sse_gpu_paths.py tests/kernels/test_gpu_sse_decode.py \
  tests/kernels/test_ccq_triton.py tests/rl/test_attn_decode.py tests/rl/test_fast_generate.py tests/eval/test_generate.py \
  -rs 2>&1 | tail -25 | tee "$OUT/tests.log"
step "random-weight SmolLM2-135M teacher"
python3 - <<'PY'
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
torch.manual_seed(0)
cfg = AutoConfig.from_pretrained(".tiny/smollm2")
AutoModelForCausalLM.from_config(cfg).save_pretrained("/root/rand-smollm2")
AutoTokenizer.from_pretrained(".tiny/smollm2").save_pretrained("/root/rand-smollm2")
PY
step "speed: teacher vs 5:1 SSE hybrid, 1k-8k"
timeout 150 python3 -u benchmarks/eval_default.py --teacher /root/rand-smollm2 --model converted=convert --tasks speed \
  --device cuda --dtype bfloat16 --speed-lengths 1k,2k,4k,8k --speed-batch 1,8 --decode-tokens 32 --time-budget 140 \
  --out "$OUT/speed" 2>&1 | tail -30
step "decode attention kernel"
timeout 60 python3 -m hybridize.kernels.triton.attn_decode 2>&1 | tail -15 | tee "$OUT/attn_decode.log"
step "rollouts: fast path with sdpa vs triton attention"
timeout 120 python3 benchmarks/rollouts.py --no-grpo --shapes qwen3-1.7b,smollm2-135m --prompt-lens 16384 --batch 8 \
  --new-tokens 48 --attention sdpa,triton --out "$OUT/rollouts_attn.json" 2>&1 | tail -20
step "SSE kernels vs chunk_gla"
timeout 110 python3 benchmarks/kernels.py --T 4096,16384 --sections gla,sse,decode --sse-n 4 --out "$OUT/bench_sse.json" 2>&1 | tail -30
step "CCQ fused read"
timeout 70 python3 benchmarks/ccq_triton.py --T 4096,16384 --H 16 --D 128 --dtype bf16 --out "$OUT/ccq_triton.json" 2>&1 | tail -15
step done
