#!/usr/bin/env bash
# Recovery from the memory tier against the disk tier (docs/checkpoint.md, "The memory tier"): examples/train_gpt,
# a 0.24B-parameter GPT at 2 ranks, every step in /dev/shm and every 5th on disk, is killed (SIGKILL) twice; after
# each kill it is relaunched with --resume from the memory tier, killed at its first trained step, and relaunched
# again with the memory folder deleted (from disk). The page cache is dropped before each relaunch (needs root),
# so the disk's files are read from the disk. Prints each relaunch's time to its first trained step and the
# step it resumed.
#   benchmarks/memory_tier_recovery.sh [build dir] [work dir]
set -u
job=${1:-build}/examples/train_gpt
job=$(realpath "$job")
work=${2:-/tmp/fsdpx_memory_tier_recovery}
export FSDPX_MEMORY_DIR=${FSDPX_MEMORY_DIR:-/dev/shm}
rm -rf "$work" && mkdir -p "$work" && cd "$work"
ours() { echo "$FSDPX_MEMORY_DIR/fsdpx-memory-$(cat ck/memory_tier_id.txt)"; }  # this root's memory tier
args=(--steps 1000 --save-every 5 --memory-tier --ckpt-dir ck --dim 1280 --layers 12 --heads 16 --seq 64 --batch 2)
export OMP_NUM_THREADS=1
launch() { setsid mpiexec --allow-run-as-root --oversubscribe -n 2 "$job" "${args[@]}" "$@" >"$log" 2>&1 & leader=$!; }
stop() { pkill -KILL -s "$leader" 2>/dev/null; wait "$leader" 2>/dev/null; while pgrep -s "$leader" >/dev/null; do sleep 0.1; done; }
first_step() { grep -m1 -oE '^step +[0-9]+' "$log" | awk '{print $2}'; }
wait_step() {  # until a step >= $1 is printed
  while ! grep -qE "^step +([0-9]+)" "$log" || (( $(grep -oE '^step +[0-9]+' "$log" | tail -1 | awk '{print $2}') < $1 )); do sleep 0.2; done
}
relaunch() {  # $1: label
  sync; echo 3 >/proc/sys/vm/drop_caches
  log=$work/$1.log; local t0=$(date +%s.%N)
  launch --resume
  while ! grep -qE '^step +[0-9]+' "$log"; do sleep 0.05; done
  local t1=$(date +%s.%N)
  stop
  printf '%s: %.1f s to the first trained step (step %s); %s\n' "$1" "$(echo "$t1 - $t0" | bc)" "$(first_step)" \
    "$(grep -oE 'resum(ed|ing) [^(]*(\(the memory tier\))?' "$log" | tail -1)"
}
for rep in 1 2; do
  log=$work/run$rep.log
  target=$((rep * 10 - 2))
  if ((rep == 1)); then launch; else launch --resume; fi
  wait_step "$target"; stop
  echo "run $rep killed after step $target: memory $(cat "$(ours)/latest_checkpointed_iteration.txt" 2>/dev/null), disk $(cat ck/latest_checkpointed_iteration.txt)"
  grep -E '^step' "$log" | tail -2
  relaunch "memory$rep"
  rm -rf "$(ours)"
  relaunch "disk$rep"
done
du -sh ck/global_step_* | tail -1
rm -rf "$(ours)"
