#!/usr/bin/env bash
# draft_node_bench.sh - speculative decoding with the draft model on another
# node (--draft-node, issue 42) over a rate-limited link (a benchmark, not a
# test).
#
# A draft node (`serve --role prefill -m TARGET --draft-model DRAFT`) runs in
# network namespace tandem-dn-p (10.78.0.1), the decode side (a --role local
# node and a router) in tandem-dn-d (10.78.0.2); the veth pair between them
# is shaped with a token bucket filter (tbf) at RATE, as tools/netbed.sh
# does. Each round runs every variant in turn (alternated, so that load
# drifts hit all of them alike), each measured by `tandem bench-serve`
# through the router, and reads the node's drafts from GET /v1/stats.
# Variants: plain (no drafts), node (--draft-node, adaptive), node-fixed
# (--draft-node --draft-fixed), model (--draft-model DRAFT on the decode node
# itself, for comparison). Without namespaces (not root) it says so and uses
# loopback. Everything it creates is removed on exit.
#
# usage: tools/draft_node_bench.sh [options]
#   -m TARGET       default: the fixtures' stories260K.gguf
#   -d DRAFT        default: the fixtures' stories260K-F16.gguf (the same
#                   weights at another type: it drafts well)
#   --rate R        tc rate (default 10gbit)
#   -c LIST         bench-serve streams (default 1,8)
#   -n N            max_tokens (default 128)
#   -r N            requests per stream per level (default 2)
#   --rounds N      rounds (default 2)
#   -t N            threads per node (default 2)
#   --variants "V ..."  default "plain node node-fixed model"
#   -o FILE         markdown output (default build/draft_node_bench.md)
# env TANDEM_BIN (default build/tandem), TANDEM_FIXTURES (default ../shared/fixtures).
set -euo pipefail
cd "$(dirname "$0")/.."
. tools/netns.sh

BIN=${TANDEM_BIN:-build/tandem}
FIX=${TANDEM_FIXTURES:-../shared/fixtures}
TARGET=$FIX/models/stories260K.gguf
DRAFT=$FIX/models/stories260K-F16.gguf
RATE=10gbit
LEVELS=1,8
NTOK=128
REQS=2
ROUNDS=2
THREADS=2
VARIANTS="plain node node-fixed model"
OUT=build/draft_node_bench.md
NS_P=tandem-dn-p
NS_D=tandem-dn-d
ADDR_P=10.78.0.1
ADDR_D=10.78.0.2

while [ $# -gt 0 ]; do
    case "$1" in
        -m) TARGET=$2; shift 2 ;;
        -d) DRAFT=$2; shift 2 ;;
        --rate) RATE=$2; shift 2 ;;
        -c) LEVELS=$2; shift 2 ;;
        -n) NTOK=$2; shift 2 ;;
        -r) REQS=$2; shift 2 ;;
        --rounds) ROUNDS=$2; shift 2 ;;
        -t) THREADS=$2; shift 2 ;;
        --variants) VARIANTS=$2; shift 2 ;;
        -o) OUT=$2; shift 2 ;;
        -h|--help) sed -n '2,31p' "$0"; exit 0 ;;
        *) echo "draft_node_bench: unknown option $1" >&2; exit 2 ;;
    esac
done
log() { echo "draft_node_bench: $*" >&2; }
[ -x "$BIN" ] || make -j2 "$BIN" >&2
for f in "$TARGET" "$DRAFT"; do [ -f "$f" ] || { log "no model $f"; exit 1; }; done

WORK=$(mktemp -d /tmp/tandem-dn-bench.XXXXXX)
PIDS=()
NETNS=0
cleanup() {
    for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    if [ "$NETNS" = 1 ]; then netns_del "$NS_P" "$NS_D"; fi
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$WORK/secret"

# ==== Link ====
IN_P=(); IN_D=(); HOST_P=127.0.0.1; LINK="loopback (no network namespaces: not root?)"
rc=0
netns_pair "$NS_P" "$NS_D" "$ADDR_P" "$ADDR_D" veth-dnp veth-dnd || rc=$?
if [ "$rc" = 0 ]; then
    NETNS=1
    n=${RATE%%[a-z]*}; u=${RATE#"$n"}
    case "$u" in gbit) bps=$((n * 125000000)) ;; mbit) bps=$((n * 125000)) ;; *) bps=$((n / 8)) ;; esac
    burst=$((bps / 250 > 15000 ? bps / 250 : 15000))   # 4 ms of the rate, at least 10 packets
    ip netns exec "$NS_P" tc qdisc replace dev veth-dnp root tbf rate "$RATE" burst "$burst" latency 100ms
    ip netns exec "$NS_D" tc qdisc replace dev veth-dnd root tbf rate "$RATE" burst "$burst" latency 100ms
    IN_P=(ip netns exec "$NS_P"); IN_D=(ip netns exec "$NS_D"); HOST_P=$ADDR_P
    LINK="veth pair between two network namespaces, tbf $RATE each way"
elif [ "$rc" = 1 ]; then
    NETNS=1; log "could not set up the namespaces; using loopback"
else
    log "network namespaces not available: using loopback"
fi

wait_port() {   # file pid
    for _ in $(seq 1 600); do
        [ -s "$1" ] && { cat "$1"; return 0; }
        kill -0 "$2" 2>/dev/null || return 1
        sleep 0.1
    done
    return 1
}

# ==== The draft node ====
"${IN_P[@]}" "$BIN" serve --role prefill -m "$TARGET" --draft-model "$DRAFT" --listen "$HOST_P:0" \
    --port-file "$WORK/dn.port" --secret-file "$WORK/secret" -t "$THREADS" --draft-slots 8 2>"$WORK/dn.log" &
DN_PID=$!; PIDS+=("$DN_PID")
DN_PORT=$(wait_port "$WORK/dn.port" "$DN_PID") || { cat "$WORK/dn.log" >&2; exit 1; }
DN=$HOST_P:$DN_PORT

# One variant: a local node and a router in the decode namespace, bench-serve
# through the router (JSON rows), then the node's drafts; prints table rows.
run_variant() {
    local round=$1 v=$2 opts=()
    case "$v" in
        plain) ;;
        node) opts=(--draft-node "$DN") ;;
        node-fixed) opts=(--draft-node "$DN" --draft-fixed) ;;
        model) opts=(--draft-model "$DRAFT") ;;
        *) log "unknown variant $v"; return 1 ;;
    esac
    rm -f "$WORK"/l.port "$WORK"/r.port
    "${IN_D[@]}" "$BIN" serve --role local -m "$TARGET" -t "$THREADS" --parallel 8 --queue 64 --listen 127.0.0.1:0 \
        --port-file "$WORK/l.port" --secret-file "$WORK/secret" "${opts[@]}" 2>"$WORK/l.log" &
    local lp=$!; PIDS+=("$lp")
    local LPORT; LPORT=$(wait_port "$WORK/l.port" "$lp") || { cat "$WORK/l.log" >&2; return 1; }
    "${IN_D[@]}" "$BIN" serve --role router --quiet --listen 127.0.0.1:0 --decode "m=127.0.0.1:$LPORT" \
        --secret-file "$WORK/secret" --port-file "$WORK/r.port" 2>"$WORK/r.log" &
    local rp=$!; PIDS+=("$rp")
    local RPORT; RPORT=$(wait_port "$WORK/r.port" "$rp") || { cat "$WORK/r.log" >&2; return 1; }
    sleep 0.5   # the draft node's connection (made in the background)
    "${IN_D[@]}" "$BIN" bench-serve --url "http://127.0.0.1:$RPORT" --model m -c "$LEVELS" -r "$REQS" -n "$NTOK" \
        -o json > "$WORK/bench.json" || true
    "${IN_D[@]}" python3 - "$WORK/bench.json" "$LPORT" "$round" "$v" "$(cut -d' ' -f1 /proc/loadavg)" <<'PY'
import json, sys, urllib.request
rows = json.load(open(sys.argv[1])) if open(sys.argv[1]).read().strip() else []
# /metrics (open; /v1/stats wants the router's signature on a node with a secret)
m = {}
for line in urllib.request.urlopen("http://127.0.0.1:%s/metrics" % sys.argv[2]).read().decode().splitlines():
    if line.startswith("tandem_decode_spec_"):
        m[line.split("{")[0]] = float(line.rsplit(" ", 1)[1])
g = lambda k: m.get("tandem_decode_spec_" + k, 0.0)
for r in rows:
    print("| %s | %s | %d | %.1f | %.2f | %.2f | %d | %d | %.2f | %s |" % (
        sys.argv[3], sys.argv[4], r["streams"], r["tps"], r["tpot_p50_ms"], r["tpot_p99_ms"],
        g("drafted_tokens_total"), g("accepted_tokens_total"), g("tokens_per_step"), sys.argv[5]))
PY
    kill -TERM "$rp" "$lp"; wait "$rp" "$lp" 2>/dev/null || true
}

mkdir -p "$(dirname "$OUT")"
{
    echo "## --draft-node: $(basename "$TARGET") drafted by $(basename "$DRAFT") on another node"
    echo
    echo "Link: $LINK. -t $THREADS per node, --parallel 8, max_tokens $NTOK, $REQS requests per stream;"
    echo "drafted / accepted / tokens per step: the node's totals over all levels of that run (/metrics)."
    echo "load: 1-minute load average when the row was taken."
    echo
    echo "| round | variant | streams | aggregate t/s | TPOT p50 ms | TPOT p99 ms | drafted | accepted | tokens/step | load |"
    echo "|---|---|---|---|---|---|---|---|---|---|"
} | tee "$OUT"
for r in $(seq 1 "$ROUNDS"); do
    for v in $VARIANTS; do run_variant "$r" "$v" | tee -a "$OUT"; done
done
log "table in $OUT"
