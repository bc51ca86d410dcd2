#!/bin/sh
# tools/mlx_build.sh - fetches MLX for the MLX backend (src/backend/mlx,
# `make MLX=1`) into build/mlx/: PyPI's mlx-cpu wheel, pinned by version and
# sha256, which carries libmlx.so (MLX's CPU backend for Linux x86-64),
# its C++ headers and the BLAS/LAPACK it was linked with. Nothing is
# compiled here: the backend is C++ against MLX's own C++ API (see
# docs/mlx.md for why not mlx-c), built by `make MLX=1 mlx`.
#
#   tools/mlx_build.sh            # build/mlx/{include,lib} (about 35 MB)
#   make MLX=1 mlx                # then the backend (build-mlx/)
#
# On a Mac: `pip install mlx==$MLX_VERSION` brings libmlx.dylib, the headers
# and mlx.metallib; `make MLX=1 mlx MLX_DIR=$(python3 -c 'import mlx,os;
# print(os.path.dirname(mlx.__file__))')` builds against them (docs/mlx.md).
#
# Exit 0 with build/mlx/ ready; 1 with a message when the wheel cannot be
# had (no network to PyPI, a different sha256, no unzip).
set -eu
cd "$(dirname "$0")/.."
# One version, checked: a new wheel is a deliberate change of these lines.
MLX_VERSION=0.32.4
WHEEL=mlx_cpu-$MLX_VERSION-py3-none-manylinux_2_35_x86_64.whl
WHEEL_SHA256=0e0a24fa2ce8b6b94d2e6a90604e8813aa8e29fcb918bb2aa01cfb6d133d8cee
OUT=build/mlx
mkdir -p "$OUT/dl"
case "$(uname -sm)" in
    "Linux x86_64") ;;
    *) echo "mlx_build.sh: the pinned wheel is for Linux x86-64; on $(uname -sm) install mlx with pip and pass MLX_DIR (docs/mlx.md)" >&2; exit 1 ;;
esac
if [ -f "$OUT/.done-$MLX_VERSION" ]; then echo "build/mlx: MLX $MLX_VERSION ready"; exit 0; fi
if [ ! -f "$OUT/dl/$WHEEL" ]; then
    python3 -m pip download --quiet --no-deps --only-binary=:all: --platform manylinux_2_35_x86_64 \
        --python-version 3.11 "mlx-cpu==$MLX_VERSION" -d "$OUT/dl" ||
        { echo "mlx_build.sh: cannot download mlx-cpu==$MLX_VERSION from PyPI" >&2; exit 1; }
fi
got=$(sha256sum "$OUT/dl/$WHEEL" | cut -d' ' -f1)
if [ "$got" != "$WHEEL_SHA256" ]; then
    echo "mlx_build.sh: $WHEEL has sha256 $got, expected $WHEEL_SHA256" >&2
    exit 1
fi
rm -rf "$OUT/include" "$OUT/lib" "$OUT/unpack"
mkdir -p "$OUT/unpack"
python3 -m zipfile -e "$OUT/dl/$WHEEL" "$OUT/unpack"
mv "$OUT/unpack/mlx/include" "$OUT/include"
mkdir -p "$OUT/lib"
mv "$OUT/unpack/mlx/lib/libmlx.so" "$OUT/lib/"
# libmlx.so names its BLAS/LAPACK by the wheel's hashed names
mv "$OUT/unpack/mlx_cpu.libs/"* "$OUT/lib/"
rm -rf "$OUT/unpack"
touch "$OUT/.done-$MLX_VERSION"
echo "build/mlx: MLX $MLX_VERSION (mlx-cpu wheel, sha256 $WHEEL_SHA256)"
