#!/usr/bin/env bash
# Load run (a benchmark, not a test): a router, a prefill node and two decode
# nodes on this machine, then CLIENTS concurrent streaming clients (the Python
# openai client, tools/loadtest.py) for SECONDS.
#   tools/load.sh [CLIENTS=8] [SECONDS=30] [MAX_TOKENS=32] [MODEL=assets/stories260K.gguf]
# Prints requests/s, TTFT and TPOT percentiles, errors and the router's RSS.
set -euo pipefail
cd "$(dirname "$0")/.."
CLIENTS=${1:-8}; SECONDS_=${2:-30}; MAXTOK=${3:-32}; MODEL=${4:-assets/stories260K.gguf}
tools/pyenv.sh || { echo "load.sh: the Python openai client is needed (tools/pyenv.sh failed)"; exit 2; }
make -j2 build/tandem >/dev/null
DIR=$(mktemp -d /tmp/tandem-load.XXXXXX); PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done; rm -rf "$DIR"; }
trap cleanup EXIT INT TERM
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$DIR/secret"
wait_port() { for _ in $(seq 1 600); do [ -s "$1" ] && { cat "$1"; return 0; }; sleep 0.1; done; return 1; }
build/tandem serve --role prefill -m "$MODEL" -t 1 --secret-file "$DIR/secret" --port-file "$DIR/p.port" >"$DIR/p.log" 2>&1 & PIDS+=($!)
PP=$(wait_port "$DIR/p.port")
for d in 1 2; do
  build/tandem serve --role decode -m "$MODEL" -t 1 --secret-file "$DIR/secret" --listen 127.0.0.1:0 --queue 64 \
    --prefill-node "127.0.0.1:$PP" --port-file "$DIR/d$d.port" >"$DIR/d$d.log" 2>&1 & PIDS+=($!)
done
D1=$(wait_port "$DIR/d1.port"); D2=$(wait_port "$DIR/d2.port")
build/tandem serve --role router --quiet --listen 127.0.0.1:0 --secret-file "$DIR/secret" --decode "m=127.0.0.1:$D1" --decode "m=127.0.0.1:$D2" \
  --prefill "m=127.0.0.1:$PP" --port-file "$DIR/r.port" >"$DIR/r.log" 2>&1 & PIDS+=($!); RPID=$!
RP=$(wait_port "$DIR/r.port")
rc=0; build/pyenv/bin/python tools/loadtest.py "http://127.0.0.1:$RP" m "$CLIENTS" "$SECONDS_" "$MAXTOK" "$RPID" || rc=$?
curl -s "http://127.0.0.1:$RP/metrics" | grep -E '^tandem_router_(requests_total|retries_total|prefill_total|decisions_total.*[1-9]$|stream_errors_total)'
exit $rc
