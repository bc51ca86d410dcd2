#!/usr/bin/env bash
# CPU engine benchmark (a benchmark, not a test): `tandem bench` side by side
# with the peer llama-bench builds of ../shared/peers on the same GGUF files
# and threads, the two programs alternated, ROUNDS times; then tandem's own
# bounds table (bandwidth, kernel ceiling, int8 peak) for each file.
#   tools/cpu_bench.sh [ROUNDS=2] MODEL.gguf...
# Environment: THREADS (2), PEERS (../shared/peers), OTHER (a second tandem
# binary, e.g. an older build, run alternately with this one: "before/after").
# A peer that cannot run here (peers/run exits 3 for a CPU without the
# extensions it was built for) or cannot load the architecture is reported
# and skipped. Quiet machine only: every number is a rate.
set -uo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-2}
shift
[ $# -ge 1 ] || { echo "usage: tools/cpu_bench.sh [ROUNDS] MODEL.gguf..." >&2; exit 2; }
THREADS=${THREADS:-2}
PEERS=${PEERS:-../shared/peers}
make -j2 build/tandem >/dev/null || exit 1
rows() { grep -E '^\|.*\| *(pp|tg)[0-9]' || echo "  (no result)"; }

peer() {   # peer NAME MODEL ARGS...
    local name=$1 model=$2; shift 2
    local out; out=$("$PEERS/run" "$name" -m "$model" -t "$THREADS" "$@" 2>&1); local rc=$?
    if [ $rc -eq 3 ]; then
        # peers/run refuses a CPU without every extension of the build machine;
        # the binary itself may still run here (it dies with SIGILL at the
        # first instruction this CPU lacks, so a finished run is a valid one)
        out=$("$PEERS/$name" -m "$model" -t "$THREADS" "$@" 2>&1); rc=$?
        [ $rc -eq 0 ] && echo "  ($name run directly: peers/run refused this CPU)"
    fi
    if [ $rc -eq 132 ]; then echo "  $name: not run (SIGILL: built for instructions this CPU lacks)"; return; fi
    if [ $rc -ne 0 ]; then echo "  $name: not run (exit $rc: $(echo "$out" | tail -1))"; return; fi
    echo "$out" | rows
}

echo "load: $(cat /proc/loadavg); $(grep -m1 'model name' /proc/cpuinfo)"
for round in $(seq 1 "$ROUNDS"); do
    for m in "$@"; do
        echo "## round $round: $(basename "$m")"
        echo "tandem:"; build/tandem bench -m "$m" -t "$THREADS" -p 512 -n 128 -r 3 --no-bounds 2>&1 | rows
        [ -n "${OTHER:-}" ] && { echo "$OTHER:"; "$OTHER" bench -m "$m" -t "$THREADS" -p 512 -n 128 -r 3 --no-bounds 2>&1 | rows; }
        for p in ik-llama-bench llama-bench; do
            echo "$p (-fa 0):"; peer "$p" "$m" -p 512 -n 128 -r 3 -fa 0
            echo "$p (-fa 1):"; peer "$p" "$m" -p 512 -n 128 -r 3 -fa 1
        done
        echo "tandem pp4096, tg64 @ d4096:"
        build/tandem bench -m "$m" -t "$THREADS" -p 4096 -n 0 -gp 4096,64 -r 1 --no-bounds 2>&1 | rows
        [ -n "${OTHER:-}" ] && { echo "$OTHER:"; "$OTHER" bench -m "$m" -t "$THREADS" -p 4096 -n 0 -gp 4096,64 -r 1 --no-bounds 2>&1 | rows; }
        for p in ik-llama-bench llama-bench; do echo "$p pp4096 (-fa 0):"; peer "$p" "$m" -p 4096 -n 0 -r 1 -fa 0; done
    done
done
echo "load: $(cat /proc/loadavg)"
for m in "$@"; do
    echo "## bounds: $(basename "$m")"
    build/tandem bench -m "$m" -t "$THREADS" -p 512 -n 128 -r 3 2>/dev/null | grep -E '^\|' | grep -vE '^\| (model|---)'
done
