#!/usr/bin/env bash
# tools/ci_parts_bench.sh - where CI's ASan part spends its time, for a
# quiet machine (docs/bench.md, "CI wall time"):
#   alone [TEST...]  each test of tests/alone.txt (or those named) under
#                    ASan+UBSan with make asan's environment, one at a time,
#                    as tests/lanes.sh runs them: wall, user and system
#                    seconds (children included: the servers it started)
#   units [FILE...]  clang's CPU seconds on the avx512 kernel set's compile
#                    units (or the files named) with make asan-build's flags,
#                    one at a time (objects into a temporary folder)
# Needs make asan-build (alone) or clang (units). Prints the load average.
set -u
cd "$(dirname "$0")/.."
mode=${1:-}; shift || true
case "$mode" in
alone)
    tests=("$@")
    [ ${#tests[@]} -gt 0 ] || mapfile -t tests < <(awk '!/^#/ && NF { print $1 }' tests/alone.txt)
    for t in "${tests[@]}"; do
        out=$( { ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 TANDEM_ASAN=1 \
            TANDEM_MODELS=build/models TANDEM_BIN=build-asan/tandem \
            /usr/bin/time -f "TIME %e %U %S" tests/run.sh build-asan/"$t"; } 2>&1)
        printf '%-22s wall/user/sys %s | %s | load %s\n' "$t" "$(sed -n 's/^TIME //p' <<<"$out")" \
            "$(grep -E '^[0-9]+ passed' <<<"$out")" "$(cut -d' ' -f1 /proc/loadavg)"
    done ;;
units)
    files=("$@")
    [ ${#files[@]} -gt 0 ] || files=(src/backend/cpu/quant_avx512*.c)
    tmp=$(mktemp -d) || exit 1
    for f in "${files[@]}"; do
        /usr/bin/time -f "$f: %U s user, %S s sys, %e s wall" clang -fsanitize=address,undefined \
            -fno-omit-frame-pointer -fno-sanitize-recover=undefined -std=c11 -D_GNU_SOURCE -Wall -Wextra \
            -Wno-unused-parameter -g -O1 -pthread -Isrc -mavx2 -mfma -mf16c -falign-loops=64 -gline-tables-only \
            -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -c "$f" -o "$tmp/unit.o"
    done
    rm -rf "$tmp" ;;
*) echo "usage: tools/ci_parts_bench.sh alone [TEST...] | units [FILE...]" >&2; exit 2 ;;
esac
echo "load $(cut -d' ' -f1-3 /proc/loadavg)"
