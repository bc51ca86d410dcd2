#!/usr/bin/env bash
# layers.sh - the include rule of src/: a folder includes only itself and the
# folders it is declared to use below, so that lower layers never include
# higher ones (docs/architecture.md, "The source tree"). Run by `make test`
# (and `make layers`); prints each include that breaks the rule and exits 1.
#
#   tools/layers.sh [SRC]     SRC: the tree to check (default: src)
set -u
src=${1:-src}

# ==== The rule, in one place ====
# FOLDER: the folders it may include (besides itself). Left to right the
# layers climb: base, engine, backend, net and api, node and router, grade,
# cmd. backend/cpu, backend/cuda and backend/mlx are one layer "backend" and
# may include each other's headers only through engine/backend.h (so none
# is listed).
declare -A uses=(
    [base]=""
    [engine]="base"
    [backend/cpu]="base engine"
    [backend/cuda]="base engine"
    [backend/mlx]="base engine"
    [net]="base engine"
    [api]="base engine"
    [node]="base engine net api"
    [router]="base net api"
    [grade]="base"
    [cmd]="base engine backend/cpu backend/cuda net api node router grade"
)

# ==== The check ====
bad=0
folder_of() {   # src/engine/model.c -> engine; src/backend/cpu/x.c -> backend/cpu
    local rel=${1#"$src"/}
    case $rel in
        backend/*/*) echo "${rel%/*}" ;;
        */*) echo "${rel%%/*}" ;;
        *) echo "." ;;
    esac
}
while IFS= read -r f; do
    from=$(folder_of "$f")
    if [ -z "${uses[$from]+x}" ]; then
        echo "layers: $f: folder '$from' is not declared in tools/layers.sh"; bad=1; continue
    fi
    while IFS=: read -r line inc; do
        inc=${inc#*\"}; inc=${inc%%\"*}
        case $inc in
            */*) to=$(folder_of "$src/$inc") ;;
            *.c) continue ;;   # a kernel set compiling its sibling under other flags
            *) if [ -f "$(dirname "$f")/$inc" ]; then continue; fi
               echo "layers: $f:$line: \"$inc\" does not name its folder (write \"<folder>/$inc\")"; bad=1; continue ;;
        esac
        [ "$to" = "$from" ] && continue
        ok=0
        for u in ${uses[$from]}; do [ "$u" = "$to" ] && ok=1; done
        if [ $ok -eq 0 ]; then
            echo "layers: $f:$line: $from/ includes \"$inc\" ($to/ is not below $from/: it may use ${uses[$from]:-nothing})"
            bad=1
        fi
    done < <(grep -n '^[[:space:]]*#[[:space:]]*include[[:space:]]*"' "$f")
done < <(find "$src" -type f \( -name '*.c' -o -name '*.h' -o -name '*.cu' -o -name '*.cpp' \) | sort)
if [ $bad -ne 0 ]; then exit 1; fi
echo "layers: src/ includes go only downward ($(find "$src" -type f \( -name '*.c' -o -name '*.h' -o -name '*.cu' -o -name '*.cpp' \) | wc -l) files)"
