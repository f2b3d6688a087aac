// Parity: fsdpx training equals unsharded training on the same global batch (AdamW, 5 steps), for
// each mesh policy, with and without CPU offload, both gradient-accumulation modes and clipping.
// CTest runs this under mpiexec at world sizes 1-4; every rank also trains the unsharded reference.
#include <catch2/catch.hpp>

#include <cstdio>
#include <functional>
#include <map>

#include <torch/nn.h>
#include <torch/optim.h>

#include <fsdpx/fsdp.hpp>

#include "../support/mpi_world.hpp"
#include "models.hpp"

using namespace fsdpx;
using fsdpx::test::world;

namespace {

struct ParityRun {
  int steps = 5;
  int micro_steps = 1;
  bool no_sync = false;        // accumulate unsharded gradients until the last micro-step
  std::optional<double> clip;  // global-norm clipping
  double tolerance = 0;        // max |sharded - reference| over every parameter element
  // Runs after each step's optimizer update (e.g. an RL trainer's offload / reload).
  std::function<void(core::ShardedModel&, torch::optim::Optimizer&)> after_step;
};

struct Batch {
  at::Tensor x, y;
};

// eps 1e-6, not 1e-8: some gradients are analytically zero (the key bias of attention: softmax is
// shift-invariant) and come out as rounding noise (~1e-10) whose value depends on the order of float
// operations. Adam turns that noise into steps of lr * noise / eps: 1e-4 with eps 1e-8 (measured),
// 1e-6 with eps 1e-6, in the reference and the sharded run alike.
torch::optim::AdamWOptions adamw() { return torch::optim::AdamWOptions(1e-2).weight_decay(0.1).eps(1e-6); }

// The reference optimizer groups parameters the way make_adamw does: matrices decay, the rest not.
torch::optim::AdamW reference_adamw(torch::nn::Module& m) {
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
at::Tensor rows(int64_t global, int W, int m, int M, std::optional<int> rank) {
  const int64_t per = global / W, micro = per / M;
  std::vector<int64_t> idx;
  for (int q = 0; q < W; ++q) {
    if (rank && q != *rank) continue;
    for (int64_t i = 0; i < micro; ++i) idx.push_back(q * per + m * micro + i);
  }
  return at::tensor(idx, at::kLong);
}

template <class Sharded, class Make>
void check_parity(Make make, const std::function<Batch(int)>& batch, const ParityRun& run, FsdpOptions options = {}) {
  const int W = world().size(), r = world().rank();
  at::manual_seed(42);
  auto reference = make();
  at::manual_seed(42);
  Sharded sharded(make(), world(), options);
  auto optimizer = make_adamw(sharded, adamw());
  auto ref_optimizer = reference_adamw(*reference);

  for (int step = 0; step < run.steps; ++step) {
    const Batch b = batch(step);
    const int64_t global = b.x.size(0);
    REQUIRE(global % (W * run.micro_steps) == 0);
    optimizer.zero_grad();
    ref_optimizer.zero_grad();
    double ref_loss = 0, local_loss = 0;
    for (int m = 0; m < run.micro_steps; ++m) {
      const auto all = rows(global, W, m, run.micro_steps, std::nullopt);
      auto l = reference->forward(b.x.index_select(0, all), b.y.index_select(0, all)) / run.micro_steps;
      l.backward();
      ref_loss += l.item().toDouble();

      const auto mine = rows(global, W, m, run.micro_steps, r);
      sharded.set_requires_gradient_sync(!run.no_sync || m == run.micro_steps - 1);
      auto ls = sharded(b.x.index_select(0, mine), b.y.index_select(0, mine)) / run.micro_steps;
      ls.backward();
      local_loss += ls.item().toDouble();
    }
    if (run.clip) {
      const double ref_norm = torch::nn::utils::clip_grad_norm_(reference->parameters(), *run.clip);
      const GradNorm norm = sharded.clip_grad_norm_(*run.clip);
      REQUIRE(norm.is_finite());
      REQUIRE(norm.value == Approx(ref_norm).epsilon(1e-4));
    }
    ref_optimizer.step();
    optimizer.step();
    if (run.after_step) run.after_step(sharded.sharded(), optimizer);
    auto loss = at::full({1}, local_loss, at::kDouble);
    world().all_reduce(loss, dist::ReduceOp::avg);
    INFO("step " << step);
    REQUIRE(loss.item().toDouble() == Approx(ref_loss).epsilon(1e-5));
  }

  // Every parameter, gathered, against the reference.
  auto scope = sharded.full_parameters();
  auto ref_params = reference->named_parameters();
  double worst = 0;
  for (const auto& p : sharded->named_parameters()) {
    const auto diff = (p.value().detach().to(at::kFloat) - ref_params[p.key()].detach()).abs().max().item().toDouble();
    INFO(p.key() << " differs by " << diff);
    CHECK(diff <= run.tolerance);
    worst = std::max(worst, diff);
  }
  if (r == 0) std::printf("  parity: max |sharded - reference| = %.3g (tolerance %.3g)\n", worst, run.tolerance);
}

std::function<Batch(int)> gpt_batches(const test::GptConfig& c) {
  return [c](int step) {
    at::manual_seed(1000 + step);
    auto tokens = at::randint(c.vocab, {24, c.seq + 1}, at::kLong);
    return Batch{tokens.narrow(1, 0, c.seq).contiguous(), tokens.narrow(1, 1, c.seq).contiguous()};
  };
}

Batch mlp_batch(int step) {
  at::manual_seed(2000 + step);
  return {at::randn({24, 20}), at::randint(5, {24}, at::kLong)};
}

// float32 tolerance. The sharded run sums the same products in another order (per-rank means, then
// a ring average; at world size 3 the average divides by 3, which is inexact). A gradient element
// that is a sum of terms of both signs carries a relative rounding error that can reach ~1e-3 when
// the terms nearly cancel, and Adam passes relative gradient error straight into its step of ~lr.
// Bound: 5 steps x lr (1e-2) x 1e-3 = 5e-5. Measured: at most 1.6e-5 (world size 3), 7e-6 (4),
// 4e-6 (2), 1e-6 (1).
constexpr double f32_tolerance = 5e-5;

using test::BlockImpl;
using test::Gpt;
using test::GptConfig;
using test::ResBlockImpl;
using test::ResMlp;

}  // namespace

TEST_CASE("GPT, FullShard: parity with unsharded training, clipping on", "[parity][gpt]") {
  const GptConfig c;
  check_parity<Fsdp<Gpt, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<BlockImpl>>>(
      [&] { return Gpt(c); }, gpt_batches(c), {.clip = 0.5, .tolerance = f32_tolerance});
}

TEST_CASE("GPT with tied head, FullShard + CpuOffload, reduce every micro-step", "[parity][gpt][offload]") {
  GptConfig c;
  c.tied = true;
  check_parity<Fsdp<Gpt, FullShard, CpuOffload<>, FullPrecision, ShardedStateDict, WrapModules<BlockImpl>>>(
      [&] { return Gpt(c); }, gpt_batches(c), {.micro_steps = 2, .clip = 1.0, .tolerance = f32_tolerance});
}

TEST_CASE("GPT, HybridShard (runtime shard size), accumulation without sync", "[parity][gpt][hybrid]") {
  const GptConfig c;
  FsdpOptions options;
  options.shard_size = world().size() % 2 == 0 ? 2 : 1;
  check_parity<Fsdp<Gpt, HybridShard<>, NoOffload, FullPrecision, ShardedStateDict, WrapModules<BlockImpl>>>(
      [&] { return Gpt(c); }, gpt_batches(c), {.micro_steps = 2, .no_sync = true, .clip = 1.0, .tolerance = f32_tolerance},
      options);
}

TEST_CASE("GPT, NoShard (plain data parallel), accumulation without sync", "[parity][gpt][noshard]") {
  const GptConfig c;
  check_parity<Fsdp<Gpt, NoShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<BlockImpl>>>(
      [&] { return Gpt(c); }, gpt_batches(c), {.micro_steps = 2, .no_sync = true, .clip = 1.0, .tolerance = f32_tolerance});
}

TEST_CASE("GPT, FullShard, parameters kept between forward and backward", "[parity][gpt]") {
  const GptConfig c;
  FsdpOptions options;
  options.reshard_after_forward = false;
  check_parity<Fsdp<Gpt, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<BlockImpl>>>(
      [&] { return Gpt(c); }, gpt_batches(c), {.clip = 1.0, .tolerance = f32_tolerance}, options);
}

TEST_CASE("residual MLP with never-used parameters, FullShard + CpuOffload", "[parity][mlp]") {
  check_parity<Fsdp<ResMlp, FullShard, CpuOffload<>, FullPrecision, ShardedStateDict, WrapModules<ResBlockImpl>>>(
      [] { return ResMlp(); }, mlp_batch, {.micro_steps = 2, .clip = 1.0, .tolerance = f32_tolerance});
}

TEST_CASE("residual MLP, HybridShard with the shard size chosen from the parameter count", "[parity][mlp][hybrid]") {
  FsdpOptions options;
  options.auto_shard_budget_bytes = 1;  // nothing fits: the smallest shard size within a node wins
  // WrapBySize<1300>: a residual block holds ~2500 parameters, its largest child (a Linear) ~1200.
  check_parity<Fsdp<ResMlp, HybridShard<auto_shard_size>, NoOffload, FullPrecision, ShardedStateDict,
                    WrapBySize<1300>>>([] { return ResMlp(); }, mlp_batch,
                                       {.no_sync = false, .clip = 1.0, .tolerance = f32_tolerance}, options);
}

namespace {
// A model whose forward calls its blocks directly, bypassing fsdpx::forward.
struct BypassImpl : torch::nn::Module {
  BypassImpl() { block = register_module("block", test::ResBlock(8)); }
  at::Tensor forward(const at::Tensor& x) { return block->forward(x).sum(); }
  test::ResBlock block{nullptr};
};
TORCH_MODULE(Bypass);
}  // namespace

TEST_CASE("a sharded unit called without fsdpx::forward fails with a clear error", "[core][errors]") {
  Fsdp<Bypass, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<ResBlockImpl>> sharded(Bypass(),
                                                                                                          world());
  using Catch::Matchers::Contains;
  REQUIRE_THROWS_AS(sharded(at::randn({2, 8})), fsdpx::ConfigError);
  REQUIRE_THROWS_WITH(sharded(at::randn({2, 8})),
                      Contains("called a sharded child directly") && Contains("fsdpx::forward") && Contains("block"));
}

TEST_CASE("a non-finite gradient norm skips the step and leaves every parameter unchanged", "[core][clip]") {
  Fsdp<ResMlp, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<ResBlockImpl>> sharded(ResMlp(),
                                                                                                          world());
  auto optimizer = make_adamw(sharded, adamw());
  const Batch b = mlp_batch(0);
  const int W = world().size(), r = world().rank();
  const auto mine = rows(b.x.size(0), W, 0, 1, r);
  // One rank's input holds an infinity: its gradients, and so the global norm, are not finite.
  auto x = b.x.index_select(0, mine);
  if (r == W - 1) x[0][0] = std::numeric_limits<float>::infinity();
  std::vector<at::Tensor> before;
  for (const auto& p : sharded.parameters()) before.push_back(p.clone());
  sharded(x, b.y.index_select(0, mine)).backward();
  const GradNorm norm = sharded.clip_grad_norm_(1.0);
  REQUIRE_FALSE(norm.is_finite());
  for (const auto& p : sharded.parameters()) REQUIRE_FALSE(p.grad().defined());
  optimizer.step();
  const auto after = sharded.parameters();
  for (size_t i = 0; i < after.size(); ++i) REQUIRE(at::equal(after[i], before[i]));
}

namespace {
// bfloat16: the reference does what BF16Mixed does, unsharded. Float32 master weights; a bfloat16
// copy computes forward and backward on the whole batch; its gradients, cast to float32, drive AdamW
// on the master.
// Tolerance. Each rank's bfloat16 gradient is rounded (relative 2^-8) before the float32 average,
// while the reference rounds the whole batch's gradient once. Adam turns relative gradient error into
// relative step error, and nearly-zero gradients can flip its step's sign. So we bound the error of
// the whole update: |theta - theta_ref| / |theta_ref - theta_0| <= 5%, about ten times 2^-8 for
// 5 steps. The loss must agree to 1% (bfloat16 logits).
void check_bf16_parity(const test::GptConfig& c, int steps) {
  using Sharded = Fsdp<Gpt, FullShard, NoOffload, BF16Mixed, ShardedStateDict, WrapModules<BlockImpl>>;
  const int W = world().size(), r = world().rank();
  at::manual_seed(42);
  auto master = Gpt(c);
  at::manual_seed(42);
  auto compute = Gpt(c);
  compute->to(at::kBFloat16);
  at::manual_seed(42);
  Sharded sharded(Gpt(c), world());
  auto optimizer = make_adamw(sharded, adamw());
  auto ref_optimizer = reference_adamw(*master);
  std::map<std::string, at::Tensor> initial;
  for (const auto& p : master->named_parameters()) initial[p.key()] = p.value().detach().clone();

  const auto batches = gpt_batches(c);
  for (int step = 0; step < steps; ++step) {
    const Batch b = batches(step);
    {
      at::NoGradGuard no_grad;
      auto mp = master->parameters();
      auto cp = compute->parameters();
      for (size_t i = 0; i < mp.size(); ++i) cp[i].copy_(mp[i]);
    }
    compute->zero_grad();
    ref_optimizer.zero_grad();
    auto ref_loss = compute->forward(b.x, b.y);
    ref_loss.backward();
    {
      auto mp = master->parameters();
      auto cp = compute->parameters();
      for (size_t i = 0; i < mp.size(); ++i) mp[i].mutable_grad() = cp[i].grad().to(at::kFloat);
    }
    ref_optimizer.step();

    optimizer.zero_grad();
    const auto mine = rows(b.x.size(0), W, 0, 1, r);
    auto loss = sharded(b.x.index_select(0, mine), b.y.index_select(0, mine));
    loss.backward();
    optimizer.step();
    auto global = loss.detach().to(at::kDouble).reshape({1});
    world().all_reduce(global, dist::ReduceOp::avg);
    REQUIRE(global.item().toDouble() == Approx(ref_loss.item().toDouble()).epsilon(1e-2));
  }
  auto scope = sharded.full_parameters();
  auto ref = master->named_parameters();
  double diff2 = 0, update2 = 0;
  for (const auto& p : sharded->named_parameters()) {
    REQUIRE(p.value().scalar_type() == at::kBFloat16);  // computes in bfloat16...
    const auto& want = ref[p.key()];
    diff2 += (p.value().detach().to(at::kFloat) - want.detach().to(at::kBFloat16).to(at::kFloat)).pow(2).sum().item().toDouble();
    update2 += (want.detach() - initial[p.key()]).pow(2).sum().item().toDouble();
  }
  for (const auto& p : sharded.parameters()) REQUIRE(p.scalar_type() == at::kFloat);  // ...masters stay float32
  const double relative = std::sqrt(diff2 / update2);
  if (r == 0) std::printf("  bf16 parity: |theta - theta_ref| / |theta_ref - theta_0| = %.3g (tolerance 0.05)\n", relative);
  REQUIRE(relative <= 0.05);
}
}  // namespace

TEST_CASE("GPT, FullShard + BF16Mixed: parity with unsharded mixed-precision training", "[parity][gpt][bf16]") {
  check_bf16_parity(GptConfig{}, 5);
}

TEST_CASE("offload_model / reload_model and optimizer-state moves between steps keep training equal", "[parity][offload]") {
  const GptConfig c;
  ParityRun run{.clip = 1.0, .tolerance = f32_tolerance};
  run.after_step = [](core::ShardedModel& m, torch::optim::Optimizer& opt) {
    m.offload_model();
    move_optimizer_state(opt, at::kCPU);
    for (size_t i = 0; i < m.num_units(); ++i) REQUIRE(m.unit(i).shard_device().is_cpu());
    m.reload_model();
    move_optimizer_state(opt, at::kCPU);  // this machine's device is the CPU
  };
  check_parity<Fsdp<Gpt, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<BlockImpl>>>(
      [&] { return Gpt(c); }, gpt_batches(c), run);
}

namespace {
// Returns activations (no loss) and has a second entry point besides forward.
struct ChainImpl : torch::nn::Module {
  ChainImpl() {
    stem = register_module("stem", torch::nn::Linear(20, 24));
    for (int i = 0; i < 3; ++i) blocks.push_back(register_module("r" + std::to_string(i), test::ResBlock(24)));
  }
  at::Tensor forward(const at::Tensor& x) {
    auto h = stem(x);
    for (auto& b : blocks) h = fsdpx::forward(b, h);
    return h;
  }
  /// A method other than forward that uses the units (as generate() would).
  at::Tensor score(const at::Tensor& x) { return forward(x).pow(2).mean(1); }
  torch::nn::Linear stem{nullptr};
  std::vector<test::ResBlock> blocks;
};
TORCH_MODULE(Chain);
}  // namespace

TEST_CASE("other methods run under the protocol; inputs and outputs follow the precision policy", "[core][bf16]") {
  at::manual_seed(5);
  Chain reference;
  at::manual_seed(5);
  using Policy = MixedPrecision<dtype::bf16, dtype::f32, dtype::f32>;  // compute bf16, outputs float32
  Fsdp<Chain, FullShard, NoOffload, Policy, ShardedStateDict, WrapModules<ResBlockImpl>> sharded(Chain(), world());
  at::manual_seed(6);
  const auto x = at::randn({4, 20});  // float32 input: cast to bfloat16 at each unit
  at::Tensor got;
  {
    at::NoGradGuard no_grad;
    got = sharded.call(&ChainImpl::score, x);
  }
  REQUIRE(got.scalar_type() == at::kFloat);
  const auto want = reference->score(x).detach();
  // bfloat16 compute through 4 layers: ~1% relative.
  REQUIRE(at::allclose(got, want, 3e-2, 1e-2));
  // Units are resharded after the call; only the root (kept until backward, as in FSDP2) is full.
  REQUIRE(sharded.sharded_bytes().unsharded == sharded.sharded().unit(0).unsharded_bytes());
}

TEST_CASE("GPT, FullShard, accumulation without sync", "[parity][gpt]") {
  const GptConfig c;
  check_parity<Fsdp<Gpt, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<BlockImpl>>>(
      [&] { return Gpt(c); }, gpt_batches(c), {.micro_steps = 2, .no_sync = true, .clip = 1.0, .tolerance = f32_tolerance});
}

TEST_CASE("GPT, HybridShard + CpuOffload, reduce every micro-step", "[parity][gpt][hybrid][offload]") {
  const GptConfig c;
  FsdpOptions options;
  options.shard_size = world().size() % 2 == 0 ? 2 : world().size();
  check_parity<Fsdp<Gpt, HybridShard<>, CpuOffload<>, FullPrecision, ShardedStateDict, WrapModules<BlockImpl>>>(
      [&] { return Gpt(c); }, gpt_batches(c), {.micro_steps = 2, .clip = 1.0, .tolerance = f32_tolerance}, options);
}
