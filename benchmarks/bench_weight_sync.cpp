// bench_weight_sync: effective bandwidth of a full weight sync (unit gathers + cast/pack + broadcast +
// unpack into the rollout module) against the raw broadcast of the same bytes over the same
// model-update group, in the same run.
//
//   mpiexec -n 3 bench_weight_sync [--trainers 2] [--dim 1024] [--layers 4] [--vocab 8192]
//                                  [--dtype f32|bf16] [--buckets 4,16,64] [--iters 5]
//
// World ranks [0, trainers) hold the GPT sharded with fsdpx (FullShard, blocks as units); the others
// are rollouts with a plain copy. Times are medians over --iters, each the slowest rank's.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <fsdpx/fsdp.hpp>
#include <fsdpx/sync.hpp>

#include "timing.hpp"

#include "../examples/common/gpt.hpp"

using namespace fsdpx;
using Clock = std::chrono::steady_clock;

namespace {

struct Args {
  int trainers = 2;
  int64_t dim = 1024, layers = 4, vocab = 8192;
  std::string dtype = "f32";
  std::vector<int64_t> buckets_mib = {4, 16, 64};
  int iters = 5;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--trainers") a.trainers = std::stoi(v);
    else if (k == "--dim") a.dim = std::stoll(v);
    else if (k == "--layers") a.layers = std::stoll(v);
    else if (k == "--vocab") a.vocab = std::stoll(v);
    else if (k == "--dtype") a.dtype = v;
    else if (k == "--iters") a.iters = std::stoi(v);
    else if (k == "--buckets") {
      a.buckets_mib.clear();
      std::stringstream ss(v);
      for (std::string item; std::getline(ss, item, ',');) a.buckets_mib.push_back(std::stoll(item));
    } else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      std::exit(2);
    }
  }
  return a;
}

using fsdpx::bench::time_collective;

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse(argc, argv);
  dist::AnyCommunicator world(dist::MpiCommunicator::world());
  auto groups = sync::split_trainer_rollout(world, args.trainers);
  const at::ScalarType dtype = args.dtype == "bf16" ? at::kBFloat16 : at::kFloat;
  const examples::GptConfig c{.vocab = args.vocab, .seq = 64, .dim = args.dim, .heads = 16, .layers = args.layers};
  using Sharded = Fsdp<examples::Gpt, FullShard, NoOffload, FullPrecision, ShardedStateDict,
                       WrapModules<examples::BlockImpl>>;

  at::manual_seed(1);
  examples::Gpt model(c);
  int64_t numel = 0;
  for (const auto& p : model->parameters()) numel += p.numel();
  const int64_t model_bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  std::unique_ptr<Sharded> fsdp;
  if (groups.is_trainer()) {
    fsdp = std::make_unique<Sharded>(model, *groups.trainer);
  } else {
    model->to(dtype);
  }
  const bool root = world.rank() == 0;
  if (root) {
    std::printf("bench_weight_sync: %d ranks (%d trainers, %d rollouts), GPT dim %lld, %lld layers, vocab %lld: "
                "%.1fM parameters, %.1f MiB as %s\n",
                world.size(), args.trainers, world.size() - args.trainers, static_cast<long long>(c.dim),
                static_cast<long long>(c.layers), static_cast<long long>(c.vocab), numel / 1e6, model_bytes / 1048576.0,
                args.dtype.c_str());
    std::printf("median of %d, slowest rank; bandwidth = model bytes / time (GB/s, 1e9)\n\n", args.iters);
  }

  // Gathers alone (trainers), so the sync's own cost is visible; and a raw all-gather of the same
  // bytes into preallocated memory over the trainer group (what the gathers cost without unit buffers
  // allocated and freed, i.e. without page faults).
  const double gathers = time_collective(world, args.iters, [&] {
    if (fsdp) sync::for_each_unsharded_unit(fsdp->sharded(), [](core::Unit&) {});
  });
  at::Tensor gather_out, gather_in;
  if (groups.trainer) {
    const int64_t per = (numel + args.trainers - 1) / args.trainers;
    gather_in = at::ones({per});
    gather_out = at::empty({per * args.trainers}).fill_(0);
  }
  const double raw_gather = time_collective(world, args.iters, [&] {
    if (groups.trainer) groups.trainer->all_gather(gather_out, gather_in);
  });
  if (root) std::printf("trainer side: unit gathers %.3f s; raw all_gather of the same float32 bytes %.3f s\n\n", gathers, raw_gather);

  if (root) {
    std::printf("| bucket (MiB) | buckets | sync (s) | sync GB/s | raw bcast (s) | raw GB/s | sync/raw | sender waits (s) |\n");
    std::printf("|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  }
  int64_t version = 0;
  for (const int64_t mib : args.buckets_mib) {
    sync::BroadcastOptions options{.bucket_bytes = mib << 20, .dtype = dtype};
    std::optional<sync::WeightBroadcaster> sender;
    std::optional<sync::WeightReceiver> receiver;
    if (fsdp) {
      sender.emplace(*fsdp, groups.model_update, options);
    } else {
      receiver.emplace(*groups.model_update);
    }
    const double sync_s = time_collective(world, args.iters, [&] {
      ++version;
      if (sender) sender->broadcast(version);
      if (receiver) receiver->receive_into(*model);
    });
    auto stats = at::zeros({3}, at::kDouble);
    if (sender && sender->is_sender()) {
      stats[0] = static_cast<double>(sender->last_stats().bytes);
      stats[1] = static_cast<double>(sender->last_stats().buckets);
      stats[2] = sender->last_stats().send_wait_seconds;
    }
    world.all_reduce(stats, dist::ReduceOp::max);
    const int64_t wire = static_cast<int64_t>(stats[0].item<double>());

    // The same bytes as one tensor per bucket size class: one broadcast per <= 1 GiB.
    at::Tensor raw;
    if (groups.model_update) raw = at::empty({wire}, at::kByte).fill_(1);
    const double raw_s = time_collective(world, args.iters, [&] {
      if (groups.model_update) groups.model_update->broadcast(raw, 0);
    });
    if (root) {
      std::printf("| %lld | %lld | %.3f | %.2f | %.3f | %.2f | %.0f%% | %.3f |\n", static_cast<long long>(mib),
                  static_cast<long long>(stats[1].item<double>()), sync_s, model_bytes / sync_s / 1e9, raw_s,
                  wire / raw_s / 1e9, 100.0 * (model_bytes / sync_s) / (wire / raw_s), stats[2].item<double>());
      std::fflush(stdout);
    }
  }
  return 0;
}
