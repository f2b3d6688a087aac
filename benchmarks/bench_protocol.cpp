// The unit protocol under conditions that used to cost it its overlap: a GPT whose every block owns
// one parameter it never uses (FullShard), and a plain GPT under HybridShard (replica all-reduces).
// Prints the median step time, the largest rank's peak RSS and its minor page faults per step. It
// uses only the public API that existed before the per-unit post-backward rewrite, so the same file
// builds against an older checkout for a side-by-side comparison (docs/benchmarks.md, "The unit
// protocol" and "Step buffers", have the commands).
//
//   mpiexec -n 2 bench_protocol unused      mpiexec -n 4 bench_protocol hybrid
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <sys/resource.h>

#include <torch/nn.h>
#include <torch/optim.h>

#include <fsdpx/fsdp.hpp>

#include "../examples/common/gpt.hpp"

using namespace fsdpx;
using examples::Block;
using examples::GptConfig;

namespace {

/// A GPT block plus a matrix it never uses (a router that is off, a head that is skipped).
struct UnusedBlockImpl : torch::nn::Module {
  explicit UnusedBlockImpl(const GptConfig& c) {
    block = register_module("block", Block(c));
    unused = register_module("unused", torch::nn::Linear(c.dim, c.dim));
  }
  at::Tensor forward(const at::Tensor& x) { return block->forward(x); }
  Block block{nullptr};
  torch::nn::Linear unused{nullptr};
};
TORCH_MODULE(UnusedBlock);

struct NetImpl : torch::nn::Module {
  NetImpl(const GptConfig& c, bool with_unused) : c(c) {
    tok = register_module("tok", torch::nn::Embedding(c.vocab, c.dim));
    for (int64_t i = 0; i < c.layers; ++i) {
      blocks.push_back(register_module("h" + std::to_string(i), UnusedBlock(c)));
      if (!with_unused) blocks.back()->unregister_module("unused");
    }
    head = register_module("head", torch::nn::Linear(c.dim, c.vocab));
  }
  at::Tensor forward(const at::Tensor& x, const at::Tensor& y) {
    auto h = tok(x);
    for (auto& b : blocks) h = fsdpx::forward(b, h);
    return torch::nn::functional::cross_entropy(head(h).reshape({-1, c.vocab}), y.reshape({-1}));
  }
  GptConfig c;
  torch::nn::Embedding tok{nullptr};
  std::vector<UnusedBlock> blocks;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Net);

int64_t peak_rss_kib() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6));
  }
  return -1;
}

/// Minor page faults of this process so far: each is a page touched for the first time since it was
/// mapped, so buffers allocated fresh every step show up here as pages faulted in every step.
int64_t minor_faults() {
  rusage usage{};
  return ::getrusage(RUSAGE_SELF, &usage) == 0 ? static_cast<int64_t>(usage.ru_minflt) : -1;
}

template <class Sharded>
void run(const char* mode, dist::AnyCommunicator world, const GptConfig& c, bool with_unused,
         FsdpOptions options = {}) {
  at::manual_seed(0);
  Sharded model(Net(c, with_unused), world, options);
  auto optimizer = make_adamw(model, torch::optim::AdamWOptions(1e-3).weight_decay(0.1));
  const int64_t batch = 4;
  std::vector<double> ms;
  int64_t faults_before = 0;
  for (int step = 0; step < 13; ++step) {
    if (step == 3) faults_before = minor_faults();
    at::manual_seed(100 + step * world.size() + world.rank());
    const auto tokens = at::randint(c.vocab, {batch, c.seq + 1}, at::kLong);
    const auto start = std::chrono::steady_clock::now();
    optimizer.zero_grad();
    model(tokens.narrow(1, 0, c.seq), tokens.narrow(1, 1, c.seq)).backward();
    optimizer.step();
    world.barrier();
    if (step >= 3)
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  const double faults_per_step = static_cast<double>(minor_faults() - faults_before) / static_cast<double>(ms.size());
  std::sort(ms.begin(), ms.end());
  auto faults = at::full({1}, faults_per_step, at::kDouble);
  world.all_reduce(faults, dist::ReduceOp::max);
  auto rss = at::full({1}, static_cast<double>(peak_rss_kib()) / 1024.0, at::kDouble);
  world.all_reduce(rss, dist::ReduceOp::max);
  if (world.rank() == 0) {
    std::printf(
        "bench_protocol %s: world %d, median step %.1f ms (min %.1f, max %.1f), peak RSS of the largest rank %.0f MiB, "
        "minor page faults per step (largest rank) %.0f\n",
        mode, world.size(), ms[ms.size() / 2], ms.front(), ms.back(), rss.item<double>(), faults.item<double>());
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "unused";
  auto world = dist::AnyCommunicator(dist::MpiCommunicator::world());
  GptConfig c;
  // Parameters weigh more than activations here (short sequences, a small batch), as in the large
  // models whose memory FSDP is for: holding full units and gradients is what shows in the peak.
  c.vocab = 4096;
  c.seq = 64;
  c.dim = 768;
  c.heads = 12;
  c.layers = 8;
  if (mode == "unused") {
    run<Fsdp<Net, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<UnusedBlockImpl>>>("unused", world,
                                                                                                        c, true);
  } else {
    FsdpOptions options;
    options.shard_size = 2;
    run<Fsdp<Net, HybridShard<>, NoOffload, FullPrecision, ShardedStateDict, WrapModules<UnusedBlockImpl>>>(
        "hybrid 2x2", world, c, false, options);
  }
  return 0;
}
