// SyncBatchNorm: without a group it is LibTorch's BatchNorm bit for bit; over the ranks it equals BatchNorm
// over every rank's batch together (PyTorch's torch.nn.SyncBatchNorm computes that, on GPUs only, so the
// reference here is its definition: one BatchNorm over the whole batch), forward statistics, running
// statistics and gradients, alone and inside a sharded ConvNet. CTest runs this under mpiexec at world
// sizes 1, 2 and 4 (label sync_batch_norm).
#include <catch2/catch.hpp>

#include <cstdio>
#include <string>
#include <vector>

#include <torch/nn.h>
#include <torch/optim.h>

#include <fsdpx/fsdp.hpp>

#include "../support/mpi_world.hpp"
#include "parity.hpp"

using namespace fsdpx;
using namespace fsdpx::test;
using fsdpx::test::world;

namespace {

/// Largest |a - b| relative to max |b|.
double relative_difference(const at::Tensor& a, const at::Tensor& b) {
  const double scale = b.abs().max().item<double>();
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>() / (scale > 0 ? scale : 1.0);
}

/// One training forward and backward of `norm` on `x` against a fixed weighting of its output.
struct Pass {
  at::Tensor y, grad_x, grad_weight, grad_bias;
};
template <class Norm>
Pass run(Norm& norm, const at::Tensor& input, const at::Tensor& weighting) {
  const at::Tensor x = input.detach().clone().requires_grad_(true);
  norm->zero_grad();
  const at::Tensor y = norm(x);
  (y.to(at::kFloat) * weighting).sum().backward();
  return {y.detach(), x.grad(), norm->weight.grad().clone(), norm->bias.grad().clone()};
}

/// SyncBatchNorm without a group against LibTorch's BatchNorm of the input's rank (`Plain`).
template <class Plain>
void check_equals_batch_norm(const std::vector<int64_t>& shape) {
  for (const std::optional<double> momentum : {std::optional<double>(0.1), std::optional<double>()}) {
    INFO("input " << at::IntArrayRef(shape) << ", momentum " << (momentum ? *momentum : -1.0));
    const auto options = torch::nn::BatchNormOptions(8).momentum(momentum);
    SyncBatchNorm sync(options);
    Plain plain(options);
    CHECK_FALSE(sync->synchronized());
    for (int step = 0; step < 3; ++step) {
      at::manual_seed(10 + step);
      const at::Tensor x = at::randn(shape) * 3 + 1, weighting = at::randn(shape);
      const Pass a = run(sync, x, weighting), b = run(plain, x, weighting);
      REQUIRE(at::equal(a.y, b.y));
      REQUIRE(at::equal(a.grad_x, b.grad_x));
      REQUIRE(at::equal(a.grad_weight, b.grad_weight));
      REQUIRE(at::equal(a.grad_bias, b.grad_bias));
    }
    REQUIRE(at::equal(sync->running_mean, plain->running_mean));
    REQUIRE(at::equal(sync->running_var, plain->running_var));
    REQUIRE(sync->num_batches_tracked.item<int64_t>() == 3);
    sync->eval();
    plain->eval();
    const at::Tensor x = at::randn(shape);
    REQUIRE(at::equal(sync(x), plain(x)));
  }
}

}  // namespace

TEST_CASE("SyncBatchNorm without a group is BatchNorm, bit for bit: outputs, gradients, running statistics",
          "[sync_batch_norm]") {
  check_equals_batch_norm<torch::nn::BatchNorm1d>({6, 8});
  check_equals_batch_norm<torch::nn::BatchNorm1d>({6, 8, 5});
  check_equals_batch_norm<torch::nn::BatchNorm2d>({3, 8, 4, 5});
  // The names of BatchNorm's parameters and buffers: state dicts and checkpoints are a BatchNorm's.
  SyncBatchNorm sync(8);
  torch::nn::BatchNorm2d plain(8);
  std::vector<std::string> a, b;
  for (const auto& p : sync->named_parameters()) a.push_back(p.key());
  for (const auto& p : sync->named_buffers()) a.push_back(p.key());
  for (const auto& p : plain->named_parameters()) b.push_back(p.key());
  for (const auto& p : plain->named_buffers()) b.push_back(p.key());
  CHECK(a == b);
  CHECK(is_batch_norm("bn", *sync));  // kept in float32 under mixed precision, as BatchNorm
  CHECK_THROWS_WITH(sync(at::randn({4, 3, 2})), Catch::Matchers::Contains("the input has 3 channels"));
}

TEST_CASE("SyncBatchNorm over the ranks equals BatchNorm over every rank's batch together", "[sync_batch_norm]") {
  // Each rank normalizes its rows with the statistics of all rows; each rank's backward gives its rows'
  // share of the whole batch's gradient: the input gradient of its rows, and its part of the weight's
  // and bias's (their sum over the ranks is the whole batch's). Float32 and bfloat16 inputs.
  const int W = world().size(), r = world().rank();
  const auto group = *world().split(0, r, "test/sync_batch_norm");
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    INFO("input " << dtype);
    const int64_t rows_per_rank = 6, length = 5;
    SyncBatchNorm sync(8);
    sync->set_group(group);
    CHECK(sync->synchronized() == (W > 1));
    torch::nn::BatchNorm1d whole(8);
    for (int step = 0; step < 3; ++step) {
      at::manual_seed(20 + step);  // every rank draws the whole batch alike
      const at::Tensor x = (at::randn({W * rows_per_rank, 8, length}) * 2 + 0.5).to(dtype);
      const at::Tensor weighting = at::randn({W * rows_per_rank, 8, length});
      const at::Tensor mine = at::arange(r * rows_per_rank, (r + 1) * rows_per_rank);
      const Pass got = run(sync, x.index_select(0, mine), weighting.index_select(0, mine));
      const Pass want = run(whole, x, weighting);
      at::Tensor grad_weight = got.grad_weight.clone(), grad_bias = got.grad_bias.clone();
      world().all_reduce(grad_weight, dist::ReduceOp::sum);
      world().all_reduce(grad_bias, dist::ReduceOp::sum);
      // The statistics are sums over the rows (a mean, then the squares about it), in other orders here
      // and there; the gradients add two more (the backward's sums over the rows, the ranks' parts).
      // Outputs stored in the input's dtype round once more.
      const int64_t n = W * rows_per_rank * length;
      const rounding::Path forward{.length = n, .depth = 2, .storage = dtype};
      const double forward_bound = rounding::relative(forward);
      const double backward_bound = rounding::relative(rounding::backward(forward, n));
      CHECK(relative_difference(got.y, want.y.index_select(0, mine)) <= forward_bound);
      CHECK(relative_difference(got.grad_x, want.grad_x.index_select(0, mine)) <= backward_bound);
      CHECK(relative_difference(grad_weight, want.grad_weight) <= backward_bound);
      CHECK(relative_difference(grad_bias, want.grad_bias) <= backward_bound);
    }
    const double stats_bound = rounding::relative({.length = W * rows_per_rank * length, .depth = 3});
    CHECK(relative_difference(sync->running_mean, whole->running_mean) <= stats_bound);
    CHECK(relative_difference(sync->running_var, whole->running_var) <= stats_bound);
    CHECK(sync->num_batches_tracked.item<int64_t>() == 3);
  }
}

TEST_CASE("SyncBatchNorm in a sharded ConvNet trains as BatchNorm over the global batch, unsharded",
          "[sync_batch_norm][parity]") {
  // Each rank trains on its slice of the batch; the reference, unsharded, on the whole batch (its
  // SyncBatchNorms have no group: BatchNorm). Fsdp hands the model's SyncBatchNorms its world.
  using Sharded =
      Fsdp<SyncConvNet, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<SyncConvBlockImpl>>;
  const int W = world().size(), r = world().rank();
  at::manual_seed(5);
  SyncConvNet reference;
  at::manual_seed(5);
  Sharded sharded(SyncConvNet(), world());
  int synchronized = 0;
  for (const auto& m : sharded->modules()) {
    if (const auto* norm = dynamic_cast<const SyncBatchNormImpl*>(m.get())) synchronized += norm->synchronized();
  }
  CHECK(synchronized == (W > 1 ? 4 : 0));
  auto optimizer = make_adamw(sharded, adamw());
  auto ref_optimizer = reference_adamw(*reference);
  const int64_t rows_n = conv_batch(0).y.numel();
  const rounding::Path path = conv_bn_net_path(rows_n);
  StepParity parity(step_bounds(path, rows_n));
  for (int step = 0; step < 4; ++step) {
    const Batch b = conv_batch(step);
    ref_optimizer.zero_grad();
    const at::Tensor ref_loss = reference->forward(b.x, b.y);
    ref_loss.backward();
    optimizer.zero_grad();
    const auto mine = rows(b.x.size(0), W, 0, 1, r);
    const at::Tensor loss = sharded(b.x.index_select(0, mine), b.y.index_select(0, mine));
    loss.backward();
    step_both(parity, sharded, optimizer, *reference, ref_optimizer, loss, ref_loss);
  }
  INFO(parity.summary());
  CHECK(parity.holds());
  // The running statistics: every rank's are the global batch's, as the reference's.
  const double buffer_bound = rounding::relative({.length = path.length + W, .depth = path.depth + 1});
  REQUIRE(check_buffers(sharded.sharded(), *reference, buffer_bound) == 4 * 3);
  if (r == 0) std::printf("  SyncBatchNorm ConvNet parity at %d ranks, %s\n", W, parity.summary().c_str());
}
