#!/usr/bin/env bash
# Runs every test binary given on the command line (or build/test_*), then
# prints the totals as "N passed, M failed, K skipped" (skipped: test parts
# whose fixture files are absent, each named on a "skipped:" line above).
# Exit status is non-zero if any check failed or any binary crashed.
set -u
bins=("$@")
[ ${#bins[@]} -gt 0 ] || bins=(build/test_*)
pass=0; fail=0; skip=0; crashed=0
for b in "${bins[@]}"; do
    [ -f "$b" ] && [ -x "$b" ] || continue
    # A hung test must fail, not stall CI: each binary gets TEST_TIMEOUT seconds.
    out=$(timeout "${TEST_TIMEOUT:-900}" "$b" 2>&1); rc=$?
    printf '%s\n' "$out" | grep -E '^(FAIL|skipped:|[a-z0-9_]+: [0-9]+ passed)' | tail -n 40
    line=$(printf '%s\n' "$out" | grep -E '^[a-z0-9_]+: [0-9]+ passed, [0-9]+ failed' | tail -n 1)
    if [ -z "$line" ]; then
        echo "CRASH $b (exit $rc)"; printf '%s\n' "$out" | tail -n 20; crashed=$((crashed+1)); continue
    fi
    p=$(printf '%s' "$line" | sed -E 's/.*: ([0-9]+) passed.*/\1/')
    f=$(printf '%s' "$line" | sed -E 's/.* ([0-9]+) failed.*/\1/')
    k=$(printf '%s' "$line" | sed -nE 's/.* ([0-9]+) skipped.*/\1/p')
    pass=$((pass+p)); fail=$((fail+f)); skip=$((skip+${k:-0}))
    if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then echo "CRASH $b (exit $rc)"; crashed=$((crashed+1)); fi
done
fail=$((fail+crashed))
echo "$pass passed, $fail failed, $skip skipped"
[ "$fail" -eq 0 ]
