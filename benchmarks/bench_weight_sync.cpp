// bench_weight_sync: effective bandwidth of a full weight sync (unit gathers + cast/pack + broadcast +
// unpack into the rollout module) against the raw broadcast of the same bytes over the same
// model-update group, in the same run.
//
//   mpiexec -n 3 bench_weight_sync [--trainers 2] [--dim 1024] [--layers 4] [--vocab 8192]
//                                  [--dtype f32|bf16] [--buckets 4,16,64] [--iters 5]
//                                  [--rollout-pages huge|default] [--checksums on|off]
//
// World ranks [0, trainers) hold the GPT sharded with fsdpx (FullShard, blocks as units); the others
// are rollouts with a plain copy. The sync and the raw broadcast alternate, iteration by iteration, so
// both see the same machine; each time is the slowest rank's, and "sync/raw" is the median of the
// per-iteration ratios (its range beside it). fsdpx's host buffers (CPU shards, gather and bucket
// buffers) are advised to use 2 MiB pages (memory::empty_host), and so is the raw broadcast's buffer,
// like for like; FSDPX_HUGE_PAGES=0 turns that off. The rollout module's parameters, where the sync's
// copies land (the raw broadcast's land in its buffer), are moved there too with
// sync::place_on_huge_pages, as docs/sync.md advises; --rollout-pages default leaves them where
// PyTorch's allocator put them (4 KiB pages unless THP_MEM_ALLOC_ENABLE=1).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <fsdpx/fsdp.hpp>
#include <fsdpx/sync.hpp>

#include "timing.hpp"

#include "../examples/common/gpt.hpp"

using namespace fsdpx;

namespace {

struct Args {
  int trainers = 2;
  int64_t dim = 1024, layers = 4, vocab = 8192;
  std::string dtype = "f32";
  std::vector<int64_t> buckets_mib = {4, 16, 64};
  int iters = 5;
  bool rollout_huge_pages = true;
  bool checksums = true;  // BroadcastOptions::checksums: the manifest's CRC-32Cs, computed on both ends
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
    else if (k == "--checksums") a.checksums = v != "off";
    else if (k == "--rollout-pages") {
      if (v != "huge" && v != "default") {
        std::fprintf(stderr, "--rollout-pages takes huge or default, not %s\n", v.c_str());
        std::exit(2);
      }
      a.rollout_huge_pages = v == "huge";
    } else if (k == "--buckets") {
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
  using Sharded =
      Fsdp<examples::Gpt, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<examples::BlockImpl>>;

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
    if (args.rollout_huge_pages) sync::place_on_huge_pages(*model);
  }
  const bool root = world.rank() == 0;
  if (root) {
    std::printf(
        "bench_weight_sync: %d ranks (%d trainers, %d rollouts), GPT dim %lld, %lld layers, vocab %lld: "
        "%.1fM parameters, %.1f MiB as %s\n",
        world.size(), args.trainers, world.size() - args.trainers, static_cast<long long>(c.dim),
        static_cast<long long>(c.layers), static_cast<long long>(c.vocab), numel / 1e6, model_bytes / 1048576.0,
        args.dtype.c_str());
    const char* thp = std::getenv("THP_MEM_ALLOC_ENABLE");
    std::printf(
        "%d iterations of sync and raw broadcast alternating, slowest rank; bandwidth = model bytes / time "
        "(GB/s, 1e9)\npages: fsdpx's host buffers and the raw buffer %s; the rollout module's parameters %s\n\n",
        args.iters, memory::host_huge_pages() ? "advised 2 MiB" : "4 KiB (FSDPX_HUGE_PAGES=0, or not Linux)",
        args.rollout_huge_pages && memory::host_huge_pages() ? "advised 2 MiB (sync::place_on_huge_pages)"
        : thp != nullptr && std::string(thp) == "1"          ? "2 MiB (THP_MEM_ALLOC_ENABLE=1)"
                                                             : "4 KiB (PyTorch's allocator, --rollout-pages default)");
  }

  // Gathers alone (trainers), so the sync's own cost is visible; and a raw all-gather of the same
  // bytes into preallocated memory over the trainer group (what the gathers cost without unit buffers
  // allocated and freed, i.e. without page faults).
  const double gathers = time_collective(world, args.iters, [&] {
    if (fsdp) sync::detail::for_each_unsharded_unit(fsdp->sharded(), [](core::Unit&) {});
  });
  at::Tensor gather_out, gather_in;
  if (groups.trainer) {
    const int64_t per = (numel + args.trainers - 1) / args.trainers;
    gather_in = memory::empty_host(per, at::kFloat).fill_(1);
    gather_out = memory::empty_host(per * args.trainers, at::kFloat).fill_(0);
  }
  const double raw_gather = time_collective(world, args.iters, [&] {
    if (groups.trainer) groups.trainer->all_gather(gather_out, gather_in);
  });
  if (root)
    std::printf("trainer side: unit gathers %.3f s; raw all_gather of the same float32 bytes %.3f s\n\n", gathers,
                raw_gather);

  if (root) {
    std::printf(
        "| bucket (MiB) | buckets | sync (s) | sync GB/s | raw bcast (s) | raw GB/s | sync/raw | range | sender waits "
        "(s) |\n");
    std::printf("|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  }
  int64_t version = 0;
  at::Tensor raw_buffer = at::empty({0}, at::kByte);
  for (const int64_t mib : args.buckets_mib) {
    sync::BroadcastOptions options{.bucket_bytes = mib << 20, .dtype = dtype, .checksums = args.checksums};
    std::optional<sync::WeightBroadcaster> sender;
    std::optional<sync::WeightReceiver> receiver;
    if (fsdp) {
      sender.emplace(*fsdp, groups.model_update, options);
    } else {
      receiver.emplace(*groups.model_update);
    }
    // The raw broadcast moves the same number of bytes as the sync put on the wire (headers
    // included), as one tensor over the same group; the two alternate, iteration by iteration.
    const auto sync_once = [&] {
      ++version;
      if (sender) sender->broadcast(version);
      if (receiver) receiver->receive_into(*model);
    };
    sync_once();  // learns the wire size
    int64_t wire = 0;
    if (sender && sender->is_sender()) wire = sender->last_stats().bytes;
    auto wire_t = at::full({1}, wire, at::kLong);
    world.all_reduce(wire_t, dist::ReduceOp::max);
    wire = wire_t.item<int64_t>();
    // One buffer for every row (a fresh one per row moved the raw figure by up to 40% on the VM).
    // Allocated as fsdpx allocates its own host buffers (memory::empty_host: huge pages where allowed).
    if (groups.model_update && raw_buffer.numel() < wire)
      raw_buffer = memory::empty_host(wire + (wire >> 4), at::kByte).fill_(1);
    at::Tensor raw = groups.model_update ? raw_buffer.narrow(0, 0, wire) : at::Tensor();
    const auto [sync_t, raw_t] = fsdpx::bench::time_side_by_side(world, args.iters, sync_once, [&] {
      if (groups.model_update) groups.model_update->broadcast(raw, 0);
    });
    std::vector<double> ratios;
    for (size_t i = 0; i < sync_t.size(); ++i) ratios.push_back((model_bytes / sync_t[i]) / (wire / raw_t[i]));
    auto stats = at::zeros({2}, at::kDouble);
    if (sender && sender->is_sender()) {
      stats[0] = static_cast<double>(sender->last_stats().buckets);
      stats[1] = sender->last_stats().send_wait_seconds;
    }
    world.all_reduce(stats, dist::ReduceOp::max);
    using fsdpx::bench::median;
    const double sync_s = median(sync_t), raw_s = median(raw_t);
    if (root) {
      std::printf("| %lld | %lld | %.3f | %.2f | %.3f | %.2f | %.0f%% | %.0f-%.0f%% | %.3f |\n",
                  static_cast<long long>(mib), static_cast<long long>(stats[0].item<double>()), sync_s,
                  model_bytes / sync_s / 1e9, raw_s, wire / raw_s / 1e9, 100.0 * median(ratios),
                  100.0 * *std::min_element(ratios.begin(), ratios.end()),
                  100.0 * *std::max_element(ratios.begin(), ratios.end()), stats[1].item<double>());
      std::fflush(stdout);
    }
  }
  return 0;
}
