#!/usr/bin/env bash
# Issue 62's crafted checkpoint files read by the readers of an earlier commit and of this work tree, side by
# side (benchmarks/untrusted_before_after.cpp: each read in a child under a 6 GiB address-space cap).
#   benchmarks/untrusted_before_after.sh [before-commit (c3f7150)] [work folder (/tmp/fsdpx_untrusted_ab)] [build (build)]
# The earlier commit is checked out with `git worktree` into the work folder; both programs are built with the
# venv's LibTorch (tools/setup.sh), header-only. Then a DCP-format root with one bit flipped in a data file
# (written by the build's fsdpx_checkpoint_job) is merged by the earlier commit's fsdpx-merge and the build's.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
before=${1:-c3f7150}
work=${2:-/tmp/fsdpx_untrusted_ab}
build=$(cd "${3:-$here/build}" && pwd)
python=$here/.venv/bin/python
torch_dir=$("$python" -c 'import os, torch; print(os.path.dirname(torch.__file__))')
mkdir -p "$work"
if [[ ! -d $work/tree ]]; then git -C "$here" worktree add --detach "$work/tree" "$before" >/dev/null; fi
git -C "$work/tree" checkout --quiet --detach "$before"
# Commits before the DCP room (issue 61) keep DCP under checkpoint/.
old_layout=()
[[ -f $work/tree/include/fsdpx/dcp.hpp ]] || old_layout=(-DFSDPX_AB_OLD_LAYOUT)
build() {  # include-dir output extra-flags...
  local include=$1 out=$2
  shift 2
  c++ -std=gnu++20 -O1 -DFSDPX_WITH_ZLIB=1 "$@" -I"$include" -isystem "$torch_dir/include" \
    -isystem "$torch_dir/include/torch/csrc/api/include" "$here/benchmarks/untrusted_before_after.cpp" -o "$out" \
    -Wl,-rpath,"$torch_dir/lib" -L"$torch_dir/lib" -Wl,--no-as-needed -ltorch -ltorch_cpu -lc10 -lz
}
build "$work/tree/include" "$work/before" "${old_layout[@]}" &
build "$here/include" "$work/after" &
wait
c++ -std=gnu++20 -O1 -I"$work/tree/include" -isystem "$torch_dir/include" \
  -isystem "$torch_dir/include/torch/csrc/api/include" "$work/tree/tools/fsdpx_merge.cpp" -o "$work/merge_before" \
  -Wl,-rpath,"$torch_dir/lib" -L"$torch_dir/lib" -Wl,--no-as-needed -ltorch -ltorch_cpu -lc10 -lz
for side in before after; do
  label=$before
  [[ $side == after ]] && label="$(git -C "$here" rev-parse --short HEAD) + work tree"
  echo "== $side ($label)"
  printf '%-34s %9s %11s  %s\n' case time "peak RSS" outcome
  OMP_NUM_THREADS=1 "$work/$side" "$work/files_$side"
done
# A DCP-format root, one bit of rank 0's model data file flipped where it still parses, merged by each side.
root=$work/dcp_root
rm -rf "$root"
OMP_NUM_THREADS=1 mpiexec --oversubscribe $( [[ $(id -u) == 0 ]] && echo --allow-run-as-root) -n 2 \
  "$build/tests/fsdpx_checkpoint_job" train --steps 2 --save-every 2 --dcp --root "$root" >/dev/null
data=$root/global_step_2/actor/__0_0.distcp
middle=$(($(stat -c %s "$data") / 2))
byte=$(od -An -tu1 -j "$middle" -N1 "$data" | tr -d ' ')
printf "\\$(printf '%03o' $((byte ^ 16)))" | dd of="$data" bs=1 seek="$middle" conv=notrunc status=none
echo "== a DCP-format root, one bit flipped in __0_0.distcp, merged"
for side in before after; do
  merge=$work/merge_before
  [[ $side == after ]] && merge=$build/tools/fsdpx-merge
  rm -rf "$work/merged_$side"
  set +e
  out=$("$merge" "$root/global_step_2" --out "$work/merged_$side" 2>&1)
  rc=$?
  set -e
  printf '%-6s exit %d: %s\n' "$side" "$rc" "$(echo "$out" | tail -1 | cut -c1-200)"
done
