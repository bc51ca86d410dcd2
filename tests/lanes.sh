#!/usr/bin/env bash
# tests/lanes.sh N BIN... - tests/run.sh over BIN... in N lanes at once.
#
# Why: under ASan+UBSan most of the suite's wall time is real server
# processes waiting on each other (CI's run of 8373c27: 626 s of ASan
# tests, the two cores idle for 709 core-seconds of that part), so a second
# lane costs little CPU. Every test already runs beside the background
# builds, picks its ports from the kernel and keeps its files in its own
# build/test_NAME.d, so two of them can run side by side.
#
# The binaries go to the lanes round-robin in the order given. Each lane's
# output is printed whole, one lane after the other, then one totals line,
# "N passed, M failed, K skipped", the sum of the lanes' (tests/run.sh's
# format, which tools/test.sh reads). Exit status non-zero if any lane
# failed or printed no totals line.
set -u
n=${1:?usage: tests/lanes.sh N BIN...}; shift
case "$n" in '' | *[!0-9]* | 0) echo "lanes: N must be a positive number" >&2; exit 2 ;; esac
dir=$(mktemp -d "${TMPDIR:-/tmp}/lanes.XXXXXX") || exit 2
trap 'rm -rf "$dir"' EXIT
lanes=()
i=0
for b in "$@"; do lanes[i % n]+="$b"$'\n'; i=$((i + 1)); done
pids=()
for ((l = 0; l < n; l++)); do
    [ -n "${lanes[l]:-}" ] || continue
    mapfile -t bins < <(printf '%s' "${lanes[l]}")
    "$(dirname "$0")/run.sh" "${bins[@]}" >"$dir/$l.out" 2>&1 &
    pids[l]=$!
done
pass=0 fail=0 skip=0 rc=0
for l in "${!pids[@]}"; do
    wait "${pids[l]}" || rc=1
    echo "== lane $((l + 1)) of $n"
    cat "$dir/$l.out"
    line=$(grep -E '^[0-9]+ passed, [0-9]+ failed' "$dir/$l.out" | tail -n 1)
    if [ -z "$line" ]; then
        echo "CRASH lane $((l + 1)): no totals line"; fail=$((fail + 1)); rc=1; continue
    fi
    read -r p _ f _ k _ <<<"${line//,/}"
    pass=$((pass + p)); fail=$((fail + f)); skip=$((skip + k))
done
echo "$pass passed, $fail failed, $skip skipped"
[ "$rc" -eq 0 ] && [ "$fail" -eq 0 ]
