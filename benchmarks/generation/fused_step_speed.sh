# SSE's one-kernel decode step against its teacher, and against the separate kernels (HYBRIDIZE_SSE_FUSED_STEP=0),
# one device call per group as measured on an H200 (RESULTS.md, "Decode: SSE's token in one kernel"): random
# weights, our engine uncompiled and compiled, bf16, 64 new tokens x 2 calls after a warm-up call, call 2 read; one
# process per row, each cell's teacher beside its hybrid.
# Group `window`: the window layer's split-KV decode step (issue 24 item 4) at the 135M shape, its rows against
# HYBRIDIZE_WINDOW_STEP=0 (the PyTorch step, masked sdpa) and the teacher (RESULTS.md, "Decode: the window layer's
# token in two kernels"; rows benchmarks/results/window_step_decode_h200.json).
#   bash benchmarks/generation/fused_step_speed.sh OUT_DIR [WHEEL_DIR] [GROUP...]   # groups: 1.7b-b1 1.7b-b8 135m window 1.7b-b32
#   WHEEL_DIR: fla-core, einops, transformers; GROUP default: the first three (about 9 minutes on an H200; window: 8; 1.7b-b32: 2)
set -u
OUT=${1:?usage: fused_step_speed.sh OUT_DIR [WHEEL_DIR] [GROUP...]}
if [ -n "${2:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /usr/local/lib/hyb-site "$2"/*.whl
  export PYTHONPATH=/usr/local/lib/hyb-site
fi
shift $(( $# < 2 ? $# : 2 ))
GROUPS_=${*:-1.7b-b1 1.7b-b8 135m}
export HYBRIDIZE_AUTOTUNE_TOP=1 PYTHONWARNINGS=ignore TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
mkdir -p "$OUT/rows"
RECOVERED="attn=16,17,18,20,21,22,23,24;swa=0,1,2,4,6,8,9,10,11,12,13,15,19,26,27,28,29"   # issue 22's run (xiv)
W="--mixer-settings swa.window=512 --mixer-settings swa.sinks=4"
row() { local n=$1; shift; echo "$(date +%T) row $n"
        timeout 200 python3 -m benchmarks.generation.compile_auto --new-tokens 64 --calls 2 --modes off,on \
          --out "$OUT/rows/$n.json" "$@" > "$OUT/rows/$n.log" 2>&1
        echo "$(date +%T) row $n exit $?"; grep "call 2" "$OUT/rows/$n.log" | tail -2; }
separate() { HYBRIDIZE_SSE_FUSED_STEP=0 row "$@"; }
sdpa() { HYBRIDIZE_WINDOW_STEP=0 row "$@"; }
Q="--shape qwen3-1.7b"; S="--model hybrid --plan 5:1 --mixer sse"
for g in $GROUPS_; do case $g in
  1.7b-b1)
    row 17-2kx1-teacher $Q --prompt-len 2048 --batch 1 --model teacher
    row 17-2kx1-fused $Q --prompt-len 2048 --batch 1 $S
    separate 17-2kx1-separate $Q --prompt-len 2048 --batch 1 $S
    row 17-8kx1-teacher $Q --prompt-len 8192 --batch 1 --model teacher
    row 17-8kx1-fused $Q --prompt-len 8192 --batch 1 $S
    row 17-32kx1-teacher $Q --prompt-len 32768 --batch 1 --model teacher
    row 17-32kx1-fused $Q --prompt-len 32768 --batch 1 $S ;;
  1.7b-b8)
    row 17-16kx8-teacher $Q --prompt-len 16384 --batch 8 --model teacher
    row 17-16kx8-fused $Q --prompt-len 16384 --batch 8 $S
    separate 17-16kx8-separate $Q --prompt-len 16384 --batch 8 $S
    row 17-2kx8-teacher $Q --prompt-len 2048 --batch 8 --model teacher
    row 17-2kx8-fused $Q --prompt-len 2048 --batch 8 $S ;;
  135m)
    M="--shape smollm2-135m --prompt-len 8192"
    row 135-8kx8-teacher $M --batch 8 --model teacher
    row 135-8kx8-sse51 $M --batch 8 $S
    row 135-8kx8-xiv $M --batch 8 --model hybrid --plan "$RECOVERED" --mixer sse $W
    row 135-8kx1-teacher $M --batch 1 --model teacher
    row 135-8kx1-xiv $M --batch 1 --model hybrid --plan "$RECOVERED" --mixer sse $W ;;
  window)
    X="--model hybrid --plan $RECOVERED --mixer sse $W"
    for cell in "8192 8" "8192 1" "2048 1" "2048 8" "1024 8" "1024 1"; do set -- $cell
      M="--shape smollm2-135m --prompt-len $1 --batch $2"
      row "135-$(($1 / 1024))kx$2-teacher" $M --model teacher
      row "135-$(($1 / 1024))kx$2-xiv" $M $X
      [ "$1 $2" = "8192 8" ] && sdpa 135-8kx8-xiv-sdpa $M $X
      [ "$1" = 8192 ] || [ "$1 $2" = "2048 8" ] || row "135-$(($1 / 1024))kx$2-sse51" $M $S
    done ;;
  1.7b-b32)
    row 17-2kx32-teacher $Q --prompt-len 2048 --batch 32 --model teacher
    row 17-2kx32-sse51 $Q --prompt-len 2048 --batch 32 $S ;;
  *) echo "unknown group $g (1.7b-b1 | 1.7b-b8 | 135m | window | 1.7b-b32)"; exit 2 ;;
esac; done
echo "DONE $(date +%T)"
