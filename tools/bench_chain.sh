#!/usr/bin/env bash
# bench_chain.sh - time to first token through a layer-split prefill chain
# (2 nodes by default, one core each) against one whole-model prefill node
# on one core (issue 41's speed table), or against the same chain cut
# elsewhere (--against). A benchmark, not a test: runs alternate (chain,
# single, chain, single ...) on the same nodes, every run is printed as a
# markdown row with the load average beside it, and each model and prompt
# length ends with the median single / chain ratio.
#
# usage: tools/bench_chain.sh [options] [MODEL.gguf ...]
#   --sizes "N ..."   prompt lengths in tokens (default "1024 4096 16384")
#   --rounds N        chain/single pairs per length (default 2)
#   --net RATE        slice nodes and single node in one network namespace,
#                     the decode side (tandem run) in another, joined by a
#                     veth pair shaped to RATE (tc tbf, e.g. 10gbit; the hidden
#                     states and the KV rows all cross it); needs root, else
#                     it says so and exits 2
#   --chunk N         fixed rows per chunk of the chain's slice nodes (-b N
#                     --chain-chunks 1); default: -b 512 and the slices' own
#                     choice (--chain-chunks 16: 256 rows at 4,096 tokens for
#                     a dense model; a MoE one keeps 16 rows per expert);
#                     the pipeline's bubble is one chunk of the second slice
#   --single-b N      the single node's -b (default 512)
#   --slices N        slice nodes in the chain (default 2); slice i runs on
#                     core (i - 1) mod the cores
#   --split S         where the slices end: "cost" (default): `tandem
#                     chain-plan --nodes N [--rates R] --prompt-tokens
#                     <largest --sizes>` (FLOPs per half block, the slowest
#                     node's time minimised: for 2 equal nodes (L-1)/2, since
#                     the last block costs only its K/V projection; 3.5 for
#                     8 blocks, 13.5 for 28; docs/layer-split.md, "Balance"
#                     and "Planning a chain"); "rated": the same with the
#                     attention's rate measured on this machine (`tandem
#                     chain-plan --attn-rate measure`, or --attn-rate R);
#                     "count": slice k ends at
#                     floor(k L / N) (L/2 for two); or the N-1 inner bounds,
#                     "B1,B2,..." (a block L or the middle of one, L.5)
#   --against S       instead of the single node, the same chain cut at S
#                     (nodes of both started; the runs alternate); the
#                     ratio column is then against / chain
#   --attn-rate R     the rate "rated" plans with (default: measure)
#   --rates R1,...    the slices' relative speeds, given to the planner
#                     (--split cost) and, with --cpu-share, made real
#   --cpu-share F     cap each slice node at F x its rate of a core (a
#                     cgroup v1 cpu quota, /sys/fs/cgroup/cpu; root), after
#                     its load; the single node at F: nodes of chosen speeds
#                     on a machine with fewer cores than nodes
#   --logs DIR        keep the nodes' logs and each run's stderr in DIR
#   -o FILE           also write the table to FILE
# Without MODEL arguments it benchmarks the issue's two models, generated
# under build/bench-models/ with `tandem gen-model` when absent (the
# vocabulary from the fixture set's qwen3-mini-Q8_0.gguf):
#   qwen3-0.6b-Q8_0.gguf      --preset qwen3-0.6b --type q8_0 (28 layers)
#   qwen3-30b-a3b-8l-Q4_K_M   the Qwen3-30B-A3B shape (2048 wide, 32/4 heads of
#                             128, 128 experts of 768, 8 used) with 8 of its 48
#                             layers, --type q4_k_m
# env TANDEM_BIN (default build/tandem), TANDEM_FIXTURES (default ../shared/fixtures).
#
# Setup: chain = slice i pinned to core (i - 1) mod the cores (2 slices:
# cores 0 and 1; taskset, -t 1, -b 512); single = one whole-model prefill node on core 0,
# -t 1. TTFT is tandem run's "prompt: N tokens in MS ms" less its "connect"
# (request sent to the first token's logits; the decode side, not pinned,
# computes the last position itself; the connections are left out: the
# first HELLO hashes the whole model file, seconds for a large one, which a
# decode server does once at start). Needs 2 cores. Beside it, from the nodes' own log lines
# (load-robust-ish): each slice's compute time and CPU seconds during the
# chain's run (the CPU seconds hold under load; the wall times do not), the second slice's waits for
# hidden states after its first frame (later chunks cost more: their
# attention spans more positions), and the CPU seconds of the decode process
# (tandem run: model load and fingerprint, KV receive, hidden-state relay).
set -euo pipefail
cd "$(dirname "$0")/.."
B=${TANDEM_BIN:-build/tandem}
FIX=${TANDEM_FIXTURES:-../shared/fixtures}
SIZES="1024 4096 16384"; ROUNDS=2; NET=""; OUT=""; MODELS=(); CHUNK=""; SINGLE_B=512; LOGS=""; SPLIT=cost
SLICES=2; AGAINST=""; RATES=""; SHARE=""; ATTN=measure
while [ $# -gt 0 ]; do
    case "$1" in
    --sizes) SIZES=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --net) NET=$2; shift 2 ;;
    --chunk) CHUNK=$2; shift 2 ;;
    --single-b) SINGLE_B=$2; shift 2 ;;
    --split) SPLIT=$2; shift 2 ;;
    --slices) SLICES=$2; shift 2 ;;
    --against) AGAINST=$2; shift 2 ;;
    --rates) RATES=$2; shift 2 ;;
    --attn-rate) ATTN=$2; shift 2 ;;
    --cpu-share) SHARE=$2; shift 2 ;;
    --logs) LOGS=$2; shift 2 ;;
    -o) OUT=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -e/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "bench_chain: unknown option $1" >&2; exit 2 ;;
    *) MODELS+=("$1"); shift ;;
    esac
done
[ -x "$B" ] || { echo "bench_chain: $B not found (make)" >&2; exit 2; }
[ "$(nproc)" -ge 2 ] || { echo "bench_chain: needs 2 cores" >&2; exit 2; }
case "$SLICES" in [1-9]|1[0-6]) ;; *) echo "bench_chain: --slices takes 1..16" >&2; exit 2 ;; esac
CG=/sys/fs/cgroup/cpu
if [ -n "$SHARE" ]; then
    [ -w "$CG" ] || { echo "bench_chain: --cpu-share needs a writable cgroup v1 $CG (root)" >&2; exit 2; }
    awk -v f="$SHARE" 'BEGIN { exit !(f > 0 && f <= 1) }' || { echo "bench_chain: --cpu-share takes 0 < F <= 1" >&2; exit 2; }
fi
RATE=(); IFS=, read -r -a RATE <<<"${RATES:-}"
[ -z "$RATES" ] || [ ${#RATE[@]} = "$SLICES" ] || { echo "bench_chain: --rates gives ${#RATE[@]} rates for $SLICES slices" >&2; exit 2; }

# ==== Models ====
gen() {  # OUT ARGS...: gen-model once
    local out=$1; shift
    [ -f "$out" ] && return 0
    mkdir -p "$(dirname "$out")"
    echo "bench_chain: generating $out" >&2
    TANDEM_FIXTURES=$FIX "$B" gen-model "$@" --vocab-from "$FIX/models/qwen3-mini-Q8_0.gguf" -q -o "$out.tmp"
    mv "$out.tmp" "$out"
}
if [ ${#MODELS[@]} = 0 ]; then
    gen build/bench-models/qwen3-0.6b-Q8_0.gguf --preset qwen3-0.6b --type q8_0
    gen build/bench-models/qwen3-30b-a3b-8l-Q4_K_M.gguf --arch qwen3moe --n-embd 2048 --n-layer 8 --n-head 32 \
        --n-head-kv 4 --head-dim 128 --n-ff 6144 --n-expert 128 --n-expert-used 8 --n-ff-exp 768 --ctx 40960 --type q4_k_m
    MODELS=(build/bench-models/qwen3-0.6b-Q8_0.gguf build/bench-models/qwen3-30b-a3b-8l-Q4_K_M.gguf)
fi
# block count of a GGUF ({arch}.block_count)
layers_of() {
    python3 - "$1" <<'PY'
import struct, sys
f = open(sys.argv[1], 'rb'); d = f.read(1 << 22)
o = 24; nkv = struct.unpack_from('<Q', d, 16)[0]
def s():
    global o
    n = struct.unpack_from('<Q', d, o)[0]; o += 8; v = d[o:o + n]; o += n; return v.decode('utf-8', 'replace')
SZ = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
def skip(t):
    global o
    if t == 8: s()
    elif t == 9:
        et = struct.unpack_from('<I', d, o)[0]; n = struct.unpack_from('<Q', d, o + 4)[0]; o += 12
        for _ in range(n): skip(et)
    else: o += SZ[t]
for _ in range(nkv):
    k = s(); t = struct.unpack_from('<I', d, o)[0]; o += 4
    if k.endswith('.block_count'): print(struct.unpack_from('<I', d, o)[0]); sys.exit(0)
    skip(t)
sys.exit(1)
PY
}

# ==== Nodes ====
T=$(mktemp -d /tmp/bench-chain-XXXXXX)
NS_P=tandem-cp NS_D=tandem-cd ADDR_P=127.0.0.1 INP=() IND=()
cleanup() {
    local p
    for p in $(cat "$T/pids" 2>/dev/null); do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    for p in "$CG"/bench-chain-$$-*; do [ -d "$p" ] && rmdir "$p" 2>/dev/null; done
    if [ -n "$NET" ]; then netns_del "$NS_P" "$NS_D"; fi
    rm -rf "$T"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$T/secret"   # 32 random bytes: nodes refuse less
if [ -n "$NET" ]; then
    . tools/netns.sh
    rc=0; netns_pair "$NS_P" "$NS_D" 10.78.0.1 10.78.0.2 veth-cp veth-cd || rc=$?
    [ "$rc" = 0 ] || { echo "bench_chain: --net needs network namespaces (root, ip(8)); rc $rc" >&2; exit 2; }
    case "$NET" in [0-9]*gbit) ;; *) echo "bench_chain: --net takes NNgbit" >&2; exit 2 ;; esac
    # the bucket holds 2 ms at the rate (as tools/netbed.sh), at least 256 KiB
    bps=$(( ${NET%gbit} * 125000000 )); burst=$((bps / 500)); [ "$burst" -ge 262144 ] || burst=262144
    ip netns exec "$NS_P" tc qdisc replace dev veth-cp root tbf rate "$NET" burst "$burst" latency 100ms
    ip netns exec "$NS_D" tc qdisc replace dev veth-cd root tbf rate "$NET" burst "$burst" latency 100ms
    ADDR_P=10.78.0.1 INP=(ip netns exec "$NS_P") IND=(ip netns exec "$NS_D")
fi
start() {  # MODEL CORE LAYERS|all NAME CTX BATCH [OPTIONS...]
    local L=() pid
    [ "$3" = all ] || L=(--layers "$3")
    L+=("${@:7}")
    rm -f "$T/port.$4"
    "${INP[@]}" taskset -c "$2" "$B" serve --role prefill -m "$1" --secret-file "$T/secret" -t 1 -b "$6" -c "$5" "${L[@]}" \
        --listen "$ADDR_P:0" --port-file "$T/port.$4" --request-ms 3600000 --timeout-ms 600000 --handshake-ms 60000 \
        >"$T/log.$4" 2>&1 &
    pid=$!; echo "$pid" >>"$T/pids"; echo "$pid" >"$T/pid.$4"
    for _ in $(seq 1 3000); do
        [ -s "$T/port.$4" ] && return 0
        kill -0 "$pid" 2>/dev/null || { cat "$T/log.$4" >&2; echo "bench_chain: node $4 died" >&2; exit 1; }
        sleep 0.2
    done
    echo "bench_chain: node $4 did not listen" >&2; exit 1
}
# cap NAME SHARE: node NAME at SHARE of a core from now on (its load ran
# uncapped); a cgroup per node, removed at exit
cap() {
    local d="$CG/bench-chain-$$-$1"
    mkdir -p "$d"
    echo 100000 >"$d/cpu.cfs_period_us"
    awk -v f="$2" 'BEGIN { printf "%d\n", f * 100000 }' >"$d/cpu.cfs_quota_us"
    echo "$(cat "$T/pid.$1")" >"$d/cgroup.procs"
}
# bounds SPLIT: the slices "0:A A:B ... :NL" of a split (see --split)
bounds() {
    local k lo hi b=() out=""
    case "$1" in
    cost) "$B" chain-plan -m "$M" --nodes "$SLICES" ${RATES:+--rates "$RATES"} --prompt-tokens "$maxn" --format bounds |
              tr '\n' ' ' ;;
    rated) "$B" chain-plan -m "$M" --nodes "$SLICES" ${RATES:+--rates "$RATES"} --prompt-tokens "$maxn" \
               --attn-rate "$ATTN" --format bounds | tr '\n' ' ' ;;
    count) for k in $(seq 0 $((SLICES - 1))); do
               printf '%d:%d ' $((k * NL / SLICES)) $(((k + 1) * NL / SLICES))
           done ;;
    *) IFS=, read -r -a b <<<"$1"
       [ ${#b[@]} = $((SLICES - 1)) ] || { echo "bench_chain: --split $1 gives ${#b[@]} bounds for $SLICES slices" >&2; return 1; }
       lo=0; for hi in "${b[@]}" "$NL"; do out+="$lo:$hi "; lo=$hi; done; echo "$out" ;;
    esac
}
# chain_start TAG SPLIT: the slices of one split, named TAG1..TAGN; sets
# SPEC_TAG (the chain spec) and prints nothing
chain_start() {
    local i=0 s spec="" sl=()
    [ -z "$CHUNK" ] || sl=(--chain-chunks 1)
    for s in $(bounds "$2"); do
        i=$((i + 1))
        start "$M" $(((i - 1) % $(nproc))) "$s" "$1$i" "$CTX" "${CHUNK:-512}" "${sl[@]}"
        [ -z "$SHARE" ] || cap "$1$i" "$(awk -v f="$SHARE" -v r="${RATE[$((i - 1))]:-1}" 'BEGIN { print f * r }')"
        spec+="${spec:+,}$ADDR_P:$(cat "$T/port.$1$i")/$s"
    done
    [ "$i" = "$SLICES" ] || { echo "bench_chain: split $2 gave $i slices, not $SLICES" >&2; exit 1; }
    printf -v "SPEC_$1" '%s' "$spec"
}
stop_all() {
    local p
    if [ -n "$LOGS" ]; then mkdir -p "$LOGS"; for p in "$T"/log.*; do cp "$p" "$LOGS/$(basename "$M" .gguf).${p##*/log.}.log" 2>/dev/null || true; done; fi
    for p in $(cat "$T/pids" 2>/dev/null); do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    : >"$T/pids"
}
prompt() {  # N: a prompt of about N tokens (the run reports the exact count)
    python3 -c "
import random; random.seed($1)
w='the of and to in a is that for it as was with be by on not he this are or his from at which but have an they you were her she there one all we their can has more when would some if no what out also so up into only other time'.split()
print(' '.join(random.choice(w) for _ in range($1)))" >"$T/p.$1"
}
load() { cut -d' ' -f1 /proc/loadavg; }
# CPU seconds a node has used (utime + stime of /proc/PID/stat, all its
# threads): what a slice computes, whatever share of its core the load left it
TCK=$(getconf CLK_TCK)
cpu_of() { awk -v t="$TCK" '{ sub(/^.*\) /, ""); printf "%.2f", ($12 + $13) / t }' "/proc/$(cat "$T/pid.$1")/stat" 2>/dev/null || echo 0; }

# ==== Runs ====
emit() { if [ -n "$OUT" ]; then echo "$*" | tee -a "$OUT"; else echo "$*"; fi; }
[ -z "$OUT" ] || : >"$OUT"
maxn=0; for n in $SIZES; do [ "$n" -gt "$maxn" ] && maxn=$n; done
CTX=$((maxn + maxn / 8 + 64))   # the words' token count runs a little over n
CHAIN_ROWS="-b 512, rows their choice"; [ -z "$CHUNK" ] || CHAIN_ROWS="-b $CHUNK --chain-chunks 1"
OTHER="single"; [ -z "$AGAINST" ] || OTHER="against"
emit "bench_chain: $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, link ${NET:-loopback}; chain = $SLICES slices on cores (i-1) mod $(nproc) ($CHAIN_ROWS)${RATES:+, rates $RATES}${SHARE:+, each capped at $SHARE x its rate of a core}, $([ -n "$AGAINST" ] && echo "against = the chain cut at --split $AGAINST" || echo "single = whole model on core 0 (-b $SINGLE_B)${SHARE:+ capped at $SHARE}"), -t 1 each"
emit ""
emit "| model | prompt tokens | round | load | chain TTFT s | $OTHER TTFT s | $OTHER / chain | chain slices | $OTHER slices | chunk rows | slices' compute s | slices' CPU s | last slice waits s | decode CPU s chain / $OTHER |"
emit "|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---:|"
# slices TAG: "A:B,..." of a started chain; figures TAG: its slices' compute
# s and CPU s of the last run (CPU: since cpu0_TAG<i> was read)
slices_of() { echo "$1" | sed 's/[^,]*\/\([0-9.:]*\)/\1/g'; }
for M in "${MODELS[@]}"; do
    NL=$(layers_of "$M") || { echo "bench_chain: no block_count in $M" >&2; exit 2; }
    chain_start a "$SPLIT"
    CHAIN=$SPEC_a
    if [ -n "$AGAINST" ]; then
        chain_start b "$AGAINST"
        OTHERPN=$SPEC_b
    else
        start "$M" 0 all w "$CTX" "$SINGLE_B"
        [ -z "$SHARE" ] || cap w "$SHARE"
        OTHERPN="$ADDR_P:$(cat "$T/port.w")"
    fi
    # one untimed request each first: the weights' pages are in memory and
    # every process has done its first-request work before the timed runs
    prompt 256
    for PN in "$CHAIN" "$OTHERPN"; do
        "${IND[@]}" "$B" run -m "$M" -f "$T/p.256" -n 1 -c "$CTX" -t 1 --secret-file "$T/secret" --prefill-node "$PN" \
            --timeout-ms 600000 >/dev/null 2>"$T/run.err" || { cat "$T/run.err" >&2; exit 1; }
    done
    for n in $SIZES; do
        prompt "$n"
        : >"$T/ratios"
        for r in $(seq 1 "$ROUNDS"); do
            declare -A ms=() cpu=() u0=()
            for mode in chain other; do
                if [ $mode = chain ]; then PN=$CHAIN; else PN=$OTHERPN; fi
                [ $mode = other ] || for i in $(seq 1 "$SLICES"); do u0[$i]=$(cpu_of "a$i"); done
                "${IND[@]}" /usr/bin/time -f "cpu_s %U %S" -o "$T/run.cpu" "$B" run -m "$M" -f "$T/p.$n" -n 1 -c "$CTX" -t 1 \
                    --secret-file "$T/secret" --prefill-node "$PN" --timeout-ms 600000 --deadline-ms 3600000 \
                    >/dev/null 2>"$T/run.err" ||
                    { cat "$T/run.err" >&2; exit 1; }
                [ -z "$LOGS" ] || { mkdir -p "$LOGS"; cp "$T/run.err" "$LOGS/$(basename "$M" .gguf).$n.$r.$mode.err"; }
                read -r tok ms[$mode] < <(sed -n 's/^prompt: \([0-9]*\) tokens in \([0-9.]*\) ms.*/\1 \2/p' "$T/run.err") ||
                    { cat "$T/run.err" >&2; echo "bench_chain: no prompt time in tandem run's output" >&2; exit 1; }
                # the request's time: less the connections, whose first HELLO hashes the whole
                # model file (seconds for a large one; a decode server does it once at start)
                con=$(sed -n 's/^handoff: .*(connect \([0-9.]*\) ms.*/\1/p' "$T/run.err")
                ms[$mode]=$(awk -v a="${ms[$mode]}" -v c="${con:-0}" 'BEGIN { printf "%.1f", a - c }')
                cpu[$mode]=$(awk '/^cpu_s/ { printf "%.1f", $2 + $3 }' "$T/run.cpu")
                [ $mode = other ] || sc=$(for i in $(seq 1 "$SLICES"); do
                    awk -v a="${u0[$i]}" -v b="$(cpu_of "a$i")" 'BEGIN { printf "%.1f\n", b - a }'; done | paste -sd/ | sed 's|/| / |g')
            done
            ratio=$(awk -v s="${ms[other]}" -v c="${ms[chain]}" 'BEGIN { printf "%.2f", s / c }')
            echo "$ratio" >>"$T/ratios"
            # the slices' last request lines: compute_ms=, rows=, act_wait_ms= (waits after the first chunk)
            cs=$(for i in $(seq 1 "$SLICES"); do
                sed -n 's/.* slice [0-9.]*:[0-9.]* chunks=.* compute_ms=\([0-9.]*\).*/\1/p' "$T/log.a$i" | tail -1 |
                    awk '{ printf "%.1f\n", $1 / 1000 }'; done | paste -sd/ | sed 's|/| / |g')
            rows=$(sed -n 's/.* slice [0-9.]*:[0-9.]* chunks=.* rows=\([0-9]*\).*/\1/p' "$T/log.a$SLICES" | tail -1)
            wb=$(sed -n 's/.* slice [0-9.]*:[0-9.]* chunks=.* act_wait_ms=\([0-9.]*\).*/\1/p' "$T/log.a$SLICES" | tail -1)
            emit "| $(basename "$M" .gguf) | $tok | $r | $(load) | $(awk -v v="${ms[chain]}" 'BEGIN{printf "%.1f", v/1000}') |" \
                 "$(awk -v v="${ms[other]}" 'BEGIN{printf "%.1f", v/1000}') | $ratio | $(slices_of "$CHAIN") |" \
                 "$([ -n "$AGAINST" ] && slices_of "$OTHERPN" || echo whole) | ${rows:-?} | $cs | $sc |" \
                 "$(awk -v v="${wb:-0}" 'BEGIN{printf "%.1f", v/1000}') | ${cpu[chain]} / ${cpu[other]} |"
        done
        emit "| $(basename "$M" .gguf) | $tok | median | | | | **$(sort -n "$T/ratios" | awk '{ a[NR] = $1 } END { printf "%.2f", NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }')** |"
    done
    stop_all
done
