#!/usr/bin/env bash
# Runs every test binary given on the command line (or build/test_*), then
# prints the totals as "N passed, M failed, K skipped" (skipped: test parts
# that cannot run here, each named on a "skipped: WHAT: WHY" line above,
# tests/t.h's t_skip_what).
# Every "skipped:" and "FAIL" line of every binary is shown. A failure is:
# a failed check, a binary that crashed or exited non-zero, a binary that
# printed no summary line, a binary whose summary says it checked nothing
# and skipped nothing, a binary named here that does not exist (or is not
# executable), and a run with no binary at all.
# Exit status is non-zero if anything failed.
set -u
# The user's own TANDEM_* settings (TANDEM_SECRET, TANDEM_API_KEY,
# TANDEM_LOG_LEVEL for their servers) must not reach the tests: only the
# harness's variables pass (the same list as tests/t.h's t_env_harness).
for v in $(compgen -e | grep '^TANDEM_'); do
    case "$v" in
    TANDEM_BIN|TANDEM_MODELS|TANDEM_REQUIRE|TANDEM_ASAN|TANDEM_FIXTURES|TANDEM_FIXTURES_PARTIAL|TANDEM_REAL_MODELS|\
    TANDEM_BACKEND|TANDEM_PREFILL_BACKEND|TANDEM_DECODE_BACKEND|TANDEM_GOLDEN|TANDEM_GOLDEN_DUMP|TANDEM_GOLDEN_SETS|\
    TANDEM_HANDOFF_ALL|TANDEM_HANDOFF_ONLY|TANDEM_KERNELS|TANDEM_CUDA_*|TANDEM_MLX_*) ;;
    *) unset "$v" ;;
    esac
done
bins=("$@")
[ ${#bins[@]} -gt 0 ] || bins=(build/test_*)
pass=0; fail=0; skip=0; crashed=0; ran=0
for b in "${bins[@]}"; do
    if [ ! -f "$b" ] || [ ! -x "$b" ]; then
        echo "MISSING $b (not built, or not executable): counted as a failure"; crashed=$((crashed+1)); continue
    fi
    ran=$((ran+1))
    # A hung test must fail, not stall CI: each binary gets TEST_TIMEOUT seconds.
    t0=$(date +%s%N)
    out=$(timeout "${TEST_TIMEOUT:-900}" "$b" 2>&1); rc=$?
    # each binary's wall time, where the suite's time goes (tools/test.sh
    # lists the slowest); a line of its own that no totals parser reads
    echo "time ${b##*/}: $(( ($(date +%s%N) - t0) / 1000000 )) ms"
    printf '%s\n' "$out" | grep -E '^(FAIL|skipped:|[a-z0-9_]+: [0-9]+ passed)'
    line=$(printf '%s\n' "$out" | grep -E '^[a-z0-9_]+: [0-9]+ passed, [0-9]+ failed' | tail -n 1)
    if [ -z "$line" ]; then
        echo "CRASH $b (exit $rc, no summary line)"; printf '%s\n' "$out" | tail -n 20; crashed=$((crashed+1)); continue
    fi
    p=$(printf '%s' "$line" | sed -E 's/.*: ([0-9]+) passed.*/\1/')
    f=$(printf '%s' "$line" | sed -E 's/.* ([0-9]+) failed.*/\1/')
    k=$(printf '%s' "$line" | sed -nE 's/.* ([0-9]+) skipped.*/\1/p')
    k=${k:-0}
    pass=$((pass+p)); fail=$((fail+f)); skip=$((skip+k))
    if [ "$p" -eq 0 ] && [ "$f" -eq 0 ] && [ "$k" -eq 0 ]; then
        echo "EMPTY $b: checked nothing and skipped nothing: counted as a failure"; crashed=$((crashed+1))
    elif [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then
        echo "CRASH $b (exit $rc)"; crashed=$((crashed+1))
    fi
done
if [ "$ran" -eq 0 ] && [ "$crashed" -eq 0 ]; then
    echo "NOTHING RAN: no test binary given or found: counted as a failure"; crashed=1
fi
fail=$((fail+crashed))
echo "$pass passed, $fail failed, $skip skipped"
[ "$fail" -eq 0 ]
