// train_gpt: a byte-level GPT trained with fsdpx on text that needs no download (Debian's license
// texts, or this repository's README), one line per step: loss, tokens/s, memory per rank.
//
//   mpiexec -n 2 train_gpt [--steps 40] [--batch 8] [--seq 128] [--dim 192] [--layers 4] [--corpus FILE]
//   torchrun --nproc-per-node=N --no-python train_gpt ...     (GPU builds: NCCL, one GPU per rank)
//
// Policies are chosen at build time: edit the Sharded alias below (e.g. HybridShard<2>, CpuOffload<>,
// BF16Mixed); a combination that makes no sense does not compile.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <torch/nn.h>
#include <torch/optim.h>

#include <fsdpx/fsdp.hpp>

#include "common/gpt.hpp"
#include "common/memory.hpp"

using fsdpx::examples::BlockImpl;
using fsdpx::examples::Gpt;
using fsdpx::examples::GptConfig;
using fsdpx::examples::peak_rss_mib;

using Sharded = fsdpx::Fsdp<Gpt, fsdpx::FullShard, fsdpx::NoOffload, fsdpx::FullPrecision, fsdpx::ShardedStateDict,
                            fsdpx::WrapModules<BlockImpl>>;

namespace {

struct Args {
  int steps = 40;
  int64_t batch = 8;  // global, split across ranks
  int64_t seq = 128;
  int64_t dim = 192;
  int64_t layers = 4;
  double lr = 3e-3;
  std::string corpus;
  bool check = false;  // exit 1 unless the loss fell (used by the tests)
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    const auto next = [&]() -> std::string {
      FSDPX_CHECK(i + 1 < argc, "train_gpt: ", k, " needs a value");
      return argv[++i];
    };
    if (k == "--steps") a.steps = std::stoi(next());
    else if (k == "--batch") a.batch = std::stoll(next());
    else if (k == "--seq") a.seq = std::stoll(next());
    else if (k == "--dim") a.dim = std::stoll(next());
    else if (k == "--layers") a.layers = std::stoll(next());
    else if (k == "--lr") a.lr = std::stod(next());
    else if (k == "--corpus") a.corpus = next();
    else if (k == "--check") a.check = true;
    else FSDPX_CHECK(false, "train_gpt: unknown option ", k);
  }
  return a;
}

at::Tensor load_corpus(const std::string& requested) {
  std::vector<std::string> candidates = {"/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0",
                                         "README.md"};
  if (!requested.empty()) candidates = {requested};
  for (const auto& path : candidates) {
    std::ifstream in(path, std::ios::binary);
    if (!in) continue;
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (text.size() < 1024) continue;
    return at::tensor(std::vector<uint8_t>(text.begin(), text.end()), at::kByte).to(at::kLong);
  }
  FSDPX_CHECK(false, "train_gpt: no corpus found (tried ", candidates.front(), "); pass --corpus FILE");
  return {};
}


}  // namespace

int main(int argc, char** argv) try {
  const Args args = parse(argc, argv);
  auto world = fsdpx::dist::MpiCommunicator::world();
  const int W = world.size(), r = world.rank();
  FSDPX_CHECK(args.batch % W == 0, "train_gpt: --batch ", args.batch, " must be a multiple of the ", W, " ranks");
  const at::Tensor corpus = load_corpus(args.corpus);

  GptConfig config;
  config.vocab = 256;  // bytes
  config.seq = args.seq;
  config.dim = args.dim;
  config.heads = 4;
  config.layers = args.layers;
  at::manual_seed(0);  // the same initial model on every rank
  Sharded model(Gpt(config), world);
  auto optimizer = fsdpx::make_adamw(model, torch::optim::AdamWOptions(args.lr).weight_decay(0.1));
  int64_t params = 0;
  for (const auto& p : model->parameters()) params += p.numel();
  if (r == 0) {
    std::printf("train_gpt: %d ranks, %.2fM parameters, %zu units, corpus %lld bytes, global batch %lld x %lld\n", W,
                params / 1e6, model.sharded().num_units(), static_cast<long long>(corpus.numel()),
                static_cast<long long>(args.batch), static_cast<long long>(args.seq));
  }

  const int64_t per_rank = args.batch / W;
  double first = 0, last = 0;
  for (int step = 1; step <= args.steps; ++step) {
    // Every rank draws the same global batch of windows and takes its own rows.
    at::manual_seed(1000 + step);
    const auto starts = at::randint(corpus.numel() - args.seq - 1, {args.batch}, at::kLong);
    const auto offsets = at::arange(args.seq + 1, at::kLong);
    const auto windows = corpus.index({(starts.unsqueeze(1) + offsets.unsqueeze(0))});
    const auto mine = windows.narrow(0, r * per_rank, per_rank);

    const auto t0 = std::chrono::steady_clock::now();
    optimizer.zero_grad();
    auto loss = model(mine.narrow(1, 0, args.seq).contiguous(), mine.narrow(1, 1, args.seq).contiguous());
    loss.backward();
    const fsdpx::GradNorm norm = model.clip_grad_norm_(1.0);
    optimizer.step();
    auto global = loss.detach().reshape({1}).to(at::kDouble);
    world.all_reduce(global, fsdpx::dist::ReduceOp::avg);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    last = global.item<double>();
    if (step == 1) first = last;
    if (r == 0) {
      const auto held = model.sharded_bytes();
      std::printf("step %3d  loss %.4f  grad-norm %.3f  %7.0f tokens/s  shards %.1f MiB/rank  peak RSS %.0f MiB\n", step,
                  last, norm.value, args.batch * args.seq / seconds, (held.parameters + held.gradients) / 1048576.0,
                  peak_rss_mib());
      std::fflush(stdout);
    }
  }
  if (r == 0) std::printf("loss %.4f -> %.4f over %d steps\n", first, last, args.steps);
  return args.check && !(last < first) ? 1 : 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "train_gpt: %s\n", e.what());
  return 1;
}
