#!/usr/bin/env bash
# tools/bench_mlx.sh - `tandem bench` on the CPU and MLX backends, alternated
# (CPU, MLX, CPU, MLX: a shared machine's load moves between runs), one
# markdown table with each run's pp/tg figures and the load average beside
# it. On Linux the MLX side is MLX's CPU backend (correctness, not speed:
# docs/mlx.md); on a Mac it is Metal. Needs `make MLX=1 mlx` (build-mlx/).
#
#   tools/bench_mlx.sh [-p N] [-n N] [-r N] MODEL.gguf...
#   e.g. tools/bench_mlx.sh -p 64 -n 16 ../shared/fixtures/models/stories260K-F16.gguf build/models/qwen3-mini-F16.gguf
set -uo pipefail
cd "$(dirname "$0")/.."
P=64 N=16 R=2
while getopts p:n:r: o; do
    case $o in p) P=$OPTARG ;; n) N=$OPTARG ;; r) R=$OPTARG ;; *) exit 2 ;; esac
done
shift $((OPTIND - 1))
[ -x build-mlx/tandem ] || { echo "bench_mlx.sh: build-mlx/tandem missing (make MLX=1 mlx)" >&2; exit 1; }
echo "| model | run | backend | pp$P t/s | tg$N t/s | load (1 min) |"
echo "|---|---:|---|---:|---:|---:|"
for m in "$@"; do
    for run in 1 2; do
        for be in cpu mlx; do
            load=$(cut -d' ' -f1 /proc/loadavg 2>/dev/null || echo "?")
            out=$(build-mlx/tandem bench -m "$m" --backend "$be" -p "$P" -n "$N" -r "$R" --no-bounds -o csv 2>/dev/null)
            pp=$(awk -F, -v t="pp$P" '$0 ~ t {print $0}' <<<"$out" | head -n1)
            tg=$(awk -F, -v t="tg$N" '$0 ~ t {print $0}' <<<"$out" | head -n1)
            col() { head -n1 <<<"$out" | tr ',' '\n' | grep -n "^$1\$" | cut -d: -f1; }
            c=$(col avg_ts); s=$(col stddev_ts)
            f() { [ -n "$1" ] && [ -n "$c" ] && awk -F, -v a="$c" -v b="$s" '{printf "%.1f ± %.1f", $a, $b}' <<<"$1" || printf 'failed'; }
            echo "| $(basename "$m" .gguf) | $run | $be | $(f "$pp") | $(f "$tg") | $load |"
        done
    done
done
