// Shared by the checkpoint tests: a small sharded model, deterministic training steps whose data
// comes from LibTorch's default generator (so a resume must restore the RNG), and comparisons.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <string>

#include <torch/optim/adamw.h>

#include <fsdpx/checkpoint.hpp>
#include <fsdpx/core/fsdp.hpp>
#include <fsdpx/core/optim.hpp>

#include "../core/models.hpp"
#include "../support/step_parity.hpp"

namespace fsdpx::test {

/// A per-test scratch directory (CTest sets FSDPX_TEST_TMP per test), emptied by rank 0.
inline std::filesystem::path scratch_dir(const std::string& name) {
  const char* base = std::getenv("FSDPX_TEST_TMP");
  return std::filesystem::path(base != nullptr ? base : "fsdpx_test_tmp") / name;
}

template <class Mesh = FullShard>
using CkptModel = Fsdp<ResMlp, Mesh, NoOffload, FullPrecision, ShardedStateDict, WrapModules<ResBlockImpl>>;

inline torch::optim::AdamWOptions adamw_options() {
  return torch::optim::AdamWOptions(1e-2).weight_decay(0.1).eps(1e-6);
}

/// A step's global batch of 12 rows, drawn from the default generator.
struct StepBatch {
  static constexpr int64_t rows = 12;
  at::Tensor x, y;
  static StepBatch draw() {
    at::Tensor x = at::randn({rows, 20});
    return {x, at::randint(0, 5, {rows})};
  }
};

/// The bound on the relative difference of two computations of a step's loss from the same weights (at
/// other world sizes: tests/support/rounding.hpp).
inline double step_loss_bound() { return rounding::relative(rounding::loss(res_mlp_path(), StepBatch::rows)); }

/// One training step on a global batch drawn from the default generator; each rank takes its rows of
/// it. Returns the global mean loss.
template <class Model>
double train_step(Model& model, torch::optim::Optimizer& opt, const dist::AnyCommunicator& comm) {
  const auto [x, y] = StepBatch::draw();
  const int64_t per = StepBatch::rows / comm.size(), lo = comm.rank() * per;
  opt.zero_grad();
  at::Tensor loss = model(x.narrow(0, lo, per), y.narrow(0, lo, per));
  loss.backward();
  opt.step();
  at::Tensor l = loss.detach().clone();
  const_cast<dist::AnyCommunicator&>(comm).all_reduce(l, dist::ReduceOp::avg);
  return l.item<double>();
}

/// Every unit's shard equal, element for element (bitwise for float32 values).
template <class A, class B>
bool same_shards(const A& a, const B& b) {
  for (size_t i = 0; i < a.sharded().num_units(); ++i) {
    if (!at::equal(a.sharded().unit(i).shard(), b.sharded().unit(i).shard())) return false;
  }
  return true;
}

}  // namespace fsdpx::test
