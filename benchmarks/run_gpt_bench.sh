#!/usr/bin/env bash
# GPT training step: fsdpx vs PyTorch FSDP2 vs PyTorch DDP (2 ranks, 1 thread each) vs unsharded
# LibTorch (1 process, 2 threads): same model, same global batch, this machine, one run.
#   benchmarks/run_gpt_bench.sh            (env: STEPS WARMUP BATCH SEQ DIM LAYERS VOCAB BUILD_DIR)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD_DIR:-build}
PY=${PYTHON:-.venv/bin/python}
ARGS=("${STEPS:-6}" "${WARMUP:-2}" "${BATCH:-8}" "${SEQ:-256}" "${DIM:-384}" "${LAYERS:-6}" "${VOCAB:-8192}")
MPIFLAGS=(--oversubscribe)
[[ $(id -u) == 0 ]] && MPIFLAGS+=(--allow-run-as-root)
cmake --build "$BUILD" --target bench_gpt >/dev/null  # benchmarks are built on demand
out=$(mktemp)
{
  OMP_NUM_THREADS=1 mpiexec -n 2 "${MPIFLAGS[@]}" "$BUILD/benchmarks/bench_gpt" fsdpx "${ARGS[@]}"
  for mode in fsdp2 ddp; do
    OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --standalone --nproc-per-node=2 benchmarks/fsdp2_gpt.py "$mode" "${ARGS[@]}" 2>&1 ||
      echo "RESULT contender=pytorch-$mode failed"
  done
  OMP_NUM_THREADS=2 "$BUILD/benchmarks/bench_gpt" unsharded "${ARGS[@]}"
} 2>&1 | tee "$out" | grep -E "RESULT|Error|error" || true
"$PY" - "$out" <<'PY'
import re, sys
rows = {}
for line in open(sys.argv[1]):
    if line.startswith("RESULT") and "failed" not in line:
        kv = dict(re.findall(r"(\w+)=(\S+)", line))
        rows[kv["contender"]] = kv
if "fsdpx" not in rows:
    sys.exit("no fsdpx result")
f = rows["fsdpx"]
print(f"\nGPT {int(f['params'])/1e6:.1f}M parameters, global batch {f['batch']} x seq {f['seq']}\n")
print("| contender | ranks | step (ms) | peak RSS per rank (MiB) | fsdpx speed-up | fsdpx memory ratio |")
print("|---|---:|---:|---:|---:|---:|")
for name, r in rows.items():
    sp = float(r["step_ms"]) / float(f["step_ms"])
    mem = float(f["peak_rss_mib"]) / float(r["peak_rss_mib"])
    print(f"| {name} | {r['world']} | {float(r['step_ms']):.0f} | {float(r['peak_rss_mib']):.0f} | {sp:.2f}x | {mem:.2f} |")
PY
rm -f "$out"
