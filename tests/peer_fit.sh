#!/usr/bin/env bash
# peer_fit.sh - checks tools/peer_fit, the benchmark helper that runs the
# reference peer builds of ../shared/peers on a CPU without their AVX-VNNI
# and AVX512-FP16 (docs/bench.md's side-by-side tables rest on it):
#  1. its self-test (selftest.c's replaced instructions against plain C,
#     with and without the jump tables read);
#     a blob whose offsets are broken one field at a time is refused;
#  2. the ggml-org llama-server of ../shared/peers, run through it on the
#     fixture qwen2-mini-Q4_0.gguf, gives fixtures/golden-mainline's 32
#     greedy token ids for every prompt (that build is the golden's oracle);
#  3. on a CPU without AVX-VNNI, tandem's own avxvnni kernel set, which the
#     other tests cannot reach there: test_quant, test_ops and
#     test_attention (every set present against the reference) and
#     test_golden with TANDEM_KERNELS=avxvnni, each moved with
#     --cpuid-avxvnni (its cpuid reports the extension, its VEX vpdpbusd
#     run as EVEX), must pass and must have tested that set.
# Prints "peer_fit: N passed, M failed" (tests/run.sh sums it); without
# AVX-512 F/BW/VL/VNNI, a compiler that takes -mavxvnni -mavx512fp16,
# python3 or the peers it says "skipped: ..." and checks nothing.
set -u
cd "$(dirname "$0")/.."
FIX=${TANDEM_FIXTURES:-../shared/fixtures}
PEERS=${PEERS:-../shared/peers}
pass=0 fail=0 skips=0
# tests/t.h's rule: a counted "skipped: peer-fit: WHY", or a failure where
# TANDEM_REQUIRE (comma list, or "all") names peer-fit
skip() {
    case ",${TANDEM_REQUIRE:-}," in
    *,all,*|*,peer-fit,*) echo "FAIL required (TANDEM_REQUIRE) peer-fit: $1"; echo "peer_fit: 0 passed, 1 failed"; exit 1 ;;
    esac
    echo "skipped: peer-fit: $1"; echo "peer_fit: 0 passed, 0 failed, 1 skipped"; exit 0
}
flags=$(grep -m1 '^flags' /proc/cpuinfo)
for f in avx512f avx512bw avx512vl avx512_vnni; do
    echo "$flags" | grep -qw "$f" || skip "this CPU lacks $f"
done
command -v python3 >/dev/null || skip "no python3"
echo 'int main(void){return 0;}' | cc -x c -mavxvnni -mavx512fp16 -o /dev/null - 2>/dev/null ||
    skip "the compiler does not take -mavxvnni -mavx512fp16"

out=$(tools/peer_fit.sh --self-test 2>&1)
if echo "$out" | grep -q "checks, 0 failed"; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL self-test: $out"; fi

# a blob whose offsets point elsewhere is refused before anything is written
# (exit 97 and a reason), not followed: each field broken in turn
bad=$(mktemp -d)
python3 - build/peer_fit/selftest.blob "$bad" <<'PY'
import struct, sys
b = bytearray(open(sys.argv[1], 'rb').read())
tramp, nrel, nblk, nmap = struct.unpack_from('<IIII', b, 8)
rel0 = 48 + tramp; blk0 = rel0 + 16 * nrel; map0 = blk0 + 16 * nblk
def out(name, f):
    c = bytearray(b); f(c); open(f'{sys.argv[2]}/{name}', 'wb').write(c)
out('size', lambda c: struct.pack_into('<I', c, 20, nmap + 1))                 # header counts more than the file
out('relpos', lambda c: struct.pack_into('<I', c, rel0, 0x7ffffff0))          # a relocation past the trampolines
out('blkaddr', lambda c: struct.pack_into('<Q', c, blk0, 1 << 40))            # a block outside the code
out('blklen', lambda c: struct.pack_into('<I', c, blk0 + 8, 3))               # shorter than the jmp
out('maporder', lambda c: struct.pack_into('<Q', c, map0 + 12, 0))            # the map out of order
PY
for v in size relpos blkaddr blklen maporder; do
    msg=$(LD_PRELOAD="$(pwd)/build/peer_fit/preload.so" PEER_FIT_BLOB="$bad/$v" build/peer_fit/selftest 2>&1); rc=$?
    if [ $rc = 97 ] && echo "$msg" | grep -q "^peer_fit: "; then pass=$((pass + 1))
    else fail=$((fail + 1)); echo "FAIL blob with a bad $v: exit $rc: $msg"; fi
done
rm -rf "$bad"

model=$FIX/models/qwen2-mini-Q4_0.gguf gold=$FIX/golden-mainline/visible/qwen2-mini-Q4_0.jsonl
if [ -x "$PEERS/llama-server" ] && [ -f "$model" ] && [ -f "$gold" ]; then
    port=$((20000 + $$ % 20000))
    log=$(mktemp)
    tools/peer_fit.sh llama-server -m "$model" -t 1 -c 4096 -np 1 --host 127.0.0.1 --port "$port" >"$log" 2>&1 &
    srv=$!
    up=0
    for _ in $(seq 1 150); do
        curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && { up=1; break; }
        kill -0 $srv 2>/dev/null || break
        sleep 0.2
    done
    if [ $up = 1 ]; then
        res=$(python3 - "$gold" "$port" <<'PY'
import json, sys, urllib.request
gold = [json.loads(l) for l in open(sys.argv[1])][1:]
ok = 0
for g in gold:
    req = {"prompt": g["prompt_ids"], "n_predict": 32, "temperature": 0, "top_k": 1, "ignore_eos": True,
           "cache_prompt": False, "return_tokens": True}
    r = json.load(urllib.request.urlopen(urllib.request.Request(
        f"http://127.0.0.1:{sys.argv[2]}/completion", json.dumps(req).encode(), {"Content-Type": "application/json"})))
    if r.get("tokens") == g["generated_ids"]:
        ok += 1
    else:
        print(f"{g['name']}: {r.get('tokens')} != {g['generated_ids']}")
print(f"{ok} of {len(gold)}")
PY
)
        if echo "$res" | tail -1 | grep -qE '^([0-9]+) of \1$'; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL llama-server through peer_fit: $res"; fi
    else
        fail=$((fail + 1)); echo "FAIL llama-server through peer_fit did not start:"; tail -5 "$log"
    fi
    kill $srv 2>/dev/null; wait $srv 2>/dev/null
    rm -f "$log"
else
    case ",${TANDEM_REQUIRE:-}," in
    *,all,*|*,peers,*) fail=$((fail + 1)); echo "FAIL required (TANDEM_REQUIRE) peers: no $PEERS/llama-server or fixture" ;;
    *) skips=$((skips + 1)); echo "skipped: peers: no $PEERS/llama-server or fixture: the golden check through peer_fit" ;;
    esac
fi
# 3. tandem's avxvnni set, where the CPU itself cannot run it
BUILD=${BUILD:-build}
if echo "$flags" | grep -qw avx_vnni; then
    echo "(this CPU has AVX-VNNI: the other tests run the avxvnni set themselves)"
else
    blobdir=$(mktemp -d)
    for t in test_quant test_ops test_attention test_golden; do
        [ -x "$BUILD/$t" ] || { fail=$((fail + 1)); echo "FAIL no $BUILD/$t"; continue; }
        python3 tools/peer_fit/relocate.py "$BUILD/$t" "$blobdir/$t.blob" --cpuid-avxvnni 2>/dev/null ||
            { fail=$((fail + 1)); echo "FAIL relocate $t"; continue; }
        ks=; [ $t = test_golden ] && ks=avxvnni
        # the real model under the avxvnni set only (test_golden runs it under
        # every set; the suite's own test_golden has the others): 3 of 4 runs less
        res=$(TANDEM_KERNELS=$ks TANDEM_GOLDEN_SETS=avxvnni LD_PRELOAD="$(pwd)/build/peer_fit/preload.so" PEER_FIT_BLOB="$blobdir/$t.blob" \
              "$BUILD/$t" 2>&1)
        line=$(echo "$res" | grep -E "^$t: [0-9]+ passed, 0 failed" | tail -1)
        tested=                # the set was reached: named by the set loops, not refused by TANDEM_KERNELS
        if [ $t = test_golden ]; then echo "$res" | grep -q "not a kernel set" || tested=yes
        else echo "$res" | grep -qE "kernels: avxvnni|\(set avxvnni\)" && tested=yes; fi
        if [ -n "$line" ] && [ "$tested" = yes ]; then
            pass=$((pass + 1)); echo "avxvnni set, emulated: $line"
        else
            fail=$((fail + 1)); echo "FAIL avxvnni set in $t: $(echo "$res" | grep -E "FAIL|failed|not a kernel" | head -5)"
        fi
    done
    rm -rf "$blobdir"
fi
if [ "$skips" -gt 0 ]; then echo "peer_fit: $pass passed, $fail failed, $skips skipped"
else echo "peer_fit: $pass passed, $fail failed"; fi
[ "$fail" -eq 0 ]
