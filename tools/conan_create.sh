#!/usr/bin/env bash
# The documented Conan path (docs/building.md, "Conan"), offline, from an empty Conan home: creates
# fsdpx's package from this checkout (its test_package runs), then builds and runs a consumer project
# in a fresh directory outside the source tree that only says `requires fsdpx/<version>`:
#
#   tools/conan_create.sh [WORK_DIR [extra conan create arguments...]]     WORK_DIR default: build/conan
#
# Conan's home is WORK_DIR/conan-home (~/.conan2 is never touched). No remote is contacted. Conan:
# $CONAN, else .venv/bin/conan, else conan on PATH. LibTorch: $Torch_DIR when set, else the recipe
# finds the torch of the Python on PATH (.venv's first). The consumer is built with neither: it finds
# LibTorch through the location the package recorded. MPIEXEC_FLAGS: extra mpiexec flags for the run.
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
[[ -x $repo/.venv/bin/python ]] && export PATH=$repo/.venv/bin:$PATH
export CONAN_HOME=$work/conan-home
version=$(sed -nE 's/^project\(fsdpx +VERSION +([0-9.]+).*/\1/p' "$repo/CMakeLists.txt")

# The documented commands.
"$conan" profile path default >/dev/null 2>&1 || "$conan" profile detect
"$conan" config install "$repo/conan/profiles" --target-folder profiles
rm -rf "$work/test_package"  # a fresh test_package build, never a CMake cache of an older package
"$conan" create "$repo" -pr:a fsdpx-system --build=missing --no-remote \
  -c tools.cmake.cmake_layout:test_folder="$work/test_package" "$@"
# Keep only the newest recipe revision, so a reused WORK_DIR does not grow with every header change.
"$conan" remove "fsdpx/*#!latest" --confirm >/dev/null 2>&1

# A consumer outside the source tree: its conanfile, its CMakeLists, the consumer tests' light program
# (one header and an all-reduce: that the package is found, links and runs; test_package above built
# and ran a sharded model through the umbrella header).
consumer=$(mktemp -d /tmp/fsdpx_conan_consumer.XXXXXX)
trap 'rm -rf "$consumer"' EXIT
cp "$repo/tests/consumer/light.cpp" "$consumer/main.cpp"
cp "$repo/tests/consumer/all_reduce_check.hpp" "$consumer/"
cat > "$consumer/conanfile.txt" <<TXT
[requires]
fsdpx/$version
[generators]
CMakeToolchain
CMakeDeps
TXT
cat > "$consumer/CMakeLists.txt" <<'CML'
cmake_minimum_required(VERSION 3.22)
project(app LANGUAGES CXX)
find_package(fsdpx CONFIG REQUIRED)
add_executable(app main.cpp)
target_link_libraries(app PRIVATE fsdpx::fsdpx)
CML
cd "$consumer"
(
  # Neither Torch_DIR nor a torch on PATH: the package says where LibTorch was.
  unset Torch_DIR
  export PATH=${PATH#"$repo/.venv/bin:"}
  "$conan" install . -pr:a fsdpx-system --build=missing --no-remote -of build
  # Release without the optimizer (only that it builds, links and runs is tested; the optimizer is
  # most of the compile time).
  cmake -S . -B build/cmake -DCMAKE_TOOLCHAIN_FILE=build/conan_toolchain.cmake -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CXX_FLAGS_RELEASE=-DNDEBUG
  cmake --build build/cmake
  read -ra flags <<< "${MPIEXEC_FLAGS:-}"
  mpiexec -n 2 "${flags[@]}" build/cmake/app
)
echo "conan_create.sh: package created and consumed from $consumer"
