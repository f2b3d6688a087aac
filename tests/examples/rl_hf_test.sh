#!/usr/bin/env bash
# examples/rl_hf on a tiny Hugging Face model: 2 trainers + 1 rollout rank run 6 steps (checkpoint at 3 and
# 6), then a second run resumes from step 6 to 10 with the two trainers as one sequence group
# (--sequence-parallel 2: each takes half of every packed row); every version reaches the rollout, the
# reward rises over a run of 10 steps from the start.
#   rl_hf_test.sh WORK_DIR RL_HF MODEL_DIR MPIEXEC [MPIEXEC_FLAGS...]
set -euo pipefail
work=$1 program=$2 model=$3 mpiexec=$4
shift 4
rm -rf "$work" && mkdir -p "$work"
run() { OMP_NUM_THREADS=1 "$mpiexec" "$@" 2>&1; }
common=(--model "$model" --eos 3 --lr 3e-3 --save-every 3 --ckpt-dir "$work/ckpt")
first=$(run -n 3 "$@" "$program" "${common[@]}" --steps 6) || { echo "$first"; echo "FAILED: the first run"; exit 1; }
echo "$first"
grep -q "rollout: version 6 " <<<"$first" || { echo "FAILED: version 6 did not reach the rollout"; exit 1; }
second=$(run -n 3 "$@" "$program" "${common[@]}" --steps 10 --resume --sequence-parallel 2) || { echo "$second"; echo "FAILED: the resumed run"; exit 1; }
echo "$second"
grep -q "rl_hf: resumed from step 6" <<<"$second" || { echo "FAILED: did not resume from step 6"; exit 1; }
grep -q "rl_hf: sequence groups of 2 trainer ranks" <<<"$second" || { echo "FAILED: no sequence groups"; exit 1; }
grep -q "trainer: step 7 " <<<"$second" && ! grep -q "trainer: step 6 " <<<"$second" || { echo "FAILED: resumed at the wrong step"; exit 1; }
grep -q "rollout: version 10 " <<<"$second" || { echo "FAILED: version 10 did not reach the rollout"; exit 1; }
whole=$(run -n 3 "$@" "$program" --model "$model" --eos 3 --lr 3e-3 --save-every 0 --steps 10) || { echo "$whole"; echo "FAILED: the 10-step run"; exit 1; }
echo "$whole"
grep -q "rl_hf: done" <<<"$whole" || { echo "FAILED: the reward did not rise over 10 steps"; exit 1; }
echo "PASSED"
