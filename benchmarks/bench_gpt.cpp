// bench_gpt: training step time and peak memory of a GPT with fsdpx (under mpirun) or unsharded (one
// process), on the same model and global batch. benchmarks/run_gpt_bench.sh runs it beside PyTorch's
// FSDP2 (benchmarks/fsdp2_gpt.py) and prints the ratios.
//
//   mpiexec -n 2 bench_gpt fsdpx      [steps=6 warmup=2 batch=8 seq=256 dim=384 layers=6 vocab=8192]
//   bench_gpt unsharded               [same]
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <torch/nn.h>
#include <torch/optim.h>

#include <fsdpx/fsdp.hpp>

#include "../examples/common/gpt.hpp"

using fsdpx::examples::BlockImpl;
using fsdpx::examples::Gpt;
using fsdpx::examples::GptConfig;
using Clock = std::chrono::steady_clock;

namespace {
double peak_rss_mib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;  // Linux: KiB
}
int64_t arg(int argc, char** argv, int i, int64_t fallback) { return argc > i ? std::atoll(argv[i]) : fallback; }
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
  config.heads = 6;

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
  }
  if (rank == 0) {
    std::printf("RESULT contender=%s world=%d params=%lld batch=%lld seq=%lld step_ms=%.1f peak_rss_mib=%.0f\n",
                mode == "unsharded" ? "libtorch-unsharded" : "fsdpx", world_size, static_cast<long long>(params),
                static_cast<long long>(batch), static_cast<long long>(config.seq), times[times.size() / 2], rss);
  }
  return 0;
}
