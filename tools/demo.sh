#!/usr/bin/env bash
# The main job on one machine: build tandem, then serve one request.
#   tools/demo.sh [MODEL.gguf] [PROMPT]
# Default model: assets/stories260K.gguf (built in).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/deps.sh
make -j"$(nproc 2>/dev/null || echo 2)" build/tandem >/dev/null
MODEL=${1:-assets/stories260K.gguf}
PROMPT=${2:-Once upon a time}
echo "== tandem run -m $MODEL"
build/tandem run -m "$MODEL" -p "$PROMPT" -n 64 -t 2
