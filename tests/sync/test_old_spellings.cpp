// The spellings of weight sync before its rebuild (issue 46) still compile, and mean what they meant,
// for one release: WeightSnapshot (now WeightVersion), WeightVersion::step (now ::version), and
// load_into, place_on_huge_pages, TensorCollector and ModuleLoader with <fsdpx/sync/bucket.hpp> alone
// (now <fsdpx/sync/load.hpp> and sync/detail/receive.hpp), and every name that became internal
// (sync/compat.hpp: the bucket codec, the receive sinks, VersionStore, split_manifest, the gathering
// helpers). Deprecated names warn; this file silences the warning it exists to provoke. Also the options that moved to
// an advanced part: ServerOptions' limits (now ServerOptions::limits) and BroadcastOptions' keep_gather_buffers and
// direct_bytes (now BroadcastOptions::tuning), which still configure what they configured.
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

TEST_CASE("the names made internal still compile, through their old spellings, and do what they did",
          "[sync][deprecated]") {
  const std::vector<fxs::NamedTensor> tensors{{"a", at::arange(10, at::kFloat)}, {"b", at::ones({3, 4})}};

  // The bucket codec: plan, pack, write and read a header, views of entries.
  std::vector<fxs::BucketLayout> layouts;
  const std::vector<at::Tensor> buckets = fxs::pack_buckets(tensors, 1 << 16, 3, &layouts);
  REQUIRE(buckets.size() == 1);
  const std::vector<fxs::TensorSpec> specs{{"a", {10}, at::kFloat}, {"b", {3, 4}, at::kFloat}};
  REQUIRE(fxs::plan_buckets(specs, 1 << 16, 3).front().entries.size() == 2);
  REQUIRE(static_cast<int64_t>(fxs::encode_header(layouts[0]).size()) == layouts[0].header_bytes);
  REQUIRE(fxs::bucket_prefix_bytes == fsdpx::sync::detail::prefix_bytes);
  const fxs::BucketLayout decoded =
      fxs::decode_header(buckets[0].const_data_ptr<uint8_t>(), buckets[0].numel(), "old spellings");
  REQUIRE(decoded.version == 3);
  const fxs::BucketEntry& b = decoded.entries[1];
  REQUIRE(fsdpx::test::bit_equal(fxs::entry_view(buckets[0], b), tensors[1].tensor.reshape({-1})));
  const at::Tensor copy = at::zeros_like(buckets[0]);
  fxs::write_header(copy, decoded);
  fxs::pack_entry(copy, decoded.entries[0], tensors[0].tensor);
  fxs::pack_entry(copy, b, tensors[1].tensor);
  REQUIRE(
      fsdpx::test::bit_equal(copy.narrow(0, 0, decoded.header_bytes), buckets[0].narrow(0, 0, decoded.header_bytes)));
  for (const fxs::BucketEntry& e : decoded.entries)  // (the alignment padding between them is unwritten)
    REQUIRE(fsdpx::test::bit_equal(fxs::entry_view(copy, e), fxs::entry_view(buckets[0], e)));

  // A module filled from the bucket by ModuleLoader.
  torch::nn::Linear net(4, 3);
  fxs::ModuleLoader loader(*net);
  const at::Tensor weight = at::full({3, 4}, 2.0f);
  loader.accept({"weight", at::kFloat, {3, 4}, 0, 12, 0}, weight.reshape({-1}));
  loader.accept({"bias", at::kFloat, {3}, 0, 3, 0}, at::zeros({3}));
  loader.finish();
  REQUIRE(fsdpx::test::bit_equal(net->weight.detach(), weight));

  // VersionStore, EncodedVersion, split_manifest and manifest_name: a full version, then a delta.
  fxs::VersionStore sender, receiver;
  fxs::EncodedVersion first = sender.cut(1, tensors);
  REQUIRE(first.tensors.front().name == fxs::manifest_name);
  receiver.accept(first.tensors, fxs::VersionStore::Apply::owned, "old spellings");
  sender.commit(std::move(first));
  std::vector<fxs::NamedTensor> changed{{"a", tensors[0].tensor.clone()}, {"b", tensors[1].tensor}};
  changed[0].tensor[4] = 40.0f;
  fxs::EncodedVersion delta = sender.cut(2, changed);
  REQUIRE(delta.manifest.is_delta());
  auto [manifest, rest] = fxs::split_manifest(delta.tensors, "old spellings");
  REQUIRE(manifest.version == 2);
  receiver.accept(delta.tensors, fxs::VersionStore::Apply::owned, "old spellings");
  REQUIRE(receiver.version() == 2);
  REQUIRE(fsdpx::test::bit_equal(receiver.tensors()[0].tensor, changed[0].tensor));
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
  // Refused, and the client hears why (the server drains what the client still sends instead of
  // resetting the connection, and the client stops sending once the server spoke).
  CHECK_THROWS_WITH(trainer.publish(1, two_mib),
                    Catch::Contains("refused") && Catch::Contains("more than max_version_bytes"));
  CHECK(flat_limits.latest_version() == fxs::no_version);
  fxs::SynchronizerServer defaults;
  fxs::SynchronizerClient other("127.0.0.1", defaults.port(), {.bucket_bytes = 64 << 10});
  other.publish(1, two_mib);
  CHECK(defaults.latest_version() == 1);
#endif
}

#pragma GCC diagnostic pop
