#!/usr/bin/env bash
# What including fsdpx costs a translation unit: the wall time to compile a file with <torch/torch.h>
# alone, then with fsdpx's layers added one by one up to the user's one include <fsdpx/fsdp.hpp>, with
# the flags a CMake consumer of fsdpx::fsdpx gets (taken from the configured build's train_gpt target:
# Release, MPI, Boost, OpenSSL), header-only; the last variant is the same include compiled with
# FSDPX_SEPARATE_COMPILATION (fsdpx/detail/config.hpp: Boost.Asio and OpenSSL compiled once, in
# <fsdpx/impl/src.hpp>). The variants run in turn, REPEAT rounds; medians and the ratio to torch
# alone are printed. docs/benchmarks.md ("Compile time") records the figures.
#   benchmarks/compile_time.sh [build_dir]        env: REPEAT (default 3), CXX (default c++)
# The headers are this checkout's; the flags come from `build_dir` (any configured build of fsdpx).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
flags_file=$build/examples/CMakeFiles/train_gpt.dir/flags.make
[[ -f $flags_file ]] || { echo "no $flags_file: configure the build first (make test or tools/configure.sh)" >&2; exit 1; }
get() { sed -n "s/^$1 = //p" "$flags_file"; }
defines=$(get CXX_DEFINES | tr ' ' '\n' | grep -v 'FSDPX_EXAMPLE_\|FSDPX_SEPARATE_COMPILATION' | tr '\n' ' ')
# fsdpx's headers from this checkout (so a copy of this script in an older worktree measures that one).
includes="-I$PWD/include $(get CXX_INCLUDES | sed -E 's#(^| )-I[^ ]*/include( |$)# #')"
cxxflags=$(get CXX_FLAGS)
repeat=${REPEAT:-3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

names=(torch policies+dist core checkpoint fsdp.hpp "fsdp.hpp separate")
headers=(""
         "#include <fsdpx/policies.hpp>
#include <fsdpx/dist.hpp>"
         "#include <fsdpx/core/fsdp.hpp>"
         "#include <fsdpx/core/fsdp.hpp>
#include <fsdpx/checkpoint.hpp>"
         "#include <fsdpx/fsdp.hpp>"
         "#define FSDPX_SEPARATE_COMPILATION 1
#include <fsdpx/fsdp.hpp>")
for i in "${!names[@]}"; do
  printf '#include <torch/torch.h>\n%s\nint main() { return 0; }\n' "${headers[$i]}" > "$work/tu$i.cpp"
done

declare -A times
for ((round = 1; round <= repeat; round++)); do
  for i in "${!names[@]}"; do
    start=$(date +%s.%N)
    # shellcheck disable=SC2086
    ${CXX:-c++} $defines $includes $cxxflags -c "$work/tu$i.cpp" -o "$work/tu$i.o"
    end=$(date +%s.%N)
    times[$i]+="$(awk -v a="$end" -v b="$start" 'BEGIN { printf "%.1f", a - b }') "
  done
done

median() { tr ' ' '\n' | grep -v '^$' | sort -n | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
base=$(echo "${times[0]}" | median)
echo "compile time of one translation unit ($repeat rounds, median; $(${CXX:-c++} --version | head -1); $(nproc) cores)"
for i in "${!names[@]}"; do
  m=$(echo "${times[$i]}" | median)
  printf '  %-18s %6.1f s   x%.2f of torch alone   (runs: %s)\n' "${names[$i]}" "$m" "$(awk -v a="$m" -v b="$base" 'BEGIN { print a / b }')" "${times[$i]}"
done
