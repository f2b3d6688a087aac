#!/usr/bin/env bash
# Resume across process restarts:
#   bit-exact: 10 steps == 5 steps, checkpoint, new processes, resume, 5 steps (2 ranks);
#   resharded: a job of 2 ranks resumes what 4 ranks (HybridShard 2x2) and 3 ranks saved, and ends
#   where the saving job would have (equal up to the reduction order of the world size).
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

for from in "4 --hybrid" 3; do
  set -- $from
  run "$1" train --steps 5 --save-every 5 --root "r$1" ${2:-} >/dev/null
  run "$1" train --steps 10 --out "ref$1.pt" ${2:-} >/dev/null
  run 2 train --steps 10 --resume --root "r$1" --out "res$1.pt" | grep resumed
  "$job" compare "ref$1.pt" "res$1.pt" --tol 2e-6
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
