# Window-heavy plans against their teacher and the 5:1 SSE hybrid, one device call (issue 22's recovered plan and
# issue 24's window layer): random weights, our engine uncompiled (CUDA graphs), bf16, 64 new tokens x 2 calls after
# a warm-up call, call 2 read; one process per row, in this order. Results: benchmarks/results/window_plans_speed_h100.json.
#   bash benchmarks/generation/window_plans_speed.sh OUT_DIR [WHEEL_DIR]    # WHEEL_DIR: fla-core, einops, transformers
set -u
OUT=${1:?usage: window_plans_speed.sh OUT_DIR [WHEEL_DIR]}
if [ -n "${2:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /usr/local/lib/hyb-site "$2"/*.whl
  export PYTHONPATH=/usr/local/lib/hyb-site
fi
export HYBRIDIZE_AUTOTUNE_TOP=1 PYTHONWARNINGS=ignore TRANSFORMERS_VERBOSITY=error
mkdir -p "$OUT/speed"
RECOVERED="attn=16,17,18,20,21,22,23,24;swa=0,1,2,4,6,8,9,10,11,12,13,15,19,26,27,28,29"   # run (xiv); SSE elsewhere
W="--mixer-settings swa.window=512 --mixer-settings swa.sinks=4"
row() { local n=$1; shift; echo "$(date +%T) speed $n"
        timeout 120 python3 -m benchmarks.generation.compile_auto --new-tokens 64 --calls 2 --modes off \
          --out "$OUT/speed/$n.json" "$@" > "$OUT/speed/$n.log" 2>&1
        echo "$(date +%T) speed $n exit $?"; grep "off call 2" "$OUT/speed/$n.log" | tail -1; }
row 135m-8kx8-xiv --shape smollm2-135m --prompt-len 8192 --batch 8 --model hybrid --plan "$RECOVERED" --mixer sse $W
row 135m-8kx8-teacher --shape smollm2-135m --prompt-len 8192 --batch 8 --model teacher
row 135m-8kx8-sse51 --shape smollm2-135m --prompt-len 8192 --batch 8 --model hybrid --plan 5:1 --mixer sse
row 1.7b-16kx8-swa4 --shape qwen3-1.7b --prompt-len 16384 --batch 8 --model hybrid --plan attn=5,11,17,23 --mixer swa $W
row 1.7b-16kx8-teacher --shape qwen3-1.7b --prompt-len 16384 --batch 8 --model teacher
row 1.7b-16kx8-sse51 --shape qwen3-1.7b --prompt-len 16384 --batch 8 --model hybrid --plan 5:1 --mixer sse
row 135m-8kx1-xiv --shape smollm2-135m --prompt-len 8192 --batch 1 --model hybrid --plan "$RECOVERED" --mixer sse $W
row 135m-8kx1-teacher --shape smollm2-135m --prompt-len 8192 --batch 1 --model teacher
echo "SPEED DONE $(date +%T)"
