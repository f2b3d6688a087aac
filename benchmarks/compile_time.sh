#!/usr/bin/env bash
# What including fsdpx costs a translation unit: the time to compile a file with <torch/torch.h> alone,
# then with <fsdpx/fsdp.hpp> (the user's one include) header-only, then compiled once
# (FSDPX_SEPARATE_COMPILATION, fsdpx/detail/config.hpp: the out-of-line parts live in
# <fsdpx/impl/src.hpp>, compiled once per program) with fsdpx's layers added one by one; each mode also
# with the TCP sync service's header (<fsdpx/sync/service.hpp>, not in fsdp.hpp) added. The flags are
# a CMake consumer's of fsdpx::fsdpx, taken from the configured build's train_gpt target (Release,
# MPI, Boost, OpenSSL). The variants run in turn, REPEAT rounds; the median wall and CPU (user +
# system) times and their ratios to torch alone are printed, then one compile of impl/src.hpp.
# docs/benchmarks.md ("Compile time") records the figures.
#   benchmarks/compile_time.sh [build_dir]        env: REPEAT (default 3), CXX (default c++), SRC=0
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

sep="#define FSDPX_SEPARATE_COMPILATION 1"
names=(torch "fsdp.hpp header-only" "+ sync service, h-o" "compiled once: dist" "compiled once: core" "+ checkpoint"
       "+ sync = fsdp.hpp" "+ sync service")
headers=(""
         "#include <fsdpx/fsdp.hpp>"
         "#include <fsdpx/fsdp.hpp>
#include <fsdpx/sync/service.hpp>"
         "$sep
#include <fsdpx/policies.hpp>
#include <fsdpx/dist.hpp>"
         "$sep
#include <fsdpx/policies.hpp>
#include <fsdpx/dist.hpp>
#include <fsdpx/core/fsdp.hpp>"
         "$sep
#include <fsdpx/policies.hpp>
#include <fsdpx/dist.hpp>
#include <fsdpx/core/fsdp.hpp>
#include <fsdpx/checkpoint.hpp>"
         "$sep
#include <fsdpx/fsdp.hpp>"
         "$sep
#include <fsdpx/fsdp.hpp>
#include <fsdpx/sync/service.hpp>")
for i in "${!names[@]}"; do
  printf '#include <torch/torch.h>\n%s\nint main() { return 0; }\n' "${headers[$i]}" > "$work/tu$i.cpp"
done

# Each compile's wall time and CPU time (user + system: steadier on a shared machine), by bash's `time`.
declare -A walls cpus
TIMEFORMAT='%R %U %S'
compile() {  # compile <source> <object> [flags...]: prints "wall cpu"
  local src=$1 obj=$2; shift 2
  # shellcheck disable=SC2086
  { time ${CXX:-c++} $defines $includes $cxxflags "$@" -c "$src" -o "$obj" 2>/dev/null; } 2>&1 | tail -1 |
    awk '{ printf "%.1f %.1f\n", $1, $2 + $3 }'
}
for ((round = 1; round <= repeat; round++)); do
  for i in "${!names[@]}"; do
    read -r wall cpu < <(compile "$work/tu$i.cpp" "$work/tu$i.o")
    walls[$i]+="$wall "
    cpus[$i]+="$cpu "
  done
done

median() { tr ' ' '\n' | grep -v '^$' | sort -n | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
base_wall=$(echo "${walls[0]}" | median)
base_cpu=$(echo "${cpus[0]}" | median)
echo "compile time of one translation unit ($repeat rounds, median; $(${CXX:-c++} --version | head -1); $(nproc) cores)"
printf '  %-22s %8s %7s   %8s %7s   %s\n' "" "wall" "ratio" "cpu" "ratio" "(wall runs; cpu runs)"
for i in "${!names[@]}"; do
  w=$(echo "${walls[$i]}" | median)
  c=$(echo "${cpus[$i]}" | median)
  printf '  %-22s %6.1f s  x%.2f   %6.1f s  x%.2f   (%s; %s)\n' "${names[$i]}" "$w" \
    "$(awk -v a="$w" -v b="$base_wall" 'BEGIN { print a / b }')" "$c" \
    "$(awk -v a="$c" -v b="$base_cpu" 'BEGIN { print a / b }')" "${walls[$i]% }" "${cpus[$i]% }"
done
# What compiling once costs: <fsdpx/impl/src.hpp>, one translation unit per program (one run).
if [[ ${SRC:-1} == 1 ]]; then
  printf '#include <fsdpx/impl/src.hpp>\n' > "$work/src.cpp"
  read -r wall cpu < <(compile "$work/src.cpp" "$work/src.o" -DFSDPX_SEPARATE_COMPILATION=1)
  printf '  %-22s %6.1f s            %6.1f s           (once per program; SRC=0 skips it)\n' "impl/src.hpp" "$wall" "$cpu"
fi
