#!/usr/bin/env bash
# Long sequences: fsdpx (layers as units and the head in the root; embedding, layers and head as units;
# + checkpointed layers; + the chunked loss) beside PyTorch FSDP2 + transformers with gradient
# checkpointing, on one Qwen2-shaped folder with the real 152k vocabulary, 2 ranks (1 thread each),
# one sample of SEQ tokens per rank. Prints a markdown table per run (docs/benchmarks.md, "Long sequences").
#   benchmarks/run_long_seq.sh        (env: LENGTHS="1024 2048 4096 8192" STEPS=2 WARMUP=1 BUILD_DIR MODEL_DIR
#                                      CONFIGS="plain units ckpt chunked" FSDP2=1)
# Sequence parallelism: CONFIGS="chunked ulysses" FSDP2=0: the two ranks share one sample of SEQ tokens
# (SequenceParallel<2>, SEQ / 2 each) beside one sample of SEQ tokens per rank.
# A configuration that keeps whole logits ([tokens, 152064] in float32, about 4 copies in a step) is
# skipped where two ranks of it would not fit in the machine's available memory; the table says so.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD_DIR:-build}
PY=${PYTHON:-.venv/bin/python}
MODEL=${MODEL_DIR:-$BUILD/long_seq_model}
LENGTHS=${LENGTHS:-"1024 2048 4096 8192"}
STEPS=${STEPS:-2}
WARMUP=${WARMUP:-1}
CONFIGS=${CONFIGS:-"plain units ckpt chunked"}
FSDP2=${FSDP2:-1}
MPIFLAGS=(--oversubscribe)
[[ $(id -u) == 0 ]] && MPIFLAGS+=(--allow-run-as-root)
cmake --build "$BUILD" --target bench_long_seq >/dev/null  # benchmarks are built on demand
[[ -f $MODEL/config.json ]] || "$PY" benchmarks/long_seq.py make "$MODEL"
available=$(( $(awk '/MemAvailable/ {print $2}' /proc/meminfo) * 1024 ))  # bytes
fits() {  # whole logits: 4 float32 copies of [seq, 152064] per rank, 2 ranks
  (( 4 * $1 * 152064 * 4 * 2 < available * 8 / 10 ))
}
out=$(mktemp)
for seq in $LENGTHS; do
  for config in $CONFIGS; do
    if [[ $config != chunked && $config != ulysses ]] && ! fits "$seq"; then
      echo "RESULT contender=fsdpx-$config seq=$seq skipped=memory" | tee -a "$out"
      continue
    fi
    OMP_NUM_THREADS=1 mpiexec -n 2 "${MPIFLAGS[@]}" "$BUILD/benchmarks/bench_long_seq" "$MODEL" "$seq" "$config" "$STEPS" "$WARMUP" \
      2>&1 | tee -a "$out" | grep -E "RESULT|rror" || echo "RESULT contender=fsdpx-$config seq=$seq failed" | tee -a "$out"
  done
  if [[ $FSDP2 != 1 ]]; then
    :
  elif fits "$seq"; then
    OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --standalone --nproc-per-node=2 benchmarks/long_seq.py fsdp2 "$MODEL" "$seq" \
      "$STEPS" "$WARMUP" 1 2>&1 | tee -a "$out" | grep -E "RESULT|rror" || echo "RESULT contender=pytorch-fsdp2-ckpt seq=$seq failed" | tee -a "$out"
  else
    echo "RESULT contender=pytorch-fsdp2-ckpt seq=$seq skipped=memory" | tee -a "$out"
  fi
done
"$PY" - "$out" <<'PY'
import re, sys
rows = [dict(re.findall(r"(\w+)=(\S+)", l)) for l in open(sys.argv[1]) if l.startswith("RESULT")]
print("\n| seq | contender | tokens per rank | step (s) | tokens/s (2 ranks) | peak RSS per rank (MiB) | peak - after warm-up (MiB) | step vs fsdpx-units | peak vs FSDP2+ckpt |")
print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
for seq in sorted({int(r["seq"]) for r in rows}):
    here = [r for r in rows if int(r["seq"]) == seq]
    by = {r["contender"]: r for r in here if "step_ms" in r}
    for r in here:
        if "step_ms" not in r:
            print(f"| {seq} | {r['contender']} | | {r.get('skipped', 'failed')} | | | | | |")
            continue
        step, peak = float(r["step_ms"]) / 1000, float(r["peak_rss_mib"])
        vs_units = f"{float(r['step_ms']) / float(by['fsdpx-units']['step_ms']):.2f}x" if "fsdpx-units" in by else ""
        vs_fsdp2 = f"{peak / float(by['pytorch-fsdp2-ckpt']['peak_rss_mib']):.2f}" if "pytorch-fsdp2-ckpt" in by else ""
        print(f"| {seq} | {r['contender']} | {r['per_rank']} | {step:.1f} | {float(r['tokens_per_s']):.0f} | {peak:.0f} | "
              f"{peak - float(r['base_rss_mib']):.0f} | {vs_units} | {vs_fsdp2} |")
PY
rm -f "$out"
