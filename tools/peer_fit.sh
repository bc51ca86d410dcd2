#!/usr/bin/env bash
# peer_fit.sh NAME [ARGS...] - runs a reference peer build of ../shared/peers
# (ik-llama-bench, llama-bench, llama-server) on an x86-64 CPU that has
# AVX-512 F/BW/VL/VNNI but not the AVX-VNNI and AVX512-FP16 of the machine the
# builds were made on (AMD Zen 4). A benchmark helper, not part of tandem.
# tools/peer_fit/relocate.py moves the binary's basic blocks that hold those
# instructions into trampolines with exact AVX-512 equivalents (see its
# docstring), preload.c applies that at start-up; every other instruction is
# the peer's own. The self-test (selftest.c against plain C) runs first.
# `tools/peer_fit.sh --self-test` runs only the self-test.
# Environment: PEERS (../shared/peers), PEER_FIT_VERBOSE=1 (blocks moved,
# entries redirected). Exit 3: this CPU lacks what the replacements need.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
PEERS=${PEERS:-$here/../shared/peers}
name=${1:?usage: tools/peer_fit.sh NAME [ARGS...] | --self-test}
shift
bin=$PEERS/$name
[ "$name" = --self-test ] || [ -x "$bin" ] || { echo "peer_fit: no peer $bin" >&2; exit 2; }
flags=$(grep -m1 '^flags' /proc/cpuinfo)
for f in avx512f avx512bw avx512vl avx512_vnni; do
    echo "$flags" | grep -qw "$f" || { echo "peer_fit: this CPU lacks $f" >&2; exit 3; }
done
out=$here/build/peer_fit
mkdir -p "$out"
src=$here/tools/peer_fit
if [ ! -f "$out/preload.so" ] || [ "$src/preload.c" -nt "$out/preload.so" ]; then
    cc -O2 -Wall -Wextra -shared -fPIC -o "$out/preload.so" "$src/preload.c"
fi
if [ ! -f "$out/selftest.ok" ] || [ "$src/relocate.py" -nt "$out/selftest.ok" ] ||
   [ "$out/preload.so" -nt "$out/selftest.ok" ] || [ "$src/selftest.c" -nt "$out/selftest.ok" ]; then
    cc -O2 -mavx2 -mfma -mavxvnni -mavx512fp16 -mno-avx512vnni -fPIE -pie -o "$out/selftest" "$src/selftest.c"
    for jt in "" --no-jump-tables; do
        python3 "$src/relocate.py" "$out/selftest" "$out/selftest.blob" $jt
        env -u PEER_FIT_VERBOSE LD_PRELOAD="$out/preload.so" PEER_FIT_BLOB="$out/selftest.blob" \
            "$out/selftest" >"$out/selftest.log" 2>&1 ||
            { echo "peer_fit: self-test failed ($jt):" >&2; cat "$out/selftest.log" >&2; exit 1; }
    done
    touch "$out/selftest.ok"
fi
if [ "$name" = --self-test ]; then cat "$out/selftest.log"; exit 0; fi
blob=$out/$name.blob
if [ ! -f "$blob" ] || [ "$bin" -nt "$blob" ] || [ "$src/relocate.py" -nt "$blob" ]; then
    python3 "$src/relocate.py" "$bin" "$blob.tmp" && mv "$blob.tmp" "$blob"
fi
LD_PRELOAD=$out/preload.so PEER_FIT_BLOB=$blob exec "$bin" "$@"
