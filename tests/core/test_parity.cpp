// Parity: fsdpx training equals unsharded training on the same global batch (AdamW, 5 steps, each
// compared from the same weights within the bounds of tests/support/step_parity.hpp), for each mesh
// policy, with and without CPU offload, both gradient-accumulation modes and clipping.
// CTest runs this under mpiexec at world sizes 1-4; every rank also trains the unsharded reference.
#include <catch2/catch.hpp>

#include <cstdio>
#include <functional>
#include <map>

#include <torch/nn.h>
#include <torch/optim.h>

#include <fsdpx/fsdp.hpp>

#include "../support/mpi_world.hpp"
#include "parity.hpp"

using namespace fsdpx;
using namespace fsdpx::test;
using fsdpx::test::world;

TEST_CASE("GPT, FullShard: parity with unsharded training, clipping on", "[parity][gpt]") {
  const GptConfig c;
  check_gpt_parity<Fsdp<Gpt, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<BlockImpl>>>(
      c, {.clip = 0.5});
}

TEST_CASE("GPT with tied head, FullShard + CpuOffload, reduce every micro-step", "[parity][gpt][offload]") {
  GptConfig c;
  c.tied = true;
  check_gpt_parity<Fsdp<Gpt, FullShard, CpuOffload<>, FullPrecision, ShardedStateDict, WrapModules<BlockImpl>>>(
      c, {.micro_steps = 2, .clip = 1.0});
}

TEST_CASE("GPT, HybridShard (runtime shard size), accumulation without sync", "[parity][gpt][hybrid]") {
  const GptConfig c;
  FsdpOptions options;
  options.shard_size = world().size() % 2 == 0 ? 2 : 1;
  check_gpt_parity<Fsdp<Gpt, HybridShard<>, NoOffload, FullPrecision, ShardedStateDict, WrapModules<BlockImpl>>>(
      c, {.micro_steps = 2, .no_sync = true, .clip = 1.0}, options);
}

TEST_CASE("GPT, NoShard (plain data parallel), accumulation without sync", "[parity][gpt][noshard]") {
  const GptConfig c;
  check_gpt_parity<Fsdp<Gpt, NoShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<BlockImpl>>>(
      c, {.micro_steps = 2, .no_sync = true, .clip = 1.0});
}

TEST_CASE("GPT, FullShard, parameters kept between forward and backward", "[parity][gpt]") {
  const GptConfig c;
  FsdpOptions options;
  options.reshard_after_forward = false;
  check_gpt_parity<Fsdp<Gpt, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<BlockImpl>>>(
      c, {.clip = 1.0}, options);
}

TEST_CASE("residual MLP with never-used parameters, FullShard + CpuOffload", "[parity][mlp]") {
  check_parity<Fsdp<ResMlp, FullShard, CpuOffload<>, FullPrecision, ShardedStateDict, WrapModules<ResBlockImpl>>>(
      [] { return ResMlp(); }, mlp_batch, {.micro_steps = 2, .clip = 1.0, .forward = res_mlp_path()});
}

TEST_CASE("residual MLP, HybridShard with the shard size chosen from the parameter count", "[parity][mlp][hybrid]") {
  FsdpOptions options;
  options.auto_shard_budget_bytes = 1;  // nothing fits: the smallest shard size within a node wins
  // WrapBySize<1300>: a residual block holds ~2500 parameters, its largest child (a Linear) ~1200.
  check_parity<
      Fsdp<ResMlp, HybridShard<auto_shard_size>, NoOffload, FullPrecision, ShardedStateDict, WrapBySize<1300>>>(
      [] { return ResMlp(); }, mlp_batch, {.no_sync = false, .clip = 1.0, .forward = res_mlp_path()}, options);
}

TEST_CASE("HybridShard<auto_shard_size> counts a tensor held under two names once", "[parity][hybrid]") {
  // One 100 x 100 weight registered in the module and in a child (tied), used twice.
  struct TiedImpl : torch::nn::Module {
    TiedImpl() {
      w = register_parameter("w", at::randn({100, 100}) * 0.01);
      register_module("child", std::make_shared<torch::nn::Module>())->register_parameter("w", w);
    }
    at::Tensor forward(const at::Tensor& x) { return at::linear(at::linear(x, w), w).sum(); }
    at::Tensor w;
  };
  TORCH_MODULE(Tied);
  auto& ctx = parity_context();
  if (ctx.comm.size() % 2 != 0) return;
  Tied model;
  REQUIRE(model->parameters().size() == 2);  // LibTorch lists the tied tensor under both names
  // 16 bytes of state per parameter: 160,000 bytes once, 320,000 counted twice. A budget of 100,000
  // per rank needs 2 shards when counted once, 4 when counted twice (world size 4).
  FsdpOptions options;
  options.auto_shard_budget_bytes = 100'000;
  Fsdp<Tied, HybridShard<auto_shard_size>, NoOffload, FullPrecision, ShardedStateDict, NoWrap> sharded(model, ctx.comm,
                                                                                                       options);
  CHECK(sharded.mesh().shard_size() == std::min(2, ctx.comm.size()));
}

TEST_CASE("HybridShard<auto_shard_size> counts an inference-only model by the bytes it holds", "[parity][hybrid]") {
  auto& ctx = parity_context();
  if (ctx.comm.size() == 1) return;
  // 10,100 parameters: 161,600 bytes of state trained (16 a parameter), 20,200 frozen in bfloat16 (2). Under a
  // budget of 50,000 bytes a rank, the trained one takes the whole world as its shard group, the frozen one 1.
  FsdpOptions options;
  options.auto_shard_budget_bytes = 50'000;
  at::manual_seed(5);  // every rank builds the same values
  Fsdp<torch::nn::Linear, HybridShard<auto_shard_size>, NoOffload, BF16Mixed, ShardedStateDict, NoWrap> trained(
      torch::nn::Linear(100, 100), ctx.comm, options);
  CHECK(trained.mesh().shard_size() == ctx.comm.size());
  options.inference_only = true;
  at::manual_seed(5);
  Fsdp<torch::nn::Linear, HybridShard<auto_shard_size>, NoOffload, BF16Mixed, ShardedStateDict, NoWrap> frozen(
      torch::nn::Linear(100, 100), ctx.comm, options);
  CHECK(frozen.mesh().shard_size() == 1);
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

TEST_CASE("GPT, FullShard + BF16Mixed: parity with unsharded mixed-precision training", "[parity][gpt][bf16]") {
  check_bf16_parity(GptConfig{}, 5);
}

TEST_CASE("offload_model / reload_model and optimizer-state moves between steps keep training equal",
          "[parity][offload]") {
  const GptConfig c;
  ParityRun run{.clip = 1.0};
  run.after_step = [](core::ShardedModel& m, torch::optim::Optimizer& opt) {
    m.offload_model();
    move_optimizer_state(opt, at::kCPU);
    for (size_t i = 0; i < m.num_units(); ++i) REQUIRE(m.unit(i).shard_device().is_cpu());
    m.reload_model();
    move_optimizer_state(opt, at::kCPU);  // this machine's device is the CPU
  };
  check_gpt_parity<Fsdp<Gpt, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<BlockImpl>>>(c, run);
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
  // bfloat16 compute against float32: every stage's result (and the weights it multiplies) rounded to
  // bfloat16 on one side. The stem, 3 blocks of 4 sums each and the score's mean: 14 stages.
  const double bound = rounding::relative({.length = 48, .depth = 14, .storage = at::kBFloat16});
  const double error = (got - want).abs().max().item<double>() / want.abs().max().item<double>();
  if (world().rank() == 0)
    std::printf("  bf16 compute vs float32 through 4 units: relative error %.2e (bound %.2e)\n", error, bound);
  REQUIRE(error <= bound);
  // Units are resharded after the call; only the root (kept until backward, as in FSDP2) is full.
  REQUIRE(sharded.sharded_bytes().unsharded == sharded.sharded().unit(0).unsharded_bytes());
}

TEST_CASE("GPT, FullShard, accumulation without sync", "[parity][gpt]") {
  const GptConfig c;
  check_gpt_parity<Fsdp<Gpt, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<BlockImpl>>>(
      c, {.micro_steps = 2, .no_sync = true, .clip = 1.0});
}

TEST_CASE("GPT, HybridShard + CpuOffload, reduce every micro-step", "[parity][gpt][hybrid][offload]") {
  const GptConfig c;
  FsdpOptions options;
  options.shard_size = world().size() % 2 == 0 ? 2 : world().size();
  check_gpt_parity<Fsdp<Gpt, HybridShard<>, CpuOffload<>, FullPrecision, ShardedStateDict, WrapModules<BlockImpl>>>(
      c, {.micro_steps = 2, .clip = 1.0}, options);
}

TEST_CASE("GPT, FullShard, stepped by FusedAdamW: parity with LibTorch's AdamW", "[parity][gpt][optim]") {
  const GptConfig c;
  check_gpt_parity<Fsdp<Gpt, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<BlockImpl>>>(
      c, {.clip = 1.0, .fused_adamw = true});
}
