#!/usr/bin/env bash
# Opens `tandem grade` reports in a real browser (headless Chromium) and
# checks what the browser built (docs/grade.md):
#   - a screenshot DIR/report.png (look at it: the table, the chart)
#   - the DOM Chromium made of the page: the chart's <svg> with its bars, one
#     table row per record, every in-page link (#student-...) has its target,
#     every relative link names a file that exists.
# usage: tools/report_check.sh [DIR...]   (default: the reports tests/grade/test_grade.c
#        leaves in build/test_grade.d/render and build/test_grade.d/class-out)
# Needs Debian's chromium package (apt-get install chromium), started through
# tools/chromium.sh (as tests/router/test_web.c does); not part of CI.
set -euo pipefail
cd "$(dirname "$0")/.."
DIRS=("$@"); [ ${#DIRS[@]} -gt 0 ] || DIRS=(build/test_grade.d/render build/test_grade.d/class-out)
# tools/chromium.sh starts it (the flags, the throw-away profile)
command -v "${CHROMIUM:-chromium}" >/dev/null || command -v chromium-browser >/dev/null ||
    { echo "report_check: chromium not found (apt-get install chromium)"; exit 2; }

browse() {   # browse ARGS...: one headless Chromium run (tools/chromium.sh)
    tools/chromium.sh "$@" 2>/dev/null
}

fail=0
for dir in "${DIRS[@]}"; do
    page="$(cd "$dir" && pwd)/report.html"
    [ -f "$page" ] || { echo "report_check: $page missing"; fail=1; continue; }
    rm -f "$dir/report.png"
    browse --screenshot="$(cd "$dir" && pwd)/report.png" "file://$page" >/dev/null
    dom=$(browse --dump-dom "file://$page")
    problems=()
    [ -s "$dir/report.png" ] || problems+=("no screenshot")
    bars=$(grep -o 'class="bar"' <<<"$dom" | wc -l)
    grep -q '<svg' <<<"$dom" && [ "$bars" -gt 0 ] || problems+=("no chart in the DOM")
    records=$(find "$dir" -maxdepth 1 -name '*.json' ! -name schema.json | wc -l)
    rows=$(grep -o '<tr class="' <<<"$dom" | wc -l)
    # the unit-test report is rendered from records held in memory, not files
    [ "$records" -eq 0 ] || [ "$rows" -eq "$records" ] || problems+=("$rows table rows for $records records")
    links=0
    while IFS= read -r href; do
        links=$((links + 1))
        case "$href" in
        \#*) grep -q "id=\"${href#\#}\"" <<<"$dom" || problems+=("link $href has no target") ;;
        http*|file:*) problems+=("external link $href") ;;
        *) [ -e "$dir/$href" ] || problems+=("link $href names no file") ;;
        esac
    done < <(grep -o 'href="[^"]*"' <<<"$dom" | sed 's/^href="//; s/"$//' | sort -u)
    if [ ${#problems[@]} -eq 0 ]; then
        echo "report_check: $dir: ok ($rows rows, $bars bars, $links distinct links, screenshot $dir/report.png)"
    else
        echo "report_check: $dir: FAILED: ${problems[*]}"; fail=1
    fi
done
exit $fail
