# shellcheck shell=bash disable=SC2034 # (the variables are the callers')
# tools/macos_zig.sh - sourced (not run) by tools/macos_check.sh and
# tools/macos_link.sh: the pinned zig toolchain and the Makefile's
# per-file instruction-set flags, translated for zig cc.
#
# macos_zig_setup: installs PyPI's ziglang==$ZIG_VERSION into $ZIGENV on
# first use and sets ZIG_EXE; on failure prints why (one line, the last)
# and returns 2 (the callers exit 2: tools/test.sh turns that into
# "skipped: ziglang: ...").

# Zig 0.17.1 (PyPI ziglang, the newest at the time of writing): clang
# 22.1.8, the SDK's headers up to macOS 27 (its default deployment
# target is macOS 15.0; MACOS_MIN below).
ZIG_VERSION=0.17.1
ZIGENV=build/zigenv
# The oldest macOS the code may need (zig cc -target <arch>-macos.MACOS_MIN;
# zig's own default is 15.0): 11.0, Big Sur, the first on Apple silicon.
# A call of something newer that is not guarded by
# __builtin_available is then a warning (-Wunguarded-availability-new),
# an error under tools/macos_check.sh's -Werror and tools/macos_link.sh's
# wrappers.
MACOS_MIN=11.0

macos_zig_ok() { "$ZIGENV/bin/python" -m ziglang version 2>/dev/null | grep -qx "$ZIG_VERSION"; }
macos_zig_setup() {
    mkdir -p build
    if ! macos_zig_ok; then
        echo "macos: installing ziglang==$ZIG_VERSION into $ZIGENV"
        { python3 -m venv "$ZIGENV" && "$ZIGENV/bin/pip" install -q "ziglang==$ZIG_VERSION"; } >build/zigenv-install.log 2>&1
        if ! macos_zig_ok; then
            tail -n 5 build/zigenv-install.log
            echo "pip install ziglang==$ZIG_VERSION into $ZIGENV failed (build/zigenv-install.log): no macOS toolchain"
            return 2
        fi
    fi
    ZIG_EXE=$("$ZIGENV/bin/python" -c 'import os, ziglang; print(os.path.join(os.path.dirname(ziglang.__file__), "zig"))')
    [ -x "$ZIG_EXE" ] || { echo "no zig executable in the ziglang package ($ZIG_EXE): no macOS toolchain"; return 2; }
    # zig keeps a cache of what it compiled (keyed on the sources, headers
    # and flags; a file that failed is not cached): here, not in ~/.cache.
    export ZIG_GLOBAL_CACHE_DIR=$PWD/build/zigcache ZIG_LOCAL_CACHE_DIR=$PWD/build/zigcache
    export ZIG_EXE
}

# macos_file_flags TARGET FILE: the per-file instruction-set flags of the
# Makefile (same sets, same files) and -Itests for the tests. zig cc takes
# no -march (it reads it as a CPU name): the Makefile's -march=armv8.2-a+X
# is its -mcpu=generic+v8_2a+X, the same features (__ARM_FEATURE_DOTPROD,
# __ARM_FEATURE_MATMUL_INT8). Without flags the arm64 target is the Apple
# M1 (zig's default for aarch64-macos, as Apple clang's), x86-64 its
# baseline.
macos_file_flags() {
    local target=$1 f=$2 kavx2="-mavx2 -mfma -mf16c -falign-loops=64"
    case "$f" in tests/*) echo -Itests ;; esac
    case "$target:$(basename "$f")" in
    x86_64*:quant_avx2.c|x86_64*:ops_avx2.c) echo "$kavx2" ;;
    x86_64*:quant_avxvnni.c) echo "$kavx2 -mavxvnni" ;;
    x86_64*:quant_avx512.c|x86_64*:quant_avx512_r16.c|x86_64*:quant_avx512_kp.c|x86_64*:quant_avx512_kp6.c|x86_64*:ops_avx512.c) echo "$kavx2 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni" ;;
    aarch64*:quant_neon_dotprod.c) echo "-mcpu=generic+v8_2a+dotprod" ;;
    aarch64*:quant_neon_i8mm.c) echo "-mcpu=generic+v8_2a+dotprod+i8mm" ;;
    esac
}
