// Per-module precision (FsdpOptions::keep_full_precision): under BF16Mixed a BatchNorm's parameters stay
// float32 beside its unit's bfloat16 convolutions (a companion flat buffer gathered and reduced with the
// unit), so a ConvNet with BatchNorm trains with mixed precision as plain LibTorch with the same
// per-module dtypes does; a dtype clash inside a unit names the module and its dtypes. CTest runs this
// under mpiexec at world sizes 1, 2 and 4 (label precision).
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdio>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <torch/nn.h>
#include <torch/optim.h>

#include <fsdpx/fsdp.hpp>

#include "../support/mpi_world.hpp"
#include "parity.hpp"

using namespace fsdpx;
using namespace fsdpx::test;
using Catch::Matchers::Contains;
using fsdpx::test::world;

namespace {

using ShardedConvNet = Fsdp<ConvBnNet, FullShard, NoOffload, BF16Mixed, ShardedStateDict, WrapModules<ConvBnBlockImpl>>;

std::vector<std::string> unit_names(const core::ShardedModel& m) {
  std::vector<std::string> out;
  for (size_t i = 0; i < m.num_units(); ++i) out.push_back(m.unit(i).name());
  return out;
}

}  // namespace

TEST_CASE("BF16Mixed keeps BatchNorm in float32: a companion member per unit, gathered and computed in float32",
          "[precision]") {
  at::manual_seed(1);
  ShardedConvNet sharded(ConvBnNet(), world());
  const core::ShardedModel& m = sharded.sharded();
  CHECK(unit_names(m) == std::vector<std::string>{"root", "root#float32", "b0", "b0#float32", "b1", "b1#float32",
                                                  "b1#frozen", "b2", "b2#float32"});
  for (size_t i = 0; i < m.num_units(); ++i) {
    const core::Unit& u = m.unit(i);
    INFO(u.name());
    const bool kept = u.name().find("#float32") != std::string::npos;
    CHECK(u.options().param_dtype == (kept ? at::kFloat : at::kBFloat16));
    CHECK(u.options().reduce_dtype == at::kFloat);
    CHECK(u.trainable() == (u.name() != "b1#frozen"));
    for (const core::ParamInfo& p : u.layout().params()) CHECK((p.name.find("bn.") != std::string::npos) == kept);
  }
  {
    auto scope = sharded.full_parameters();
    for (const auto& p : sharded->named_parameters()) {
      INFO(p.key());
      CHECK(p.value().scalar_type() == (p.key().find("bn.") != std::string::npos ? at::kFloat : at::kBFloat16));
    }
  }
  for (const auto& p : sharded.parameters()) CHECK(p.scalar_type() == at::kFloat);  // masters stay float32
  // State dicts see parameters by name, whichever member holds them.
  std::set<std::string> saved, want;
  for (const auto& e : full_state_dict(sharded.sharded(), /*all_ranks=*/true).entries) saved.insert(e.name);
  for (const auto& p : sharded->named_parameters()) want.insert(p.key());
  for (const auto& b : sharded->named_buffers()) want.insert(b.key());
  CHECK(saved == want);
  // Full precision splits nothing.
  at::manual_seed(1);
  Fsdp<ConvBnNet, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<ConvBnBlockImpl>> full(ConvBnNet(),
                                                                                                            world());
  CHECK(unit_names(full.sharded()) == std::vector<std::string>{"root", "b0", "b1", "b1#frozen", "b2"});
}

TEST_CASE("a ConvNet with BatchNorm under BF16Mixed trains as plain LibTorch with the same per-module dtypes",
          "[precision][parity]") {
  // Every rank sees the whole batch, so each rank's batch statistics are the reference's and the ranks'
  // averaged gradients are its gradients. The reference: float32 masters; a compute copy with bfloat16
  // convolutions and head, float32 BatchNorms, on a bfloat16 input; its gradients, in float32, drive
  // AdamW on the masters. Each step from the same masters (StepParity), every stage stored in bfloat16.
  const int W = world().size();
  at::manual_seed(42);
  ConvBnNet master;
  at::manual_seed(42);
  ConvBnNet compute;
  to_compute_dtypes(*compute);
  at::manual_seed(42);
  ShardedConvNet sharded(ConvBnNet(), world());
  auto optimizer = make_adamw(sharded, adamw());
  auto ref_optimizer = reference_adamw(*master);
  const int64_t rows_n = conv_batch(0).y.numel();
  rounding::Path forward = conv_bn_net_path(rows_n);
  forward.storage = at::kBFloat16;
  StepParity parity(step_bounds(forward, rows_n));
  for (int step = 0; step < 4; ++step) {
    const Batch b = conv_batch(step);
    const at::Tensor ref_loss = reference_backward(master, compute, ref_optimizer, b.x.to(at::kBFloat16), b.y);
    parity.note_reference_gradients(sharded.sharded(), named_gradients(*master), false);

    optimizer.zero_grad();
    const at::Tensor loss = sharded(b.x, b.y);
    REQUIRE(loss.scalar_type() == at::kBFloat16);
    loss.backward();
    parity.check_gradients(sharded.sharded(), named_gradients(*master));
    ref_optimizer.step();
    optimizer.step();
    auto global = loss.detach().to(at::kDouble).reshape({1});
    world().all_reduce(global, dist::ReduceOp::avg);
    parity.check_loss(global.item<double>(), ref_loss.item<double>());
    parity.check_step(optimizer, sharded.sharded(), named_values(*master));
    take_sharded_parameters(sharded.sharded(), *master);
  }
  INFO(parity.summary());
  CHECK(parity.holds());
  // The running statistics: float32, on the forward path of bfloat16 stages, one more sum over the rows.
  const double buffer_bound =
      rounding::relative({.length = forward.length, .depth = forward.depth + 1, .storage = at::kBFloat16});
  for (const auto& [name, b] : sharded.sharded().named_buffers()) {
    INFO(name);
    CHECK((b.scalar_type() == at::kFloat || !b.is_floating_point()));  // the statistics stay float32
  }
  // Mean, variance and counter of each BatchNorm.
  REQUIRE(check_buffers(sharded.sharded(), *compute, buffer_bound) == 4 * 3);
  if (world().rank() == 0) std::printf("  ConvNet BF16Mixed parity at %d ranks, %s\n", W, parity.summary().c_str());
}

TEST_CASE("with no module kept, a BatchNorm's dtype clash names the module, its dtypes and the option",
          "[precision][errors]") {
  FsdpOptions options;
  options.keep_full_precision = nullptr;
  at::manual_seed(1);
  ShardedConvNet sharded(ConvBnNet(), world(), options);
  CHECK(unit_names(sharded.sharded()) == std::vector<std::string>{"root", "b0", "b1", "b1#frozen", "b2"});
  const Batch b = conv_batch(0);
  try {
    sharded(b.x, b.y);
    FAIL("a bfloat16 BatchNorm beside float32 running statistics ran");
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    INFO(what);
    CHECK_THAT(what, Contains("unit 'root'"));
    CHECK_THAT(what, Contains("'stem_bn' (parameters BFloat16, buffers Float)"));
    CHECK_THAT(what, Contains("FsdpOptions::keep_full_precision"));
    CHECK_THAT(what, Contains("expected scalar type"));
  }
  // The failed forward left the model clean: no pass is left half-done.
  CHECK(sharded.sharded().stage() == core::PassStage::idle);
}

TEST_CASE("keep_full_precision chooses by module name and type; is_norm_layer keeps every normalization layer",
          "[precision]") {
  const auto layer = [](auto holder) -> const torch::nn::Module& { return *holder.ptr(); };
  CHECK(is_batch_norm("", layer(torch::nn::BatchNorm2d(3))));
  CHECK(is_batch_norm("", layer(torch::nn::BatchNorm3d(3))));
  CHECK_FALSE(is_batch_norm("", layer(torch::nn::LayerNorm(torch::nn::LayerNormOptions({3})))));
  CHECK(is_norm_layer("", layer(torch::nn::LayerNorm(torch::nn::LayerNormOptions({3})))));
  CHECK(is_norm_layer("", layer(torch::nn::GroupNorm(1, 3))));
  CHECK(is_norm_layer("", layer(torch::nn::InstanceNorm2d(torch::nn::InstanceNorm2dOptions(3).affine(true)))));
  CHECK(is_norm_layer("", layer(torch::nn::BatchNorm1d(3))));
  CHECK_FALSE(is_norm_layer("", layer(torch::nn::Linear(3, 3))));
  CHECK_FALSE(is_norm_layer("", layer(torch::nn::Conv1d(3, 3, 1))));

  // By dotted name: only the blocks' BatchNorms (the stem's stays bfloat16, which ATen refuses: not run).
  std::set<std::string> asked;
  FsdpOptions options;
  options.keep_full_precision = [&](const std::string& name, const torch::nn::Module& module) {
    asked.insert(name);
    return is_batch_norm(name, module) && name != "stem_bn";
  };
  at::manual_seed(1);
  ShardedConvNet sharded(ConvBnNet(), world(), options);
  CHECK(asked.count("stem_bn") == 1);
  CHECK(asked.count("b1.bn") == 1);
  CHECK(asked.count("b1.mix") == 1);
  CHECK(unit_names(sharded.sharded()) ==
        std::vector<std::string>{"root", "b0", "b0#float32", "b1", "b1#float32", "b1#frozen", "b2", "b2#float32"});
}

namespace {

/// Linear, LayerNorm and GroupNorm blocks: under BF16Mixed with every norm kept, a step runs on bfloat16
/// activations with float32 norm parameters.
struct NormBlockImpl : torch::nn::Module {
  NormBlockImpl() {
    fc = register_module("fc", torch::nn::Linear(16, 16));
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({16})));
    gn = register_module("gn", torch::nn::GroupNorm(4, 16));
  }
  at::Tensor forward(const at::Tensor& x) { return x + gn(ln(torch::gelu(fc(x)))); }
  torch::nn::Linear fc{nullptr};
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::GroupNorm gn{nullptr};
};
TORCH_MODULE(NormBlock);

struct NormNetImpl : torch::nn::Module {
  NormNetImpl() {
    for (int i = 0; i < 2; ++i) blocks.push_back(register_module("n" + std::to_string(i), NormBlock()));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = x;
    for (auto& b : blocks) h = fsdpx::forward(b, h);
    return h.to(at::kFloat).square().mean();
  }
  std::vector<NormBlock> blocks;
};
TORCH_MODULE(NormNet);

}  // namespace

TEST_CASE("is_norm_layer under BF16Mixed: LayerNorm and GroupNorm train in float32 on bfloat16 activations",
          "[precision]") {
  FsdpOptions options;
  options.keep_full_precision = is_norm_layer;
  at::manual_seed(2);
  Fsdp<NormNet, FullShard, NoOffload, BF16Mixed, ShardedStateDict, WrapModules<NormBlockImpl>> sharded(
      NormNet(), world(), options);
  CHECK(unit_names(sharded.sharded()) == std::vector<std::string>{"root", "n0", "n0#float32", "n1", "n1#float32"});
  auto optimizer = make_adamw(sharded, adamw());
  at::manual_seed(3);
  const at::Tensor x = at::randn({8, 16});
  double first = 0, last = 0;
  for (int step = 0; step < 3; ++step) {
    optimizer.zero_grad();
    const at::Tensor loss = sharded(x);
    loss.backward();
    optimizer.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  CHECK(std::isfinite(last));
  CHECK(last < first);  // the steps descend
  // Every member's gradient reached its shards (the norms' too): summed over the ranks, as a rank may hold
  // only padding of a small member.
  const core::ShardedModel& m = sharded.sharded();
  for (size_t i = 1; i < m.num_units(); ++i) {
    INFO(m.unit(i).name());
    at::Tensor total = at::zeros({1}, at::kDouble);
    for (const at::Tensor& g : m.unit(i).shard_grads()) total += g.abs().sum().to(at::kDouble);
    world().all_reduce(total, dist::ReduceOp::sum);
    CHECK(total.item<double>() > 0);
  }
}
