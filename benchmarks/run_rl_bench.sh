#!/usr/bin/env bash
# RL with fsdpx's decoder: training on packed rollouts against the same rollouts padded (2 ranks, side by
# side in one run), and generation with the KV cache against transformers' generate on the same folder
# and prompts (1 thread each), plus fsdpx's sharded generation at 2 ranks. Prints the RESULT lines and
# the tables of docs/benchmarks.md ("Packed rollouts", "Generation").
#   benchmarks/run_rl_bench.sh     (env: SAMPLES=16 STEPS=2 ROUNDS=2 BUILD_DIR MODEL_DIR)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD_DIR:-build}
PY=${PYTHON:-.venv/bin/python}
MODEL=${MODEL_DIR:-$BUILD/rl_bench_model}
SAMPLES=${SAMPLES:-16}
STEPS=${STEPS:-2}
ROUNDS=${ROUNDS:-2}
MPIFLAGS=(--oversubscribe)
[[ $(id -u) == 0 ]] && MPIFLAGS+=(--allow-run-as-root)
cmake --build "$BUILD" --target bench_rl >/dev/null  # benchmarks are built on demand
[[ -f $MODEL/config.json ]] || "$PY" benchmarks/rl_bench.py make "$MODEL"
out=$(mktemp)
for round in $(seq "$ROUNDS"); do
  OMP_NUM_THREADS=1 mpiexec -n 2 "${MPIFLAGS[@]}" "$BUILD/benchmarks/bench_rl" "$MODEL" packed "$SAMPLES" "$STEPS" "$round" \
    2>&1 | tee -a "$out" | grep -E "RESULT|rror" || echo "RESULT mode=packed failed" | tee -a "$out"
  OMP_NUM_THREADS=1 "$BUILD/benchmarks/bench_rl" "$MODEL" generate 2>&1 | tee -a "$out" | grep -E "RESULT|rror"
  OMP_NUM_THREADS=1 "$PY" benchmarks/rl_bench.py generate "$MODEL" 2>&1 | tee -a "$out" | grep -E "RESULT|rror"
  OMP_NUM_THREADS=1 mpiexec -n 2 "${MPIFLAGS[@]}" "$BUILD/benchmarks/bench_rl" "$MODEL" generate 2>&1 | tee -a "$out" | grep -E "RESULT|rror"
done
"$PY" - "$out" <<'PY'
import re, statistics, sys
rows = [dict(re.findall(r"(\w+)=(\S+)", l)) for l in open(sys.argv[1]) if l.startswith("RESULT")]
packed = [r for r in rows if r.get("mode") == "packed" and "speedup" in r]
if packed:
    s = [float(r["speedup"]) for r in packed]
    print("\n| rollouts (2 ranks) | real tokens | padded tokens | packed tokens | padded tokens/s | packed tokens/s | packed vs padded |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in packed:
        print(f"| {r['rollouts']} | {r['tokens']} | {r['padded_tokens']} | {r['packed_tokens']} | {r['padded_tokens_per_s']} | "
              f"{r['packed_tokens_per_s']} | {float(r['speedup']):.2f}x |")
    print(f"\npacked vs padded: median {statistics.median(s):.2f}x, range {min(s):.2f}x to {max(s):.2f}x over {len(s)} steps")
gen = [r for r in rows if r.get("mode") == "generate"]
if gen:
    print("\n| contender | ranks | tokens/s (median of rounds) | range |")
    print("|---|---:|---:|---|")
    for c in dict.fromkeys(r["contender"] for r in gen):
        t = [float(r["tokens_per_s"]) for r in gen if r["contender"] == c]
        w = [r["world"] for r in gen if r["contender"] == c][0]
        print(f"| {c} | {w} | {statistics.median(t):.1f} | {min(t):.1f} to {max(t):.1f} |")
    f = [float(r["tokens_per_s"]) for r in gen if r["contender"] == "fsdpx-plain"]
    t = [float(r["tokens_per_s"]) for r in gen if r["contender"] == "transformers"]
    if f and t:
        ratios = [a / b for a, b in zip(f, t)]
        print(f"\nfsdpx vs transformers generate, round by round: {', '.join(f'{x:.2f}x' for x in ratios)}")
    sums = {r["checksum"] for r in gen if "checksum" in r}
    print("same tokens as transformers: " + ("yes" if len(sums) == 1 else f"NO ({sums})"))
PY
rm -f "$out"
