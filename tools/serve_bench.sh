#!/usr/bin/env bash
# Serving benchmark (a benchmark, not a test): tandem (router + one --role
# local node with --parallel 8) and llama.cpp's llama-server (-np 8 -cb) on
# the same GGUF file and threads, measured alternately by the same client
# (`tandem bench-serve`) at 1, 2, 4, 8 and 16 concurrent streams.
#   tools/serve_bench.sh MODEL.gguf [ROUNDS=2] [bench-serve options...]
# llama-server comes from ../shared/peers (it loads llama and qwen2 files;
# for other architectures only tandem runs). Prints one table per run.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:?usage: tools/serve_bench.sh MODEL.gguf [ROUNDS] [bench-serve options]}
ROUNDS=${2:-2}
shift $(( $# >= 2 ? 2 : 1 ))
THREADS=${THREADS:-2}
PEERS=${PEERS:-../shared/peers}
make -j2 build/tandem >/dev/null
DIR=$(mktemp -d /tmp/tandem-serve-bench.XXXXXX); PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$DIR"; }
trap cleanup EXIT INT TERM
wait_file() { for _ in $(seq 1 600); do [ -s "$1" ] && { cat "$1"; return 0; }; sleep 0.1; done; return 1; }

run_tandem() {
    rm -f "$DIR"/*.port
    build/tandem serve --role local -m "$MODEL" -t "$THREADS" -c 4096 --parallel 8 --queue 64 \
        --listen 127.0.0.1:0 --port-file "$DIR/l.port" >"$DIR/l.log" 2>&1 & local lp=$!
    local LPORT; LPORT=$(wait_file "$DIR/l.port")
    build/tandem serve --role router --quiet --listen 127.0.0.1:0 --decode "m=127.0.0.1:$LPORT" \
        --port-file "$DIR/r.port" >"$DIR/r.log" 2>&1 & local rp=$!
    local RPORT; RPORT=$(wait_file "$DIR/r.port")
    echo "## tandem router + --role local --parallel 8 -t $THREADS"
    build/tandem bench-serve --url "http://127.0.0.1:$RPORT" --model m "$@" || true
    kill -TERM $rp $lp; wait $rp $lp 2>/dev/null || true
}

run_llama() {
    [ -x "$PEERS/llama-server" ] || { echo "(no llama-server in $PEERS)"; return 0; }
    local port=$(( 20000 + RANDOM % 20000 ))
    "$PEERS/run" llama-server -m "$MODEL" -t "$THREADS" -np 8 -c 8192 -cb --port "$port" >"$DIR/ls.log" 2>&1 & local sp=$!
    for _ in $(seq 1 600); do curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break; sleep 0.2; done
    if ! curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1; then
        echo "(llama-server did not start: $(tail -n 2 "$DIR/ls.log"))"; kill $sp 2>/dev/null || true; return 0
    fi
    echo "## llama-server -np 8 -cb -t $THREADS"
    build/tandem bench-serve --url "http://127.0.0.1:$port" --model m "$@" || true
    kill -TERM $sp; wait $sp 2>/dev/null || true
}

for r in $(seq 1 "$ROUNDS"); do
    echo "# round $r, $(basename "$MODEL")"
    run_tandem "$@"
    run_llama "$@"
done
