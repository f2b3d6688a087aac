// rl_sync: the weight exchange of RL post-training. The world is split into a trainer group, which
// trains a GPT sharded with fsdpx (FullShard), and a rollout group, each rank of which holds a plain,
// unsharded bfloat16 copy for generation. After every optimizer step the trainers broadcast the new
// weights (fsdpx::sync::WeightBroadcaster: gathered unit by unit, packed into buckets, sent by trainer
// rank 0); every rollout rank receives them into its copy (WeightReceiver::receive_into), evaluates
// the held-out loss, generates a few bytes greedily and prints the version.
//
// The example checks itself: after each sync the trainers also send their full parameters
// (Fsdp::full_parameters(), cast to bfloat16) over the model-update group, and every rollout copy must
// equal them bit for bit; the loss the rollouts measure must fall. It exits 1 otherwise.
//
//   mpiexec -n 3 rl_sync [--trainers 2] [--steps 6] [--dim 64] [--layers 2] [--seq 64] [--batch 8] [--corpus FILE]
//   torchrun --nproc-per-node=3 --no-python rl_sync ...        (GPUs: NCCL, one GPU per rank)
//
// With more ranks there are more rollouts: mpiexec -n 5 rl_sync --trainers 2 (2 trainers, 3 rollouts).
#include <algorithm>
#include <cctype>
#include <cstdio>
#include <optional>
#include <string>

#include <torch/nn.h>
#include <torch/optim.h>

#include <fsdpx/fsdp.hpp>
#include <fsdpx/sync/broadcast.hpp>

#include "common/corpus.hpp"
#include "common/gpt.hpp"
#include "common/launch.hpp"

using fsdpx::examples::BlockImpl;
using fsdpx::examples::Gpt;
using fsdpx::examples::GptConfig;
using fsdpx::examples::GptImpl;

using Sharded = fsdpx::Fsdp<Gpt, fsdpx::FullShard, fsdpx::NoOffload, fsdpx::FullPrecision, fsdpx::ShardedStateDict,
                            fsdpx::WrapModules<BlockImpl>>;

namespace {

struct Args {
  int trainers = 2;
  int64_t steps = 6;
  int64_t batch = 8;  // global over the trainers
  int64_t seq = 64;
  int64_t dim = 64;
  int64_t layers = 2;
  double lr = 3e-3;
  std::string corpus;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    const auto next = [&]() -> std::string {
      FSDPX_CHECK(i + 1 < argc, "rl_sync: ", k, " needs a value");
      return argv[++i];
    };
    if (k == "--trainers") a.trainers = std::stoi(next());
    else if (k == "--steps") a.steps = std::stoll(next());
    else if (k == "--batch") a.batch = std::stoll(next());
    else if (k == "--seq") a.seq = std::stoll(next());
    else if (k == "--dim") a.dim = std::stoll(next());
    else if (k == "--layers") a.layers = std::stoll(next());
    else if (k == "--lr") a.lr = std::stod(next());
    else if (k == "--corpus") a.corpus = next();
    else FSDPX_CHECK(false, "rl_sync: unknown option ", k);
  }
  return a;
}

/// The GPT's next-byte logits (GptImpl::forward returns the loss): the same layers, called directly.
at::Tensor logits(GptImpl& m, const at::Tensor& idx) {
  auto x = m.tok(idx) + m.pos(at::arange(idx.size(1), at::TensorOptions().dtype(at::kLong).device(idx.device())));
  for (auto& b : m.blocks) x = b(x);
  return m.head(m.ln_f(x));
}

/// Greedy continuation of `prompt` by `n` bytes (printable ASCII shown, the rest as '.').
std::string generate(GptImpl& m, const std::string& prompt, int n, const c10::Device& device) {
  std::vector<int64_t> ids(prompt.begin(), prompt.end());
  std::string out;
  for (int i = 0; i < n; ++i) {
    const int64_t from = std::max<int64_t>(0, static_cast<int64_t>(ids.size()) - m.config.seq);
    const auto idx = at::tensor(std::vector<int64_t>(ids.begin() + from, ids.end()), at::kLong).unsqueeze(0).to(device);
    const int64_t next = logits(m, idx).select(1, idx.size(1) - 1).argmax(-1).item<int64_t>();
    ids.push_back(next);
    out += std::isprint(static_cast<int>(next)) ? static_cast<char>(next) : '.';
  }
  return out;
}

/// Every parameter, in named_parameters() order, cast to `dtype` and flattened into one tensor.
at::Tensor flat_parameters(torch::nn::Module& m, at::ScalarType dtype) {
  std::vector<at::Tensor> parts;
  for (const auto& p : m.named_parameters()) parts.push_back(p.value().detach().to(dtype).reshape({-1}));
  return at::cat(parts);
}

}  // namespace

int main(int argc, char** argv) try {
  const Args args = parse(argc, argv);
  auto [world, device] = fsdpx::examples::init_world();
  FSDPX_CHECK(world.size() > args.trainers, "rl_sync: ", args.trainers,
              " trainers need at least one more rank for the "
              "rollouts; run it with mpiexec -n ",
              args.trainers + 1, " or more");
  auto groups = fsdpx::sync::split_trainer_rollout(world, args.trainers);  // collective over the world
  FSDPX_CHECK(args.batch % args.trainers == 0, "rl_sync: --batch must be a multiple of --trainers");
  std::string corpus_path;
  const at::Tensor text = fsdpx::examples::load_corpus(args.corpus, corpus_path);
  // The last tenth is held out: the rollouts evaluate on it, the trainers never see it.
  const int64_t split = text.numel() * 9 / 10;
  const at::Tensor train = text.narrow(0, 0, split), held_out = text.narrow(0, split, text.numel() - split);

  GptConfig config;
  config.vocab = 256;
  config.seq = args.seq;
  config.dim = args.dim;
  config.heads = 4;
  config.layers = args.layers;
  const at::ScalarType rollout_dtype = at::kBFloat16;
  if (world.rank() == 0) {
    std::printf(
        "rl_sync: trainer ranks: %d (FullShard, float32); rollout ranks: %d (unsharded, bfloat16); over %s; "
        "corpus %s\n",
        args.trainers, world.size() - args.trainers, std::string(world.backend_name()).c_str(), corpus_path.c_str());
    std::fflush(stdout);
  }

  bool ok = true;
  if (groups.is_trainer()) {
    auto& trainers = *groups.trainer;
    at::manual_seed(0);
    Gpt gpt(config);
    gpt->to(device);
    Sharded model(gpt, trainers);
    auto optimizer = fsdpx::make_adamw(model, torch::optim::AdamWOptions(args.lr).weight_decay(0.1));
    // Small buckets (64 KiB), so that the larger tensors travel split over several of them.
    fsdpx::sync::WeightBroadcaster sender(model, groups.model_update,
                                          {.bucket_bytes = 64 << 10, .dtype = rollout_dtype});
    const int64_t per_rank = args.batch / args.trainers;
    for (int64_t step = 1; step <= args.steps; ++step) {
      at::manual_seed(1000 + step);
      const auto mine = fsdpx::examples::random_windows(train, args.batch, args.seq)
                            .narrow(0, trainers.rank() * per_rank, per_rank)
                            .to(device);
      optimizer.zero_grad();
      auto loss = model(mine.narrow(1, 0, args.seq).contiguous(), mine.narrow(1, 1, args.seq).contiguous());
      loss.backward();
      model.clip_grad_norm_(1.0);
      optimizer.step();
      auto mean = loss.detach().reshape({1}).to(at::kDouble);
      trainers.all_reduce(mean, fsdpx::dist::ReduceOp::avg);

      sender.broadcast(step);  // every trainer rank: the gathers are collective; trainer rank 0 sends
      const auto& sent = sender.last_stats();
      if (trainers.rank() == 0) {
        std::printf(
            "trainer: step %lld  train loss %.4f  sent version %lld (%.2f MiB in %lld buckets; broadcast() %.1f ms)\n",
            static_cast<long long>(step), mean.item<double>(), static_cast<long long>(step), sent.bytes / 1048576.0,
            static_cast<long long>(sent.buckets), sent.seconds * 1e3);
        std::fflush(stdout);
      }
      // The check: the trainers' own full parameters, cast as the broadcast casts them.
      auto full = model.full_parameters();  // collective over the trainers
      if (groups.model_update) groups.model_update->broadcast(flat_parameters(*model.module(), rollout_dtype), 0);
    }
  } else {
    Gpt rollout(config);  // its own initial values: everything it uses must come from the trainers
    rollout->to(device, rollout_dtype);
    rollout->eval();
    fsdpx::sync::place_on_huge_pages(*rollout);  // on CPU ranks: the broadcast's copies land here
    torch::NoGradGuard no_grad;
    fsdpx::sync::WeightReceiver receiver(*groups.model_update, {.device = device});
    const int me = groups.rollout->rank();
    at::manual_seed(7);  // the same held-out batch at every version
    const auto eval = fsdpx::examples::random_windows(held_out, 8, args.seq).to(device);
    double first = 0, last = 0;
    for (int64_t step = 1; step <= args.steps; ++step) {
      const int64_t version = receiver.receive_into(*rollout);
      auto expected = at::empty_like(flat_parameters(*rollout, rollout_dtype));
      groups.model_update->broadcast(expected, 0);
      const bool equal = version == step && at::equal(flat_parameters(*rollout, rollout_dtype), expected);
      ok = ok && equal;
      last = rollout->forward(eval.narrow(1, 0, args.seq).contiguous(), eval.narrow(1, 1, args.seq).contiguous())
                 .item<double>();
      if (step == 1) first = last;
      const std::string sample = generate(*rollout, "The ", 24, device);
      std::printf("rollout %d: version %lld  held-out loss %.4f  %s  greedy \"The %s\"\n", me,
                  static_cast<long long>(version), last,
                  equal ? "== trainer's weights (bf16, bit for bit)" : "!= TRAINER'S WEIGHTS", sample.c_str());
      std::fflush(stdout);
    }
    if (!(last < first)) {
      std::printf("rollout %d: the held-out loss did not fall (%.4f -> %.4f)\n", me, first, last);
      ok = false;
    }
  }
  auto all_ok = at::full({1}, ok ? 1.0 : 0.0, at::TensorOptions().dtype(at::kDouble).device(device));
  world.all_reduce(all_ok, fsdpx::dist::ReduceOp::min);
  const bool passed = all_ok.item<double>() == 1.0;
  if (world.rank() == 0)
    std::printf("rl_sync: %s\n",
                passed ? "every rollout copy equalled the trainer's weights at every version" : "FAILED");
  return passed ? 0 : 1;
} catch (const std::exception& e) {
  return fsdpx::examples::report_failure("rl_sync", e);
}
