#!/usr/bin/env bash
# The whole test suite, as CI runs it, from a fresh machine:
#   1. install missing Debian packages (tools/deps.sh)
#   2. build and run the tests (make test)
#   3. the same tests under AddressSanitizer + UndefinedBehaviorSanitizer (make asan)
#   4. every libFuzzer target for a short bounded time
# The last line printed is the total "N passed, M failed".
set -euo pipefail
cd "$(dirname "$0")/.."
tools/deps.sh
JOBS=$(nproc 2>/dev/null || echo 2)
FUZZ_SECONDS=${FUZZ_SECONDS:-30}

make -j"$JOBS" all models
echo "== tests"
make test | tee build/test.log
echo "== tests under ASan+UBSan"
make -j"$JOBS" asan | tee build/asan.log
echo "== fuzzing (${FUZZ_SECONDS}s per target)"
make -j"$JOBS" fuzz >/dev/null
FIX=${TANDEM_FIXTURES:-../shared/fixtures}
# Seeds: the start of real files for the parsers, real prompts for the tokenizer.
fuzz_seed() {
    case "$1" in
    gguf) head -c 16384 "$FIX/models/stories260K.gguf" >"$2/stories-head.gguf"
          head -c 60000 "$FIX/vocab/ggml-vocab-llama-spm.gguf" >"$2/spm-head.gguf" ;;
    tokenizer) python3 -c "
import json,sys
for i,l in enumerate(open('$FIX/tokenize/visible.jsonl')):
    j=json.loads(l)
    if 'text' in j: open('$2/p%d'%i,'wb').write(bytes([i*37%256])+j['text'].encode())" ;;
    decode_request)
          printf '\x00{"prompt":"Once upon a time","max_tokens":4}' >"$2/prompt"
          printf '\x01{"messages":[{"role":"user","content":"hi"}],"stream":true,"prefill":"local"}' >"$2/messages"
          printf '\x01{"tokens":[1,2,3],"temperature":0.5,"stop":["x"]}' >"$2/tokens" ;;
    grade)
          printf '\x00# Lab\n## Correctness (6 points)\nworks\n## Style (4 pts)\ntidy\n' >"$2/rubric"
          printf '\x01{"scores":{"correctness":{"score":5,"justification":"ok"},"style":{"score":3,"justification":"x"}},"total":8,"problems":[{"file":"a.py","line":2,"description":"d"}]}' >"$2/analysis"
          printf '\x02[system]\n{{rubric}} {{schema}}\n[user]\n{{name}}: {{submission}}\n' >"$2/template"
          printf '\x03{"$defs":{"a":{"type":"integer"}},"anyOf":[{"$ref":"#/$defs/a"},{"enum":[null]}]}\0003' >"$2/validate"
          printf '\x04{"status":"graded","total":7,"scores":{}}' >"$2/chart" ;;
    http_api)
          printf '\x00{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"max_tokens":8}' >"$2/chat"
          printf '\x01{"model":"m","prompt":"Once","stop":["."],"seed":3}' >"$2/completion"
          printf '\x02{"token":42,"text":"hi"}' >"$2/line" ;;
    esac
}
fuzz_fail=0
for f in build/fuzz_*; do
    [ -x "$f" ] || continue
    name=$(basename "$f")
    corpus="build/corpus-$name"; mkdir -p "$corpus"
    seeds="build/seeds-$name"; mkdir -p "$seeds"
    fuzz_seed "${name#fuzz_}" "$seeds"
    args=("$corpus" "$seeds")
    if "$f" -max_total_time="$FUZZ_SECONDS" -rss_limit_mb=2048 -max_len=65536 "${args[@]}" >build/"$name".log 2>&1; then
        echo "$name: $(ls "$corpus" | wc -l) corpus files, no crash"
    else
        echo "$name: FAILED"; tail -n 30 build/"$name".log; fuzz_fail=1
    fi
done
# totals over both runs and the fuzzers
p1=$(tail -n 1 build/test.log | sed -nE 's/^([0-9]+) passed, ([0-9]+) failed.*/\1/p')
f1=$(tail -n 1 build/test.log | sed -nE 's/^([0-9]+) passed, ([0-9]+) failed.*/\2/p')
p2=$(grep -E '^[0-9]+ passed, [0-9]+ failed' build/asan.log | tail -n 1 | sed -nE 's/^([0-9]+) passed.*/\1/p')
f2=$(grep -E '^[0-9]+ passed, [0-9]+ failed' build/asan.log | tail -n 1 | sed -nE 's/.* ([0-9]+) failed.*/\1/p')
nf=$(ls build/fuzz_* 2>/dev/null | wc -l)
pass=$(( ${p1:-0} + ${p2:-0} + nf - fuzz_fail ))
fail=$(( ${f1:-1} + ${f2:-1} + fuzz_fail ))
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
