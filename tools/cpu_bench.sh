#!/usr/bin/env bash
# CPU engine benchmark (a benchmark, not a test): `tandem bench` side by side
# with the peer llama-bench builds of ../shared/peers on the same GGUF files
# and threads, the two programs alternated, ROUNDS times; then tandem's own
# bounds table (bandwidth, kernel ceiling, int8 peak) for each file.
#   tools/cpu_bench.sh [ROUNDS=2] MODEL.gguf...
# Environment: THREADS (2), PEERS (../shared/peers), OTHER (a second tandem
# binary, e.g. an older build, run alternately with this one: "before/after").
# A peer that peers/run refuses (exit 3: this CPU lacks an extension of the
# build machine) is run directly; if it then dies with SIGILL it is run
# through tools/peer_fit.sh (its AVX-VNNI and AVX512-FP16 instructions moved
# to exact AVX-512 equivalents, everything else its own). A peer that cannot
# load the architecture is reported and skipped. DEBIAN_PEER=1 adds llama.cpp's llama-bench as Debian
# unstable builds it (tools/peer_debian.sh: one CPU backend per x86-64
# generation, chosen at start-up, so it runs where the reference builds
# cannot; needs root). Quiet machine only: every number is a rate.
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
    local bin="$PEERS/$name"
    local out; out=$("$PEERS/run" "$name" -m "$model" -t "$THREADS" "$@" 2>&1); local rc=$?
    if [ $rc -eq 3 ]; then
        # peers/run refuses a CPU without every extension of the build machine;
        # the binary itself may still run here (it dies with SIGILL at the
        # first instruction this CPU lacks, so a finished run is a valid one)
        out=$("$bin" -m "$model" -t "$THREADS" "$@" 2>&1); rc=$?
        if [ $rc -eq 132 ]; then
            # built with AVX-VNNI and AVX512-FP16: run it with the blocks that
            # hold those moved to exact AVX-512 equivalents (tools/peer_fit.sh)
            out=$(tools/peer_fit.sh "$name" -m "$model" -t "$THREADS" "$@" 2>&1); rc=$?
            [ $rc -eq 0 ] && echo "  ($name: run through tools/peer_fit.sh)"
        elif [ $rc -eq 0 ]; then
            echo "  ($name run directly: peers/run refused this CPU)"
        fi
    fi
    if [ $rc -eq 132 ]; then echo "  $name: not run (SIGILL: built for instructions this CPU lacks)"; return; fi
    if [ $rc -ne 0 ]; then echo "  $name: not run (exit $rc: $(echo "$out" | tail -1))"; return; fi
    echo "$out" | rows
}

echo "load: $(cat /proc/loadavg); $(grep -m1 'model name' /proc/cpuinfo)"
tandem() {   # tandem BINARY MODEL ARGS...
    local bin=$1 model=$2; shift 2
    "$bin" bench -m "$model" -t "$THREADS" --no-bounds "$@" 2>&1 | rows
}
for round in $(seq 1 "$ROUNDS"); do
    for m in "$@"; do
        echo "## round $round: $(basename "$m")"
        for b in build/tandem ${OTHER:-}; do
            echo "$b:"; tandem "$b" "$m" -p 512 -n 128 -r 3
            echo "$b pp4096, tg64 @ d4096:"; tandem "$b" "$m" -p 4096 -n 0 -gp 4096,64 -r 1
        done
        echo "ik-llama-bench:"; peer ik-llama-bench "$m" -p 512 -n 128 -r 3
        echo "ik-llama-bench -rtr 1:"; peer ik-llama-bench "$m" -p 0 -n 128 -r 3 -rtr 1
        echo "ik-llama-bench pp4096, tg64 @ d4096:"; peer ik-llama-bench "$m" -p 4096 -n 0 -gp 4096,64 -r 1
        echo "ik-llama-bench -rtr 1, tg64 @ d4096:"; peer ik-llama-bench "$m" -p 0 -n 0 -gp 4096,64 -r 1 -rtr 1
        echo "llama-bench:"; peer llama-bench "$m" -p 512 -n 128 -r 3
        echo "llama-bench pp4096 (-fa 1):"; peer llama-bench "$m" -p 4096 -n 0 -r 1 -fa 1
        if [ "${DEBIAN_PEER:-0}" = 1 ]; then
            echo "llama-bench (Debian):"; tools/peer_debian.sh "$m" -t "$THREADS" -p 512 -n 128 -r 3 2>&1 | rows
            echo "llama-bench (Debian) pp4096, tg64 @ d4096:"
            tools/peer_debian.sh "$m" -t "$THREADS" -p 4096 -n 0 -r 1 2>&1 | rows
            tools/peer_debian.sh "$m" -t "$THREADS" -p 0 -n 64 -d 4096 -r 1 2>&1 | rows
        fi
    done
done
echo "load: $(cat /proc/loadavg)"
for m in "$@"; do
    echo "## bounds: $(basename "$m")"
    build/tandem bench -m "$m" -t "$THREADS" -p 512 -n 128 -r 3 2>/dev/null | grep -E '^\|' | grep -vE '^\| (model|---)'
done
