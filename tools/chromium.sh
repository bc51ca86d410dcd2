#!/usr/bin/env bash
# chromium.sh ARGS... - one headless Chromium run with a throw-away profile
# and the flags that keep it from reaching anything by itself (no
# background networking, component updates, sync or QUIC); ARGS are
# Chromium's (--screenshot=FILE URL, --dump-dom URL, --remote-debugging-pipe
# ...). The one way this project starts a browser: tools/report_check.sh
# (the grade report) and tests/clients/web_check.py (the router's chat page,
# which passes the DevTools pipe on fds 3 and 4) both go through it.
# Exit 2 when no Chromium is installed (Debian: apt-get install chromium);
# CHROMIUM names another binary; CHROMIUM_TIMEOUT bounds the run (120 s).
set -uo pipefail
CHROMIUM=${CHROMIUM:-$(command -v chromium || command -v chromium-browser || true)}
[ -n "$CHROMIUM" ] || { echo "chromium.sh: chromium not found (apt-get install chromium)" >&2; exit 2; }
profile=$(mktemp -d)
trap 'rm -rf "$profile"' EXIT
timeout "${CHROMIUM_TIMEOUT:-120}" "$CHROMIUM" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
    --disable-background-networking --disable-component-update --disable-sync \
    --user-data-dir="$profile" --window-size=1200,900 "$@"
