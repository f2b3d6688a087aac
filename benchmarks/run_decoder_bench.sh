#!/usr/bin/env bash
# The decoder users train, fsdpx beside PyTorch FSDP2 + transformers: one Qwen2-shaped folder (made by
# benchmarks/decoder_bench.py, bfloat16 files), one sample of TOKENS tokens per rank, BF16Mixed against
# MixedPrecisionPolicy(bf16, fp32); without checkpointing, with it, and fsdpx also with the chunked loss.
# The contenders alternate, REPEAT rounds; then the table (tokens/s per rank, MFU, peak memory, ratios).
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
[[ -x $BUILD/benchmarks/bench_decoder ]] || cmake --build "$BUILD" --target bench_decoder >/dev/null || exit 1

fsdpx() {
  if [[ $DEVICE == cuda ]]; then
    "$PY" -m torch.distributed.run --standalone --nproc-per-node="$RANKS" --no-python \
      "$BUILD/benchmarks/bench_decoder" cuda "$MODEL" "$1" "$TOKENS" "$STEPS" "$WARMUP" "$2"
  else
    local flags=(--oversubscribe)
    [[ $(id -u) == 0 ]] && flags+=(--allow-run-as-root)
    OMP_NUM_THREADS=1 mpiexec -n "$RANKS" "${flags[@]}" "$BUILD/benchmarks/bench_decoder" cpu "$MODEL" "$1" "$TOKENS" "$STEPS" "$WARMUP" "$2"
  fi
}
fsdp2() {
  OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --standalone --nproc-per-node="$RANKS" \
    benchmarks/decoder_bench.py fsdp2 "$MODEL" "$1" "$TOKENS" "$STEPS" "$WARMUP" --device "$DEVICE" --optim "$2"
}
one() {  # one contender's run; its RESULT line (or its failure) goes to the log
  local out
  out=$("$@" 2>&1)
  if grep -q '^RESULT' <<<"$out"; then
    grep '^RESULT' <<<"$out" | tee -a "$LOG"
  else
    echo "FAILED: $*"; tail -20 <<<"$out"; status=1
  fi
}
for ((round = 1; round <= REPEAT; round++)); do
  for optim in $OPTIMS; do
    for config in $CONFIGS; do
      one fsdpx "$config" "$optim"
      [[ $config == chunked ]] || one fsdp2 "$config" "$optim"  # transformers has no chunked loss
    done
  done
done
"$PY" benchmarks/decoder_bench.py table "$MODEL" "$LOG"
exit $status
