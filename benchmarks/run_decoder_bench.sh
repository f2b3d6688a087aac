#!/usr/bin/env bash
# The decoder users train, fsdpx beside PyTorch FSDP2 + transformers: one Qwen2-shaped folder (made by
# benchmarks/decoder_bench.py, bfloat16 files), one sample of TOKENS tokens per rank, BF16Mixed against
# MixedPrecisionPolicy(bf16, fp32); without checkpointing, with it, and fsdpx also with the chunked loss.
# Each side loads the model once per round and runs every configuration on it; the sides alternate,
# REPEAT rounds; then the table (tokens/s per rank, MFU, peak memory, ratios).
#   benchmarks/run_decoder_bench.sh          GPU: one rank (torchrun), NCCL   (docs/gpu.md, tools/gpu_check.sh)
#   DEVICE=cpu SHAPE=tiny benchmarks/run_decoder_bench.sh                     CPU smoke test: 2 MPI ranks, gloo
# Env: DEVICE (cuda), SHAPE (qwen2-1.5b), RANKS (1 on cuda, 2 on cpu), TOKENS (4096), STEPS (10), WARMUP (3),
#      REPEAT (2), OPTIMS ("adamw fused": LibTorch's / PyTorch's default AdamW, and the fused kernel on both
#      sides), CONFIGS ("plain ckpt chunked"), BUILD_DIR (build), MODEL_DIR ($BUILD_DIR/decoder_bench_<shape>),
#      PYTHON, LOG (a temporary file).
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=${DEVICE:-cuda}
SHAPE=${SHAPE:-qwen2-1.5b}
BUILD=${BUILD_DIR:-build}
PY=${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || command -v python3)}
MODEL=${MODEL_DIR:-$BUILD/decoder_bench_$SHAPE}
TOKENS=${TOKENS:-4096} STEPS=${STEPS:-10} WARMUP=${WARMUP:-3} REPEAT=${REPEAT:-2}
OPTIMS=${OPTIMS:-"adamw fused"} CONFIGS=${CONFIGS:-"plain ckpt chunked"}
RANKS=${RANKS:-$([[ $DEVICE == cuda ]] && echo 1 || echo 2)}
LOG=${LOG:-$(mktemp)}
status=0
[[ -f $MODEL/config.json ]] || "$PY" benchmarks/decoder_bench.py make "$MODEL" --shape "$SHAPE" --device "$DEVICE" || exit 1
cmake --build "$BUILD" --target bench_decoder >/dev/null || exit 1  # benchmarks are built on demand

fsdpx_configs=() fsdp2_configs=()
for optim in $OPTIMS; do
  suffix=$([[ $optim == fused ]] && echo -fused)
  for config in $CONFIGS; do
    fsdpx_configs+=("$config$suffix")
    [[ $config == chunked ]] || fsdp2_configs+=("$config$suffix")  # transformers has no chunked loss
  done
done
fsdpx() {
  if [[ $DEVICE == cuda ]]; then
    "$PY" -m torch.distributed.run --standalone --nproc-per-node="$RANKS" --no-python \
      "$BUILD/benchmarks/bench_decoder" cuda "$MODEL" "$TOKENS" "$STEPS" "$WARMUP" "${fsdpx_configs[@]}"
  else
    local flags=(--oversubscribe)
    [[ $(id -u) == 0 ]] && flags+=(--allow-run-as-root)
    OMP_NUM_THREADS=1 mpiexec -n "$RANKS" "${flags[@]}" "$BUILD/benchmarks/bench_decoder" cpu "$MODEL" "$TOKENS" "$STEPS" \
      "$WARMUP" "${fsdpx_configs[@]}"
  fi
}
fsdp2() {
  OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --standalone --nproc-per-node="$RANKS" \
    benchmarks/decoder_bench.py fsdp2 "$MODEL" "$TOKENS" "$STEPS" "$WARMUP" "${fsdp2_configs[@]}" --device "$DEVICE"
}
one() {  # one side's run of every configuration; its RESULT lines (or its failure) go to the log
  local out
  out=$("$@" 2>&1)
  grep '^RESULT' <<<"$out" | tee -a "$LOG"
  local want=${#fsdp2_configs[@]}
  [[ $1 == fsdpx ]] && want=${#fsdpx_configs[@]}
  if [[ $(grep -c '^RESULT' <<<"$out") -ne $want ]]; then
    echo "FAILED: $1"; tail -20 <<<"$out"; status=1
  fi
}
for ((round = 1; round <= REPEAT; round++)); do  # the two sides alternate
  one fsdpx
  (( ${#fsdp2_configs[@]} == 0 )) || one fsdp2
done
"$PY" benchmarks/decoder_bench.py table "$MODEL" "$LOG"
exit $status
