// Memory per rank: what a rank holds is the unsharded model state divided by the shard size (plus
// padding), and the transient unsharded parameters are bounded by the units in flight.
#include <catch2/catch.hpp>

#include <torch/nn.h>
#include <torch/optim.h>

#include <fsdpx/fsdp.hpp>

#include "../support/mpi_world.hpp"
#include "models.hpp"

using namespace fsdpx;
using fsdpx::test::world;

TEST_CASE("parameters, gradients and optimizer state per rank are 1/shard of the model", "[memory][core]") {
  const int W = world().size();
  constexpr int64_t in = 32, dim = 96, blocks = 6, classes = 10;
  at::manual_seed(0);
  test::ResMlp model(in, dim, blocks, classes);
  int64_t total = 0;
  for (const auto& p : model->parameters()) total += p.numel();

  Fsdp<test::ResMlp, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<test::ResBlockImpl>> sharded(
      model, world());
  auto optimizer = make_adamw(sharded, torch::optim::AdamWOptions(1e-3));
  REQUIRE(sharded.sharded().num_units() == blocks + 1);

  // Transient: at a block's forward, at most the root, that block and the prefetched next one are full.
  int64_t peak_unsharded = 0;
  test::ResBlockImpl::probe = [&] { peak_unsharded = std::max(peak_unsharded, sharded.sharded_bytes().unsharded); };
  for (int step = 0; step < 2; ++step) {
    optimizer.zero_grad();
    sharded(at::randn({8, in}), at::randint(classes, {8}, at::kLong)).backward();
    optimizer.step();
    REQUIRE(sharded.sharded_bytes().unsharded == 0);  // everything resharded after backward
  }
  test::ResBlockImpl::probe = nullptr;

  int64_t padding = 0;
  for (size_t i = 0; i < sharded.sharded().num_units(); ++i) {
    const auto& layout = sharded.sharded().unit(i).layout();
    padding += layout.padded_numel() - layout.numel();
  }
  const ShardedBytes held = sharded.sharded_bytes();
  int64_t optimizer_bytes = 0;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      const auto& state = static_cast<torch::optim::AdamWParamState&>(*optimizer.state().at(p.unsafeGetTensorImpl()));
      optimizer_bytes += state.exp_avg().nbytes() + state.exp_avg_sq().nbytes();
    }
  }
  // Exactly (unsharded + padding) / W of each: float32 parameters, gradients, two Adam moments.
  CHECK(held.parameters * W == (total + padding) * 4);
  CHECK(held.gradients == held.parameters);
  CHECK(optimizer_bytes == 2 * held.parameters);
  // Alignment padding: under one alignment per parameter, plus one per shard of each unit.
  int64_t padding_bound = 0;
  for (size_t i = 0; i < sharded.sharded().num_units(); ++i) {
    padding_bound += static_cast<int64_t>(sharded.sharded().unit(i).layout().params().size() + W) *
                     core::FlatParamLayout::alignment_elements;
  }
  CHECK(padding < padding_bound);
  const int64_t unsharded_state = total * 16;  // parameters + gradients + 2 moments, float32
  INFO("per rank " << held.parameters + held.gradients + optimizer_bytes << " bytes, unsharded " << unsharded_state);
  CHECK(held.parameters + held.gradients + optimizer_bytes <= unsharded_state / W + padding * 16);

  const int64_t root = sharded.sharded().unit(0).layout().padded_numel() * 4;
  const int64_t block = sharded.sharded().unit(1).layout().padded_numel() * 4;
  INFO("peak unsharded " << peak_unsharded << ", root " << root << ", block " << block);
  CHECK(peak_unsharded >= root + block);      // the running block is gathered...
  CHECK(peak_unsharded <= root + 2 * block);  // ...and at most one prefetched block beside it
  CHECK(peak_unsharded < total * 4);          // never the whole model
}
