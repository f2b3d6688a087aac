#!/usr/bin/env bash
# Creates fsdpx's Conan package from this checkout and runs its test_package, offline, against the
# system's LibTorch, MPI and Boost (conan/profiles/system maps them as [platform_requires]):
#
#   tools/conan_create.sh [WORK_DIR [extra conan create arguments...]]     WORK_DIR default: build/conan
#
# Conan's home is WORK_DIR/conan-home (~/.conan2 is never touched; a default profile is detected there
# once); test_package builds in WORK_DIR/test_package. No remote is contacted (--no-remote).
# Conan: $CONAN, else .venv/bin/conan, else conan on PATH. LibTorch: $Torch_DIR, else .venv's wheel.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-$repo/build/conan}
shift || true
mkdir -p "$work"
work=$(cd "$work" && pwd)

conan=${CONAN:-}
if [[ -z $conan ]]; then
  if [[ -x $repo/.venv/bin/conan ]]; then conan=$repo/.venv/bin/conan; else conan=conan; fi
fi
if [[ -z ${Torch_DIR:-} ]]; then
  prefix=$("$repo/.venv/bin/python" -c "import torch; print(torch.utils.cmake_prefix_path)" 2>/dev/null) ||
    { echo "conan_create.sh: set Torch_DIR to <libtorch>/share/cmake/Torch (no torch in .venv)" >&2; exit 1; }
  export Torch_DIR=$prefix/Torch
fi
export CONAN_HOME=$work/conan-home

"$conan" profile path default >/dev/null 2>&1 || "$conan" profile detect
# A fresh test_package build, so it never reuses a CMake cache that points at an older package.
rm -rf "$work/test_package"
"$conan" create "$repo" -pr:a "$repo/conan/profiles/system" --build=missing --no-remote \
  -c tools.cmake.cmake_layout:test_folder="$work/test_package" "$@"
# Keep only the newest recipe revision, so a reused WORK_DIR does not grow with every header change.
"$conan" remove "fsdpx/*#!latest" --confirm >/dev/null 2>&1
