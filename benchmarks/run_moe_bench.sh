#!/usr/bin/env bash
# A mixture of experts trained sharded: fsdpx (embedding, layers and head as units; tokens grouped by
# expert) beside PyTorch FSDP2 + transformers' Qwen3MoeForCausalLM (each layer and the root fully_shard-ed,
# transformers' default experts implementation), on one Qwen3-MoE folder (16 experts, top-4), 2 ranks
# with one thread each, one sample of SEQ tokens per rank, float32, AdamW, no activation checkpointing,
# alternating rounds. Prints the RESULT lines and the table of docs/benchmarks.md ("Mixture of experts").
#   benchmarks/run_moe_bench.sh     (env: SEQ=1024 STEPS=2 WARMUP=1 ROUNDS=3 BUILD_DIR MODEL_DIR)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD_DIR:-build}
PY=${PYTHON:-.venv/bin/python}
MODEL=${MODEL_DIR:-$BUILD/moe_bench_model}
SEQ=${SEQ:-1024}
STEPS=${STEPS:-2}
WARMUP=${WARMUP:-1}
ROUNDS=${ROUNDS:-3}
MPIFLAGS=(--oversubscribe)
[[ $(id -u) == 0 ]] && MPIFLAGS+=(--allow-run-as-root)
cmake --build "$BUILD" --target bench_long_seq >/dev/null  # benchmarks are built on demand
[[ -f $MODEL/config.json ]] || "$PY" benchmarks/moe_bench.py make "$MODEL"
out=$(mktemp)
for round in $(seq "$ROUNDS"); do
  OMP_NUM_THREADS=1 mpiexec -n 2 "${MPIFLAGS[@]}" "$BUILD/benchmarks/bench_long_seq" "$MODEL" "$SEQ" units "$STEPS" "$WARMUP" \
    2>&1 | tee -a "$out" | grep -E "RESULT|rror" || echo "RESULT contender=fsdpx-units failed" | tee -a "$out"
  OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --standalone --nproc-per-node=2 benchmarks/long_seq.py fsdp2 "$MODEL" "$SEQ" \
    "$STEPS" "$WARMUP" 0 2>&1 | tee -a "$out" | grep -E "RESULT|rror" || echo "RESULT contender=pytorch-fsdp2 failed" | tee -a "$out"
done
"$PY" - "$out" <<'PY'
import re, statistics, sys
rows = [dict(re.findall(r"(\w+)=(\S+)", l)) for l in open(sys.argv[1]) if l.startswith("RESULT")]
f = [r for r in rows if r.get("contender") == "fsdpx-units" and "tokens_per_s" in r]
t = [r for r in rows if r.get("contender") == "pytorch-fsdp2" and "tokens_per_s" in r]
print("\n| round | fsdpx tokens/s | FSDP2 tokens/s | fsdpx vs FSDP2 | fsdpx peak RSS (MiB) | FSDP2 peak RSS (MiB) |")
print("|---:|---:|---:|---:|---:|---:|")
ratios = []
for i, (a, b) in enumerate(zip(f, t), 1):
    ratios.append(float(a["tokens_per_s"]) / float(b["tokens_per_s"]))
    print(f"| {i} | {a['tokens_per_s']} | {b['tokens_per_s']} | {ratios[-1]:.2f}x | {a['peak_rss_mib']} | {b['peak_rss_mib']} |")
if ratios:
    print(f"\nfsdpx vs FSDP2: median {statistics.median(ratios):.2f}x, range {min(ratios):.2f}x to {max(ratios):.2f}x")
PY
rm -f "$out"
