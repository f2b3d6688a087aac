#!/usr/bin/env bash
# Resume across process restarts:
#   bit-exact: 10 steps == 5 steps, checkpoint, new processes, resume, 5 steps (2 ranks);
#   resharded: a job of 2 ranks resumes what 4 ranks (HybridShard 2x2) and 3 ranks saved: the state it
#   resumes is the saved one bit for bit, and its next step's loss, from those weights, equals the saving
#   job's within the rounding bound of another reduction order (the job prints it). The steps after
#   that are compared in process, step by step (tests/core/test_trainer.cpp), since AdamW turns rounding
#   into differences no bound could derive once the runs' weights part.
# Usage: resume_test.sh <workdir> <job> <python> <mpiexec> [mpiexec flags...]
set -euo pipefail
work=$1 job=$2 python=$3
shift 3
mpi=("$@")
rm -rf "$work" && mkdir -p "$work" && cd "$work"
run() { local np=$1; shift; "${mpi[@]}" -n "$np" "$job" "$@"; }

run 2 train --steps 10 --out ref2.pt >/dev/null
run 2 train --steps 5 --save-every 5 --root r2 >/dev/null
run 2 train --steps 10 --resume --root r2 --out res2.pt | grep resumed
"$job" compare ref2.pt res2.pt --tol 0

# The loss of step $2 in log $1, and its bound.
step_loss() { awk -v s="$2" '$1 == "step" && $2 == s { print $4, $6 }' "$1"; }
for from in "4 --hybrid" 3; do
  set -- $from
  run "$1" train --steps 5 --save-every 5 --root "r$1" --out "saved$1.pt" ${2:-} >/dev/null
  run "$1" train --steps 6 ${2:-} >"ref$1.log"
  run 2 train --steps 5 --resume --root "r$1" --out "resumed$1.pt" | grep resumed
  "$job" compare "saved$1.pt" "resumed$1.pt" --tol 0
  run 2 train --steps 6 --resume --root "r$1" >"res$1.log"
  read -r want bound < <(step_loss "ref$1.log" 6)
  read -r got _ < <(step_loss "res$1.log" 6)
  [[ -n $want && -n $bound && -n $got ]] || { echo "no step-6 loss in ref$1.log or res$1.log"; exit 1; }
  awk -v a="$got" -v b="$want" -v t="$bound" -v n="$1 ranks" 'BEGIN {
    d = a - b; if (d < 0) d = -d
    printf "step 6 after resuming at 2 what %s saved: loss %s vs %s, |difference| %.3g (bound %s)\n", n, a, b, d, t
    exit !(d <= t) }'
done

# Python's torch.load reads a shard of a real checkpoint.
"$python" - r2/global_step_5/actor <<'PY'
import sys, torch
d = sys.argv[1]
sd = torch.load(f"{d}/model_world_size_2_rank_1.pt", weights_only=True)
assert sd["format"] == "fsdpx" and sd["world_size"] == 2 and sd["rank"] == 1, sd.keys()
e = sd["entries"]
assert len(e) > 0 and all(v["data"].numel() == v["end"] - v["begin"] for v in e.values())
opt = torch.load(f"{d}/optim_world_size_2_rank_0.pt", weights_only=True)
assert all("exp_avg" in v for v in opt["entries"].values())
extra = torch.load(f"{d}/extra_state_world_size_2_rank_0.pt", weights_only=True)
assert extra["client"]["samples_seen"] == 60 and extra["rng"]["cpu"].dtype == torch.uint8
print(f"python torch.load: {len(e)} entries in rank 1's model shard, optimizer and extra_state read")
PY
echo "resume test passed"
