#!/usr/bin/env bash
# tools/kvblock_seed.sh DIR: seeds for fuzz/fuzz_kvblock.c in DIR, made from
# real KV store block files: a stories260K node (assets/stories260K.gguf,
# f16 cache) answers a 130-token prompt, and its blocks 0 and 1 are copied
# out of its --kv-cache-dir, each behind a mode byte (0: as written; 7: the
# checksum recomputed, ids and hash from the file). Needs build/tandem and
# curl. Used by tools/test.sh (fuzz_seed kvblock).
set -euo pipefail
out=${1:?usage: tools/kvblock_seed.sh DIR}
mkdir -p "$out"
tmp=$(mktemp -d /tmp/tandem-kvblock-seed-XXXXXX)
pid=
cleanup() { [ -n "$pid" ] && kill "$pid" 2>/dev/null; rm -rf "$tmp"; }
trap cleanup EXIT
build/tandem serve --role local -m assets/stories260K.gguf --listen 127.0.0.1:0 --port-file "$tmp/port" \
    --parallel 1 -c 256 -t 1 --kv-cache-dir "$tmp/store" >"$tmp/log" 2>&1 &
pid=$!
for _ in $(seq 200); do [ -s "$tmp/port" ] && break; sleep 0.05; done
[ -s "$tmp/port" ] || { echo "kvblock_seed: the node did not start:" >&2; cat "$tmp/log" >&2; exit 1; }
# the fuzz target's fixed prompt: 3 + (i * 37) % 500
ids=$(seq 0 129 | awk '{printf "%s%d", (NR > 1 ? "," : ""), 3 + ($1 * 37) % 500}')
curl -sf -o /dev/null -d "{\"tokens\":[$ids],\"max_tokens\":1}" "http://127.0.0.1:$(cat "$tmp/port")/v1/generate"
kill -TERM "$pid"; wait "$pid" || true; pid=
n=0
for f in "$tmp"/store/*/*.kvb; do
    [ -f "$f" ] || continue
    { printf '\x00'; cat "$f"; } >"$out/block$n"
    { printf '\x07'; cat "$f"; } >"$out/block$n-fixed"
    n=$((n + 1))
done
[ "$n" = 2 ] || { echo "kvblock_seed: $n block files (want 2)" >&2; exit 1; }
echo "kvblock_seed: 2 block files into $out"
