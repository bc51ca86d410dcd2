#!/usr/bin/env bash
# netbed.sh - the KV handoff over rate-limited links.
#
# Puts a prefill node and the decode side (`tandem bench-handoff`) in two
# network namespaces, tandem-p (10.77.0.1) and tandem-d (10.77.0.2), joined by
# a veth pair whose two ends are shaped with a token bucket filter (tbf) for
# each rate, and collects the bench-handoff tables into one markdown file.
# When namespaces cannot be created (not root, no CAP_NET_ADMIN, a container
# without netns support) it measures plain loopback instead: one table.
# Everything it creates is removed on exit (trap).
#
# usage: tools/netbed.sh [options]
#   -m MODEL          GGUF model (default build/models/qwen3-0.6b-Q8_0.gguf, generated
#                     with `tandem gen-model --preset qwen3-0.6b --type q8_0` if missing,
#                     the vocabulary from the fixture set's qwen3-mini-Q8_0.gguf)
#   -o FILE           markdown output (default build/netbed.md)
#   --rates "R ..."   tc rates (default "10gbit 2500mbit 1gbit")
#   --lengths L       bench-handoff --lengths (default 128,256,512,1024,2048,4096)
#   --wire-dtype D    bench-handoff --wire-dtype (default f16,q8_0)
#   -r N              repetitions (default 1)
#   -t N              threads per node (default 2)
#   --loopback        skip the namespaces
# env TANDEM_BIN: the tandem binary (default build/tandem, built with make if missing).
set -euo pipefail
cd "$(dirname "$0")/.."
. tools/netns.sh

BIN=${TANDEM_BIN:-build/tandem}
MODEL=""
OUT=build/netbed.md
RATES="10gbit 2500mbit 1gbit"
LENGTHS=128,256,512,1024,2048,4096
DTYPES=f16,q8_0
REPS=1
THREADS=2
FORCE_LOOPBACK=0
NS_P=tandem-p
NS_D=tandem-d
ADDR_P=10.77.0.1
ADDR_D=10.77.0.2

while [ $# -gt 0 ]; do
    case "$1" in
        -m) MODEL=$2; shift 2 ;;
        -o) OUT=$2; shift 2 ;;
        --rates) RATES=$2; shift 2 ;;
        --lengths) LENGTHS=$2; shift 2 ;;
        --wire-dtype) DTYPES=$2; shift 2 ;;
        -r) REPS=$2; shift 2 ;;
        -t) THREADS=$2; shift 2 ;;
        --loopback) FORCE_LOOPBACK=1; shift ;;
        -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
        *) echo "netbed: unknown option $1" >&2; exit 2 ;;
    esac
done

log() { echo "netbed: $*" >&2; }

# ==== Setup ====
[ -x "$BIN" ] || make -j"$(nproc 2>/dev/null || echo 2)" "$BIN" >&2
if [ -z "$MODEL" ]; then
    MODEL=build/models/qwen3-0.6b-Q8_0.gguf
    if [ ! -f "$MODEL" ]; then
        mkdir -p build/models
        log "generating $MODEL (random weights, qwen3-0.6b shape)"
        "$BIN" gen-model --preset qwen3-0.6b --type q8_0 -q -o "$MODEL.tmp" \
            --vocab-from "${TANDEM_FIXTURES:-../shared/fixtures}/models/qwen3-mini-Q8_0.gguf" && mv "$MODEL.tmp" "$MODEL"
    fi
fi
[ -f "$MODEL" ] || { echo "netbed: no model $MODEL" >&2; exit 1; }
MAXLEN=$(echo "$LENGTHS" | tr ',' '\n' | sort -n | tail -n 1)

WORK=$(mktemp -d /tmp/tandem-netbed.XXXXXX)
NODE_PID=""
NETNS=0
cleanup() {
    if [ -n "$NODE_PID" ]; then kill "$NODE_PID" 2>/dev/null || true; wait "$NODE_PID" 2>/dev/null || true; fi
    if [ "$NETNS" = 1 ]; then netns_del "$NS_P" "$NS_D"; fi
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$WORK/secret"

# 10gbit -> "10 Gbit/s", 2500mbit -> "2.5 Gbit/s"
rate_label() {
    local r=$1 n u
    n=${r%%[a-z]*}; u=${r#"$n"}
    case "$u" in
        gbit) echo "$n Gbit/s" ;;
        mbit) if [ $((n % 1000)) -eq 0 ]; then echo "$((n / 1000)) Gbit/s";
              elif [ "$n" -ge 1000 ]; then echo "$((n / 1000)).$(((n % 1000) / 100)) Gbit/s";
              else echo "$n Mbit/s"; fi ;;
        *) echo "$r" ;;
    esac
}

# bytes per second of a tc rate (for the bucket size)
rate_bytes() {
    local r=$1 n u
    n=${r%%[a-z]*}; u=${r#"$n"}
    case "$u" in
        gbit) echo $((n * 125000000)) ;;
        mbit) echo $((n * 125000)) ;;
        kbit) echo $((n * 125)) ;;
        *) echo $((n / 8)) ;;
    esac
}

# Starts the prefill node (optionally inside a namespace); sets NODE_PID, NODE_PORT.
start_node() {
    local listen=$1; shift
    rm -f "$WORK/port"
    "$@" "$BIN" serve --role prefill -m "$MODEL" --listen "$listen" --port-file "$WORK/port" \
        --secret-file "$WORK/secret" -t "$THREADS" -c "$MAXLEN" --timeout-ms 120000 2>>"$WORK/node.log" &
    NODE_PID=$!
    for _ in $(seq 1 600); do
        [ -s "$WORK/port" ] && break
        kill -0 "$NODE_PID" 2>/dev/null || { cat "$WORK/node.log" >&2; echo "netbed: prefill node died" >&2; exit 1; }
        sleep 0.1
    done
    NODE_PORT=$(cat "$WORK/port")
}

bench() {
    local node=$1 label=$2; shift 2
    "$@" "$BIN" bench-handoff -m "$MODEL" --prefill-node "$node" --secret-file "$WORK/secret" \
        --lengths "$LENGTHS" --wire-dtype "$DTYPES" -r "$REPS" -t "$THREADS" --timeout-ms 120000 --link-label "$label"
}

# ==== Namespaces ====
setup_netns() {
    local rc=0
    netns_pair "$NS_P" "$NS_D" "$ADDR_P" "$ADDR_D" veth-tp veth-td || rc=$?
    [ "$rc" = 2 ] && return 1
    NETNS=1
    [ "$rc" = 0 ] || return 1
    ip netns exec "$NS_D" ping -c 1 -W 2 "$ADDR_P" >/dev/null 2>&1 || log "(ping unavailable or failed; continuing)"
    return 0
}

shape() {
    local rate=$1 bps burst
    bps=$(rate_bytes "$rate")
    # The bucket holds 2 ms at the rate, at least 256 KiB: tbf needs a burst of
    # at least rate/HZ, and veth hands it 64 KiB GSO segments.
    burst=$((bps / 500)); [ "$burst" -ge 262144 ] || burst=262144
    ip netns exec "$NS_P" tc qdisc replace dev veth-tp root tbf rate "$rate" burst "$burst" latency 100ms
    ip netns exec "$NS_D" tc qdisc replace dev veth-td root tbf rate "$rate" burst "$burst" latency 100ms
}

# ==== Run ====
mkdir -p "$(dirname "$OUT")"
CPU=$(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | sed 's/.*: //' || echo unknown)
CORES=$(nproc 2>/dev/null || echo '?')
{
    echo "# KV handoff test bed"
    echo
    echo "$(date -u '+%Y-%m-%d %H:%M UTC'), $(uname -srm), $CPU, $CORES core(s)."
    echo "Model: \`$MODEL\`. Lengths $LENGTHS, wire dtypes $DTYPES, $REPS repetition(s) after a warm-up, $THREADS thread(s) per node."
    echo
    echo "Both nodes run on this one machine: the prefill node and the decode side share its $CORES core(s),"
    echo "so the decode side's frame handling competes with the prefill compute, and \"remote\" prefill is"
    echo "no faster than local prefill here. What the tables measure is the handoff's cost: bytes, link time,"
    echo "and how much of it is exposed in the time to first token."
    echo
} > "$OUT"

if [ "$FORCE_LOOPBACK" = 0 ] && [ "$(id -u)" = 0 ] && setup_netns; then
    log "namespaces $NS_P ($ADDR_P) and $NS_D ($ADDR_D) joined by veth"
    start_node "$ADDR_P:0" ip netns exec "$NS_P"
    for rate in $RATES; do
        shape "$rate"
        label="$(rate_label "$rate") (tbf, veth)"
        log "measuring $label"
        { echo "## $label"; echo; } >> "$OUT"
        bench "$ADDR_P:$NODE_PORT" "$label" ip netns exec "$NS_D" | tee -a "$OUT" >&2
        echo >> "$OUT"
    done
else
    if [ "$NETNS" = 1 ]; then log "could not set up the namespaces; falling back to loopback"; fi
    [ "$NETNS" = 1 ] && netns_del "$NS_P" "$NS_D"
    NETNS=0
    log "network namespaces not available: measuring plain loopback"
    { echo "## loopback (no network namespaces available: no rate limit)"; echo; } >> "$OUT"
    start_node "127.0.0.1:0"
    bench "127.0.0.1:$NODE_PORT" "loopback" | tee -a "$OUT" >&2
    echo >> "$OUT"
fi
log "wrote $OUT"
