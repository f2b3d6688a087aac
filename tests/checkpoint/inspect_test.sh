#!/usr/bin/env bash
# fsdpx-inspect on a checkpoint root (CTest checkpoint_inspect): it lists the steps, their commit state,
# world sizes and the iteration files; --verify passes on intact files and, once one is corrupted,
# truncated or missing, exits 1 naming it.
#   inspect_test.sh <work dir> <fsdpx_merge_fixture> <fsdpx-inspect>
set -euo pipefail
work=$1 fixture=$2 inspect=$3
fail() { echo "FAILED: $*" >&2; exit 1; }
rm -rf "$work" && mkdir -p "$work/out" && cd "$work/out"
"$fixture" write "$work/fixture" >/dev/null   # steps 5 (world size 2) and 12 (world size 3) under ckpt/
root=$work/fixture/ckpt

"$inspect" "$root" > list.txt || fail "fsdpx-inspect of an intact root exited $?"
cat list.txt
grep -q "latest_checkpointed_iteration.txt -> step 12" list.txt || fail "the iteration file is not shown"
grep -q "^step 5: committed, complete (model+optim); world size 2, shard groups of 2, sharded state dicts" list.txt ||
  fail "step 5's state is not shown"
grep -q "^step 12: committed, complete (model+optim); world size 3" list.txt || fail "step 12's state is not shown"

"$inspect" "$root" --step 12 --tensors > step.txt || fail "--step 12 --tensors exited $?"
grep -q "model_world_size_3_rank_2.pt" step.txt || fail "step 12's files are not listed"
grep -qE "^    [a-z0-9_.]+  \[[0-9, ]+\]  Float$" step.txt || fail "no tensor with its shape and dtype"
grep -q "elements, .* of model data over 3 files" step.txt || fail "no total"

"$inspect" "$root" --verify > verify.txt || fail "--verify of intact files exited $?"
grep -q "every file intact (6)" verify.txt || fail "--verify did not check step 12's 6 files"

victim=$root/global_step_12/actor/model_world_size_3_rank_1.pt
printf '\xff' | dd of="$victim" bs=1 seek=200 conv=notrunc status=none
if "$inspect" "$root" --verify > bad.txt 2> bad.err; then fail "--verify passed a corrupted file"; fi
grep -q "'$victim' is corrupt: its CRC-32C is" bad.err || fail "the corrupted file is not named: $(cat bad.err)"

truncate -s -7 "$victim"
if "$inspect" "$root" --verify --step 12 > bad.txt 2> bad.err; then fail "--verify passed a truncated file"; fi
grep -q "'$victim' has .* bytes but its commit record says" bad.err || fail "the truncated file is not named: $(cat bad.err)"

rm "$root/global_step_5/actor/optim_world_size_2_rank_0.pt"
if "$inspect" "$root" --verify --step 5 > bad.txt 2> bad.err; then fail "--verify passed a missing file"; fi
grep -q "optim_world_size_2_rank_0.pt" bad.err || fail "the missing file is not named: $(cat bad.err)"
if "$inspect" "$root" --step 99 2> bad.err; then fail "a missing step was inspected"; fi
grep -q "has no step 99" bad.err || fail "a missing step is not said so"
# An iteration file that names a step which is not there, or is a FIFO: --verify fails naming it, at once.
"$fixture" write "$work/fixture2" >/dev/null
root2=$work/fixture2/ckpt
"$inspect" "$root2" --verify > /dev/null || fail "--verify of a second intact root exited $?"
echo 77 > "$root2/latest_checkpointed_iteration.txt"
if "$inspect" "$root2" --verify > bad.txt 2> bad.err; then fail "--verify passed an iteration file naming a missing step"; fi
grep -q "latest_checkpointed_iteration.txt' names step 77, which has no global_step_77 directory" bad.err ||
  fail "the dangling iteration file is not named: $(cat bad.err)"
rm "$root2/latest_checkpointed_iteration.txt" && mkfifo "$root2/latest_checkpointed_iteration.txt"
if timeout 20 "$inspect" "$root2" --verify > bad.txt 2> bad.err; then fail "--verify passed a FIFO iteration file"; fi
grep -q "latest_checkpointed_iteration.txt' is not a regular file" bad.err || fail "the FIFO is not named: $(cat bad.err)"
echo "fsdpx-inspect test passed"
