#!/usr/bin/env bash
# peer_debian.sh MODEL.gguf [llama-bench ARGS...] - a benchmark helper, not part
# of tandem: runs llama.cpp's llama-bench as Debian unstable ships it, on a
# CPU where the reference builds in ../shared/peers cannot run (they were
# compiled with -march=native for a Xeon with AVX-VNNI and AVX512-FP16 and
# die with SIGILL elsewhere, e.g. on AMD Zen 4).
#
# Debian builds ggml's CPU backend once per CPU generation (sse42 ... zen4,
# sapphirerapids) and loads the one this CPU supports at start-up, as tandem
# picks its kernel set; the first stderr line names it. Debian unstable needs
# a newer C library than this machine's, so the packages are unpacked into a
# directory of their own (PEER_ROOT, default build/peer-debian) and the bench
# runs chrooted there, in a private mount namespace holding /proc, /dev,
# /sys and the model's directory (as /models). Needs root and the network
# path to deb.debian.org that apt uses (and gpgv with Debian's archive
# keyring, as apt has); the first run downloads about 23 MB.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: tools/peer_debian.sh MODEL.gguf [llama-bench ARGS...]" >&2; exit 2; }
cd "$(dirname "$0")/.."
ROOT=${PEER_ROOT:-build/peer-debian}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
# llama-bench and what it links, down to the C library (the loader included)
PKGS="llama.cpp-tools libllama0 libggml0 libc6 libstdc++6 libgcc-s1 libgomp1 libssl3t64 zlib1g libzstd1"

# field F of package P's stanza in $tmp/Packages
peer_field() { awk -v P="Package: $1" -v F="$2:" '$0 == P {s = 1} /^$/ {s = 0} s && $1 == F {print $2; exit}' "$tmp/Packages"; }
# file's SHA256 must be the (non-empty) expected one
peer_check() {
    [ -n "$2" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ] ||
        { echo "peer_debian: $1 does not match its SHA256 in the signed index" >&2; exit 1; }
}

peer_setup() {
    local tmp="$ROOT.tmp" p f
    rm -rf "$tmp" && mkdir -p "$tmp/debs" "$tmp/root"
    # what runs as root below comes over plain http: trust it as apt does,
    # through the archive's signed InRelease (its key in this machine's
    # keyring), the index's SHA256 listed there and each package's in the index
    curl -fsS -m 120 -o "$tmp/InRelease" "$MIRROR/dists/sid/InRelease"
    gpgv --keyring /usr/share/keyrings/debian-archive-keyring.gpg --output "$tmp/Release" "$tmp/InRelease" 2>/dev/null ||
        { echo "peer_debian: Debian unstable's InRelease does not verify" >&2; exit 1; }
    curl -fsS -m 120 -o "$tmp/Packages.xz" "$MIRROR/dists/sid/main/binary-amd64/Packages.xz"
    peer_check "$tmp/Packages.xz" "$(awk '/^SHA256:/ {s = 1; next} /^[^ ]/ {s = 0}
        s && $3 == "main/binary-amd64/Packages.xz" {print $1}' "$tmp/Release")"
    xz -dc "$tmp/Packages.xz" > "$tmp/Packages"
    for p in $PKGS; do
        f=$(peer_field "$p" Filename) && [ -n "$f" ] || { echo "peer_debian: $p is not in Debian unstable's index" >&2; exit 1; }
        curl -fsS -m 300 -o "$tmp/debs/${f##*/}" "$MIRROR/$f"
        peer_check "$tmp/debs/${f##*/}" "$(peer_field "$p" SHA256)"
        dpkg-deb -x "$tmp/debs/${f##*/}" "$tmp/root"
    done
    # merged /usr: the loader is asked for as /lib64/ld-linux-x86-64.so.2
    ln -s usr/lib64 "$tmp/root/lib64"; ln -s usr/lib "$tmp/root/lib"; ln -s usr/bin "$tmp/root/bin"
    mkdir -p "$tmp/root/proc" "$tmp/root/dev" "$tmp/root/sys" "$tmp/root/models"
    (cd "$tmp/debs" && ls) > "$tmp/root/PACKAGES"
    rm -rf "$tmp/debs" "$tmp/Packages" "$tmp/Packages.xz" "$tmp/InRelease" "$tmp/Release"
    rm -rf "$ROOT" && mv "$tmp" "$ROOT"
}

[ -x "$ROOT/root/usr/bin/llama-bench" ] || peer_setup
model=$(realpath "$1"); shift
[ -f "$model" ] || { echo "peer_debian: no file $model" >&2; exit 2; }
dir=$(dirname "$model") r=$(realpath "$ROOT/root")
exec unshare -m sh -c 'mount --make-rprivate / && for d in proc dev sys; do mount --rbind /$d "$1/$d"; done &&
    mount --bind "$2" "$1/models" && root=$1 && shift 2 && exec chroot "$root" /usr/bin/llama-bench "$@"' \
    sh "$r" "$dir" -m "/models/$(basename "$model")" "$@"
