#!/usr/bin/env bash
# The first hour, as a test (CTest: example_train_gpt_resume_merge):
#   train_gpt trains 8 steps on 2 ranks with background checkpoints every 4: the loss falls and
#   checkpoints are committed; a run without --resume refuses the non-empty checkpoint root; --resume
#   continues from step 8 to 12 and ends exactly where an uninterrupted 12-step run ends; merge turns
#   the checkpoint into safetensors + config.json, which Python opens (check_merged.py).
# Usage: train_resume_test.sh <workdir> <train_gpt> <merge> <python> <mpiexec> [mpiexec flags...]
set -euo pipefail
work=$1 train=$2 merge=$3 python=$4
shift 4
mpi=("$@")
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$work" && mkdir -p "$work" && cd "$work"
corpus=/usr/share/common-licenses/GPL-3
[[ -f $corpus ]] || corpus=$here/../../README.md
model=(--dim 64 --layers 2 --seq 64 --batch 8 --corpus "$corpus")
run() { "${mpi[@]}" -n 2 "$train" "${model[@]}" "$@"; }
fail() { echo "FAILED: $*"; exit 1; }

echo "== train 8 steps, checkpoints every 4 (keep 2)"
run --steps 8 --save-every 4 --keep 2 --ckpt-dir ckpt --check | tee first.log
grep -q "checkpoint: step 8 committed" first.log || fail "no commit message for step 8"
[[ $(cat ckpt/latest_checkpointed_iteration.txt) == 8 ]] || fail "latest_checkpointed_iteration.txt is not 8"
for f in fsdp_config.json model_world_size_2_rank_0.pt model_world_size_2_rank_1.pt optim_world_size_2_rank_1.pt \
         extra_state_world_size_2_rank_0.pt huggingface/config.json; do
  [[ -f ckpt/global_step_8/actor/$f ]] || fail "ckpt/global_step_8/actor/$f is missing"
done
grep -qE '"complete": *true' ckpt/global_step_8/actor/fsdp_config.json || fail "step 8 is not complete"
[[ -d ckpt/global_step_4 ]] || fail "step 4 is missing"

echo "== a fresh run refuses the checkpoint root"
if run --steps 2 --save-every 1 --ckpt-dir ckpt >refuse.log 2>&1; then fail "a run without --resume overwrote ckpt"; fi
grep -q "already holds checkpoints" refuse.log || { cat refuse.log; fail "no explanation for the refusal"; }

echo "== resume to step 12, against an uninterrupted run of 12 steps"
run --steps 12 --save-every 4 --keep 2 --ckpt-dir ckpt --resume --check | tee resumed.log
grep -q "resumed from step 8" resumed.log || fail "did not print 'resumed from step 8'"
first_step=$(grep -m1 -E '^step +[0-9]+' resumed.log | awk '{print $2}')
[[ $first_step == 9 ]] || fail "the resumed run started at step $first_step, not 9"
run --steps 12 --ckpt-dir none > straight.log
resumed_loss=$(grep -E '^step +12 ' resumed.log | awk '{print $4}')
straight_loss=$(grep -E '^step +12 ' straight.log | awk '{print $4}')
echo "step 12 loss: resumed $resumed_loss, uninterrupted $straight_loss"
[[ -n $resumed_loss && $resumed_loss == "$straight_loss" ]] || fail "the resumed run diverged from the uninterrupted one"
[[ $(cat ckpt/latest_checkpointed_iteration.txt) == 12 ]] || fail "latest_checkpointed_iteration.txt is not 12"
[[ ! -d ckpt/global_step_4 ]] || fail "--keep 2 did not rotate step 4 away"

echo "== merge the checkpoint and open it in Python"
"$merge" ckpt hf | tee merge.log
grep -q "of step 12" merge.log || fail "merge did not take the newest step"
[[ -f hf/model.safetensors && -f hf/config.json ]] || fail "hf/model.safetensors or hf/config.json is missing"
"$merge" ckpt/global_step_12 plain --keep-names >/dev/null
if [[ $python == none ]] || ! "$python" -W ignore -c "import torch, safetensors" 2>/dev/null; then
  echo "no Python with torch and safetensors (tools/setup.sh installs them into .venv): the Python check is skipped"
else
  "$python" "$here/check_merged.py" hf plain "$corpus"
fi
echo "train/resume/merge test passed"
