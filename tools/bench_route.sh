#!/usr/bin/env bash
# bench_route.sh - a class through `tandem grade --bench N` on 2 prefill +
# 2 decode nodes and a router, cache-aware routing on and off, alternating
# (issue 47; docs/bench.md "Routing by cache"). Per run: the prompt positions
# the cluster computed (the prefill nodes' tandem_prefill_tokens_computed_total
# plus the decode nodes' computed_local, as their final lines report them in
# the router's log), the whole prompt positions, grade's submissions/hour and
# the worst time to first token (the router's "done" lines).
#
#   tools/bench_route.sh [MODEL.gguf] [ROUNDS] [N]
# Defaults: build/models/qwen3-mini-F16.gguf, 2 rounds (off, on, off, on), a
# class of 16. Env: SPLIT (auto), PARALLEL (decode slots, 4), GRADE_PAR (4),
# TOKENS (max_tokens of analysis and feedback, 32: the prompts are the point),
# MODES ("off on": the order within a round; "on" alone to study the picks),
# TANDEM_BIN (build/tandem), BENCH_DIR (build/bench_route).
# Each line ends with the 1-minute load average; the router logs at debug
# level, so $dir/MODE.ROUND/rt.log has each pick's terms ("pick:" lines).
set -u
model=${1:-build/models/qwen3-mini-F16.gguf}
rounds=${2:-2}
n=${3:-16}
split=${SPLIT:-auto}
par=${PARALLEL:-4}
gpar=${GRADE_PAR:-4}
tokens=${TOKENS:-32}
bin=${TANDEM_BIN:-build/tandem}
dir=${BENCH_DIR:-build/bench_route}
mkdir -p "$dir"
unset TANDEM_SECRET TANDEM_API_KEY TANDEM_LOG_LEVEL
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$dir/secret"
pids=()

wait_port() {   # file -> port
    for _ in $(seq 1 600); do
        [ -s "$1" ] && { cat "$1"; return 0; }
        sleep 0.1
    done
    echo "no port in $1" >&2; return 1
}

stop_all() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
    pids=()
}
trap stop_all EXIT

run_one() {   # mode (on|off) -> one result line
    local mode=$1 d="$dir/$1.$2"
    rm -rf "$d"; mkdir -p "$d"
    local pp=() mp=() dp=()
    for i in 0 1; do
        "$bin" serve --role prefill -m "$model" -t 1 -c 8192 --secret-file "$dir/secret" --metrics-listen 127.0.0.1:0 \
            --metrics-port-file "$d/pm$i.port" --port-file "$d/pf$i.port" > "$d/pf$i.log" 2>&1 &
        pids+=($!)
    done
    for i in 0 1; do
        "$bin" serve --role decode -m "$model" -t 1 -c 8192 --parallel "$par" --client-share 100 --secret-file "$dir/secret" \
            --listen 127.0.0.1:0 --port-file "$d/dn$i.port" > "$d/dn$i.log" 2>&1 &
        pids+=($!)
    done
    for i in 0 1; do pp[$i]=$(wait_port "$d/pf$i.port"); mp[$i]=$(wait_port "$d/pm$i.port"); dp[$i]=$(wait_port "$d/dn$i.port"); done
    "$bin" serve --role router --listen 127.0.0.1:0 --secret-file "$dir/secret" --split "$split" --cache-aware "$mode" \
        --decode "q=127.0.0.1:${dp[0]}" --decode "q=127.0.0.1:${dp[1]}" \
        --prefill "q=127.0.0.1:${pp[0]}" --prefill "q=127.0.0.1:${pp[1]}" \
        --log-level debug --port-file "$d/rt.port" > "$d/rt.log" 2>&1 &
    pids+=($!)
    local rp; rp=$(wait_port "$d/rt.port")
    local out
    out=$("$bin" grade --bench "$n" --router "http://127.0.0.1:$rp" --analysis-model q --feedback-model q \
        --out "$d/grade" --parallel "$gpar" --analysis-tokens "$tokens" --feedback-tokens "$tokens" --quiet 2>&1)
    local pf=0
    for i in 0 1; do
        local v; v=$(curl -s "http://127.0.0.1:${mp[$i]}/metrics" | awk '/^tandem_prefill_tokens_computed_total/ {s+=$2} END {printf "%d", s}')
        pf=$((pf + v))
    done
    stop_all
    local dl prompt done
    dl=$(grep -o ' computed_local=[0-9]*' "$d/rt.log" | awk -F= '{s+=$2} END {printf "%d", s}')
    prompt=$(grep ' done status=200' "$d/rt.log" | grep -o ' prompt=[0-9]*' | awk -F= '{s+=$2} END {printf "%d", s}')
    done=$(grep -c ' done status=200' "$d/rt.log")
    local ttft; ttft=$(grep ' done status=200' "$d/rt.log" | grep -o ' ttft_ms=[0-9.]*' | awk -F= '$2 > m {m = $2} END {printf "%.1f", m / 1e3}')
    local sph; sph=$(printf '%s\n' "$out" | sed -n 's/.*wall time \([0-9.]*\) s, \([0-9.]*\) submissions\/hour.*/\1 \2/p')
    local load; load=$(cut -d' ' -f1 /proc/loadavg 2>/dev/null || echo '?')
    printf '%-4s requests %3d  prompt positions %8d  computed %8d (prefill nodes %8d, decode nodes %7d)  wall s / subm per hour: %s  worst TTFT %s s  load %s\n' \
        "$mode" "$done" "$prompt" "$((pf + dl))" "$pf" "$dl" "${sph:-?}" "$ttft" "$load"
}

modes=${MODES:-off on}
for r in $(seq 1 "$rounds"); do
    for m in $modes; do run_one "$m" "$r"; done
done
