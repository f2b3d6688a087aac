// The first-hour user's ConvNet, whole (issue 68): a 1-D residual ConvNet with a frozen convolution and
// SyncBatchNorm after every convolution, sharded with FullShard and HybridShard<2>, each rank training on
// its slice of the batch, activation checkpointing on every second block, in float32 and under BF16Mixed
// with the norms kept in float32. Each against plain LibTorch on the whole batch with the same
// per-module dtypes (its norms BatchNorm: SyncBatchNorm without a group), within the derived bounds;
// and checkpointing on against off, bit for bit: losses, weights, buffers and evaluation outputs.
// CTest runs this under mpiexec at world sizes 2 and 4 (label first_hour).
#include <catch2/catch.hpp>

#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include <torch/nn.h>
#include <torch/optim.h>

#include <fsdpx/fsdp.hpp>

#include "../support/bit_equal.hpp"
#include "../support/mpi_world.hpp"
#include "parity.hpp"

using namespace fsdpx;
using namespace fsdpx::test;
using fsdpx::test::world;

namespace {

template <class Mesh, class Precision, class Checkpoint>
using FirstHourNet =
    Fsdp<SyncConvNet, Mesh, NoOffload, Precision, ShardedStateDict, WrapModules<SyncConvBlockImpl>, Checkpoint>;

SyncConvNet seeded_net() {
  at::manual_seed(7);  // every run and the reference start from the same weights
  return SyncConvNet();
}

/// A sharded model, its optimizer and the loss of every step.
template <class Sharded>
struct Run {
  Sharded model{seeded_net(), world()};
  torch::optim::AdamW optimizer = make_adamw(model, adamw());
  std::vector<at::Tensor> losses;
};

/// This rank's slice of the batch's rows.
Batch my_rows(const Batch& b) {
  const auto mine = rows(b.x.size(0), world().size(), 0, 1, world().rank());
  return {b.x.index_select(0, mine), b.y.index_select(0, mine)};
}

/// One step of `run` on this rank's rows of `b`.
template <class Sharded>
void train_step(Run<Sharded>& run, const Batch& b) {
  const Batch mine = my_rows(b);
  run.optimizer.zero_grad();
  at::Tensor loss = run.model(mine.x, mine.y);
  loss.backward();
  run.optimizer.step();
  run.losses.push_back(loss.detach());
}

/// Checkpointing on against off after the same steps: every loss, every parameter and buffer, and
/// the evaluation loss (running statistics in use) equal bit for bit.
template <class On, class Off>
void check_checkpointing_changes_nothing(Run<On>& on, Run<Off>& off) {
  REQUIRE(on.losses.size() == off.losses.size());
  for (size_t i = 0; i < on.losses.size(); ++i) {
    INFO("step " << i);
    REQUIRE(bit_equal(on.losses[i], off.losses[i]));
  }
  const auto full_on = full_state_dict(on.model.sharded(), /*all_ranks=*/true);
  const auto full_off = full_state_dict(off.model.sharded(), /*all_ranks=*/true);
  REQUIRE(full_on.entries.size() == full_off.entries.size());
  for (size_t i = 0; i < full_on.entries.size(); ++i) {
    INFO(full_on.entries[i].name);
    REQUIRE(full_on.entries[i].name == full_off.entries[i].name);
    REQUIRE(bit_equal(full_on.entries[i].data(), full_off.entries[i].data()));
  }
  const auto buffers_on = on.model.sharded().named_buffers();
  const auto buffers_off = off.model.sharded().named_buffers();
  REQUIRE(buffers_on.size() == 4 * 3);  // mean, variance and counter of each norm
  REQUIRE(buffers_on.size() == buffers_off.size());
  for (size_t i = 0; i < buffers_on.size(); ++i) {
    INFO(buffers_on[i].first);
    REQUIRE(bit_equal(buffers_on[i].second, buffers_off[i].second));
  }
  on.model->eval();
  off.model->eval();
  const Batch b = conv_batch(100);
  const Batch mine = my_rows(b);
  at::NoGradGuard no_grad;
  REQUIRE(bit_equal(on.model(mine.x, mine.y), off.model(mine.x, mine.y)));
  on.model->train();
  off.model->train();
}

/// The case at one mesh and precision: `mixed` is BF16Mixed (norms in float32), else float32.
template <class Mesh, class Precision>
void check_first_hour_case(bool mixed) {
  const int W = world().size();
  using Checkpointed = FirstHourNet<Mesh, Precision, CheckpointEvery<2>>;
  using Plain = FirstHourNet<Mesh, Precision, NoActivationCheckpointing>;
  Run<Checkpointed> on;
  Run<Plain> off;
  int synchronized = 0;
  for (const auto& m : on.model->modules()) {
    if (const auto* norm = dynamic_cast<const SyncBatchNormImpl*>(m.get())) synchronized += norm->synchronized();
  }
  REQUIRE(synchronized == 4);  // every norm over all ranks' rows
  // The modules whose units recompute (a unit and its companions: b1, b1#frozen, b1#float32).
  const auto checkpointed = [](const core::ShardedModel& m) {
    std::set<std::string> modules;
    for (size_t i = 0; i < m.num_units(); ++i) {
      if (m.unit(i).options().checkpoint_activations)
        modules.insert(m.unit(i).name().substr(0, m.unit(i).name().find('#')));
    }
    return modules;
  };
  CHECK(checkpointed(on.model.sharded()) == std::set<std::string>{"b1"});  // the second block
  CHECK(checkpointed(off.model.sharded()).empty());

  // The reference: float32 masters and a compute copy in the policy's per-module dtypes, unsharded,
  // on the whole batch; each step from the sharded model's masters (StepParity).
  SyncConvNet master = seeded_net(), compute = seeded_net();
  if (mixed) to_compute_dtypes(*compute);
  auto ref_optimizer = reference_adamw(*master);
  const int64_t rows_n = conv_batch(0).y.numel();
  rounding::Path forward = conv_bn_net_path(rows_n);
  if (mixed) forward.storage = at::kBFloat16;
  StepParity parity(step_bounds(forward, rows_n));
  for (int step = 0; step < 4; ++step) {
    const Batch b = conv_batch(step);
    const at::Tensor ref_loss =
        reference_backward(master, compute, ref_optimizer, mixed ? b.x.to(at::kBFloat16) : b.x, b.y);
    parity.note_reference_gradients(on.model.sharded(), named_gradients(*master), false);

    const Batch mine = my_rows(b);
    on.optimizer.zero_grad();
    at::Tensor loss = on.model(mine.x, mine.y);
    REQUIRE(loss.scalar_type() == (mixed ? at::kBFloat16 : at::kFloat));
    loss.backward();
    parity.check_gradients(on.model.sharded(), named_gradients(*master));
    ref_optimizer.step();
    on.optimizer.step();
    on.losses.push_back(loss.detach());
    auto global = loss.detach().to(at::kDouble).reshape({1});
    world().all_reduce(global, dist::ReduceOp::avg);
    parity.check_loss(global.item<double>(), ref_loss.item<double>());
    parity.check_step(on.optimizer, on.model.sharded(), named_values(*master));
    train_step(off, b);
    take_sharded_parameters(on.model.sharded(), *master);
  }
  INFO(parity.summary());
  CHECK(parity.holds());
  // The running statistics, float32 in both, over the whole batch: one more sum over the rows, and the
  // ranks' partial sums added.
  for (const auto& [name, buffer] : on.model.sharded().named_buffers()) {
    INFO(name);
    CHECK((buffer.scalar_type() == at::kFloat || !buffer.is_floating_point()));
  }
  const double buffer_bound =
      rounding::relative({.length = forward.length + W, .depth = forward.depth + 1, .storage = forward.storage});
  REQUIRE(check_buffers(on.model.sharded(), *compute, buffer_bound) == 4 * 3);
  check_checkpointing_changes_nothing(on, off);
  if (world().rank() == 0)
    std::printf("  first-hour ConvNet, %s, %s at %d ranks: %s\n",
                std::is_same_v<Mesh, FullShard> ? "FullShard" : "HybridShard<2>",
                mixed ? "BF16Mixed (norms float32)" : "float32", W, parity.summary().c_str());
}

}  // namespace

TEST_CASE("the first-hour ConvNet: SyncBatchNorm, BF16Mixed with norms in float32, checkpointing, FullShard",
          "[first_hour][parity]") {
  check_first_hour_case<FullShard, FullPrecision>(false);
  check_first_hour_case<FullShard, BF16Mixed>(true);
}

TEST_CASE("the first-hour ConvNet: SyncBatchNorm, BF16Mixed with norms in float32, checkpointing, HybridShard<2>",
          "[first_hour][parity]") {
  REQUIRE(world().size() % 2 == 0);  // CTest runs this at 2 and 4 ranks
  check_first_hour_case<HybridShard<2>, FullPrecision>(false);
  check_first_hour_case<HybridShard<2>, BF16Mixed>(true);
}
