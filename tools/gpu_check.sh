#!/usr/bin/env bash
# The GPU runs of docs/gpu.md in one command, for the lent GPU machine (CUDA PyTorch, nvcc, NCCL; no MPI,
# Boost or Catch2, no network): configure NCCL-only, build the GPU tests and benchmarks, then the decoder
# beside PyTorch FSDP2 + transformers (benchmarks/run_decoder_bench.sh: a random Qwen2-1.5B-shaped folder
# made there), `ctest -L gpu`, then the toy GPT's throughput comparison (fsdpx-cuda, libtorch-cuda, FSDP2),
# and on request (`profile`, not part of all) one traced step of the decoder and the GPT on each side, with
# fused AdamW on both, summarised by benchmarks/trace_summary.py (traces in TRACES).
# The whole script fits in about 6 minutes of device time, so that a rerun after a fix fits one lease.
#   tools/gpu_check.sh [build|decoder|test|bench|profile|all]...   (default: all = all but profile, in that order)
# The machine has no package registry: the Debian packages it lacks (catch2, nlohmann-json3-dev) travel
# as .deb files in .gpu/ (ignored by git; `apt-get download` them there) and are unpacked into a prefix.
# Env: DEBS (default .gpu), BUILD_DIR (default build-gpu), TARGETS (what the build step builds),
#      TRACES (the profile step's folder, default /tmp/fsdpx-traces),
#      REPEAT (the decoder's rounds, default 2), GPT_REPEAT (the GPT's, default 1), JOBS,
#      BENCH_ARGS (bench_gpt's "steps warmup batch seq dim layers vocab heads"),
#      and run_decoder_bench.sh's TOKENS, STEPS, WARMUP, OPTIMS, CONFIGS, SHAPE, MODEL_DIR.
# Every step runs even when an earlier one failed (one lease is short); the exit status is the first failure.
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD_DIR:-build-gpu}
ARGS=(${BENCH_ARGS:-5 2 4 2048 2048 18 32000 16})
REPEAT=${REPEAT:-2}
GPT_REPEAT=${GPT_REPEAT:-1}
JOBS=${JOBS:-$(nproc)}
steps=("$@")
[[ ${#steps[@]} -eq 0 ]] && steps=(all)
status=0
note() { printf '\n==== %s (at %d s)\n' "$*" "$SECONDS"; }  # the phases' times: the script must fit one lease
fail() { echo "FAILED: $*"; [[ $status -ne 0 ]] || status=1; }
want() {  # all means every step but profile
  local s
  for s in "${steps[@]}"; do [[ $s == "$1" || ($s == all && $1 != profile) ]] && return 0; done
  return 1
}

if want build; then
  note "machine"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || fail "nvidia-smi"
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
  deps=/tmp/fsdpx-deps
  for name in catch2 nlohmann-json3-dev; do
    deb=$(ls "${DEBS:-.gpu}"/${name}_*.deb 2>/dev/null | head -1)
    if [[ -n $deb ]]; then dpkg -x "$deb" "$deps"; else fail "no $name .deb in ${DEBS:-.gpu}"; fi
  done
  torch_prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
  note "configure ($BUILD)"
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -Wno-dev \
        -DCMAKE_PREFIX_PATH="$torch_prefix;$deps/usr" -DPython3_EXECUTABLE="$(command -v python3)" \
        -DFSDPX_BUILD_EXAMPLES=OFF -DFSDPX_BUILD_TOOLS=OFF 2>&1 | grep -E "fsdpx|Error|error" || true
  [[ -f $BUILD/build.ninja ]] || fail "configure"
  note "build"
  cmake --build "$BUILD" -j "$JOBS" --target ${TARGETS:-fsdpx_nccl_tests fsdpx_gpu_parity bench_gpt bench_decoder} 2>&1 | grep -E -A8 "error|FAILED" | head -150
  [[ ${PIPESTATUS[0]} -eq 0 ]] || fail "build"
fi

if want decoder; then
  note "decoder: fsdpx vs PyTorch FSDP2 + transformers (x$REPEAT)"
  BUILD_DIR=$BUILD REPEAT=$REPEAT PYTHON=$(command -v python3) MODEL_DIR=${MODEL_DIR:-/tmp/decoder_bench_model} \
    benchmarks/run_decoder_bench.sh || fail "decoder"
fi

if want test; then
  note "ctest -L gpu"
  (cd "$BUILD" && ctest -L gpu --output-on-failure) || fail "ctest -L gpu"
fi

if want bench; then
  note "throughput: bench_gpt ${ARGS[*]} (x$GPT_REPEAT)"
  export RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1
  for ((i = 1; i <= GPT_REPEAT; i++)); do
    MASTER_PORT=$((29511 + i)) "$BUILD/benchmarks/bench_gpt" fsdpx-cuda "${ARGS[@]}" 2>&1 | tail -5 || fail "fsdpx-cuda"
    "$BUILD/benchmarks/bench_gpt" libtorch-cuda "${ARGS[@]}" 2>&1 | tail -5 || fail "libtorch-cuda"
    (unset RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR
     python3 -m torch.distributed.run --standalone --nproc-per-node=1 benchmarks/fsdp2_gpt.py fsdp2-cuda "${ARGS[@]}" 2>&1 | tail -5) ||
      fail "fsdp2-cuda"
  done
fi
if want profile; then
  traces=${TRACES:-/tmp/fsdpx-traces} model=${MODEL_DIR:-/tmp/decoder_bench_model}
  note "profile: one traced step per side, fused AdamW (traces in $traces)"
  rm -rf "$traces"  # this run's traces only
  [[ -f $model/config.json ]] || python3 benchmarks/decoder_bench.py make "$model" --shape qwen2-1.5b --device cuda
  export FSDPX_PROFILE=$traces RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1
  torchrun=(python3 -m torch.distributed.run --standalone --nproc-per-node=1)
  (unset RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR
   "${torchrun[@]}" --no-python "$BUILD/benchmarks/bench_decoder" cuda "$model" 4096 2 2 plain-fused ckpt-fused 2>&1 |
     grep -E "RESULT|rror") || fail "fsdpx decoder profile"
  (unset RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR
   "${torchrun[@]}" benchmarks/decoder_bench.py fsdp2 "$model" 4096 2 2 plain-fused ckpt-fused --device cuda 2>&1 |
     grep -E "RESULT|rror") || fail "fsdp2 decoder profile"
  MASTER_PORT=29531 "$BUILD/benchmarks/bench_gpt" fsdpx-cuda-fused "${ARGS[@]}" 2>&1 | tail -3 || fail "fsdpx gpt profile"
  (unset RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR
   "${torchrun[@]}" benchmarks/fsdp2_gpt.py fsdp2-cuda-fused "${ARGS[@]}" 2>&1 | tail -3) || fail "fsdp2 gpt profile"
  unset FSDPX_PROFILE
  python3 benchmarks/trace_summary.py "$traces"/*.json || fail "trace summary"
fi
note "done"
exit $status
