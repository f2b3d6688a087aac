// The spellings of weight sync before its rebuild (issue 46) still compile, and mean what they meant,
// for one release: WeightSnapshot (now WeightVersion), WeightVersion::step (now ::version), and
// load_into, place_on_huge_pages, TensorCollector and ModuleLoader with <fsdpx/sync/bucket.hpp> alone
// (now <fsdpx/sync/load.hpp> and sync/detail/receive.hpp). Deprecated names warn; this file silences
// the warning it exists to provoke. Also the options that moved to an advanced part: ServerOptions'
// limits (now ServerOptions::limits) and BroadcastOptions' keep_gather_buffers and direct_bytes (now
// BroadcastOptions::tuning), which still configure what they configured.
#include <catch2/catch.hpp>

#include <fsdpx/sync/bucket.hpp>  // first and alone, as before: what came with it still does

#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn.h>

#include <fsdpx/sync/broadcast.hpp>
#include <fsdpx/sync/delta.hpp>
#include <fsdpx/sync/synchronizer.hpp>
#if defined(FSDPX_WITH_SYNC_SERVICE)
#include <fsdpx/sync/service.hpp>
#endif

#include "../support/bit_equal.hpp"

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

namespace fxs = fsdpx::sync;

TEST_CASE("weight sync's old spellings compile and mean what they meant", "[sync][deprecated]") {
  torch::nn::Linear net(3, 2);
  std::vector<fxs::NamedTensor> tensors;
  for (const auto& p : net->named_parameters()) tensors.push_back({p.key(), p.value().detach().clone() + 1});

  // WeightSnapshot is WeightVersion: what Synchronizer::latest() and the clients return.
  fxs::Synchronizer sync;
  sync.publish(7, tensors);
  const std::shared_ptr<const fxs::WeightSnapshot> latest = sync.latest();
  static_assert(std::is_same_v<fxs::WeightSnapshot, fxs::WeightVersion>);
  REQUIRE(latest->version == 7);
  REQUIRE(fsdpx::test::bit_equal(latest->at("weight"), tensors[0].tensor));
  REQUIRE(latest->manifest != nullptr);

  // WeightVersion::step (the checkpoint watcher's name for the version) reads the version.
  fxs::WeightVersion by_step{.version = 12, .tensors = tensors};
  by_step.step = 12;
  REQUIRE(by_step.step == by_step.version);

  // load_into and TensorCollector, with <fsdpx/sync/bucket.hpp> alone.
  fxs::load_into(*net, latest->tensors);
  REQUIRE(fsdpx::test::bit_equal(net->weight.detach(), tensors[0].tensor));
  fxs::TensorCollector collector(at::kCPU, int64_t{1} << 20, /*huge_pages=*/false);
  for (const auto& t : tensors) {
    collector.accept({t.name, t.tensor.scalar_type(), t.tensor.sizes().vec(), 0, t.tensor.numel(), 0},
                     t.tensor.reshape({-1}));
  }
  REQUIRE(collector.finish().size() == tensors.size());
  REQUIRE(fxs::place_on_huge_pages(*net) >= 0);
}

TEST_CASE("the service's and the broadcast's flat options still configure them", "[sync][deprecated]") {
  const fxs::BroadcastOptions flat{.keep_gather_buffers = false, .direct_bytes = 4096};
  CHECK(flat.keep_gather_buffers == false);
  CHECK(flat.direct_bytes == 4096);
#if defined(FSDPX_WITH_SYNC_SERVICE)
  // A version of 2 MiB does not fit the flat max_version_bytes of 1 MiB; the defaults take it.
  const std::vector<fxs::NamedTensor> two_mib{{"w", at::zeros({1 << 19})}};
  fxs::SynchronizerServer flat_limits({.max_bucket_bytes = 64 << 10, .max_version_bytes = 1 << 20});
  fxs::SynchronizerClient trainer("127.0.0.1", flat_limits.port(), {.bucket_bytes = 64 << 10});
  // Refused: the server says why, or, when the refusal races the client's next bucket, the reset is
  // what the client sees; either way the version is not taken.
  CHECK_THROWS_AS(trainer.publish(1, two_mib), fsdpx::SyncError);
  CHECK(flat_limits.latest_version() == fxs::no_version);
  fxs::SynchronizerServer defaults;
  fxs::SynchronizerClient other("127.0.0.1", defaults.port(), {.bucket_bytes = 64 << 10});
  other.publish(1, two_mib);
  CHECK(defaults.latest_version() == 1);
#endif
}

#pragma GCC diagnostic pop
