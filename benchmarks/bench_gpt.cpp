// bench_gpt: training step time and peak memory of a GPT with fsdpx or without it, on the same model
// and global batch. benchmarks/run_gpt_bench.sh (CPU) and docs/gpu.md (GPU) run it beside PyTorch's
// FSDP2 (benchmarks/fsdp2_gpt.py) and print the ratios.
//
//   mpiexec -n 2 bench_gpt fsdpx      [steps=6 warmup=2 batch=8 seq=256 dim=384 layers=6 vocab=8192 heads=6]
//   bench_gpt unsharded               [same]                  CPU, float32
//   torchrun --no-python bench_gpt fsdpx-cuda    [same]      NCCL, BF16Mixed, one GPU per rank
//   torchrun --no-python bench_gpt fsdpx-cuda-fused  [same]  the same, stepped by FusedAdamW
//   bench_gpt libtorch-cuda                      [same]      plain LibTorch, bf16 autocast
// CUDA modes print tokens/s, peak allocated GPU memory and MFU (peak: FSDPX_PEAK_TFLOPS, default
// 989 = H100 SXM dense bf16); FSDPX_PROFILE=DIR writes a trace of one step (cuda_profile.hpp).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/nn.h>
#include <torch/optim.h>

#include <fsdpx/fsdp.hpp>

#if defined(FSDPX_WITH_NCCL)
#include <ATen/autocast_mode.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/cuda.h>
#endif

#include "../examples/common/gpt.hpp"
#include "../examples/common/memory.hpp"
#include "cuda_profile.hpp"

using fsdpx::examples::BlockImpl;
using fsdpx::examples::Gpt;
using fsdpx::examples::GptConfig;
using fsdpx::examples::peak_rss_mib;
using Clock = std::chrono::steady_clock;

namespace {
int64_t arg(int argc, char** argv, int i, int64_t fallback) { return argc > i ? std::atoll(argv[i]) : fallback; }

#if defined(FSDPX_WITH_NCCL)
// Tokens/s, peak GPU memory and MFU of fsdpx (NCCL, BF16Mixed) or plain LibTorch (bf16 autocast).
int run_cuda(const std::string& mode, const GptConfig& config, int64_t batch, int steps, int warmup) {
  const auto env = fsdpx::dist::detect_launch_env();
  const c10::DeviceIndex index = static_cast<c10::DeviceIndex>(env.local_rank);
  c10::cuda::set_device(index);
  const c10::Device device(c10::kCUDA, index);
  at::manual_seed(0);
  Gpt model(config);
  model->to(device);
  int64_t params = 0;
  for (const auto& p : model->parameters()) params += p.numel();
  const int64_t per = batch / env.world_size;
  at::manual_seed(1 + env.rank);
  const auto tokens =
      at::randint(config.vocab, {per, config.seq + 1}, at::TensorOptions().dtype(at::kLong).device(device));
  const auto x = tokens.narrow(1, 0, config.seq).contiguous(), y = tokens.narrow(1, 1, config.seq).contiguous();
  const auto options = torch::optim::AdamWOptions(3e-4).weight_decay(0.1);

  std::function<void()> step;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  using Sharded = fsdpx::Fsdp<Gpt, fsdpx::FullShard, fsdpx::NoOffload, fsdpx::BF16Mixed, fsdpx::ShardedStateDict,
                              fsdpx::WrapModules<BlockImpl>>;
  std::unique_ptr<Sharded> sharded;
  if (mode == "fsdpx-cuda" || mode == "fsdpx-cuda-fused") {
    sharded = std::make_unique<Sharded>(model, fsdpx::dist::nccl_world());
    if (mode == "fsdpx-cuda-fused") {
      optimizer = std::make_unique<fsdpx::FusedAdamW>(fsdpx::make_adamw<fsdpx::FusedAdamW>(*sharded, options));
    } else {
      optimizer = std::make_unique<torch::optim::AdamW>(fsdpx::make_adamw(*sharded, options));
    }
    step = [&] {
      optimizer->zero_grad();
      (*sharded)(x, y).backward();
      optimizer->step();
    };
  } else {
    optimizer = std::make_unique<torch::optim::AdamW>(model->parameters(), options);
    step = [&] {
      optimizer->zero_grad();
      at::autocast::set_autocast_enabled(at::kCUDA, true);
      at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
      auto loss = model->forward(x, y);
      at::autocast::set_autocast_enabled(at::kCUDA, false);
      at::autocast::clear_cache();
      loss.backward();
      optimizer->step();
    };
  }
  for (int s = 0; s < warmup; ++s) step();
  torch::cuda::synchronize();
  const auto t0 = Clock::now();
  for (int s = 0; s < steps; ++s) step();
  torch::cuda::synchronize();
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  fsdpx::bench::profile_step(fsdpx::bench::trace_name(mode + "-gpt", env.rank, env.world_size), [&] {
    step();
    torch::cuda::synchronize();
  });
  const double tokens_per_s = static_cast<double>(per * config.seq * steps) / seconds;  // per GPU
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(index);
  const double peak_gib =
      stats.allocated_bytes[static_cast<size_t>(c10::CachingDeviceAllocator::StatType::AGGREGATE)].peak / 1073741824.0;
  // Training FLOPs per token: 6 per parameter plus attention's 12 * layers * seq * dim.
  const double flops = 6.0 * params + 12.0 * config.layers * config.seq * config.dim;
  const char* peak_env = std::getenv("FSDPX_PEAK_TFLOPS");
  const double peak = (peak_env != nullptr ? std::atof(peak_env) : 989.0) * 1e12;
  if (env.rank == 0) {
    std::printf(
        "RESULT contender=%s world=%d params=%lld batch=%lld seq=%lld step_ms=%.1f tokens_per_s_per_gpu=%.0f "
        "peak_gpu_gib=%.2f mfu=%.3f\n",
        mode.c_str(), env.world_size, static_cast<long long>(params), static_cast<long long>(batch),
        static_cast<long long>(config.seq), seconds * 1000 / steps, tokens_per_s, peak_gib,
        tokens_per_s * flops / peak);
  }
  return 0;
}
#endif
}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "fsdpx";
  const int steps = static_cast<int>(arg(argc, argv, 2, 6)), warmup = static_cast<int>(arg(argc, argv, 3, 2));
  const int64_t batch = arg(argc, argv, 4, 8);
  GptConfig config;
  config.seq = arg(argc, argv, 5, 256);
  config.dim = arg(argc, argv, 6, 384);
  config.layers = arg(argc, argv, 7, 6);
  config.vocab = arg(argc, argv, 8, 8192);
  config.heads = arg(argc, argv, 9, 6);
#if defined(FSDPX_WITH_NCCL)
  if (mode == "fsdpx-cuda" || mode == "fsdpx-cuda-fused" || mode == "libtorch-cuda")
    return run_cuda(mode, config, batch, steps, warmup);
#endif
  FSDPX_CHECK(mode == "fsdpx" || mode == "unsharded", "bench_gpt: unknown mode '", mode,
              "' (fsdpx, unsharded; with NCCL also fsdpx-cuda, fsdpx-cuda-fused, libtorch-cuda)");

  at::manual_seed(0);
  Gpt model(config);
  int64_t params = 0;
  for (const auto& p : model->parameters()) params += p.numel();
  const auto options = torch::optim::AdamWOptions(3e-4).weight_decay(0.1);
  at::manual_seed(1);
  const auto tokens = at::randint(config.vocab, {batch, config.seq + 1}, at::kLong);
  const auto x = tokens.narrow(1, 0, config.seq).contiguous(), y = tokens.narrow(1, 1, config.seq).contiguous();

  std::vector<double> times;
  int rank = 0, world_size = 1;
  double rss = 0;
  const auto timed = [&](auto&& step) {
    for (int s = 0; s < warmup + steps; ++s) {
      const auto t0 = Clock::now();
      step();
      if (s >= warmup) times.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    }
    std::sort(times.begin(), times.end());
  };

  if (mode == "unsharded") {
    torch::optim::AdamW optimizer(model->parameters(), options);
    timed([&] {
      optimizer.zero_grad();
      model->forward(x, y).backward();
      optimizer.step();
    });
    rss = peak_rss_mib();
  } else {
#if defined(FSDPX_WITH_MPI)
    auto world = fsdpx::dist::MpiCommunicator::world();
    rank = world.rank();
    world_size = world.size();
    fsdpx::Fsdp<Gpt, fsdpx::FullShard, fsdpx::NoOffload, fsdpx::FullPrecision, fsdpx::ShardedStateDict,
                fsdpx::WrapModules<BlockImpl>>
        sharded(model, world);
    auto optimizer = fsdpx::make_adamw(sharded, options);
    const int64_t per = batch / world_size;
    const auto xs = x.narrow(0, rank * per, per), ys = y.narrow(0, rank * per, per);
    timed([&] {
      optimizer.zero_grad();
      sharded(xs, ys).backward();
      optimizer.step();
      world.barrier();
    });
    // The slowest rank's median, the largest peak.
    auto stats = at::tensor({times[times.size() / 2], peak_rss_mib()}, at::kDouble);
    world.all_reduce(stats, fsdpx::dist::ReduceOp::max);
    times.assign(1, stats[0].item<double>());
    rss = stats[1].item<double>();
#else
    FSDPX_CHECK(false, "bench_gpt: the CPU fsdpx mode needs MPI, and this build has none");
#endif
  }
  if (rank == 0) {
    std::printf("RESULT contender=%s world=%d params=%lld batch=%lld seq=%lld step_ms=%.1f peak_rss_mib=%.0f\n",
                mode == "unsharded" ? "libtorch-unsharded" : "fsdpx", world_size, static_cast<long long>(params),
                static_cast<long long>(batch), static_cast<long long>(config.seq), times[times.size() / 2], rss);
  }
  return 0;
}
