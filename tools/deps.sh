#!/usr/bin/env bash
# Installs the Debian packages tandem needs to build and test, if missing.
# Safe to run repeatedly: it calls apt-get only when something is absent.
#   tools/deps.sh [build|browser]   (default: both)
# build: the compilers, libraries and Python the build and the tests need;
# browser: Chromium alone (test_web's), which tools/test.sh installs in the
# background while the library compiles, as nothing is built against it.
set -euo pipefail
what=${1:-all}
case $what in
all|build|browser) ;;
*) echo "usage: tools/deps.sh [build|browser]" >&2; exit 64 ;;
esac
if [ "$what" != browser ]; then
PKGS=(build-essential clang libclang-rt-14-dev python3 python3-venv pkg-config
      libjansson-dev libutf8proc-dev libzstd-dev libmicrohttpd-dev libssl-dev libxxhash-dev libcurl4-openssl-dev
      iproute2 curl openssl)
missing=()
for p in "${PKGS[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
# Jinja2: tests/render_chat.py, test_tools' oracle of chat-template rendering
# (CI requires it: .ci/run's TANDEM_REQUIRE). Debian's package, unless the
# python3 on PATH already has it.
python3 -c 'import jinja2' 2>/dev/null || dpkg -s python3-jinja2 >/dev/null 2>&1 || missing+=(python3-jinja2)
if [ ${#missing[@]} -gt 0 ]; then
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    echo "deps: installing ${missing[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
fi
[ "$what" != build ] || exit 0
# Chromium: test_web opens the router's chat page in it (tools/chromium.sh),
# as tools/report_check.sh opens the grade report. Installed on its own, so
# that a failure here leaves the build's packages in place; CI requires it
# (.ci/run's TANDEM_REQUIRE names chromium), elsewhere test_web says
# "skipped: chromium".
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    echo "deps: installing chromium"
    { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null; } ||
        echo "deps: chromium could not be installed: test_web will say so"
fi
