#!/usr/bin/env bash
# tests/selftest.sh - the test harness tested: deliberately broken runs
# through tests/run.sh and tests/t.h, each of which must give the totals it
# should (a failure, or a counted, named skip), never a clean pass.
#
#   tests/selftest.sh [harness|cuda|all]   (default all, or $SELFTEST_PART:
#   tools/test.sh runs it through tests/run.sh, which passes no arguments)
#
# harness: tiny programs built from tests/selftest/*.c with tests/t.h (a
#   crash before and after the summary, a binary that checks nothing, one
#   without t.h that says it checked nothing, a missing binary, a skip,
#   the same skip where TANDEM_REQUIRE names it, in every form, and each
#   name .ci/run requires), and a Python package absent for real: jinja2
#   hidden from test_tools (build/test_tools, where built) by a module on
#   PYTHONPATH that fails to import, with and without TANDEM_REQUIRE; and
#   tests/lanes.sh (make asan's lanes) summing its lanes' passes, skips,
#   crashes and missing binaries, and running the binaries its -a list
#   names alone after the lanes (tests/selftest/lane_mark.sh sees whether
#   another test ran beside it), their failures in the sum.
# cuda: the CUDA build's tests (build-cuda, or SELFTEST_CUDA_BIN) on this
#   machine: without a CUDA device each is one counted skip, and a failure
#   where TANDEM_REQUIRE=cuda; with a libcuda.so.1 that is there but broken
#   (tests/selftest/libcuda_broken.c on LD_LIBRARY_PATH) the backend cannot
#   start and that is a failure naming the cause. A machine with a GPU, or
#   no CUDA build, counts these cases as skips ("selftest-cuda").
# Prints "selftest: N passed, M failed[, K skipped]" (selftest_cuda: for the
# cuda part) like a test binary; non-zero exit status if a case failed.
set -u
cd "$(dirname "$0")/.."
part=${1:-${SELFTEST_PART:-all}}
B=${SELFTEST_BUILD:-build/selftest}
CUDA_BIN=${SELFTEST_CUDA_BIN:-build-cuda}
mkdir -p "$B"
pass=0; fail=0; skip=0
OUTER_REQUIRE=${TANDEM_REQUIRE:-}   # the cases below set their own

# In the cases that run real test binaries, N is any count, K at least one
# skip (the named one is checked by MUST_SAY; a fresh clone without the
# fixture set adds "fixtures" skips), Z any number of skips.
# One case: expect NAME WANT_RE WANT_EXIT CMD...: runs CMD, whose last line
# must match the ERE WANT_RE (the totals) and whose exit status must be 0
# (WANT_EXIT ok) or not (WANT_EXIT fail). MUST_SAY, where set, must also
# appear in its output.
expect() {
    local name=$1 want=$2 wexit=$3; shift 3
    local out rc last
    out=$("$@" 2>&1); rc=$?
    last=$(printf '%s\n' "$out" | tail -n 1)
    local ok=1
    printf '%s\n' "$last" | grep -qE "^$want\$" || ok=0
    { [ "$wexit" = ok ] && [ "$rc" -ne 0 ]; } && ok=0
    { [ "$wexit" = fail ] && [ "$rc" -eq 0 ]; } && ok=0
    if [ -n "${MUST_SAY:-}" ] && ! printf '%s\n' "$out" | grep -qF -- "$MUST_SAY"; then ok=0; fi
    if [ "$ok" = 1 ]; then
        pass=$((pass+1)); echo "  ok: $name: $last (exit $rc)"
    else
        fail=$((fail+1))
        echo "FAIL selftest $name: got '$last' (exit $rc), want /$want/ (exit $wexit)${MUST_SAY:+ and '$MUST_SAY'}"
        printf '%s\n' "$out" | tail -n 15 | sed 's/^/    | /'
    fi
}
skip_case() {   # a case that cannot run here: counted like t_skip_what
    case ",$OUTER_REQUIRE," in
    *,all,*|*,"$1",*) fail=$((fail+1)); echo "FAIL required (TANDEM_REQUIRE) $1: $2" ;;
    *) skip=$((skip+1)); echo "skipped: $1: $2" ;;
    esac
}
summary() {
    if [ "$skip" -gt 0 ]; then echo "$1: $pass passed, $fail failed, $skip skipped"
    else echo "$1: $pass passed, $fail failed"; fi
    [ "$fail" -eq 0 ]
}

build() {
    local ok=1 s
    for s in tests/selftest/*.c; do
        case $s in *libcuda_*) continue ;; esac
        cc -std=c11 -D_GNU_SOURCE -Wall -Wextra -Isrc -Itests "$s" -o "$B/$(basename "$s" .c)" || ok=0
    done
    cp tests/selftest/empty_legacy.sh "$B/empty_legacy" || ok=0
    cp tests/selftest/lane_mark.sh "$B/busy" && cp tests/selftest/lane_mark.sh "$B/alone" || ok=0
    printf 'alone  # must see no other test\nfail\ncrash\nnot-built\n' >"$B/alone.txt" || ok=0
    mkdir -p "$B/brokencuda"
    cc -shared -fPIC -Wall tests/selftest/libcuda_broken.c -o "$B/brokencuda/libcuda.so.1" || ok=0
    mkdir -p "$B/nojinja"
    printf 'raise ImportError("hidden by tests/selftest.sh")\n' >"$B/nojinja/jinja2.py"
    [ "$ok" = 1 ] || { echo "FAIL selftest: cannot build tests/selftest/"; fail=$((fail+1)); }
}

# The names .ci/run makes CI require (its TANDEM_REQUIRE default).
ci_required() { sed -nE 's/.*TANDEM_REQUIRE:-([^}"]*).*/\1/p' .ci/run | head -n 1; }

harness() {
    local R=tests/run.sh N='[0-9]+' K='[1-9][0-9]*' Z='[0-9]+'
    # run outside CI's switch unless a case sets it
    local -x TANDEM_REQUIRE=
    expect "one passing check" "1 passed, 0 failed, 0 skipped" ok $R "$B/pass"
    expect "a failing check" "1 passed, 1 failed, 0 skipped" fail $R "$B/fail"
    MUST_SAY="CRASH $B/crash" expect "a crash before the summary" "0 passed, 1 failed, 0 skipped" fail $R "$B/crash"
    MUST_SAY="CRASH $B/crash_late" expect "a crash after a clean summary" "1 passed, 1 failed, 0 skipped" fail \
        $R "$B/crash_late"
    MUST_SAY="no check ran" expect "a binary that checks nothing (t.h)" "0 passed, 1 failed, 0 skipped" fail $R "$B/empty"
    MUST_SAY="EMPTY" expect "a binary that says it checked nothing" "0 passed, 1 failed, 0 skipped" fail \
        $R "$B/empty_legacy"
    MUST_SAY="MISSING" expect "a missing binary" "1 passed, 1 failed, 0 skipped" fail $R "$B/pass" "$B/not-built"
    # tests/lanes.sh (make asan's two lanes): each lane's failures reach the sum
    local L="tests/lanes.sh 2"
    expect "two lanes, both passing" "3 passed, 0 failed, 1 skipped" ok $L "$B/pass" "$B/skip" "$B/pass"
    MUST_SAY="CRASH $B/crash" expect "a crash in the second lane" "2 passed, 1 failed, 0 skipped" fail \
        $L "$B/pass" "$B/crash" "$B/pass"
    MUST_SAY="MISSING" expect "a missing binary in the first lane" "2 passed, 2 failed, 0 skipped" fail \
        $L "$B/not-built" "$B/pass" "$B/fail"
    # tests/lanes.sh -a LIST: the binaries LIST names run after the lanes, one
    # at a time, nothing beside them, and their failures reach the sum too
    local A="tests/lanes.sh -a $B/alone.txt 2"
    rm -rf "$B/marks"; mkdir -p "$B/marks"
    MUST_SAY="$B/alone (alone, after the lanes)" SELFTEST_LANES_DIR="$B/marks" \
        expect "a listed binary alone, nothing beside it" "5 passed, 0 failed, 0 skipped" ok \
        $A "$B/busy" "$B/busy" "$B/alone" "$B/busy" "$B/busy"
    MUST_SAY="$B/fail (alone, after the lanes)" expect "a failure alone" "3 passed, 1 failed, 0 skipped" fail \
        $A "$B/pass" "$B/fail" "$B/pass"
    MUST_SAY="MISSING" expect "a crash and a missing binary alone" "1 passed, 2 failed, 0 skipped" fail \
        $A "$B/crash" "$B/pass" "$B/not-built"
    MUST_SAY="skipped: selftest-thing: deliberately absent" expect "a skip, counted and named" \
        "1 passed, 0 failed, 1 skipped" ok $R "$B/skip"
    expect "a skip among passes" "2 passed, 0 failed, 1 skipped" ok $R "$B/pass" "$B/skip"
    local req
    for req in selftest-thing "other,selftest-thing" "selftest-thing,other" all; do
        MUST_SAY="FAIL required (TANDEM_REQUIRE) selftest-thing" TANDEM_REQUIRE=$req \
            expect "a required skip (TANDEM_REQUIRE=$req)" "1 passed, 1 failed, 0 skipped" fail $R "$B/skip"
    done
    TANDEM_REQUIRE="selftest-thingy,selftest" expect "TANDEM_REQUIRE names another thing" \
        "1 passed, 0 failed, 1 skipped" ok $R "$B/skip"
    # what CI requires: each name, skipped where it is not required, fails under .ci/run's switch
    local ci w
    ci=$(ci_required)
    if [ -z "$ci" ]; then
        echo "FAIL selftest: .ci/run sets no TANDEM_REQUIRE default"; fail=$((fail+1))
    fi
    for w in ${ci//,/ }; do
        SELFTEST_WHAT=$w expect "'$w' absent outside CI" "1 passed, 0 failed, 1 skipped" ok $R "$B/skip"
        SELFTEST_WHAT=$w TANDEM_REQUIRE=$ci expect "'$w' absent under CI's TANDEM_REQUIRE=$ci" \
            "1 passed, 1 failed, 0 skipped" fail $R "$B/skip"
    done
    # a Python package really absent: jinja2, test_tools' oracle
    if [ ! -d "${TANDEM_FIXTURES:-../shared/fixtures}" ]; then
        skip_case selftest-jinja2 "no fixture set: test_tools reaches its Jinja2 oracle only with qwen3's template"
    elif [ -x build/test_tools ]; then
        MUST_SAY="skipped: jinja2:" PYTHONPATH="$B/nojinja" expect "jinja2 absent (test_tools)" \
            "$N passed, 0 failed, $K skipped" ok $R build/test_tools
        MUST_SAY="FAIL required (TANDEM_REQUIRE) jinja2" PYTHONPATH="$B/nojinja" TANDEM_REQUIRE=jinja2 \
            expect "jinja2 absent, required (test_tools)" "$N passed, 1 failed, $Z skipped" fail $R build/test_tools
    else
        skip_case selftest-jinja2 "build/test_tools not built (make): the real jinja2 cases"
    fi
}

cuda() {
    local R=tests/run.sh N='[0-9]+' K='[1-9][0-9]*' Z='[0-9]+'
    local -x TANDEM_REQUIRE= TANDEM_MODELS=${TANDEM_MODELS:-build/models}
    if [ ! -x "$CUDA_BIN/test_backend_ops" ]; then
        skip_case selftest-cuda "no CUDA build in $CUDA_BIN (make CUDA=1 BUILD=$CUDA_BIN)"; return
    fi
    # A machine with an NVIDIA driver and a device cannot show the no-device
    # cases; a machine without the driver library can.
    if ls /dev/nvidia[0-9]* >/dev/null 2>&1 || ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1 '; then
        skip_case selftest-cuda "this machine has an NVIDIA driver: the no-device cases need one without"; return
    fi
    MUST_SAY="skipped: cuda: no CUDA device" expect "CUDA build, no device: test_backend_ops" \
        "$N passed, 0 failed, $K skipped" ok $R "$CUDA_BIN/test_backend_ops"
    MUST_SAY="skipped: cuda: no CUDA device" TANDEM_BACKEND=cuda expect "CUDA build, no device: test_golden" \
        "0 passed, 0 failed, 1 skipped" ok $R "$CUDA_BIN/test_golden"
    if [ -x "$CUDA_BIN/tandem" ] && [ -x "$CUDA_BIN/test_handoff" ]; then
        MUST_SAY="skipped: cuda: no CUDA device" TANDEM_PREFILL_BACKEND=cuda TANDEM_BIN="$CUDA_BIN/tandem" \
            expect "CUDA build, no device: test_handoff" "$N passed, 0 failed, $K skipped" ok $R "$CUDA_BIN/test_handoff"
    fi
    if [ -x "$CUDA_BIN/tandem" ] && [ -x "$CUDA_BIN/test_chain_backend" ]; then   # CUDA slices in chains
        MUST_SAY="skipped: cuda: no CUDA device" TANDEM_PREFILL_BACKEND=cuda TANDEM_BIN="$CUDA_BIN/tandem" \
            expect "CUDA build, no device: test_chain_backend" "0 passed, 0 failed, 1 skipped" ok \
            $R "$CUDA_BIN/test_chain_backend"
        MUST_SAY="FAIL required (TANDEM_REQUIRE) cuda" TANDEM_REQUIRE=cuda TANDEM_PREFILL_BACKEND=cuda \
            TANDEM_BIN="$CUDA_BIN/tandem" expect "no device, cuda required: test_chain_backend" \
            "0 passed, 1 failed, 0 skipped" fail $R "$CUDA_BIN/test_chain_backend"
    fi
    MUST_SAY="FAIL required (TANDEM_REQUIRE) cuda" TANDEM_REQUIRE=cuda expect "no device, cuda required" \
        "$N passed, 1 failed, $Z skipped" fail $R "$CUDA_BIN/test_backend_ops"
    # a driver library that is there but fails: start-up fails, with its cause
    MUST_SAY="the CUDA driver failed" LD_LIBRARY_PATH="$B/brokencuda${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
        expect "CUDA backend cannot start (broken driver): test_backend_ops" "$N passed, 1 failed, $Z skipped" fail \
        $R "$CUDA_BIN/test_backend_ops"
    MUST_SAY="the CUDA driver failed" TANDEM_BACKEND=cuda \
        LD_LIBRARY_PATH="$B/brokencuda${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
        expect "CUDA backend cannot start (broken driver): test_golden" "0 passed, 1 failed, 0 skipped" fail \
        $R "$CUDA_BIN/test_golden"
    # a build without CUDA asked for it is a failure too, not a missing device
    if [ -x build/test_golden ]; then
        MUST_SAY="no CUDA backend" TANDEM_BACKEND=cuda expect "TANDEM_BACKEND=cuda on a build without CUDA" \
            "0 passed, 1 failed, 0 skipped" fail $R build/test_golden
    fi
}

build
case $part in
harness) harness; summary selftest ;;
cuda) cuda; summary selftest_cuda ;;
all) harness; cuda; summary selftest ;;
*) echo "usage: tests/selftest.sh [harness|cuda|all]" >&2; exit 2 ;;
esac
