#!/usr/bin/env bash
# Device-side steps that need the embedded default's GGUF (98 MB: it travels in parts, one part per call).
#   bash benchmarks/device_default.sh $OUT join .parts1      # call 1: keep part 1 on the machine
#   bash benchmarks/device_default.sh $OUT join .parts2      # call 2: add the rest, check the sha256
#   bash benchmarks/device_default.sh $OUT recipes lr2x,lr3x # demo variants (benchmarks/demo_recipes.py),
#                                                            # in turn, in one process
#   bash benchmarks/device_default.sh $OUT recovery "--time-budget 300"  # demo student vs teacher: eval recovery
#   bash benchmarks/device_default.sh $OUT select "--greedy"   # hybridize select --keep 5 on cuda (ARG: more options)
# The GGUF ends up at /root/p/smollm2.gguf. Needs .whl/ installed on PYTHONPATH (see the device README).
set -uo pipefail
OUT=${1:?output folder}; STEP=${2:?step}; ARG=${3:-}
GGUF=/root/p/smollm2.gguf
SHA=b179c952
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONWARNINGS=ignore
mkdir -p "$OUT" /root/p
case $STEP in
  join)
    cp "$ARG"/gp.* /root/p/
    if [ -f /root/p/gp.ac ]; then
      cat /root/p/gp.a? > "$GGUF" && sha256sum "$GGUF" | grep -q "^$SHA" && echo "GGUF ok" || echo "GGUF BAD"
    else echo "part kept: $(ls /root/p)"; fi ;;
  recipes)
    # one process runs the variants in turn, on the torch kernels: at the demo's small fp32 shapes Triton gains
    # nothing, and its first use compiles and autotunes for minutes (8 processes side by side did so at once)
    HYBRIDIZE_KERNELS=torch timeout ${RECIPE_TIMEOUT:-540} python3 benchmarks/demo_recipes.py --teacher "$GGUF" \
      --variants "$ARG" --out /root/recipes > "$OUT/recipes.log" 2>&1
    cp /root/recipes/recipes.jsonl "$OUT/" 2>/dev/null
    grep -h "RESULT\|Error\|error" "$OUT/recipes.log" | tail -40 ;;
  recovery)
    # the demo's student (default recipe, torch kernels), then the recovery report against the teacher;
    # ARG = extra eval-recovery options
    HYBRIDIZE_KERNELS=torch python3 -m hybridize.cli demo teacher="$GGUF" out=/root/demo > "$OUT/demo.log" 2>&1
    grep -A8 "| model" "$OUT/demo.log"
    HYBRIDIZE_KERNELS=torch python3 -m hybridize.cli eval recovery --teacher "$GGUF" -m demo=/root/demo/student \
      --out "$OUT/recovery" --generation hf $ARG 2>&1 | tee "$OUT/recovery.log" | tail -40 ;;
  select)
    # measured layer selection on the embedded default (its GGUF, the same weights as --src default), defaults of
    # `hybridize select` (target: under 5 minutes on one H100, the teacher's load included); torch kernels as above.
    # A rerun resumes from /root/select (same machine); the timings per phase are in select.json.
    t0=$(date +%s)
    HYBRIDIZE_KERNELS=torch python3 -m hybridize.cli select --src "$GGUF" --keep 5 --mixer sse --device cuda \
      --out /root/select $ARG > "$OUT/select.log" 2>&1
    echo "select: exit $?, $(( $(date +%s) - t0 )) s wall" | tee -a "$OUT/select.log"
    cp /root/select/select.json /root/select/select.md /root/select/select.png /root/select/plan.txt "$OUT/" 2>/dev/null
    grep -v "it/s\]" "$OUT/select.log" | tail -45 ;;
esac
