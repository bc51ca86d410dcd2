#!/usr/bin/env bash
# The checks that need a GPU (issue: CUDA prefill backend), in one run on a
# machine with one, after `make CUDA=1 BUILD=build-cuda` (or with the
# binaries somewhere else: BIN=DIR). Each step has its own time limit, so a
# hang costs one step, not the run; the log of each lands in $LOG_DIR.
#   1. test_backend_ops: every op of backend.h on the GPU against the CPU
#      backend by NMSE, every weight type, odd sizes; KV rows byte-equal
#   2. test_golden on the CUDA backend (TANDEM_BACKEND=cuda)
#   3. test_handoff with CUDA prefill nodes and CPU decode (the cross-backend
#      KV proof: F16/F32 split output == CPU-only output)
#   4. test_chain_backend with TANDEM_PREFILL_BACKEND=cuda (issue 41):
#      layer-split prefill chains of CUDA slice nodes and chains mixing
#      CUDA and CPU slices both ways, each with a CPU and a CUDA decode
#      side (F16/F32 files: the CPU single-node tokens exactly; quantized:
#      the first token on at least half the runs), a decode node over a
#      CUDA chain (prefix reuse; kill -9 of a CUDA slice mid-prefill), a
#      CUDA slice's RSS below a CUDA whole-model node's. Alone:
#      STEPS=chain tools/cuda_check.sh (T_CHAIN, default 480 s)
#   5. tandem bench --backend cuda on the model files named in BENCH_MODELS
# Step memcheck runs step 1 under compute-sanitizer (every device read and
# write against the bounds of its allocation): a scratch region sized for
# the wrong width once wrote past its buffer with every check passing.
# Step 2 runs again with TANDEM_CUDA_ATTN=cores (long prompts' attention on
# CUDA cores instead of the default tensor cores; step 1 checks both), and
# step 5 benchmarks both ways. Step golden_repeat loads each quantized file
# REPEAT times (default 8) in fresh processes: a race between a weight's
# upload and its first use showed up in about one load in eight, so one
# passing run proves little.
# Needs the fixture set (TANDEM_FIXTURES) for 1-4; the F16 test models are
# generated into TANDEM_MODELS if missing (tools/gen_mini.py, about 10 s).
# A GPU check that could not run is not a pass: TANDEM_REQUIRE gains "cuda"
# and "fixtures" here (tests/t.h), so a machine without a CUDA device, or a
# CUDA backend that cannot start, fails step 1 instead of skipping it. The
# last line names every step that failed (a non-zero exit, a timeout, a
# golden_repeat load that failed, memcheck errors); exit status 1 then.
set -uo pipefail
BIN=${BIN:-build-cuda}
FIX=${TANDEM_FIXTURES:-../shared/fixtures}
MODELS=${TANDEM_MODELS:-$BIN/models}
LOG_DIR=${LOG_DIR:-$BIN/cuda-check}
STEPS=${STEPS:-ops memcheck golden golden_cores golden_repeat handoff chain bench}
REPEAT=${REPEAT:-8}
BENCH_MODELS=${BENCH_MODELS:-}
BENCH_ARGS=${BENCH_ARGS:--p 512,4096,16384 -n 0 -r 3}
export TANDEM_FIXTURES=$FIX TANDEM_MODELS=$MODELS
export TANDEM_REQUIRE="${TANDEM_REQUIRE:+$TANDEM_REQUIRE,}cuda,fixtures"
mkdir -p "$LOG_DIR" "$MODELS"
FAILED=()

step() {   # step NAME LIMIT_S CMD...: runs it, logs, prints the tail and the time
    local name=$1 limit=$2; shift 2
    local t0=$(date +%s.%N)
    echo "== $name ($*)"
    timeout -k 5 "$limit" "$@" >"$LOG_DIR/$name.log" 2>&1
    local rc=$?
    local t1=$(date +%s.%N)
    grep -E '^(FAIL|skipped|handoff:|chain_cuda:|golden|ops|\|)|passed|error|Error' "$LOG_DIR/$name.log" | head -n 60
    tail -n 3 "$LOG_DIR/$name.log"
    awk -v n="$name" -v r="$rc" -v a="$t0" -v b="$t1" 'BEGIN { printf "== %s: rc %d, %.1f s\n", n, r, b - a }'
    [ "$rc" -eq 0 ] || { FAILED+=("$name (rc $rc$( [ "$rc" -eq 124 ] && echo ', timed out'))"); echo "== $name: FAILED"; }
    return "$rc"
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>&1 | head -n 2
pids=; for a in qwen3 qwen3moe qwen2; do
    f=$MODELS/$a-mini-F16.gguf
    [ -f "$f" ] || { python3 "$FIX/tools/gen_mini.py" "$a" "$f" >/dev/null & pids="$pids $!"; }
done
for p in $pids; do wait "$p" || FAILED+=("gen_mini (a test model could not be generated)"); done
for s in $STEPS; do
    case $s in
    ops) step backend_ops ${T_OPS:-180} "$BIN/test_backend_ops" ;;
    golden) TANDEM_BACKEND=cuda step golden ${T_GOLDEN:-240} "$BIN/test_golden" ;;
    golden_cores) TANDEM_CUDA_ATTN=cores TANDEM_BACKEND=cuda step golden_cores ${T_GOLDEN:-240} "$BIN/test_golden" ;;
    golden_repeat)
        for f in "$FIX"/models/*-Q*.gguf; do   # the quantized fixture files present
            [ -f "$f" ] || continue
            q=$(basename "$f" .gguf)
            bad=0
            for i in $(seq 1 "$REPEAT"); do
                TANDEM_BACKEND=cuda TANDEM_GOLDEN=$q timeout -k 5 120 "$BIN/test_golden" >"$LOG_DIR/repeat.log" 2>&1 ||
                    { bad=$((bad + 1)); cp "$LOG_DIR/repeat.log" "$LOG_DIR/repeat-fail-$q.log"; }
            done
            echo "== golden_repeat $q: $((REPEAT - bad)) of $REPEAT loads passed"
            [ "$bad" -eq 0 ] || FAILED+=("golden_repeat $q ($bad of $REPEAT loads failed)")
        done ;;
    memcheck)   # every device access against its allocation's bounds
        san=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
        if [ -z "$san" ]; then echo "== memcheck: no compute-sanitizer: not run"; FAILED+=("memcheck (no compute-sanitizer)"); continue; fi
        step memcheck ${T_MEMCHECK:-600} "$san" --tool memcheck --error-exitcode 9 "$BIN/test_backend_ops"
        grep -E 'ERROR SUMMARY|Invalid' "$LOG_DIR/memcheck.log" | head -n 5 ;;
    handoff) TANDEM_BIN=$BIN/tandem TANDEM_PREFILL_BACKEND=cuda step handoff ${T_HANDOFF:-240} "$BIN/test_handoff" ;;
    chain) TANDEM_BIN=$BIN/tandem TANDEM_PREFILL_BACKEND=cuda step chain ${T_CHAIN:-480} "$BIN/test_chain_backend" ;;
    bench) for m in $BENCH_MODELS; do
               for a in cores tc; do
                   # shellcheck disable=SC2086
                   TANDEM_CUDA_ATTN=$a step "bench-$a-$(basename "$m" .gguf)" ${T_BENCH:-300} "$BIN/tandem" bench \
                       --backend cuda -m "$m" $BENCH_ARGS
                   grep -v INFO "$LOG_DIR/bench-$a-$(basename "$m" .gguf).log"
               done
           done ;;
    esac
done
if [ ${#FAILED[@]} -gt 0 ]; then
    echo "cuda_check: ${#FAILED[@]} step(s) failed: $(IFS=';'; echo "${FAILED[*]}")"
    exit 1
fi
echo "cuda_check: every step passed ($STEPS)"
