#!/usr/bin/env bash
# The RL trainer's loop as a test (CTest: example_rl_trainer_resume): rl_trainer runs 4 of 8 steps with
# 2 trainers and 1 rollout, checkpointing every 2; then 3 trainers and 1 rollout resume mid-schedule
# from step 4 and finish. Every update steps, every version reaches the rollout in order, and the
# resumed run's LR continues the schedule.
# Usage: rl_trainer_test.sh <workdir> <rl_trainer> <mpiexec> [mpiexec flags...]
set -euo pipefail
work=$1 trainer=$2
shift 2
mpi=("$@")
rm -rf "$work" && mkdir -p "$work" && cd "$work"
fail() { echo "FAILED: $*"; exit 1; }
common=(--steps 8 --save-every 2 --ckpt-dir ckpt --dim 32 --seq 32)

echo "== 2 trainers + 1 rollout: steps 1-4 of 8"
"${mpi[@]}" -n 3 "$trainer" "${common[@]}" --trainers 2 --stop-after 4 | tee first.log
grep -q "rl_trainer: done" first.log || fail "the first run did not finish"
grep -q "rollout: version 4 " first.log || fail "the rollout did not receive version 4"
[[ $(cat ckpt/latest_checkpointed_iteration.txt) == 4 ]] || fail "latest_checkpointed_iteration.txt is not 4"

echo "== 3 trainers + 1 rollout resume: steps 5-8"
"${mpi[@]}" -n 4 "$trainer" "${common[@]}" --trainers 3 --batch 9 --resume | tee second.log
grep -q "resumed from step 4 of ckpt (saved by 2 trainers)" second.log || fail "no resume from step 4"
grep -q "rollout: version 5 " second.log || fail "the rollout did not receive version 5 first"
# cosine(warmup 2, total 8, min 0.1) x 3e-3 at update 5 (factor(4) = 0.775): the schedule continued.
grep -qE "step 5 .* lr 0\.0023[23] " second.log || fail "update 5 did not use the schedule's LR 0.002325"
grep -q "rl_trainer: done" second.log || fail "the resumed run did not finish"
if grep -q SKIPPED first.log second.log; then fail "an update was skipped"; fi
echo "PASSED"
