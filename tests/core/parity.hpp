// The parity harness: fsdpx training against unsharded training on the same global batch, written
// once for any communicator and device. tests/core/test_parity.cpp runs it under mpiexec on CPU ranks;
// tests/nccl/gpu_parity.cpp runs it at one rank on a GPU with NCCL.
#pragma once

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/nn.h>
#include <torch/optim.h>

#include <fsdpx/fsdp.hpp>

#include "../support/step_parity.hpp"
#include "models.hpp"

namespace fsdpx::test {

/// Where the harness runs: set by each test executable's main().
struct ParityContext {
  dist::AnyCommunicator comm;
  at::Device device;
};
ParityContext& parity_context();

struct ParityRun {
  int steps = 5;
  int micro_steps = 1;
  bool no_sync = false;        // accumulate unsharded gradients until the last micro-step
  std::optional<double> clip;  // global-norm clipping
  /// The model's forward rounding path: the bounds of the loss, gradients and updates derive from it
  /// (tests/support/rounding.hpp). check_gpt_parity sets the GPT's.
  rounding::Path forward;
  // Before each micro-step, a forward with gradients on whose loss is read and dropped (an RL
  // trainer's old log-probs computed without a NoGradGuard): it must change nothing.
  bool dropped_forward = false;
  // Runs after each step's optimizer update (e.g. an RL trainer's offload / reload).
  std::function<void(core::ShardedModel&, torch::optim::Optimizer&)> after_step;
  // The sharded model steps with FusedAdamW (ATen's fused kernel), the reference with LibTorch's AdamW.
  bool fused_adamw = false;
};

struct Batch {
  at::Tensor x, y;
  Batch to(const at::Device& d) const { return {x.to(d), y.to(d)}; }
};

// eps 1e-6, not 1e-8: some gradients are analytically zero (the key bias of attention: softmax is
// shift-invariant) and come out as rounding noise (~1e-10); Adam turns noise into steps of up to
// lr * noise / eps. The parity checks bound each step by AdamW's own sensitivity (StepParity), which
// holds for any eps; 1e-6 keeps those steps small in the models' trajectories themselves.
inline torch::optim::AdamWOptions adamw() { return torch::optim::AdamWOptions(1e-2).weight_decay(0.1).eps(1e-6); }

// The reference optimizer groups parameters the way make_adamw does: matrices decay, the rest not.
inline torch::optim::AdamW reference_adamw(torch::nn::Module& m) {
  std::vector<at::Tensor> decay, no_decay;
  for (auto& p : m.parameters()) (p.dim() >= 2 ? decay : no_decay).push_back(p);
  auto nd = adamw();
  nd.weight_decay(0.0);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(adamw()));
  groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(nd));
  return torch::optim::AdamW(std::move(groups), adamw());
}

// Rows of micro-step m: from every rank's slice (reference) or from this rank's (sharded).
inline at::Tensor rows(int64_t global, int W, int m, int M, std::optional<int> rank) {
  const int64_t per = global / W, micro = per / M;
  std::vector<int64_t> idx;
  for (int q = 0; q < W; ++q) {
    if (rank && q != *rank) continue;
    for (int64_t i = 0; i < micro; ++i) idx.push_back(q * per + m * micro + i);
  }
  return at::tensor(idx, at::kLong);
}

/// fsdpx training against unsharded training of the same global batch, step by step from the same
/// weights (StepParity): each step's loss, gradient norm, every gradient element and every updated
/// weight this rank holds, within the bounds the arithmetic gives; the reference then takes the
/// sharded model's weights.
template <class Sharded, class Make>
void check_parity(Make make, const std::function<Batch(int)>& batch, const ParityRun& run, FsdpOptions options = {}) {
  auto& ctx = parity_context();
  const int W = ctx.comm.size(), r = ctx.comm.rank();
  at::manual_seed(42);
  auto reference = make();
  reference->to(ctx.device);
  at::manual_seed(42);
  auto model = make();
  model->to(ctx.device);
  Sharded sharded(model, ctx.comm, options);
  std::unique_ptr<torch::optim::AdamW> optimizer;
  if (run.fused_adamw) {
    optimizer = std::make_unique<FusedAdamW>(make_adamw<FusedAdamW>(sharded, adamw()));
  } else {
    optimizer = std::make_unique<torch::optim::AdamW>(make_adamw(sharded, adamw()));
  }
  auto ref_optimizer = reference_adamw(*reference);
  StepParity parity(step_bounds(run.forward, batch(0).y.numel()));

  for (int step = 0; step < run.steps; ++step) {
    const Batch b = batch(step).to(ctx.device);
    const int64_t global = b.x.size(0);
    REQUIRE(global % (W * run.micro_steps) == 0);
    optimizer->zero_grad();
    ref_optimizer.zero_grad();
    double ref_loss = 0, local_loss = 0;
    for (int m = 0; m < run.micro_steps; ++m) {
      const auto all = rows(global, W, m, run.micro_steps, std::nullopt).to(ctx.device);
      auto l = reference->forward(b.x.index_select(0, all), b.y.index_select(0, all)) / run.micro_steps;
      l.backward();
      ref_loss += l.item().toDouble();

      const auto mine = rows(global, W, m, run.micro_steps, r).to(ctx.device);
      sharded.set_requires_gradient_sync(!run.no_sync || m == run.micro_steps - 1);
      if (run.dropped_forward)
        (void)sharded(b.x.index_select(0, mine), b.y.index_select(0, mine)).template item<double>();
      auto ls = sharded(b.x.index_select(0, mine), b.y.index_select(0, mine)) / run.micro_steps;
      ls.backward();
      local_loss += ls.item().toDouble();
    }
    std::optional<double> norm, ref_norm;
    if (run.clip) {
      ref_norm = torch::nn::utils::clip_grad_norm_(reference->parameters(), *run.clip);
      const GradNorm n = sharded.clip_grad_norm_(*run.clip);
      REQUIRE(n.is_finite());
      norm = n.value;
    }
    parity.note_reference_gradients(sharded.sharded(), named_gradients(*reference), run.clip.has_value());
    if (run.clip) parity.check_norm(*norm, *ref_norm);
    parity.check_gradients(sharded.sharded(), named_gradients(*reference));
    ref_optimizer.step();
    optimizer->step();
    if (run.after_step) run.after_step(sharded.sharded(), *optimizer);
    auto loss = at::full({1}, local_loss, at::kDouble).to(ctx.device);
    ctx.comm.all_reduce(loss, dist::ReduceOp::avg);
    parity.check_loss(loss.item().toDouble(), ref_loss);
    parity.check_step(*optimizer, sharded.sharded(), named_values(*reference));
    take_weights(*reference, sharded);
  }
  INFO(parity.summary());
  CHECK(parity.holds());
  if (r == 0) std::printf("  parity, %d steps at %d ranks, %s\n", run.steps, W, parity.summary().c_str());
}

inline std::function<Batch(int)> gpt_batches(const test::GptConfig& c) {
  return [c](int step) {
    at::manual_seed(1000 + step);
    auto tokens = at::randint(c.vocab, {24, c.seq + 1}, at::kLong);
    return Batch{tokens.narrow(1, 0, c.seq).contiguous(), tokens.narrow(1, 1, c.seq).contiguous()};
  };
}

/// check_parity for the GPT of `c` on its batches.
template <class Sharded>
void check_gpt_parity(const GptConfig& c, ParityRun run, const FsdpOptions& options = {}) {
  run.forward = gpt_path(c);
  check_parity<Sharded>([&] { return Gpt(c); }, gpt_batches(c), run, options);
}

inline Batch mlp_batch(int step) {
  at::manual_seed(2000 + step);
  return {at::randn({24, 20}), at::randint(5, {24}, at::kLong)};
}

/// Every buffer of the sharded model against the reference's: the same dtype; a floating one within
/// `bound` of the reference's largest element, the others (counters) equal. Returns how many it compared.
inline int check_buffers(const core::ShardedModel& sharded, torch::nn::Module& reference, double bound) {
  auto want = reference.named_buffers();
  int compared = 0;
  for (const auto& [name, got] : sharded.named_buffers()) {
    INFO(name);
    REQUIRE(got.scalar_type() == want[name].scalar_type());
    if (got.is_floating_point()) {
      const double diff = (got - want[name]).abs().max().item<double>();
      const double scale = want[name].abs().max().item<double>();
      INFO("max |sharded - reference| = " << diff << ", bound " << bound * scale);
      REQUIRE(diff <= bound * scale);
    } else {
      REQUIRE(at::equal(got, want[name]));
    }
    ++compared;
  }
  return compared;
}

/// What BF16Mixed with BatchNorm kept does, unsharded: every parameter but the BatchNorms' in bfloat16.
inline void to_compute_dtypes(torch::nn::Module& model) {
  at::NoGradGuard no_grad;
  for (const auto& item : model.named_modules()) {
    if (is_batch_norm(item.key(), *item.value())) continue;
    for (auto& p : item.value()->parameters(/*recurse=*/false)) p.set_data(p.to(at::kBFloat16));
  }
}

/// A mixed-precision reference: its compute copy takes the float32 masters' values (in its own dtypes)...
inline void masters_to_compute(torch::nn::Module& master, torch::nn::Module& compute) {
  at::NoGradGuard no_grad;
  auto mp = master.parameters();
  auto cp = compute.parameters();
  for (size_t i = 0; i < mp.size(); ++i) cp[i].copy_(mp[i]);
}
/// ...and after its backward the masters take its gradients, in float32.
inline void compute_gradients_to_masters(torch::nn::Module& compute, torch::nn::Module& master) {
  auto mp = master.parameters();
  auto cp = compute.parameters();
  for (size_t i = 0; i < mp.size(); ++i) {
    if (cp[i].grad().defined()) mp[i].mutable_grad() = cp[i].grad().to(at::kFloat);
  }
}

/// One step of a mixed-precision reference up to its optimizer: the compute copy takes the masters'
/// values, runs forward and backward on (x, y), and the masters take its gradients. Returns the loss.
template <class Net>
at::Tensor reference_backward(Net& master, Net& compute, torch::optim::Optimizer& optimizer, const at::Tensor& x,
                              const at::Tensor& y) {
  masters_to_compute(*master, *compute);
  compute->zero_grad();
  optimizer.zero_grad();
  at::Tensor loss = compute->forward(x, y);
  loss.backward();
  compute_gradients_to_masters(*compute, *master);
  return loss;
}

/// The next step starts from the same weights (StepParity): the reference takes the sharded model's
/// parameters (its float32 masters); each keeps its own buffers.
inline void take_sharded_parameters(core::ShardedModel& sharded, torch::nn::Module& reference) {
  const auto full = full_state_dict(sharded, /*all_ranks=*/true);
  at::NoGradGuard no_grad;
  auto want = reference.named_parameters();
  for (const auto& e : full.entries) {
    if (at::Tensor* p = want.find(e.name)) p->copy_(e.data());
  }
}

/// ConvBnNet's batches: 24 sequences (whole slices at 1-4 ranks) of 16 steps, and their classes.
inline Batch conv_batch(int step) {
  at::manual_seed(3000 + step);
  return {at::randn({24, ConvNetShape::in_channels, ConvNetShape::length}),
          at::randint(ConvNetShape::classes, {24}, at::kLong)};
}

// bfloat16: the reference does what BF16Mixed does, unsharded. Float32 master weights; a bfloat16 copy
// computes forward and backward on the whole batch; its gradients, cast to float32, drive AdamW on the
// master. Each step is compared from the same masters (StepParity), along the GPT's path with every
// stage's result stored in bfloat16 (rounding.hpp: u = 2^-8 per stage, the sums accumulating in float32):
// the ranks round their own gradients before the float32 average where the reference rounds the whole
// batch's once, and a kernel may block other row counts otherwise.
inline void check_bf16_parity(const test::GptConfig& c, int steps) {
  using Sharded = Fsdp<Gpt, FullShard, NoOffload, BF16Mixed, ShardedStateDict, WrapModules<BlockImpl>>;
  auto& ctx = parity_context();
  const int W = ctx.comm.size(), r = ctx.comm.rank();
  at::manual_seed(42);
  auto master = Gpt(c);
  master->to(ctx.device);
  at::manual_seed(42);
  auto compute = Gpt(c);
  compute->to(ctx.device, at::kBFloat16);
  at::manual_seed(42);
  auto model = Gpt(c);
  model->to(ctx.device);
  Sharded sharded(model, ctx.comm);
  auto optimizer = make_adamw(sharded, adamw());
  auto ref_optimizer = reference_adamw(*master);
  const auto batches = gpt_batches(c);
  rounding::Path forward = gpt_path(c);
  forward.storage = at::kBFloat16;
  StepParity parity(step_bounds(forward, batches(0).y.numel()));

  for (int step = 0; step < steps; ++step) {
    const Batch b = batches(step).to(ctx.device);
    const at::Tensor ref_loss = reference_backward(master, compute, ref_optimizer, b.x, b.y);
    parity.note_reference_gradients(sharded.sharded(), named_gradients(*master), false);

    optimizer.zero_grad();
    const auto mine = rows(b.x.size(0), W, 0, 1, r).to(ctx.device);
    auto loss = sharded(b.x.index_select(0, mine), b.y.index_select(0, mine));
    loss.backward();
    parity.check_gradients(sharded.sharded(), named_gradients(*master));
    ref_optimizer.step();
    optimizer.step();
    auto global = loss.detach().to(at::kDouble).reshape({1});
    ctx.comm.all_reduce(global, dist::ReduceOp::avg);
    parity.check_loss(global.item().toDouble(), ref_loss.item().toDouble());
    parity.check_step(optimizer, sharded.sharded(), named_values(*master));
    take_sharded_parameters(sharded.sharded(), *master);  // float32, not the bfloat16 compute copies
  }
  {
    auto scope = sharded.full_parameters();
    for (const auto& p : sharded->named_parameters())
      REQUIRE(p.value().scalar_type() == at::kBFloat16);  // computes in bfloat16...
  }
  for (const auto& p : sharded.parameters()) REQUIRE(p.scalar_type() == at::kFloat);  // ...masters stay float32
  INFO(parity.summary());
  CHECK(parity.holds());
  if (r == 0) std::printf("  bf16 parity, %d steps at %d ranks, %s\n", steps, W, parity.summary().c_str());
}

}  // namespace fsdpx::test
