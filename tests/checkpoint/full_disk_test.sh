#!/usr/bin/env bash
# A real full disk: the checkpoint root is a tmpfs with room for one step but not two. The second
# save fails with ENOSPC; training goes on, the job reports the cause, the iteration files still
# name step 1, and step 1 loads with verified checksums. (Registered only where tmpfs can be mounted.)
# Usage: full_disk_test.sh <workdir> <job> <mpiexec> [mpiexec flags...]
set -euo pipefail
work=$1 job=$2
shift 2
mpi=("$@")
rm -rf "$work" && mkdir -p "$work/probe" "$work/tiny"
cd "$work"
# The size of one step, measured on the ordinary disk.
"${mpi[@]}" -n 2 "$job" train --steps 1 --save-every 1 --root probe >/dev/null
step_kib=$(du -sk probe/global_step_1 | cut -f1)
size_kib=$((step_kib * 3 / 2 + 16))
mount -t tmpfs -o "size=${size_kib}k" tmpfs tiny
trap 'umount "$work/tiny" 2>/dev/null || true' EXIT
set +e
"${mpi[@]}" -n 2 "$job" train --steps 4 --save-every 1 --root tiny/ckpt >log 2>&1
rc=$?
set -e
cat log
((rc == 3)) || { echo "the job should finish training and exit 3 (a save failed), got $rc"; exit 1; }
grep -q "No space left on device (ENOSPC: the disk is full)" log
[[ $(cat tiny/ckpt/latest_checkpointed_iteration.txt) == 1 ]]
[[ $(cat tiny/ckpt/latest_state_dict_iteration.txt) == 1 ]]
"${mpi[@]}" -n 2 "$job" verify --root tiny/ckpt | grep "verified step 1"
echo "full disk test passed: a step of ${step_kib} KiB on a ${size_kib} KiB tmpfs"
