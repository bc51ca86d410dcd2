#!/usr/bin/env bash
# The arm64 build and its NEON kernels, checked on an x86-64 machine under
# qemu-user (Debian multiarch): the tree cross-compiled once with
# aarch64-linux-gnu-gcc for the baseline (armv8-a, no ARCH_FLAGS: the one
# binary a user builds), and the kernel tests run on three emulated CPUs: a
# Cortex-A53 (NEON without dot products: the neon set must be chosen and
# dotprod and i8mm refused), a Neoverse N1 (dot products without int8
# matrix multiplies: dotprod chosen, i8mm refused) and qemu's "max" (both:
# the i8mm set, picked at run time from the hwcaps). test_quant, test_ops,
# test_backend_ops and test_attention compare every kernel set present
# (ref, neon, dotprod, i8mm; test_quant's quantised tiles bit for bit) with
# the reference; test_golden with stories260K runs the engine end to end
# against llama.cpp's outputs. ARCH_FLAGS=-march=armv8.2-a+dotprod builds
# a second tree for that target too (the neon set then uses sdot as well).
# Correctness only: qemu says nothing about speed. Not part of CI (about
# 6 minutes here, 19 on a loaded machine). SMOLLM2=1 also runs the real
# SmolLM2 Q4_1 model's goldens (tools/models.sh) on qemu's max CPU with
# every set (ref, neon, dotprod, i8mm: about 40 minutes). INSTALL=1 installs the cross compiler, qemu-user and the
# arm64 libraries first (apt-get, root).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${INSTALL:-0}" = 1 ]; then
    dpkg --add-architecture arm64
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q qemu-user gcc-aarch64-linux-gnu libjansson-dev:arm64 \
        libutf8proc-dev:arm64 libzstd-dev:arm64 libmicrohttpd-dev:arm64 libssl-dev:arm64 libxxhash-dev:arm64 \
        libcurl4-openssl-dev:arm64
fi
command -v aarch64-linux-gnu-gcc >/dev/null && command -v qemu-aarch64 >/dev/null ||
    { echo "arm64_check: needs aarch64-linux-gnu-gcc and qemu-aarch64 (INSTALL=1)" >&2; exit 1; }
JOBS=$(nproc 2>/dev/null || echo 2)
tests=(test_quant test_ops test_backend_ops test_attention test_golden)
builds=("build-arm64:")
[ -n "${ARCH_FLAGS:-}" ] && builds+=("build-arm64-flags:$ARCH_FLAGS")
for v in "${builds[@]}"; do
    dir=${v%%:*} flags=${v#*:}
    make -j"$JOBS" CC=aarch64-linux-gnu-gcc BUILD="$dir" ARCH_FLAGS="$flags" "${tests[@]/#/$dir/}" >/dev/null
    for cpu in cortex-a53 neoverse-n1 max; do
        echo "== $dir (${flags:-armv8-a}) on qemu's $cpu"
        for t in "${tests[@]}"; do
            out=$(TANDEM_GOLDEN=stories260K qemu-aarch64 -cpu "$cpu" "$dir/$t" 2>&1) || true
            printf '%s\n' "$out" | grep -E '^(FAIL|CRASH)|kernels: |set (neon|dotprod|i8mm)|arm64 hwcaps' | head -n 20 || true
            printf '%s\n' "$out" | grep -E '^[a-z0-9_]+: [0-9]+ passed' | tail -n 1 || echo "CRASH $dir/$t"
        done
    done
done
if [ "${SMOLLM2:-0}" = 1 ]; then
    echo "== build-arm64 (armv8-a) on qemu's max: SmolLM2 Q4_1 goldens"
    out=$(TANDEM_GOLDEN=smollm2 qemu-aarch64 -cpu max build-arm64/test_golden 2>&1) || true
    printf '%s\n' "$out" | grep -E '^(FAIL|CRASH)|smollm2-Q4_1|skipped' | head -n 20 || true
    printf '%s\n' "$out" | grep -E '^test_golden: [0-9]+ passed' | tail -n 1 || echo "CRASH build-arm64/test_golden"
fi
