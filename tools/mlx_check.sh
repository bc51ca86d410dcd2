#!/usr/bin/env bash
# tools/mlx_check.sh - the MLX backend's checks on this machine (MLX's CPU
# backend on Linux x86-64; on a Mac with MLX_DIR set, Metal):
#   1. tools/mlx_build.sh (the pinned mlx-cpu wheel into build/mlx/)
#   2. make MLX=1 mlx: the one MLX object, linked with build/libtandem.a
#      (the default build's library, made first if missing: the backend is
#      chosen at run time, so nothing else is compiled for MLX) into
#      build-mlx/tandem and build-mlx/test_*
#   3. test_backend_ops: every op of backend.h against the CPU backend by NMSE
#   4. test_golden on the MLX backend (TANDEM_BACKEND=mlx): every golden
#      file within its tolerances
#   5. test_handoff with CPU prefill nodes and an MLX decode side
#      (TANDEM_DECODE_BACKEND=mlx): F16/F32 files give the CPU-only greedy
#      tokens exactly, quantized files agree above the floor
#   6. test_serve_mlx: serving nodes with --backend mlx (a router before
#      one, continuous batching, prefix sharing, --lookup) against a CPU
#      node's greedy tokens, on stories260K-F16
#   7. test_chain_backend (TANDEM_PREFILL_BACKEND unset: its default, MLX):
#      layer-split prefill chains with MLX slices and
#      chains mixing MLX and CPU slices (CPU and MLX decode sides, a decode
#      node's prefix reuse, kill -9 of an MLX slice mid-prefill): F16/F32
#      files give the CPU single-node tokens exactly, quantized files agree
#      above test_handoff's floor
# MLX_QUICK=1: test_golden, test_handoff and test_chain_backend on the
# stories260K files only (F32 and F16; what tools/test.sh runs: MLX's CPU
# backend is slow). The
# full test_golden took 488 s at load 2 and passed tests/run.sh's 900 s at
# load 6-9, so the full run gives each test binary TEST_TIMEOUT=7200 s.
# Prints tests/run.sh's totals ("N passed, M failed, K skipped") last.
# Exit 2 with "mlx: ..." when MLX cannot be had here (tools/test.sh counts
# that as the named skip "mlx").
#
#   tools/mlx_check.sh [-jN]        JOBS for make (default 2)
set -uo pipefail
cd "$(dirname "$0")/.."
JOBS=${1:--j2}
if [ -z "${MLX_DIR:-}" ]; then
    tools/mlx_build.sh || { echo "mlx: tools/mlx_build.sh could not fetch MLX (see above)"; exit 2; }
    MLX_DIR=build/mlx
fi
make models >/dev/null   # build/models: the generated F16 fixtures the suite uses
make "$JOBS" build/libtandem.a >/dev/null &&
    make "$JOBS" MLX=1 MLX_DIR="$MLX_DIR" mlx >/dev/null ||
    { echo "FAIL mlx: make MLX=1 failed"; echo "0 passed, 1 failed, 0 skipped"; exit 1; }
quick=(TEST_TIMEOUT="${TEST_TIMEOUT:-7200}")
[ "${MLX_QUICK:-0}" = 1 ] && quick=(TANDEM_GOLDEN=stories260K TANDEM_HANDOFF_ONLY=stories260K)
# the runs set every TANDEM_* variable the tests read
env -u TANDEM_PREFILL_BACKEND -u TANDEM_GOLDEN -u TANDEM_HANDOFF_ONLY "${quick[@]}" TANDEM_MODELS=build/models TANDEM_BIN=build-mlx/tandem TANDEM_BACKEND=mlx \
    TANDEM_DECODE_BACKEND=mlx tests/run.sh build-mlx/test_backend_ops build-mlx/test_golden build-mlx/test_handoff build-mlx/test_serve_mlx \
    build-mlx/test_chain_backend
