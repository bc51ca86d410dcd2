#!/usr/bin/env bash
# tools/macos_check.sh - does every non-CUDA source of tandem compile for
# macOS? Each file of src/ (except src/backend/cuda), tests/ and fuzz/ is
# compiled (-c) for aarch64-macos and x86_64-macos by `zig cc`,
# a clang that carries its own copy of the macOS SDK's headers (libc,
# pthread, sys/, arm_neon.h, immintrin.h), with the Makefile's CFLAGS and
# its per-file instruction-set flags, warnings as errors (the Linux build
# has none either). One result per file and target; a file that does not
# compile prints the compiler's errors. Last line: "macos: N passed, M
# failed" (and tools/test.sh's "N passed, M failed, K skipped" before it).
#
# The toolchain is PyPI's ziglang, pinned, in a venv under build/ (made on
# first use; tools/macos_zig.sh, shared with tools/macos_link.sh, which
# links the whole command). The deployment target is macOS 11.0: a call of
# anything newer is a warning, so an error here. The dependencies' headers
# come from the Debian -dev packages installed on this machine, copied into
# build/macos-check/include/ (see deps_include below for why copies and not
# -I/usr/include).
#
# Usage: tools/macos_check.sh [-j N] [-v] [file.c ...]   (default: all files)
# Exit status: 0 all compiled, 1 a file failed (or a library's headers are
# missing), 2 no toolchain (the caller decides whether that is a skip:
# tools/test.sh does; the last line says why).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

. tools/macos_zig.sh   # ZIG_VERSION, macos_zig_setup, macos_file_flags
OUT=build/macos-check
JOBS=1
VERBOSE=0
while [ $# -gt 0 ]; do
    case "$1" in
    -j) JOBS=$2; shift 2 ;;
    -j*) JOBS=${1#-j}; shift ;;
    -v) VERBOSE=1; shift ;;
    --) shift; break ;;
    -*) echo "usage: $0 [-j N] [-v] [file.c ...]" >&2; exit 64 ;;
    *) break ;;
    esac
done

# ==== The toolchain ====
# (tools/macos_zig.sh) Without it the last line says why and the status is
# 2 (tools/test.sh turns that into "skipped: ziglang: ...").
macos_zig_setup || exit 2

# ==== The dependencies' headers ====
# Not -I/usr/include or -I/usr/include/x86_64-linux-gnu: those hold glibc's
# and Linux's own headers (stdio.h, bits/, sys/, asm/), which would shadow
# the macOS SDK's and make the check say nothing about macOS. So only the
# seven libraries' headers are copied into an include folder of their own.
# They are portable as they stand:
#  - jansson, utf8proc, zstd, xxhash, libmicrohttpd: /usr/include, the same
#    files on every Debian architecture (jansson_config.h's values - inline,
#    long long integers, localeconv, atomic builtins - are those of its
#    macOS build too; microhttpd.h picks its socket types per platform itself);
#  - openssl: /usr/include/openssl, plus the two generated headers Debian
#    keeps in the multiarch folder (configuration.h, opensslconf.h): for an
#    LP64 target their only machine-dependent settings are SIXTY_FOUR_BIT_LONG
#    and RC4_INT unsigned int, which is what OpenSSL's darwin64-arm64 and
#    darwin64-x86_64 configurations set as well (both macOS targets are LP64);
#  - curl: the whole of /usr/include/<multiarch>/curl: since curl 7.62 there
#    is no generated curlbuild.h, system.h derives the types from the
#    compiler's own macros (__APPLE__, __LP64__), so the files are the same
#    on every architecture.
INC=$OUT/include
deps_include() {
    local multi lib f
    multi=$(gcc -print-multiarch 2>/dev/null || dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null)
    rm -rf "$INC"; mkdir -p "$INC/openssl"
    for f in jansson.h jansson_config.h utf8proc.h zstd.h zstd_errors.h xxhash.h xxh3.h microhttpd.h; do
        [ -f "/usr/include/$f" ] || { echo "macos: /usr/include/$f not found (tools/deps.sh installs the -dev packages)"; return 1; }
        cp "/usr/include/$f" "$INC/"
    done
    if [ ! -d /usr/include/openssl ] || [ ! -f "/usr/include/$multi/openssl/configuration.h" ]; then
        echo "macos: openssl headers not found (/usr/include/openssl, /usr/include/$multi/openssl)"; return 1
    fi
    cp /usr/include/openssl/*.h "$INC/openssl/"
    cp "/usr/include/$multi/openssl/configuration.h" "/usr/include/$multi/openssl/opensslconf.h" "$INC/openssl/"
    lib=/usr/include/$multi/curl; [ -d "$lib" ] || lib=/usr/include/curl
    [ -f "$lib/curl.h" ] || { echo "macos: curl headers not found"; return 1; }
    cp -r "$lib" "$INC/curl"
}
mkdir -p "$OUT"
# (the headers are what the Linux build needs too: their absence is a failure)
deps_include || { echo "0 passed, 1 failed, 0 skipped"; exit 1; }

# ==== Files and flags ====
# The Makefile's CFLAGS (less -g and -pthread, which change no diagnostic
# here) and -Werror. Compiled to objects (-c): zig cc's -fsyntax-only fails
# on its own cache (it renames an object that was never written).
# (A string, for xargs' shells: the paths in it have no spaces.)
MACOS_CFLAGS="-std=c11 -D_GNU_SOURCE -Wall -Wextra -Wno-unused-parameter -O2 -Werror -Isrc -isystem $INC"
if [ $# -gt 0 ]; then
    FILES=("$@")
else
    mapfile -t FILES < <(ls src/*/*.c src/backend/cpu/*.c src/backend/mlx/*.c tests/test_*.c tests/*/test_*.c fuzz/fuzz_*.c 2>/dev/null | sort -u)
fi
# ==== Compile ====
# one_file TARGET FILE: compiles, writes its result to $OUT/<target>/<file>.{ok,err}
one_file() {
    local target=$1 f=$2 log
    log="$OUT/$target/${f//\//_}"
    # shellcheck disable=SC2046,SC2086 # the flags are words
    if "$ZIG_EXE" cc -target "$target.$MACOS_MIN" $MACOS_CFLAGS $(macos_file_flags "$target" "$f") -c "$f" -o "$log.o" >"$log.err" 2>&1; then
        mv "$log.err" "$log.ok"
    fi
}
export -f one_file macos_file_flags
export OUT MACOS_CFLAGS MACOS_MIN
TARGETS=(aarch64-macos x86_64-macos)
start=$(date +%s)
for t in "${TARGETS[@]}"; do rm -rf "${OUT:?}/$t"; mkdir -p "$OUT/$t"; done
# shellcheck disable=SC2016 # $1 and $2 are the inner shell's
for t in "${TARGETS[@]}"; do for f in "${FILES[@]}"; do printf '%s\0%s\0' "$t" "$f"; done; done |
    xargs -0 -n 2 -P "$JOBS" bash -c 'one_file "$1" "$2"' _
pass=0; fail=0
for t in "${TARGETS[@]}"; do
    tp=0; tf=0
    for f in "${FILES[@]}"; do
        log="$OUT/$t/${f//\//_}"
        if [ -f "$log.ok" ]; then
            tp=$((tp+1)); [ "$VERBOSE" = 1 ] && echo "ok   $t $f"
        else
            tf=$((tf+1)); echo "FAIL $t $f"; sed 's/^/    /' "$log.err" 2>/dev/null | head -n 40
        fi
    done
    echo "macos $t: $tp passed, $tf failed"
    pass=$((pass+tp)); fail=$((fail+tf))
done
echo "macos: ${#FILES[@]} files x ${#TARGETS[@]} targets in $(( $(date +%s) - start )) s (zig $ZIG_VERSION, -j$JOBS)"
echo "$pass passed, $fail failed, 0 skipped"
echo "macos: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
