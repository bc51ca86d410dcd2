#!/usr/bin/env bash
# tests/lanes.sh [-a LIST] N BIN... - tests/run.sh over BIN... in N lanes at
# once, the binaries LIST names one at a time after them, alone.
#
# Why: under ASan+UBSan most of the suite's wall time is real server
# processes waiting on each other (CI's run of 8373c27: 626 s of ASan
# tests, the two cores idle for 709 core-seconds of that part), so a second
# lane costs little CPU. Every test already runs beside the background
# builds, picks its ports from the kernel and keeps its files in its own
# build/test_NAME.d, so two of them can run side by side. Not the tests
# whose checks are bars on their own time (a flood's handshakes within 1 s,
# a timeout within 1.5 s, an estimate within 20% of the measured time):
# beside another lane on 2 cores they fail by chance (CI's run of c167748,
# test_attack_wire), so LIST (tests/alone.txt for make asan: one binary's
# name a line, "#" comments) names them and they run after the lanes have
# ended, one at a time, with nothing of this suite beside them.
#
# The lanes share one queue, in the order given: each lane takes the next
# binary no lane has taken (mkdir of a claim: atomic), so a lane that drew
# quick tests takes more of them. Each binary's output (run.sh's, less its
# totals line) is printed in the order given, under a line naming its lane,
# then one totals line, "N passed, M failed, K skipped": the sum over every
# binary given, in a lane or alone (tests/run.sh's format, which
# tools/test.sh reads). A binary that printed no totals line (its lane
# died, or never took it) counts as a failure. Exit status non-zero if
# anything failed.
set -u
alone_list=""
if [ "${1:-}" = -a ]; then alone_list=${2:?usage: tests/lanes.sh [-a LIST] N BIN...}; shift 2; fi
n=${1:?usage: tests/lanes.sh [-a LIST] N BIN...}; shift
case "$n" in '' | *[!0-9]* | 0) echo "lanes: N must be a positive number" >&2; exit 2 ;; esac
run=$(dirname "$0")/run.sh
declare -A alone=()
if [ -n "$alone_list" ]; then
    [ -r "$alone_list" ] || { echo "lanes: cannot read $alone_list" >&2; exit 2; }
    while read -r name _; do
        case "$name" in '' | '#'*) ;; *) alone[$name]=1 ;; esac
    done <"$alone_list"
fi
dir=$(mktemp -d "${TMPDIR:-/tmp}/lanes.XXXXXX") || exit 2
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; rm -rf "$dir"' EXIT
bins=("$@")
shared=() solo=()
for i in "${!bins[@]}"; do
    if [ -n "${alone[${bins[i]##*/}]:-}" ]; then solo+=("$i"); else shared+=("$i"); fi
done

# ==== The lanes, then the binaries that run alone ====
# lane L: the shared binaries no other lane has claimed, in order
lane() {
    local i
    for i in "${shared[@]}"; do
        mkdir "$dir/claim.$i" 2>/dev/null || continue
        echo "lane $1 of $n" >"$dir/$i.where"
        "$run" "${bins[i]}" >"$dir/$i.out" 2>&1
    done
}
for ((l = 1; l <= n; l++)); do lane "$l" & pids+=($!); done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
pids=()
for i in "${solo[@]}"; do
    echo "alone, after the lanes" >"$dir/$i.where"
    "$run" "${bins[i]}" >"$dir/$i.out" 2>&1
done

# ==== Output and totals ====
pass=0 fail=0 skip=0
for i in "${!bins[@]}"; do
    echo "== ${bins[i]} ($(cat "$dir/$i.where" 2>/dev/null || echo "never run"))"
    line=$(grep -E '^[0-9]+ passed, [0-9]+ failed' "$dir/$i.out" 2>/dev/null | tail -n 1)
    grep -vE '^[0-9]+ passed, [0-9]+ failed' "$dir/$i.out" 2>/dev/null
    if [ -z "$line" ]; then
        echo "CRASH ${bins[i]}: no totals line from tests/run.sh (its lane died or never took it)"
        fail=$((fail + 1)); continue
    fi
    read -r p _ f _ k _ <<<"${line//,/}"
    pass=$((pass + p)); fail=$((fail + f)); skip=$((skip + k))
done
[ "$rc" -eq 0 ] || [ "$fail" -gt 0 ] || { echo "FAIL lanes: a lane exited non-zero"; fail=$((fail + 1)); }
echo "$pass passed, $fail failed, $skip skipped"
[ "$fail" -eq 0 ]
