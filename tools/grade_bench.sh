#!/usr/bin/env bash
# Measures `tandem grade --bench N` on several topologies of this machine
# (docs/bench.md, "Grading a class"):
#   one-node      one local node (-t 2) serves both requests (model A for both)
#   two-nodes     two local nodes (-t 1 each), model A for both requests
#   two-models    node A serves the analysis (model A), node B the feedback (model B)
#   split-on      two-models with decode nodes plus one prefill node per model, --split always
#   split-off     the same processes, --split never
#   store-off     one local node (-t 2, SLOTS slots), no KV store (issue 43's baseline)
#   store-on      the same node with the KV store: --kv-cache-ram 2 GiB and a
#                 --kv-cache-dir under build/grade-bench (emptied first)
# Each topology starts its processes, runs one grading of the synthetic class,
# prints the summary and stops everything. On a real cluster, run the same
# `tandem grade --bench N --router URL ...` against its router.
#
# usage: tools/grade_bench.sh [N] [TOPOLOGY...]
#   env: MODEL_A, MODEL_B (GGUF files), PARALLEL (submissions in flight, 4), CTX (8192),
#        SLOTS (store-off/store-on: the node's --parallel, 4), TIMEOUT (grade's
#        per-request --timeout in s, 600: a loaded 2-core machine needs more)
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-16}; shift || true
TOPS=("$@"); [ ${#TOPS[@]} -gt 0 ] || TOPS=(one-node two-nodes two-models split-on split-off)
FIX=${TANDEM_FIXTURES:-../shared/fixtures}
MODEL_A=${MODEL_A:-$FIX/models/qwen3-mini-Q8_0.gguf}
MODEL_B=${MODEL_B:-$FIX/models/qwen2-mini-Q4_0.gguf}
PARALLEL=${PARALLEL:-4}
CTX=${CTX:-8192}
SLOTS=${SLOTS:-4}
TIMEOUT=${TIMEOUT:-600}
BIN=build/tandem
WORK=build/grade-bench
mkdir -p "$WORK"
export TANDEM_SECRET=${TANDEM_SECRET:-$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')}
# Long prompts queue behind each other on 2 cores: the first token of a
# request can come minutes after it was sent, longer than the router's
# default 30 s idle limit (docs/router.md), so the limits are raised.
echo '{"limits": {"idle_timeout_ms": 900000, "request_timeout_ms": 3600000}}' >"$WORK/router.json"
PIDS=()

cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
    PIDS=()
}
trap cleanup EXIT

# start NAME ARGS...: a `tandem serve` process; its port in PORT
start() {
    local name=$1; shift
    rm -f "$WORK/$name.port"
    "$BIN" serve "$@" --listen 127.0.0.1:0 --port-file "$WORK/$name.port" >"$WORK/$name.log" 2>&1 &
    PIDS+=($!)
    for _ in $(seq 600); do
        [ -s "$WORK/$name.port" ] && { PORT=$(cat "$WORK/$name.port"); return; }
        sleep 0.1
    done
    echo "grade_bench: $name did not start (see $WORK/$name.log)" >&2
    exit 1
}

node() {   # node NAME ROLE MODEL THREADS SLOTS [OPTIONS...]
    local name=$1 role=$2 model=$3 threads=$4 slots=$5; shift 5
    start "$name" --role "$role" -m "$model" -t "$threads" -c "$CTX" --parallel "$slots" "$@"
}

run() {    # run TOPOLOGY ROUTER_PORT ANALYSIS_MODEL FEEDBACK_MODEL
    # the load average tells how much else this (shared) machine was doing
    echo "== $1: $N submissions, --parallel $PARALLEL, load average $(cut -d' ' -f1-3 /proc/loadavg)"
    "$BIN" grade --bench "$N" --router "http://127.0.0.1:$2" --analysis-model "$3" --feedback-model "$4" \
        --out "$WORK/out-$1" --parallel "$PARALLEL" --quiet
}

# store_report PORT: the decode node's prompt positions served from its slots
# and its KV store, from /metrics (what the store saved)
store_report() {
    curl -s "http://127.0.0.1:$1/metrics" | grep -E '^tandem_decode_(kv_store_(hits|misses|read_bytes)_total|prompt_tokens|cached)' || true
}

for top in "${TOPS[@]}"; do
    case "$top" in
    one-node)
        node a local "$MODEL_A" 2 8; a=$PORT
        start router --role router --config "$WORK/router.json" --decode "A=127.0.0.1:$a"; r=$PORT
        run "$top" "$r" A A ;;
    two-nodes)
        node a local "$MODEL_A" 1 4; a=$PORT
        node b local "$MODEL_A" 1 4; b=$PORT
        start router --role router --config "$WORK/router.json" --decode "A=127.0.0.1:$a" --decode "A2=127.0.0.1:$b"; r=$PORT
        run "$top" "$r" A A2 ;;
    two-models)
        node a local "$MODEL_A" 1 4; a=$PORT
        node b local "$MODEL_B" 1 4; b=$PORT
        start router --role router --config "$WORK/router.json" --decode "A=127.0.0.1:$a" --decode "B=127.0.0.1:$b"; r=$PORT
        run "$top" "$r" A B ;;
    split-on|split-off)
        # under this load a prompt's first KV frame can come later than the decode
        # node's default 10 s handoff timeout, after which it prefills locally
        # (measured: most analysis prompts fell back with the default)
        node a decode "$MODEL_A" 1 4 --timeout-ms 900000; a=$PORT
        node b decode "$MODEL_B" 1 4 --timeout-ms 900000; b=$PORT
        start pa --role prefill -m "$MODEL_A" -t 1 -c "$CTX"; pa=$PORT
        start pb --role prefill -m "$MODEL_B" -t 1 -c "$CTX"; pb=$PORT
        policy=always; [ "$top" = split-off ] && policy=never
        start router --role router --config "$WORK/router.json" --decode "A=127.0.0.1:$a" --decode "B=127.0.0.1:$b" \
            --prefill "A=127.0.0.1:$pa" --prefill "B=127.0.0.1:$pb" --split "$policy"; r=$PORT
        run "$top" "$r" A B ;;
    store-off|store-on)
        opts=()
        if [ "$top" = store-on ]; then
            rm -rf "$WORK/kvstore"; mkdir -m 700 "$WORK/kvstore"
            opts=(--kv-cache-ram $((2 << 30)) --kv-cache-dir "$WORK/kvstore")
        fi
        node a local "$MODEL_A" 2 "$SLOTS" "${opts[@]}"; a=$PORT
        start router --role router --config "$WORK/router.json" --decode "A=127.0.0.1:$a"; r=$PORT
        /usr/bin/time -f "$top: %e s wall" "$BIN" grade --bench "$N" --router "http://127.0.0.1:$r" --analysis-model A \
            --feedback-model A --out "$WORK/out-$top" --parallel "$PARALLEL" --timeout "$TIMEOUT" --quiet || true
        echo "(load average after: $(cut -d' ' -f1-3 /proc/loadavg))"
        store_report "$a" ;;
    *) echo "grade_bench: unknown topology $top" >&2; exit 2 ;;
    esac
    cleanup
done
