#!/usr/bin/env bash
# Crash consistency: a 2-rank job saves every step (keeping 2) and is killed with SIGKILL at a
# random moment, again and again, each time resuming from the newest committed step. After each
# kill the iteration file names a committed step that loads with verified checksums, the steps
# never go backwards, and rotation never leaves zero good checkpoints.
# Usage: crash_test.sh <workdir> <job> <rounds> <mpiexec> [mpiexec flags...]
set -euo pipefail
work=$1 job=$2 rounds=$3
shift 3
mpi=("$@")
rm -rf "$work" && mkdir -p "$work" && cd "$work"
last=-1
kills_mid_save=0
for round in $(seq 1 "$rounds"); do
  setsid "${mpi[@]}" -n 2 "$job" train --steps 1000000 --save-every 1 --keep 2 --resume --root ckpt >"log$round" 2>&1 &
  leader=$!
  # A random moment between 0.8 and 3.0 s: past start-up, in the middle of the save loop.
  sleep "$(awk -v r="$RANDOM" 'BEGIN { printf "%.2f", 0.8 + (r % 220) / 100 }')"
  # The whole session: Open MPI puts its ranks in process groups of their own.
  pkill -KILL -s "$leader" 2>/dev/null || true
  wait "$leader" 2>/dev/null || true
  while pgrep -s "$leader" >/dev/null; do sleep 0.05; done
  # Files mid-write at the kill: temporaries, or steps without a commit record.
  if compgen -G "ckpt/global_step_*/actor/*.tmp" >/dev/null; then kills_mid_save=$((kills_mid_save + 1)); fi
  if [[ ! -f ckpt/latest_checkpointed_iteration.txt ]]; then
    echo "round $round: killed before the first commit"
    continue
  fi
  now=$(cat ckpt/latest_checkpointed_iteration.txt)
  if ((now < last)); then
    echo "round $round: the iteration file went backwards: $last -> $now"
    exit 1
  fi
  last=$now
  out=$("${mpi[@]}" -n 2 "$job" verify --root ckpt)
  echo "round $round: iteration file names step $now; $out; $(ls -d ckpt/global_step_* | wc -l) step directories"
  grep -q "verified step $now" <<<"$out"
done
((last > 0)) || { echo "no checkpoint was ever committed"; exit 1; }
echo "crash test passed: $rounds kills ($kills_mid_save with a file mid-write), newest committed step $last"
