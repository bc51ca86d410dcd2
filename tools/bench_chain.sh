#!/bin/sh
# bench_chain.sh - time to first token through a 2-node layer-split prefill
# chain (one core each) against one whole-model prefill node on one core
# (issue 41). A benchmark, not a test: runs alternate, chain then single,
# and every run's numbers are printed.
#
# usage: [NL=28] tools/bench_chain.sh MODEL.gguf "1024 4096" [ROUNDS]
set -eu
M=$1; SIZES=${2:-"1024 4096"}; ROUNDS=${3:-2}
B=${TANDEM_BIN:-build/tandem}
T=$(mktemp -d /tmp/bench-chain-XXXXXX)
trap 'kill $(cat $T/pids 2>/dev/null) 2>/dev/null; rm -rf $T' EXIT
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > $T/secret   # 32 random bytes: nodes refuse less
NL=${NL:-28}   # the model's block count (Qwen3-0.6B: 28)
H=$((NL / 2))
CTX=17000
start() {  # core layers name
    if [ "$2" = all ]; then L=""; else L="--layers $2"; fi
    taskset -c "$1" $B serve --role prefill -m "$M" --secret-file $T/secret -t 1 -c $CTX $L \
        --port-file $T/port.$3 --request-ms 3600000 --timeout-ms 600000 --handshake-ms 60000 > $T/log.$3 2>&1 &
    echo $! >> $T/pids
    while [ ! -s $T/port.$3 ]; do sleep 0.3; done
}
start 0 0:$H a; start 1 $H:$NL b; start 0 all w
CHAIN="127.0.0.1:$(cat $T/port.a)/0:$H,127.0.0.1:$(cat $T/port.b)/$H:$NL"
SINGLE="127.0.0.1:$(cat $T/port.w)"
echo "model $(basename $M): $NL layers; chain 0:$H on core 0, $H:$NL on core 1; single node on core 0"
for n in $SIZES; do
    # a prompt of about n tokens (the run reports the exact count)
    python3 -c "
import random; random.seed($n)
w='the of and to in a is that for it as was with be by on not he this are or his from at which but have an they you were her she there one all we their can has more when would some if no what out also so up into only other time'.split()
print(' '.join(random.choice(w) for _ in range($n)))" > $T/p.$n
    for r in $(seq 1 $ROUNDS); do
        for mode in chain single; do
            if [ $mode = chain ]; then PN=$CHAIN; else PN=$SINGLE; fi
            $B run -m "$M" -f $T/p.$n -n 1 -c $CTX -t 1 --secret-file $T/secret --prefill-node "$PN" \
                --timeout-ms 600000 > /dev/null 2> $T/run.err || { cat $T/run.err; exit 1; }
            P=$(sed -n 's/^prompt: \([0-9]*\) tokens in \([0-9.]*\) ms.*/\1 \2/p' $T/run.err)
            echo "n=$n round=$r mode=$mode tokens_ttft_ms: $P"
        done
    done
done
