#!/usr/bin/env bash
# Configures the CMake build in $1 (default build/) against your LibTorch or the one in .venv; further
# arguments go to cmake (e.g. -DFSDPX_BUILD_TESTS=OFF).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${1:-build}
shift $(($# > 0 ? 1 : 0))
VENV=${VENV:-.venv}
args=(-S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE="${CMAKE_BUILD_TYPE:-Release}")
if [[ -n ${Torch_DIR:-} ]]; then
  args+=(-DTorch_DIR="$Torch_DIR")
elif [[ -x $VENV/bin/python ]] && "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  prefix=$("$VENV/bin/python" -c "import torch; print(torch.utils.cmake_prefix_path)" 2>/dev/null)
  args+=(-DCMAKE_PREFIX_PATH="${CMAKE_PREFIX_PATH:+$CMAKE_PREFIX_PATH;}$prefix")
fi
[[ -x $VENV/bin/python ]] && args+=(-DPython3_EXECUTABLE="$PWD/$VENV/bin/python")
args+=("$@")
# LibTorch's config warns about libraries a pip wheel does not ship (kineto); that is expected.
cmake "${args[@]}" -Wno-dev 2>&1 | grep -v -E "^$|kineto|TorchConfig.cmake|append_torchlib_if_found|find_dependency|fsdpxDependencies.cmake|Call Stack|CMakeLists.txt:[0-9]+ \(include\)|^CMake Warning at" || true
test -f "$BUILD_DIR/CMakeCache.txt"
