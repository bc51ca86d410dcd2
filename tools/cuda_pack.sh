#!/usr/bin/env bash
# Packs what tools/cuda_check.sh needs into one folder, to run the GPU
# checks on a machine that has an NVIDIA driver and CUDA 13's cuBLAS but
# not this project's build dependencies (a rented GPU box, a lab machine):
#   tools/cuda_pack.sh OUT [--quantized] [--model NAME ...] [--gz]
# OUT/bin: the CUDA build's tandem and its four GPU tests, stripped;
# OUT/lib: the shared libraries they load, except the C library and CUDA's
# (a newer glibc there is fine); OUT/fx: the part of the fixture set the
# tests read (goldens, stories260K, the F16 generator and its tokenizer;
# with --quantized every quantized model too, about 190 MB more; with
# --model NAME only that one, e.g. qwen3-mini-Q4_K_M.gguf); OUT/run.sh runs
# tools/cuda_check.sh from there (extra environment as for cuda_check.sh,
# e.g. BENCH_MODELS). About 30 MB without the quantized models. A set
# without every quantized model runs with TANDEM_FIXTURES_PARTIAL=1: the
# goldens of the models left out print "skipped" lines instead of failing.
# --gz: OUT holds pack.tgz and run.sh only (14 MB without models; a
# quantized model shrinks by about 10%), for a machine that takes at most
# 64 MiB a call: one quantized model fits beside the pack.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: tools/cuda_pack.sh OUT [--quantized] [--model NAME ...] [--gz]}
shift
QUANT= GZ= MODELS=
while [ $# -gt 0 ]; do
    case $1 in
    --quantized) QUANT=1 ;;
    --gz) GZ=1 ;;
    --model) MODELS="$MODELS ${2:?--model needs a file name}"; shift ;;
    *) echo "cuda_pack: unknown option $1" >&2; exit 2 ;;
    esac
    shift
done
FIX=${TANDEM_FIXTURES:-../shared/fixtures}
[ -d "$FIX" ] || { echo "cuda_pack: fixture set $FIX not found (set TANDEM_FIXTURES)" >&2; exit 1; }
for m in $MODELS; do [ -f "$FIX/models/$m" ] || { echo "cuda_pack: $FIX/models/$m not found" >&2; exit 1; }; done
DEST=$OUT
if [ -n "$GZ" ]; then   # staged in a folder of its own, then packed into DEST
    OUT=$(mktemp -d)
    trap 'rm -rf "$OUT"' EXIT
fi
make -j"$(nproc)" CUDA=1 BUILD=build-cuda build-cuda/tandem build-cuda/test_backend_ops build-cuda/test_golden \
    build-cuda/test_handoff build-cuda/test_chain_backend >/dev/null
mkdir -p "$OUT/bin" "$OUT/lib" "$OUT/fx/golden" "$OUT/fx/golden-mainline" "$OUT/fx/models" "$OUT/fx/tools" \
    "$OUT/fx/tokenizers" "$OUT/tools"
for b in tandem test_backend_ops test_golden test_handoff test_chain_backend; do strip -o "$OUT/bin/$b" "build-cuda/$b"; done
ldd "$OUT/bin/tandem" "$OUT/bin/test_handoff" | awk '$3 ~ /^\// { print $3 }' | sort -u |
    grep -vE '/(libc|libm|libdl|libpthread|librt|libresolv|libgcc_s|libstdc\+\+)\.so|libcublas|libcudart' |
    while read -r l; do cp -L "$l" "$OUT/lib/"; done
cp -r "$FIX/golden/visible" "$FIX"/golden/*.txt "$OUT/fx/golden/"
cp -r "$FIX/golden-mainline/visible" "$OUT/fx/golden-mainline/"
cp "$FIX"/models/stories260K*.gguf "$OUT/fx/models/"
if [ -n "$QUANT" ]; then cp "$FIX"/models/*-Q*.gguf "$OUT/fx/models/"; fi
for m in $MODELS; do cp "$FIX/models/$m" "$OUT/fx/models/"; done
cp "$FIX/tools/gen_mini.py" "$OUT/fx/tools/"
cp -r "$FIX/tokenizers/qwen3" "$OUT/fx/tokenizers/"
cp "$FIX/README.md" "$OUT/fx/"
cp tools/cuda_check.sh "$OUT/tools/"
cat >"$OUT/run.sh" <<'RUN'
#!/usr/bin/env bash
# Runs the GPU checks from this folder (made by tools/cuda_pack.sh).
cd "$(dirname "$0")"
here=$PWD
mkdir -p models
# the F16 test models first: the generator is the system's Python, which
# must not load the libraries packed here
for a in qwen3 qwen3moe qwen2; do
    [ -f "models/$a-mini-F16.gguf" ] || python3 fx/tools/gen_mini.py "$a" "models/$a-mini-F16.gguf" >/dev/null
done
export LD_LIBRARY_PATH=$here/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
[ -f fx/.partial ] && export TANDEM_FIXTURES_PARTIAL=1
BIN=$here/bin TANDEM_FIXTURES=$here/fx TANDEM_MODELS=$here/models LOG_DIR=${LOG_DIR:-$here/logs} \
    exec bash tools/cuda_check.sh
RUN
chmod +x "$OUT/run.sh"
[ -n "$QUANT" ] || touch "$OUT/fx/.partial"
if [ -n "$GZ" ]; then
    mkdir -p "$DEST"
    tar czf "$DEST/pack.tgz" -C "$OUT" .
    cat >"$DEST/run.sh" <<'RUN'
#!/usr/bin/env bash
# Unpacks pack.tgz (made by tools/cuda_pack.sh --gz) beside it and runs its run.sh.
cd "$(dirname "$0")"
mkdir -p unpacked
tar xzf pack.tgz -C unpacked
exec unpacked/run.sh
RUN
    chmod +x "$DEST/run.sh"
fi
du -sh "$DEST"
