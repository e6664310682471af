#!/bin/bash
# One device run for issue 6: verify (parallel groups), warm-compile benchmarks (parallel), time them.
# Usage on the device machine, from the repo root: bash benchmarks/ops/gpu_run.sh "$OUT" [T list] [deadline s]
OUT=${1:?out dir}; TS=${2:-4096,16384,32768,65536}; DEADLINE=${3:-200}
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache HYBRIDIZE_AUTOTUNE_TOP=${HYBRIDIZE_AUTOTUNE_TOP:-0}
mkdir -p $TRITON_CACHE_DIR
for f in .tcache/triton.tgz.*; do [ -e "$f" ] && cat .tcache/triton.tgz.* | tar xzf - -C /tmp && break; done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv,noheader
python3 -c "import torch, triton, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__)"
t0=$(date +%s)
for s in gla sse ccq delta decode; do
  timeout ${CHECK_TIMEOUT:-330} python3 -m benchmarks.ops.kernels --warm --sections $s --T 4096 > $OUT/warm_$s.log 2>&1 &
done
timeout ${CHECK_TIMEOUT:-330} python3 -m benchmarks.ops.gpu_check --jobs 7 --out $OUT/check.jsonl 2>&1 | tee $OUT/check.log
echo "check rc=${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s"
wait
echo "warm done after $(( $(date +%s) - t0 )) s"; tail -n 3 $OUT/warm_*.log
timeout $(( DEADLINE + 60 )) python3 -m benchmarks.ops.kernels --T $TS --out $OUT/bench.json --deadline $DEADLINE 2>&1 | tee $OUT/bench.log
echo "bench done after $(( $(date +%s) - t0 )) s"
cat $OUT/warm_*.log > $OUT/warm.log; rm -f $OUT/warm_*.log
tar czf /tmp/triton.tgz -C /tmp tcache && ls -la /tmp/triton.tgz
sz=$(stat -c %s /tmp/triton.tgz)
if [ $sz -lt 44000000 ]; then (cd $OUT && split -b 15000000 /tmp/triton.tgz triton.tgz.); fi
ls -la $OUT
