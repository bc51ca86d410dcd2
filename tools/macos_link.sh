#!/usr/bin/env bash
# tools/macos_link.sh - links the whole `tandem` command for macOS
# (aarch64-macos and x86_64-macos) on Linux, with PyPI's zig (its clang,
# its copy of the macOS SDK's libc headers and libSystem stubs, its
# Mach-O linker; tools/macos_zig.sh). The seven libraries tandem links
# (the Makefile's LDLIBS, and libssl for curl's TLS) are built from their
# Debian source packages as static libraries, so the binary needs nothing
# but libSystem, which every Mac has. It cannot run here; a Mac runs it as build/macos-link/<target>/tandem.
#
#  1. sources: Debian bookworm's source packages of the pinned versions
#     below (deb.debian.org, through apt with a private sources list and
#     state under build/, no system configuration touched); apt checks the
#     archive's signature and the .dsc hashes, this script the .dsc's own
#     sha256 (pinned below), dpkg-source the tarballs' against the .dsc.
#  2. each library, minimal (only what src/ calls), into
#     build/macos-link/<target>/prefix/{include,lib}; a stamp per library,
#     version and recipe (the build function's text), so a rerun builds
#     nothing that is built.
#  3. tandem's sources (the Makefile's: src/*/*.c, the CPU backend, the MLX
#     entry points of a build without MLX, the generated web page) with the
#     Makefile's CFLAGS and per-file instruction sets, linked.
#  4. checks of the result (python, reading the Mach-O): the CPU type, the
#     libraries it loads (libSystem only), the undefined symbols (every one
#     bound to libSystem), its size.
#
# What it took (zig 0.17.1, -j2 on two shared cores at load 7-12, so the
# times are long and noisy; seconds per target, aarch64 / x86_64):
#   library     built by                          seconds
#   utf8proc    its one file                      2 / 1
#   xxhash      xxhash.c                          5 / 3
#   zstd        lib/{common,compress,decompress}  61 / 47
#   jansson     src/*.c, config headers written   3 / 4
#   microhttpd  configure --host, make            54 / 75
#   openssl     Configure darwin64-*-cc, make     201 / 198 (libcrypto, libssl)
#   curl        configure --host, make            102 / 97
#   tandem      compile and link                  113 / 115 (1-3 with zig's cache)
# Cold (sources fetched and unpacked in 11 s): 24 minutes for both targets
# at load 10-12 (a first recipe, without libssl), 18 by the rows above; a
# rerun with nothing changed 4.5 s.
#
# Usage: tools/macos_link.sh [-j N] [TARGET ...]
#        (default: aarch64-macos x86_64-macos; -j: parallel compiles, 2)
# Exit status: 0 linked and checked, 1 a step failed (its log is named),
# 2 no toolchain (no zig, apt, dpkg-source or network for the sources).
set -euo pipefail
cd "$(dirname "$0")/.."
. tools/macos_zig.sh   # ZIG_VERSION, macos_zig_setup, macos_file_flags

OUT=build/macos-link
JOBS=2
while [ $# -gt 0 ]; do
    case "$1" in
    -j) JOBS=$2; shift 2 ;;
    -j*) JOBS=${1#-j}; shift ;;
    -*) echo "usage: $0 [-j N] [aarch64-macos|x86_64-macos ...]" >&2; exit 64 ;;
    *) break ;;
    esac
done
TARGETS=("$@"); [ ${#TARGETS[@]} -gt 0 ] || TARGETS=(aarch64-macos x86_64-macos)
ROOT=$PWD
mkdir -p "$OUT"
macos_zig_setup || exit 2

# ==== Pinned sources ====
# name  Debian source package  version  sha256 of its .dsc. bookworm's
# versions, those of the -dev packages whose headers tools/macos_check.sh
# copies, except OpenSSL: the machine's 3.0.19-1~deb12u2 has left the
# archive (deb.debian.org keeps a suite's current version only, and
# snapshot.debian.org is not reachable from here), so bookworm's current
# 3.0.20-1~deb12u2 (the same 3.0 API and ABI). When a version leaves the
# archive the download fails naming it; `apt-cache showsrc` with the same
# -o options (see apt_opts) lists what is there now.
DEPS=(
    "jansson       jansson        2.14-2              6296ddd9c0a022bd1b70074aefb171cfcdf5694a04ffd32b35fd66097621af87"
    "utf8proc      utf8proc       2.8.0-1             6ce2b0ab12fe7d0c3fd0a40d4eb886ae82bf6ea356e4db1a0a9f76582947625c"
    "zstd          libzstd        1.5.4+dfsg2-5       8f602f92b575aa8b5e979196fb6ee82d78f233521dc9636526d3ecba1f63c1b1"
    "xxhash        xxhash         0.8.1-1             4a961627c06efc8fa3bc4b06ee9dba6cfaf092f2550b88d63e9218a2728721b4"
    "microhttpd    libmicrohttpd  0.9.75-6            c0f8a9cd77c41285d2d48fc68bbee2e460a55042fcd5d3f6b9946c017d4b6846"
    "crypto        openssl        3.0.20-1~deb12u2    a614474a2773c23b10c0d65f4eccbcf93fdac4749afb7c26d76e1b0340154d3d"
    "curl          curl           7.88.1-10+deb12u15  2744f12e3aef161c0361743fa1b318296b122e566e47f381e4a63320fbcc23f4"
)
SRC=$OUT/src
APT=$OUT/apt
apt_opts() {
    echo "-o Dir::Etc::SourceList=$ROOT/$APT/sources.list -o Dir::Etc::SourceParts=/dev/null" \
         "-o Dir::State::Lists=$ROOT/$APT/lists -o Dir::Cache=$ROOT/$APT/cache -o Debug::NoLocking=1" \
         "-o APT::Sandbox::User=$(id -un)"
}
# src_dir NAME: the unpacked source tree of a library (dpkg-source's name)
src_dir() {
    local d; d=$(dep_field "$1" 2); echo "$SRC/$d-$(dep_field "$1" 3 | sed 's/-[^-]*$//')"
}
dep_field() {   # dep_field NAME N: field N (1-4) of NAME's DEPS line
    local l f
    for l in "${DEPS[@]}"; do read -r -a f <<<"$l"; [ "${f[0]}" = "$1" ] && { echo "${f[$2-1]}"; return; }; done
    return 1
}
# sources_get: downloads and unpacks what is missing; a tree that is there
# with a .dsc of the pinned hash is kept.
sources_get() {
    local l f need=() dsc
    mkdir -p "$SRC" "$APT/lists/partial" "$APT/cache/archives/partial"
    for l in "${DEPS[@]}"; do
        read -r -a f <<<"$l"
        dsc="$SRC/${f[1]}_${f[2]#*:}.dsc"
        if [ -f "$dsc" ] && echo "${f[3]}  $dsc" | sha256sum -c --quiet - >/dev/null 2>&1 && [ -d "$(src_dir "${f[0]}")" ]; then
            continue
        fi
        need+=("${f[1]}=${f[2]}")
    done
    [ ${#need[@]} -gt 0 ] || return 0
    if ! command -v apt-get >/dev/null || ! command -v dpkg-source >/dev/null; then
        echo "macos-link: apt-get and dpkg-source (dpkg-dev) are needed to fetch the sources"; return 2
    fi
    local k=/usr/share/keyrings/debian-archive-keyring.gpg
    cat >"$APT/sources.list" <<EOF
deb-src [signed-by=$k] http://deb.debian.org/debian bookworm main
deb-src [signed-by=$k] http://deb.debian.org/debian bookworm-updates main
deb-src [signed-by=$k] http://deb.debian.org/debian-security bookworm-security main
EOF
    echo "macos-link: fetching ${need[*]}"
    # shellcheck disable=SC2046 # the options are words
    if ! { apt-get -q $(apt_opts) update && (cd "$SRC" && apt-get -q $(apt_opts) source --download-only "${need[@]}"); } >"$OUT/sources.log" 2>&1; then
        grep -E '^(E|W):' "$OUT/sources.log" | head -n 5
        echo "macos-link: fetching the sources failed ($OUT/sources.log)"; return 2
    fi
    for l in "${DEPS[@]}"; do
        read -r -a f <<<"$l"
        dsc="$SRC/${f[1]}_${f[2]#*:}.dsc"
        echo "${f[3]}  $dsc" | sha256sum -c --quiet - ||
            { echo "macos-link: $dsc is not the pinned one (sha256 ${f[3]})"; return 1; }
        rm -rf "$(src_dir "${f[0]}")"
        # (the signatures: the archive's, which apt checked; gpgv here has no key)
        (cd "$SRC" && dpkg-source -q -x "$(basename "$dsc")") >>"$OUT/sources.log" 2>&1 ||
            { echo "macos-link: dpkg-source -x $dsc failed ($OUT/sources.log)"; return 1; }
    done
}

# ==== Toolchain per target ====
# Wrappers, so that configure scripts and Makefiles see one command each:
# cc (zig cc for the target; -arch, which OpenSSL's darwin configurations
# add, is dropped: the target says it), ar, ranlib (flags dropped: OpenSSL
# asks for Apple's `ranlib -c`).
# The deployment target is MACOS_MIN (tools/macos_zig.sh), and a call of
# a function the SDK marks as newer is an error (zig's SDK headers are
# macOS 27's: unchecked, libmicrohttpd's configure found pipe2(), which
# macOS has only since 27.0, and the binary would not have started on any
# older macOS). So a configure probe of such a function fails and the
# library uses its fallback (libmicrohttpd: pipe() and fcntl()).
tools_make() {
    local t=$1 b=$OUT/$1/bin
    mkdir -p "$b"
    cat >"$b/cc" <<EOF
#!/bin/sh
# zig cc for $t (tools/macos_link.sh)
for a; do shift; case "\$a" in -arch) skip=1 ;; *) if [ -n "\${skip:-}" ]; then skip=; else set -- "\$@" "\$a"; fi ;; esac; done
exec "$ZIG_EXE" cc -target $t.$MACOS_MIN -Werror=unguarded-availability-new -Werror=unguarded-availability "\$@"
EOF
    printf '#!/bin/sh\nexec "%s" ar "$@"\n' "$ZIG_EXE" >"$b/ar"
    # shellcheck disable=SC2016 # the wrappers' own $@
    printf '#!/bin/sh\nfor a; do shift; case "$a" in -*) ;; *) set -- "$@" "$a" ;; esac; done\nexec "%s" ranlib "$@"\n' "$ZIG_EXE" >"$b/ranlib"
    chmod +x "$b/cc" "$b/ar" "$b/ranlib"
}

# ==== The libraries ====
# Each build_NAME TARGET builds one library into $P (prefix: include/ and
# lib/), working in $W; $B is the target's wrappers, $D the source tree.
# lib_archive NAME "FLAGS" FILE...: compiles the files in parallel into
# $W/obj and archives them as $P/lib/libNAME.a.
lib_archive() {
    local name=$1 flags=$2 f; shift 2
    rm -rf "$W/obj"; mkdir -p "$W/obj" "$P/lib"
    # shellcheck disable=SC2016 # $1 $2 $3 are the inner shell's
    for f in "$@"; do printf '%s\0%s\0' "$f" "$W/obj/$(echo "${f#"$D"/}" | tr / _).o"; done |
        xargs -0 -n 2 -P "$JOBS" sh -c "\"$B/cc\" $flags -c \"\$1\" -o \"\$2\"" _
    rm -f "$P/lib/lib$name.a"
    "$B/ar" rcs "$P/lib/lib$name.a" "$W"/obj/*.o
}

# utf8proc: its one file (utf8proc_data.c is included by it).
build_utf8proc() {
    lib_archive utf8proc "-O2" "$D/utf8proc.c"
    cp "$D/utf8proc.h" "$P/include/"
}
# xxhash: xxhash.c (the XXH32/64 and XXH3 functions; no x86 dispatch, the
# default is SSE2 on x86-64 and NEON on arm64).
build_xxhash() {
    lib_archive xxhash "-O2" "$D/xxhash.c"
    cp "$D/xxhash.h" "$D/xxh3.h" "$P/include/"
}
# zstd: compression and decompression, single-threaded, without the
# dictionary builder, the deprecated API and the legacy formats (tandem
# reads only frames it wrote); XXH_NAMESPACE as zstd's own Makefile sets
# it, so its private xxhash copy does not clash with libxxhash; its x86-64
# Huffman decoder in assembly (Mach-O supported) on x86_64; -O3 as upstream.
build_zstd() {
    local asm=()
    case "$T" in x86_64*) asm=("$D/lib/decompress/huf_decompress_amd64.S") ;; esac
    lib_archive zstd "-O3 -DXXH_NAMESPACE=ZSTD_ -DZSTD_LEGACY_SUPPORT=0 -I$D/lib -I$D/lib/common" \
        "$D"/lib/common/*.c "$D"/lib/compress/*.c "$D"/lib/decompress/*.c "${asm[@]}"
    cp "$D/lib/zstd.h" "$D/lib/zstd_errors.h" "$P/include/"
}
# jansson: its configuration headers written here (what its configure or
# CMake find on macOS: every POSIX header and call, /dev/urandom for the
# hash seed, the atomic builtins, long long integers, localeconv; no
# endian.h on macOS), then src/*.c.
build_jansson() {
    sed -e 's/@json_inline@/inline/' -e 's/@json_have_long_long@/1/' -e 's/@json_have_localeconv@/1/' \
        -e 's/@json_have_atomic_builtins@/1/' -e 's/@json_have_sync_builtins@/1/' \
        "$D/src/jansson_config.h.in" >"$P/include/jansson_config.h"
    ! grep -n '@json_[a-z_]*@' "$P/include/jansson_config.h" || return 1
    mkdir -p "$W"
    {
        for m in FCNTL_H SCHED_H UNISTD_H SYS_PARAM_H SYS_STAT_H SYS_TIME_H SYS_TYPES_H STDINT_H \
                 CLOSE GETPID GETTIMEOFDAY OPEN READ SCHED_YIELD SYNC_BUILTINS ATOMIC_BUILTINS \
                 LOCALE_H SETLOCALE INT32_T UINT32_T UINT16_T UINT8_T SSIZE_T; do
            echo "#define HAVE_$m 1"
        done
        echo "#define USE_URANDOM 1"
        echo "#define INITIAL_HASHTABLE_ORDER 3"
    } >"$W/jansson_private_config.h"
    cp "$D/src/jansson.h" "$P/include/"
    lib_archive jansson "-O2 -DHAVE_CONFIG_H -I$W -I$P/include" "$D"/src/*.c
}
# libmicrohttpd: its configure, cross (--host), without what tandem does not
# use (HTTPS, authentication, the POST processor, HTTP Upgrade).
build_microhttpd() {
    mkdir -p "$W" && cd "$W"
    CC="$B/cc" AR="$B/ar" RANLIB="$B/ranlib" CFLAGS=-O2 "$D/configure" --host="$HOST" --build="$(uname -m)-pc-linux-gnu" \
        --prefix="$P" --disable-shared --enable-static --disable-https --without-gnutls \
        --disable-bauth --disable-dauth --disable-postprocessor --disable-httpupgrade \
        --disable-doc --disable-examples --disable-curl --disable-nls --with-threads=posix
    make -j"$JOBS" -C src/microhttpd install
    make -C src/include install
}
# OpenSSL: libcrypto (src/ calls SHA-256, HMAC, AES-256-GCM, the random
# generator, CRYPTO_memcmp, OPENSSL_cleanse, base64) and libssl (curl's
# TLS), in C (no-asm),
# without engines, modules, the legacy provider, async jobs (which would
# bring makecontext() and its kin, deprecated on macOS) and the algorithms
# and formats nothing in tandem reaches.
build_crypto() {
    local conf flags="no-asm no-shared no-tests no-async no-engine no-dynamic-engine no-module no-dso
        no-legacy no-comp no-ocsp no-cms no-ts no-ct no-srp no-srtp no-cmp no-gost no-rfc3779
        no-ui-console no-idea no-rc2 no-rc4 no-rc5 no-md4 no-mdc2 no-whirlpool no-seed no-bf no-cast
        no-camellia no-aria no-sm2 no-sm3 no-sm4 no-siphash no-ssl3 no-dtls"
    case "$T" in aarch64*) conf=darwin64-arm64-cc ;; x86_64*) conf=darwin64-x86_64-cc ;; esac
    mkdir -p "$W" && cd "$W"
    # shellcheck disable=SC2086 # the flags are words
    perl "$D/Configure" "$conf" $flags --prefix="$P" \
        CC="$B/cc" AR="$B/ar" RANLIB="$B/ranlib"
    make -j"$JOBS" build_generated
    make -j"$JOBS" libcrypto.a libssl.a
    cp libcrypto.a libssl.a "$P/lib/"
    mkdir -p "$P/include/openssl"
    cp "$D"/include/openssl/*.h include/openssl/*.h "$P/include/openssl/"
}
# curl: HTTP and HTTPS (what src/ speaks: the router's node API,
# registration, the bench client) with the OpenSSL above, whose
# certificate store on a Mac is /etc/ssl/cert.pem (macOS's own bundle; the
# Keychain is Apple's TLS's, not OpenSSL's), the threaded resolver and
# IPv6. Built in a
# copy of its tree with two edits, both of macOS's SystemConfiguration
# framework, which zig's SDK does not carry: configure's
# "-framework CoreFoundation -framework SystemConfiguration" and the call
# it is for (curl_setup.h's CURL_OSX_CALL_COPYPROXIES: a
# SCDynamicStoreCopyProxies() before resolving, which lets NAT64
# synthesize an IPv6 address for an IPv4 literal on IPv6-only networks).
build_curl() {
    rm -rf "$W"; mkdir -p "$W"; cp -a "$D" "$W/src"; cd "$W/src"
    # shellcheck disable=SC2016,SC2015 # configure's text; both greps must match
    grep -q 'LDFLAGS="$LDFLAGS -framework CoreFoundation -framework SystemConfiguration"' configure &&
        grep -q 'define CURL_OSX_CALL_COPYPROXIES 1' lib/curl_setup.h || { echo "curl: the edits no longer apply"; return 1; }
    # shellcheck disable=SC2016 # configure's text
    sed -i 's/LDFLAGS="$LDFLAGS -framework CoreFoundation -framework SystemConfiguration"/:/' configure
    sed -i '/define CURL_OSX_CALL_COPYPROXIES 1/d' lib/curl_setup.h
    CC="$B/cc" AR="$B/ar" RANLIB="$B/ranlib" CFLAGS=-O2 ./configure --host="$HOST" --build="$(uname -m)-pc-linux-gnu" \
        --prefix="$P" --disable-shared --enable-static --with-openssl="$P" \
        --with-ca-bundle=/etc/ssl/cert.pem --without-ca-path --without-zlib --without-brotli \
        --without-zstd --without-libpsl --without-libidn2 --without-nghttp2 --without-libssh2 --without-librtmp \
        --disable-ldap --disable-ldaps --disable-rtsp --disable-dict --disable-telnet --disable-tftp --disable-pop3 \
        --disable-imap --disable-smb --disable-smtp --disable-gopher --disable-mqtt --disable-ftp --disable-file \
        --disable-manual --disable-ntlm --disable-cookies --disable-alt-svc --disable-hsts --disable-unix-sockets \
        --enable-ipv6 --enable-threaded-resolver
    make -j"$JOBS" -C lib install
    make -C include install
}

# dep_build TARGET NAME: builds NAME unless its stamp (version, recipe,
# toolchain) is there; prints the wall time and the load average.
dep_build() {
    local t=$1 name=$2 ver recipe stamp start rc
    ver=$(dep_field "$name" 3)
    # (curl is built against OpenSSL: a new OpenSSL recipe rebuilds it)
    recipe=$( { declare -f "build_$name" lib_archive tools_make; [ "$name" != curl ] || declare -f build_crypto; echo "$ZIG_VERSION $MACOS_MIN"; } | sha256sum | cut -c1-12)
    stamp=$OUT/$t/stamps/$name-$ver-$recipe
    [ -f "$stamp" ] && return 0
    mkdir -p "$OUT/$t/stamps" "$OUT/$t/logs" "$OUT/$t/prefix/include" "$OUT/$t/prefix/lib"
    rm -f "$OUT/$t/stamps/$name"-*
    start=$(date +%s)
    printf 'macos-link: %s %s %s ... ' "$t" "$name" "$ver"
    rc=0
    ( set -e; T=$t; HOST=${t%-macos}-apple-darwin; B=$ROOT/$OUT/$t/bin; P=$ROOT/$OUT/$t/prefix
      W=$ROOT/$OUT/$t/work/$name; D=$ROOT/$(src_dir "$name"); rm -rf "$W"; mkdir -p "$W"
      "build_$name" ) >"$OUT/$t/logs/$name.log" 2>&1 &
    # (waited for, not `( ... ) || rc=$?`: in a tested command bash ignores
    # set -e, and a failed step would not stop the build)
    wait $! || rc=$?
    if [ $rc -ne 0 ]; then
        echo "FAILED"; tail -n 20 "$OUT/$t/logs/$name.log" | sed 's/^/    /'
        echo "macos-link: $name for $t failed ($OUT/$t/logs/$name.log)"; return 1
    fi
    echo "$(( $(date +%s) - start )) s (load $(cut -d' ' -f1-3 /proc/loadavg))"
    echo "$(( $(date +%s) - start )) s, load $(cut -d' ' -f1-3 /proc/loadavg)" >"$stamp"
}

# ==== tandem ====
# The Makefile's sources of the command (LIB_SRC and src/cmd/main.c) and
# its CFLAGS (-g, -O2, -pthread; TANDEM_GIT as the Makefile sets it), the
# web page generated as the Makefile does, then one link against the
# static libraries (the Makefile's LDLIBS, libssl with curl).
TANDEM_CFLAGS="-std=c11 -D_GNU_SOURCE -Wall -Wextra -Wno-unused-parameter -g -O2 -pthread -Isrc"
tandem_link() {
    local t=$1 o=$OUT/$1/obj p=$OUT/$1/prefix f files gen=$OUT/gen/web_page.c rev
    mkdir -p "$OUT/gen"
    { echo '/* generated by tools/macos_link.sh from src/router/web_page.html (as the Makefile) - do not edit */'
      echo '#include <stddef.h>'
      echo 'const unsigned char rt_web_page_html[] = {'
      od -An -v -tx1 src/router/web_page.html | sed 's/[0-9a-f][0-9a-f]/0x&,/g'
      echo '0x00};'
      echo "const size_t rt_web_page_len = $(wc -c <src/router/web_page.html);"; } >"$gen"
    mapfile -t files < <(ls src/*/*.c src/backend/cpu/*.c src/backend/mlx/backend_mlx_absent.c "$gen" | sort -u)
    rev=$(git rev-parse --short HEAD 2>/dev/null || true)
    rm -rf "$o"; mkdir -p "$o"
    # shellcheck disable=SC2016 # $1 $2 $3 are the inner shell's
    for f in "${files[@]}"; do
        printf '%s\0%s\0%s\0' "$f" "$o/$(echo "$f" | tr / _).o" \
            "$(macos_file_flags "$t" "$f") $([ "$f" = src/cmd/cli.c ] && [ -n "$rev" ] && echo "-DTANDEM_GIT=\"$rev\"")"
    done | xargs -0 -n 3 -P "$JOBS" sh -c \
        "\"$OUT/$t/bin/cc\" $TANDEM_CFLAGS -isystem $p/include \$3 -c \"\$1\" -o \"\$2\" || { echo \"FAIL \$1\"; exit 1; }" _ \
        >"$OUT/$t/logs/tandem-cc.log" 2>&1 || { echo "macos-link: $t: compiling failed:"; grep -v '^$' "$OUT/$t/logs/tandem-cc.log" | head -n 30; return 1; }
    # shellcheck disable=SC2086 # the flags are words
    "$OUT/$t/bin/cc" -g -pthread "$o"/*.o -L"$p/lib" -lm -ljansson -lutf8proc -lzstd -lmicrohttpd -lxxhash -lcurl -lssl -lcrypto \
        -o "$OUT/$t/tandem" >"$OUT/$t/logs/tandem-ld.log" 2>&1 ||
        { echo "macos-link: $t: linking failed:"; head -n 40 "$OUT/$t/logs/tandem-ld.log"; return 1; }
}

# ==== Checks ====
# macho_check FILE CPU: reads the Mach-O: 64-bit executable of CPU (arm64 or
# x86_64), the dylibs it loads (libSystem only), every undefined symbol
# bound to one of them (two-level namespace), the minimum macOS; prints one
# line, fails on a mismatch.
macho_check() {
    python3 - "$1" "$2" <<'PY'
import struct, sys
path, want = sys.argv[1], sys.argv[2]
b = open(path, 'rb').read()
magic, cpu, _sub, ftype, ncmds, _size, flags, _r = struct.unpack_from('<IiiIIIII', b, 0)
cpus = {0x0100000c: 'arm64', 0x01000007: 'x86_64'}
errs = []
if magic != 0xfeedfacf: sys.exit(f'{path}: not a 64-bit Mach-O (magic {magic:#x})')
if cpus.get(cpu) != want: errs.append(f'CPU {cpus.get(cpu, hex(cpu))}, not {want}')
if ftype != 2: errs.append(f'file type {ftype}, not an executable (2)')
off, dylibs, symtab, dysymtab, minos = 32, [], None, None, '?'
for _ in range(ncmds):
    cmd, size = struct.unpack_from('<II', b, off)
    if cmd in (0xc, 0x80000018, 0x8000001f, 0x80000023):   # LOAD, WEAK, REEXPORT, LAZY dylib
        (name_off,) = struct.unpack_from('<I', b, off + 8)
        dylibs.append(b[off + name_off:off + size].split(b'\0')[0].decode())
    elif cmd == 0x2: symtab = struct.unpack_from('<IIII', b, off + 8)
    elif cmd == 0xb: dysymtab = struct.unpack_from('<18I', b, off + 8)
    elif cmd == 0x32:                                       # LC_BUILD_VERSION
        v = struct.unpack_from('<I', b, off + 12)[0]; minos = f'{v >> 16}.{(v >> 8) & 255}'
    off += size
symoff, nsyms, stroff, _strsize = symtab
iundef, nundef = dysymtab[4], dysymtab[5]
bad = []
for i in range(iundef, iundef + nundef):
    strx, _t, _s, desc, _v = struct.unpack_from('<IBBHQ', b, symoff + 16 * i)
    ordinal = desc >> 8
    name = b[stroff + strx:].split(b'\0')[0].decode()
    if not (1 <= ordinal <= len(dylibs)) or not dylibs[ordinal - 1].startswith('/usr/lib/libSystem'):
        bad.append(f'{name} (ordinal {ordinal})')
if [d for d in dylibs if not d.startswith('/usr/lib/libSystem')]: errs.append(f'loads {dylibs}')
if bad: errs.append(f'{len(bad)} undefined symbols not from libSystem: {bad[:10]}')
print(f'{path}: Mach-O 64-bit executable {cpus.get(cpu)}, macOS >= {minos}, {len(b) / 1e6:.1f} MB, '
      f'loads {", ".join(dylibs)}; {nundef} undefined symbols, all from libSystem' if not errs else
      f'{path}: ' + '; '.join(errs))
sys.exit(1 if errs else 0)
PY
}

# ==== Main ====
sources_get || exit $?
for t in "${TARGETS[@]}"; do
    case "$t" in aarch64-macos|x86_64-macos) ;; *) echo "macos-link: unknown target $t" >&2; exit 64 ;; esac
    tools_make "$t"
    for name in utf8proc xxhash zstd jansson microhttpd crypto curl; do dep_build "$t" "$name" || exit 1; done
    start=$(date +%s)
    tandem_link "$t" || exit 1
    echo "macos-link: $t tandem compiled and linked in $(( $(date +%s) - start )) s (load $(cut -d' ' -f1-3 /proc/loadavg))"
    case "$t" in aarch64*) cpu=arm64 ;; *) cpu=x86_64 ;; esac
    macho_check "$OUT/$t/tandem" "$cpu" || exit 1
done
