#!/usr/bin/env bash
# Speculative-decoding benchmark (a benchmark, not a test): one --role local
# node behind a router per variant, the variants alternated within each
# round, each measured by the same client (`tandem bench-serve`) and then
# asked for its drafts (GET /v1/stats: spec_drafted, spec_accepted,
# spec_tokens_per_step).
#   tools/spec_bench.sh MODEL.gguf [ROUNDS=2] [bench-serve options...]
# VARIANTS: node options per variant, separated by ';' (default
# "plain;--lookup 8"; "plain" is none). THREADS (default 2), PARALLEL (8).
# Example, prompt lookup on a quoting prompt at 1 and 8 streams:
#   VARIANTS="plain;--lookup 8" tools/spec_bench.sh M.gguf 2 -c 1,8 -r 2 -n 128 -f prompt.txt
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:?usage: tools/spec_bench.sh MODEL.gguf [ROUNDS] [bench-serve options]}
ROUNDS=${2:-2}
shift $(( $# >= 2 ? 2 : 1 ))
THREADS=${THREADS:-2}
PARALLEL=${PARALLEL:-8}
VARIANTS=${VARIANTS:-"plain;--lookup 8"}
make -j2 build/tandem >/dev/null
DIR=$(mktemp -d /tmp/tandem-spec-bench.XXXXXX); PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$DIR"; }
trap cleanup EXIT INT TERM
wait_file() { for _ in $(seq 1 600); do [ -s "$1" ] && { cat "$1"; return 0; }; sleep 0.1; done; return 1; }

run_variant() {
    local v=$1; shift
    local opts=()
    [ "$v" = plain ] || read -r -a opts <<<"$v"
    rm -f "$DIR"/*.port
    build/tandem serve --role local -m "$MODEL" -t "$THREADS" -c 4096 --parallel "$PARALLEL" --queue 64 \
        --listen 127.0.0.1:0 --port-file "$DIR/l.port" "${opts[@]}" >"$DIR/l.log" 2>&1 & local lp=$!
    PIDS+=("$lp")
    local LPORT; LPORT=$(wait_file "$DIR/l.port")
    build/tandem serve --role router --quiet --listen 127.0.0.1:0 --decode "m=127.0.0.1:$LPORT" \
        --port-file "$DIR/r.port" >"$DIR/r.log" 2>&1 & local rp=$!
    PIDS+=("$rp")
    local RPORT; RPORT=$(wait_file "$DIR/r.port")
    echo "## $v"
    build/tandem bench-serve --url "http://127.0.0.1:$RPORT" --model m "$@" || true
    curl -s "http://127.0.0.1:$LPORT/v1/stats" | python3 -c 'import json,sys; o=json.load(sys.stdin); print("drafts: %s, %d drafted, %d accepted (%.2f), %.2f tokens per sequence step\n" % (o["spec_source"], o["spec_drafted"], o["spec_accepted"], o["spec_acceptance"], o["spec_tokens_per_step"]))'
    kill -TERM $rp $lp; wait $rp $lp 2>/dev/null || true
}

IFS=';' read -r -a VS <<<"$VARIANTS"
for r in $(seq 1 "$ROUNDS"); do
    echo "# round $r, $(basename "$MODEL"), -t $THREADS, --parallel $PARALLEL"
    for v in "${VS[@]}"; do run_variant "$v" "$@"; done
done
