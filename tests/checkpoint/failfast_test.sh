#!/usr/bin/env bash
# Failing fast: one rank of a 2-rank training job that checkpoints fails, and the whole job must end
# within 30 s (with FSDPX_TIMEOUT_MS at its 10-minute default), the cause printed by the rank that saw
# it, and the checkpoint root still consistent: its last committed step loads with verified checksums.
# Usage: failfast_test.sh <workdir> <job> <scenario> <mpiexec> [mpiexec flags...]
#   corrupt_shard   resume finds a corrupt shard of rank 1
#   save_fails      rank 1's writes fail with ENOSPC (injected); a failed save ends the job
#   writer_killed   rank 1 is killed with SIGKILL while it writes its shard
#   writer_stopped  rank 1 is stopped with SIGSTOP while it writes its shard
#   throws          rank 1 throws between two steps
set -euo pipefail
work=$1 job=$2 scenario=$3
shift 3
mpi=("$@")
unset FSDPX_TIMEOUT_MS FSDPX_HEARTBEAT_TIMEOUT_MS  # the defaults are what is under test
limit=30
rm -rf "$work" && mkdir -p "$work" && cd "$work"

fail() { echo "FAILED ($scenario): $*"; echo "---- log"; cat log 2>/dev/null || true; exit 1; }

# Steps 2 and 4 committed: what must survive every failure below.
"${mpi[@]}" -n 2 "$job" train --steps 4 --save-every 2 --root ckpt >setup.log 2>&1 || { cat setup.log; exit 1; }
[[ $(cat ckpt/latest_checkpointed_iteration.txt) == 4 ]] || fail "the setup run did not commit step 4"

resume=(train --steps 40 --save-every 2 --resume --root ckpt --fatal-save-errors)
victim=()  # the launcher's arguments for rank 1
case $scenario in
  corrupt_shard)
    shard=$(ls ckpt/global_step_4/actor/model_world_size_2_rank_1.pt)
    size=$(stat -c %s "$shard")
    printf '\xde\xad\xbe\xef' | dd of="$shard" bs=1 seek=$((size / 2)) conv=notrunc status=none
    ;;
  save_fails) victim=(env FSDPX_INJECT_WRITE_ERROR=ENOSPC:0) ;;
  writer_killed | writer_stopped) resume+=(--slow-save 1:20000) ;;
  throws) resume+=(--throw-at 7:1) ;;
  *) echo "unknown scenario $scenario"; exit 64 ;;
esac

start=$(date +%s.%N)
setsid "${mpi[@]}" -n 1 "$job" "${resume[@]}" : -n 1 "${victim[@]}" "$job" "${resume[@]}" >log 2>&1 &
launcher=$!
pid=""
if [[ $scenario == writer_* ]]; then
  for _ in $(seq 1 600); do
    pid=$(sed -n 's/^rank 1 pid \([0-9]*\) writing step .*/\1/p' log | head -n 1)
    [[ -n $pid ]] && break
    sleep 0.1
  done
  [[ -n $pid ]] || fail "rank 1 never started writing"
  sleep 0.5
  start=$(date +%s.%N)  # the clock runs from the fault
  kill -"$([[ $scenario == writer_killed ]] && echo KILL || echo STOP)" "$pid"
fi
# Wait for the job, at most twice the limit (then it failed anyway), and clean up whatever is left.
for _ in $(seq 1 $((limit * 20))); do kill -0 "$launcher" 2>/dev/null || break; sleep 0.1; done
end=$(date +%s.%N)
still_running=0
kill -0 "$launcher" 2>/dev/null && still_running=1
pkill -KILL -s "$launcher" 2>/dev/null || true
[[ -n $pid ]] && kill -KILL "$pid" 2>/dev/null || true
rc=0
wait "$launcher" 2>/dev/null || rc=$?
while pgrep -s "$launcher" >/dev/null; do sleep 0.05; done
elapsed=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", b - a }')
((still_running == 0)) || fail "the job was still running after ${elapsed} s"
awk -v e="$elapsed" -v l="$limit" 'BEGIN { exit !(e < l) }' || fail "the job took ${elapsed} s to end (limit ${limit} s)"
((rc != 0)) || fail "the job exited 0"

# The cause, printed by the rank that saw it.
case $scenario in
  corrupt_shard) cause="checkpoint_job rank [01]: .*model_world_size_2_rank_1.pt" ;;
  save_fails) cause="checkpoint_job rank 1: .*could not save its .*No space left on device" ;;
  writer_killed) cause="exited on signal 9" ;;
  writer_stopped) cause="checkpoint_job rank 0: .*world rank 1 has not answered for 15000 ms" ;;
  throws) cause="checkpoint_job rank 1: the injected failure after step 7" ;;
esac
grep -Eq "$cause" log || fail "the log does not show the cause ($cause)"
# No rank waited out a collective timeout, and nothing hung silently.
! grep -q "did not complete within" log || fail "a rank waited for a collective timeout"

# The root: the iteration file names a committed step that loads.
now=$(cat ckpt/latest_checkpointed_iteration.txt)
((now >= 4)) || fail "the iteration file went back to $now"
if [[ $scenario != corrupt_shard ]]; then  # there the newest step is the one corrupted on purpose
  out=$("${mpi[@]}" -n 2 "$job" verify --root ckpt 2>&1) || { echo "$out"; fail "the last committed step does not load"; }
  grep -q "verified step $now" <<<"$out" || fail "verify: $out"
fi
echo "---- log"
cat log
echo "failfast $scenario passed: the job ended ${elapsed} s after the fault (exit $rc); step $now committed and loads"
