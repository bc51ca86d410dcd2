#!/usr/bin/env bash
# twohost.sh - README's two-machine serving recipe, run as written, across two
# network namespaces.
#
# Takes the ```sh block of README.md's "Serving" section and runs its lines
# in two namespaces standing for the machines `spark` (10.77.1.1) and `mac`
# (10.77.1.2), joined by a veth pair (tools/netns.sh); /etc/netns/NS/hosts
# makes both names resolve inside them. A comment line "# on spark ..." or
# "# on mac ..." says where the lines after it run. Substitutions: build/tandem
# -> $TANDEM_BIN, model.gguf -> the test model, and the router gets
# --split always (under auto a short prompt stays on the decode node).
# Test model: the fixture set's qwen3-mini-Q8_0.gguf (it has a chat template,
# so README's chat request runs too), else assets/stories260K.gguf.
# Checks: every node starts; README's request streams an answer; a greedy
# completion through the router equals `tandem run` on one process; its prompt
# was prefilled on spark (X-Tandem-Prefill: split, computed_remote > 0); and
# the KV bytes the router reports crossed the veth (mac's receive counter);
# every node exits cleanly on SIGTERM, with no sanitizer report in its log.
# Prints "twohost: N passed, M failed[, K skipped]" like the C tests
# (tests/run.sh sums it). Without root or network namespaces it says
# "skipped: ..." and checks nothing.
set -u
cd "$(dirname "$0")/.."
. tools/netns.sh
ROOT=$(pwd)
BIN=$(readlink -f "${TANDEM_BIN:-build/tandem}")
FIX=${TANDEM_FIXTURES:-../shared/fixtures}
NS_S=tandem-spark-$$
NS_M=tandem-mac-$$
ADDR_S=10.77.1.1
ADDR_M=10.77.1.2
PROMPT="Once upon a time, there was a little girl named Lily. She loved to play outside"
pass=0; fail=0; skip=0
PIDS=()

ok() {   # cond-status message
    if [ "$1" = 0 ]; then pass=$((pass+1)); else fail=$((fail+1)); echo "FAIL twohost: $2"; fi
}
# tests/t.h's rule: skip_what WHAT WHY counts "skipped: WHAT: WHY", or a
# failure where TANDEM_REQUIRE (comma list, or "all") names WHAT
skip_what() {
    case ",${TANDEM_REQUIRE:-}," in
    *,all,*|*,"$1",*) fail=$((fail+1)); echo "FAIL required (TANDEM_REQUIRE) $1: $2" ;;
    *) skip=$((skip+1)); echo "skipped: $1: $2" ;;
    esac
}
done_() {
    if [ "$skip" -gt 0 ]; then echo "twohost: $pass passed, $fail failed, $skip skipped"
    else echo "twohost: $pass passed, $fail failed"; fi
    [ "$fail" = 0 ]
    exit
}

# ==== Setup ====
if [ "$(id -u)" != 0 ] || ! command -v ip >/dev/null || ! command -v curl >/dev/null; then
    skip_what netns "two-host recipe test needs root, ip(8) and curl (network namespaces)"
    done_
fi
WORK=$(mktemp -d /tmp/tandem-twohost.XXXXXX)
cleanup() {
    local p
    for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; done
    for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null; done
    netns_del "$NS_S" "$NS_M"
    rm -rf "/etc/netns/$NS_S" "/etc/netns/$NS_M" "$WORK"
    rmdir /etc/netns 2>/dev/null
}
trap cleanup EXIT
trap 'exit 130' INT TERM
rc=0
netns_pair "$NS_S" "$NS_M" "$ADDR_S" "$ADDR_M" veth-s$$ veth-m$$ || rc=$?
if [ "$rc" != 0 ]; then
    skip_what netns "two-host recipe test: cannot create network namespaces (ip netns add failed)"
    done_
fi
for ns in "$NS_S" "$NS_M"; do
    mkdir -p "/etc/netns/$ns"
    printf '127.0.0.1 localhost\n%s spark\n%s mac\n' "$ADDR_S" "$ADDR_M" >"/etc/netns/$ns/hosts"
done
ip netns exec "$NS_M" getent hosts spark >/dev/null; ok $? "the name spark resolves inside the mac namespace"

MODEL=$ROOT/assets/stories260K.gguf
CHAT=0
if [ -f "$FIX/models/qwen3-mini-Q8_0.gguf" ]; then MODEL=$(readlink -f "$FIX/models/qwen3-mini-Q8_0.gguf"); CHAT=1; fi

# ==== The recipe ====
# README's block, continuation lines joined.
recipe=$(awk '/^## Serving/ { s = 1 } s && /^```sh/ { b = 1; next } b && /^```/ { exit } b' README.md |
         sed -e ':a' -e '/\\$/N; s/\\\n[[:space:]]*/ /; ta')
ok $([ -n "$recipe" ]; echo $?) "README.md has a sh block in its Serving section"

name_of() { [ "$1" = "$NS_S" ] && echo spark || echo mac; }

wait_tcp() {   # ns host port pid: until something listens there (60 s)
    local i
    for i in $(seq 1 600); do
        ip netns exec "$1" bash -c "exec 3<>/dev/tcp/$2/$3" 2>/dev/null && return 0
        kill -0 "$4" 2>/dev/null || return 1
        sleep 0.1
    done
    return 1
}

cd "$WORK"
host=""; n_serve=0; curl_line=""; router_ns=""
while IFS= read -r line; do
    case "$line" in
        "# on spark"*) host=$NS_S; continue ;;
        "# on mac"*) host=$NS_M; continue ;;
        "#"*|"") continue ;;
    esac
    line=${line//build\/tandem/$BIN}
    line=${line//model.gguf/$MODEL}
    case "$line" in
        openssl*)
            if command -v openssl >/dev/null; then bash -c "$line"
            else head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >secret.txt; fi
            ok $([ -s secret.txt ]; echo $?) "secret.txt written" ;;
        *" serve "*)
            [ -n "$host" ] || { ok 1 "README: a serve line before any '# on spark' / '# on mac' comment"; continue; }
            case "$line" in *"--role router"*) line="$line --split always"; router_ns=$host ;; esac
            n_serve=$((n_serve+1))
            ip netns exec "$host" bash -c "exec $line" >"serve$n_serve.log" 2>&1 &
            PIDS+=($!)
            listen=$(printf '%s\n' "$line" | sed -nE 's/.*--listen ([^ ]+).*/\1/p')
            lh=${listen%:*}; [ "$lh" = 0.0.0.0 ] && lh=127.0.0.1
            wait_tcp "$host" "$lh" "${listen##*:}" "${PIDS[-1]}"
            ok $? "started on $(name_of "$host"): ${line#"$BIN" } (log: serve$n_serve.log: $(tail -n 2 "serve$n_serve.log" | tr '\n' ' '))" ;;
        curl*) curl_line=$line ;;
    esac
done <<<"$recipe"
ok $([ "$n_serve" = 3 ] && [ -n "$router_ns" ] && [ -n "$curl_line" ]; echo $?) \
   "the recipe has three serve lines and a curl line ($n_serve, router in '$router_ns')"
[ "$fail" = 0 ] || done_
RURL=http://127.0.0.1:$(printf '%s\n' "$curl_line" | sed -nE 's|.*http://127\.0\.0\.1:([0-9]+)/.*|\1|p')

# The router finds both nodes up (health checks over the link).
up=1
for _ in $(seq 1 100); do
    h=$(ip netns exec "$router_ns" curl -s "$RURL/health")
    [ "$(printf '%s' "$h" | grep -o '"up":true' | wc -l)" = 2 ] && { up=0; break; }
    sleep 0.2
done
ok $up "the router sees both nodes up: $h"

# ==== Requests ====
if [ "$CHAT" = 1 ]; then
    out=$(ip netns exec "$router_ns" bash -c "$curl_line -sS" 2>&1)
    printf '%s\n' "$out" | grep -q '"content":"[^"]' && printf '%s\n' "$out" | grep -q '^data: \[DONE\]'
    ok $? "README's chat request streams an answer: $(printf '%s' "$out" | head -c 300)"
else
    skip_what fixtures "README's chat request: $MODEL has no chat template (set TANDEM_FIXTURES for qwen3-mini-Q8_0.gguf)"
fi

rx0=$(ip netns exec "$NS_M" cat "/sys/class/net/veth-m$$/statistics/rx_bytes")
body=$(python3 -c 'import json,sys; print(json.dumps({"model":"mymodel","prompt":sys.argv[1],"max_tokens":16,"temperature":0}))' "$PROMPT")
ip netns exec "$router_ns" curl -sS -D headers.txt "$RURL/v1/completions" -d "$body" >reply.json 2>&1
rx1=$(ip netns exec "$NS_M" cat "/sys/class/net/veth-m$$/statistics/rx_bytes")
text=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["choices"][0]["text"], end="")' reply.json 2>/dev/null)
ok $? "completion through the router: $(head -c 300 reply.json)"
want=$("$BIN" run -m "$MODEL" -p "$PROMPT" -n 16 -t 1 2>/dev/null)
ok $([ -n "$text" ] && [ "$text" = "$want" ]; echo $?) "split answer equals the one-process answer: got '$text', want '$want'"
grep -qi '^X-Tandem-Prefill: split' headers.txt
ok $? "prompt prefilled on the prefill node (X-Tandem-Prefill: split): $(tr '\r\n' '  ' <headers.txt)"

# The router's record of the request: remote positions, KV and wire bytes.
done_line=$(grep -h 'done status=200' serve*.log | grep 'prompt=' | tail -n 1)
kv=$(printf '%s' "$done_line" | sed -nE 's/.* kv_bytes=([0-9]+).*/\1/p')
wire=$(printf '%s' "$done_line" | sed -nE 's/.* wire_bytes=([0-9]+).*/\1/p')
remote=$(printf '%s' "$done_line" | sed -nE 's/.* computed_remote=([0-9]+).*/\1/p')
ok $([ "${remote:-0}" -gt 0 ] && [ "${kv:-0}" -gt 0 ]; echo $?) "router log: positions computed remotely and KV bytes: $done_line"
ok $([ "${wire:-0}" -gt 0 ] && [ $((rx1 - rx0)) -ge "${wire:-0}" ]; echo $?) \
   "the KV crossed the link: mac received $((rx1 - rx0)) bytes on its veth, wire bytes $wire"
echo "twohost: model $(basename "$MODEL"): $remote positions prefilled on spark, $kv KV bytes, $wire wire bytes; mac's veth received $((rx1 - rx0)) bytes"

# ==== Stop ====
# Every process exits on SIGTERM; under the sanitizers (make asan) their
# reports, leaks included, come out then.
stopped=0
for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; done
for p in "${PIDS[@]}"; do wait "$p" || stopped=1; done
PIDS=()
ok $stopped "every node exits cleanly on SIGTERM"
! grep -lE 'ERROR: (AddressSanitizer|LeakSanitizer)|runtime error:' serve*.log
ok $? "no sanitizer report in the node logs: $(grep -hE -m1 'ERROR: (AddressSanitizer|LeakSanitizer)|runtime error:' serve*.log)"
done_
