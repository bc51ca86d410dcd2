#!/usr/bin/env bash
# The arm64 build and its NEON kernels, checked on an x86-64 machine under
# qemu-user (Debian multiarch): the tree cross-compiled with
# aarch64-linux-gnu-gcc twice, for the baseline (armv8-a: NEON without dot
# products, what a plain arm64 build runs) and for armv8.2-a+dotprod
# (ARCH_FLAGS, as on Apple silicon or a Graviton), and the kernel tests run
# on each: test_quant, test_ops, test_backend_ops and test_attention compare
# every kernel set present (ref, neon) with the reference; test_golden with
# stories260K runs the engine end to end against llama.cpp's outputs.
# Correctness only: qemu says nothing about speed. Not part of CI (about
# 5 minutes here); INSTALL=1 installs the cross compiler, qemu-user and the
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
for v in "build-arm64:" "build-arm64-dotprod:-march=armv8.2-a+dotprod"; do
    dir=${v%%:*} flags=${v#*:}
    make -j"$JOBS" CC=aarch64-linux-gnu-gcc BUILD="$dir" ARCH_FLAGS="$flags" "${tests[@]/#/$dir/}" >/dev/null
    echo "== $dir (${flags:-armv8-a})"
    # -cpu max: the emulated CPU has the dot-product instructions
    for t in "${tests[@]}"; do
        out=$(TANDEM_GOLDEN=stories260K qemu-aarch64 -cpu max "$dir/$t" 2>&1) || true
        printf '%s\n' "$out" | grep -E '^(FAIL|CRASH)|kernels: |set neon' | head -n 20 || true
        printf '%s\n' "$out" | grep -E '^[a-z0-9_]+: [0-9]+ passed' | tail -n 1 || echo "CRASH $dir/$t"
    done
done
