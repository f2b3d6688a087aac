#!/usr/bin/env bash
# The memory tier: a 2-rank job keeps every step in memory (save_to_memory, in a folder that stands for its
# node's /dev/shm) and every 10th on disk, and is killed with SIGKILL at random moments. Each relaunch with
# --resume must resume the newest memory step committed at the kill (never an older one), and every loss it
# prints and the final weights must equal an uninterrupted run's, bit for bit. Then the node's memory is lost
# (the folder deleted): the relaunch resumes the disk's newest step; and a damaged memory copy (a byte flipped
# in one rank's file of the newest step) is refused by its CRC: every rank resumes from disk; other roots'
# memory tiers that are stale are removed, the others kept.
# Usage: memory_tier_test.sh <workdir> <job> <rounds> <mpiexec> [mpiexec flags...]
set -euo pipefail
work=$1 job=$2 rounds=$3
shift 3
mpi=("$@")
rm -rf "$work" && mkdir -p "$work/shm" && cd "$work"
export FSDPX_MEMORY_DIR=$work/shm
steps=1000  # 20 s of 20 ms steps: more than the rounds' kills (3 s at most each) take
train=(train --steps "$steps" --save-every 10 --memory-every 1 --keep 2 --resume --root ckpt --step-ms 20)

"${mpi[@]}" -n 2 "$job" train --steps "$steps" --out ref.pt >ref.log 2>&1

newest() {  # the step an iteration file names, -1 without one
  local f
  f=$(compgen -G "$1" | head -1 || true)
  if [[ -n $f && -f $f ]]; then cat "$f"; else echo -1; fi
}
memory_newest() { newest "shm/fsdpx-memory-*/latest_checkpointed_iteration.txt"; }
disk_newest() { newest "ckpt/latest_checkpointed_iteration.txt"; }

# every loss a run printed is the uninterrupted run's, to the digit
same_losses() {
  local line
  while read -r line; do
    grep -qxF "$line" ref.log || { echo "$1: '$line' differs from the uninterrupted run's"; grep -F "${line% loss*} loss" ref.log; exit 1; }
  done < <(grep -E '^step [0-9]+ loss ' "$1")
}

# what the relaunch logged in $1 must be a resume of step $2 from $3 (memory or disk)
resumed() {
  grep -q "resumed from step $2 (saved by 2 ranks) from $3" "$1" ||
    { echo "$1: expected a resume of step $2 from $3:"; grep -E "resumed|load_checkpoint|warn" "$1" || true; exit 1; }
}

expect_step=-1 expect_from=
run_round() {  # $1: the log; $2: kill after this many seconds (0: run to the end); $3: train to this step
  setsid "${mpi[@]}" -n 2 "$job" "${train[@]}" ${3:+--steps "$3"} >"$1" 2>&1 &
  local leader=$!
  if [[ $2 != 0 ]]; then
    sleep "$2"
    pkill -KILL -s "$leader" 2>/dev/null || true
  fi
  wait "$leader" 2>/dev/null || true
  while pgrep -s "$leader" >/dev/null; do sleep 0.05; done
  # a kill during start-up, before the resume: nothing to check, nothing changed
  if ! grep -qE '^(resumed from step|step [0-9]+ loss)' "$1"; then echo "$1: killed before it resumed"; return; fi
  if ((expect_step >= 0)); then resumed "$1" "$expect_step" "$expect_from"; fi
  same_losses "$1"
}

for round in $(seq 1 "$rounds"); do
  run_round "log$round" "$(awk -v r="$RANDOM" 'BEGIN { printf "%.2f", 1.5 + (r % 150) / 100 }')"
  m=$(memory_newest) d=$(disk_newest)
  echo "round $round: killed; memory tier at step $m, disk at step $d"
  if ((m >= d && m >= 0)); then expect_step=$m expect_from=memory;
  elif ((d >= 0)); then expect_step=$d expect_from=disk; fi
  ((m < steps)) || break
done
from_memory=$(grep -l "from memory" log[0-9]* | wc -l)
((from_memory > 0)) || { echo "no relaunch resumed from the memory tier"; exit 1; }

# One rank's copy of the newest memory step damaged: its CRC refuses it, and every rank resumes from disk
m=$(memory_newest) d=$(disk_newest)
if ((m <= d && d >= 0)); then  # the last kill fell on a disk step: three more steps put the memory tier ahead
  run_round log_ahead 0 $((d + 3))
  expect_step=$((d + 3)) expect_from=memory
  m=$(memory_newest) d=$(disk_newest)
fi
((m > d && d >= 0 && m + 5 <= steps)) || { echo "no memory step ahead of a disk step to damage (memory $m, disk $d)"; exit 1; }
f=$(compgen -G "shm/fsdpx-memory-*/global_step_$m/actor/model_world_size_2_rank_1.pt" | head -1)
byte=$(od -An -tu1 -j200 -N1 "$f")
printf "\\$(printf '%03o' $((byte ^ 255)))" | dd of="$f" bs=1 seek=200 conv=notrunc status=none  # its bits flipped
expect_step=$d expect_from=disk
run_round log_damaged 0 $((m + 5))
grep -q "cannot read memory step $m" log_damaged || { echo "the damaged copy was not named"; exit 1; }
echo "damaged memory copy of step $m: refused, resumed step $d from disk"
m=$(memory_newest) d=$(disk_newest)
if ((m >= d && m >= 0)); then expect_step=$m expect_from=memory; else expect_step=$d expect_from=disk; fi

# The node's memory lost: the disk's newest step
d=$(disk_newest)
((d >= 0 && d + 15 <= steps)) || { echo "no disk step to fall back to (disk $d)"; exit 1; }
rm -rf shm/fsdpx-memory-*
expect_step=$d expect_from=disk
run_round log_node_lost 0 $((d + 15))
echo "memory folder deleted: resumed step $d from disk"
m=$(memory_newest) d=$(disk_newest)
if ((m >= d && m >= 0)); then expect_step=$m expect_from=memory; else expect_step=$d expect_from=disk; fi

# Other roots' memory tiers on the node: stale ones (their root gone, or naming another tier) untouched for
# 10 minutes are removed when the tier starts; a fresh one, and one whose root still names it, stay
other_tier() {  # $1: id, $2: the disk root it names, $3: touch -d's date of its files
  mkdir -p "shm/fsdpx-memory-$1/global_step_3"
  printf '%s' "$2" >"shm/fsdpx-memory-$1/disk_root.txt"
  touch -d "$3" "shm/fsdpx-memory-$1"/* "shm/fsdpx-memory-$1"
}
mkdir -p other_root live_root && echo cccc >other_root/memory_tier_id.txt && echo eeee >live_root/memory_tier_id.txt
other_tier aaaa "$work/gone_root" "1 hour ago"
other_tier bbbb "$work/other_root" "1 hour ago"
other_tier dddd "$work/gone_root" "now"
other_tier eeee "$work/live_root" "1 hour ago"

# To the end: the same weights as the uninterrupted run, bit for bit; the clean end removes the memory tier
own=shm/fsdpx-memory-$(cat ckpt/memory_tier_id.txt)
train+=(--out final.pt --step-ms 0)  # to the end at full speed
run_round log_final 0
"$job" compare ref.pt final.pt --tol 0
[[ ! -e $own ]] || { echo "the clean end left the memory tier's folder"; exit 1; }
grep -q "removed the stale memory tier '.*fsdpx-memory-aaaa': its disk root '.*gone_root' is gone" log_final &&
  grep -q "removed the stale memory tier '.*fsdpx-memory-bbbb': .*names another memory tier" log_final ||
  { echo "the stale memory tiers were not removed with their causes:"; grep -i stale log_final; exit 1; }
[[ ! -e shm/fsdpx-memory-aaaa && ! -e shm/fsdpx-memory-bbbb && -d shm/fsdpx-memory-dddd && -d shm/fsdpx-memory-eeee ]] ||
  { echo "stale removal: expected aaaa and bbbb gone, dddd (fresh) and eeee (its root names it) kept:"; ls shm; exit 1; }
echo "other roots' memory tiers: the two stale ones removed with their causes, the fresh and the live one kept"

# Ranks that do not share one memory folder (two nodes): the tier stays off, saying why; the disk tier goes on
"${mpi[@]}" -n 1 -x FSDPX_MEMORY_DIR="$work/node_a" "$job" train --steps 12 --save-every 10 --memory-every 1 --root split \
  : -n 1 -x FSDPX_MEMORY_DIR="$work/node_b" "$job" train --steps 12 --save-every 10 --memory-every 1 --root split \
  >log_split 2>&1
grep -q "the memory tier is off, the disk tier goes on: rank 1 does not see" log_split ||
  { echo "two memory folders: the tier was not turned off with its cause"; cat log_split; exit 1; }
[[ $(cat split/latest_checkpointed_iteration.txt) == 10 ]] || { echo "two memory folders: the disk tier did not commit step 10"; exit 1; }
echo "two memory folders: the tier is off, said so, and the disk tier committed step 10"
echo "memory tier test passed: $from_memory resumes from memory, final weights equal the uninterrupted run's"
