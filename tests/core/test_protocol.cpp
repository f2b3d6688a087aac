// The unit protocol on models the parity tests' GPT does not cover, each against unsharded training:
// unused parameters in every unit and an execution order unlike the registration order (reductions
// must start when each unit's backward ends, memory must stay bounded by the units in flight), a unit
// skipped on some steps, exceptions in backward and forward, ranks that built different models, and
// units chosen by name. CTest runs this under mpiexec at world sizes 1-4 (label protocol).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include <unistd.h>

#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/nn.h>
#include <torch/optim.h>

#include <fsdpx/fsdp.hpp>

#include "../support/bn_block.hpp"
#include "../support/mpi_world.hpp"
#include "parity.hpp"

using namespace fsdpx;
using namespace fsdpx::test;
using Catch::Matchers::Contains;
using fsdpx::test::world;

namespace {

/// Set by the tests: which block a forward skips (-1: none), and which step's backward or forward throws.
int g_skip_block = -1;
bool g_throw_in_backward = false;
bool g_throw_in_forward = false;

/// Identity whose backward throws while g_throw_in_backward is set (a user's exception, an OOM).
struct ThrowInBackward : torch::autograd::Function<ThrowInBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*, torch::autograd::variable_list g) {
    if (g_throw_in_backward) throw std::runtime_error("injected failure in backward");
    return g;
  }
};

/// Blocks run in `order` (not the order they are registered in), each owning a LayerNorm it never
/// uses; block 1 may be skipped, and block 2 may throw in its backward or forward.
struct ShuffledImpl : torch::nn::Module {
  explicit ShuffledImpl(int64_t blocks_n = 6, int64_t dim = 24) {
    stem = register_module("stem", torch::nn::Linear(20, dim));
    for (int64_t i = 0; i < blocks_n; ++i) blocks.push_back(register_module("r" + std::to_string(i), ResBlock(dim)));
    head = register_module("head", torch::nn::Linear(dim, 5));
    for (int64_t i = 0; i < blocks_n; ++i) order.push_back((i * 5 + 2) % blocks_n);  // 2, 1, 0, 5, 4, 3 for 6
  }
  at::Tensor forward(const at::Tensor& x, const at::Tensor& y) {
    auto h = stem(x);
    for (const int64_t b : order) {
      if (b == g_skip_block) continue;
      if (b == 2) {
        if (g_throw_in_forward) throw std::runtime_error("injected failure in forward");
        h = ThrowInBackward::apply(h);
      }
      h = fsdpx::forward(blocks[b], h);
    }
    return torch::nn::functional::cross_entropy(head(h), y);
  }
  torch::nn::Linear stem{nullptr}, head{nullptr};
  std::vector<ResBlock> blocks;
  std::vector<int64_t> order;
};
TORCH_MODULE(Shuffled);
inline rounding::Path shuffled_path() { return res_mlp_path(20, 24, 6, 5); }

using ShardedShuffled =
    Fsdp<Shuffled, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<ResBlockImpl>>;

/// The ConfigError constructing ShardedShuffled from `model` throws on this rank ("" when none).
std::string construction_error(Shuffled& model) {
  try {
    ShardedShuffled sharded(model, world());
  } catch (const fsdpx::ConfigError& e) {
    return e.what();
  }
  return {};
}

/// The bytes of the root's full parameters plus those of the `n` largest other units: the most that
/// may be unsharded at once when at most `n` units are in flight beside the root.
int64_t in_flight_bound(const core::ShardedModel& m, size_t n) {
  std::vector<int64_t> sizes;
  for (size_t i = 1; i < m.num_units(); ++i) sizes.push_back(m.unit(i).layout().padded_numel() * 4);
  std::sort(sizes.rbegin(), sizes.rend());
  int64_t bound = m.unit(0).layout().padded_numel() * 4;
  for (size_t i = 0; i < std::min(n, sizes.size()); ++i) bound += sizes[i];
  return bound;
}

/// Blocks with BatchNorm (running statistics, a batch counter) and a root buffer the model updates.
using fsdpx::test::BnBlock;
using fsdpx::test::BnBlockImpl;

struct BnMlpImpl : torch::nn::Module {
  BnMlpImpl() {
    stem = register_module("stem", torch::nn::Linear(20, 16));
    for (int i = 0; i < 3; ++i) blocks.push_back(register_module("b" + std::to_string(i), BnBlock(16)));
    head = register_module("head", torch::nn::Linear(16, 5));
    seen = register_buffer("seen", at::zeros({1}));
  }
  at::Tensor forward(const at::Tensor& x, const at::Tensor& y) {
    if (is_training()) {
      at::NoGradGuard no_grad;
      seen.add_(x.size(0));  // a buffer the model updates itself (rows seen on this rank)
    }
    auto h = stem(x);
    for (auto& b : blocks) h = fsdpx::forward(b, h);
    return torch::nn::functional::cross_entropy(head(h), y);
  }
  torch::nn::Linear stem{nullptr}, head{nullptr};
  std::vector<BnBlock> blocks;
  at::Tensor seen;
};
TORCH_MODULE(BnMlp);
/// A BnBlock sums 3 deep: fc, then its batch statistics (a mean and a variance over the rows).
inline rounding::Path bn_mlp_path() { return classifier_path(24, 3, 3); }

using ShardedBnMlp = Fsdp<BnMlp, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<BnBlockImpl>>;

Batch bn_batch(int step) {
  at::manual_seed(1000 + step);
  return {at::randn({24, 20}), at::randint(5, {24}, at::kLong)};  // 24 rows: whole slices at 1-4 ranks
}

/// Whether `t` holds the same values on every rank (rank 0's sent to all and compared), the same
/// verdict on every rank, so a failed check ends the test on all of them together.
bool same_on_every_rank(const at::Tensor& t) {
  at::Tensor rank0 = t.detach().clone();
  world().broadcast(rank0, 0);
  at::Tensor equal = at::full({1}, at::equal(rank0, t.detach()) ? 1.0 : 0.0, at::kDouble);
  world().all_reduce(equal, fsdpx::dist::ReduceOp::min);
  return equal.item<double>() == 1.0;
}

}  // namespace

TEST_CASE(
    "unused parameters in every unit and a shuffled execution order: each reduction starts when its unit's "
    "backward ends",
    "[protocol]") {
  ParityRun run{.clip = 1.0, .forward = shuffled_path()};
  run.after_step = [](core::ShardedModel& m, torch::optim::Optimizer&) {
    const StepStats& s = m.last_step_stats();
    INFO("reductions during backward " << s.reductions_during_backward << ", at its end " << s.reductions_at_end);
    // Every unit ran, and every one was reduced before backward ended: the unused LayerNorm of each
    // block held nothing back.
    CHECK(s.units_run == static_cast<int>(m.num_units()));
    CHECK(s.reductions_during_backward == s.units_run);
    CHECK(s.reductions_at_end == 0);
    // The order recorded is the execution order, not the registration order.
    CHECK(s.forward_order == std::vector<std::string>{"r2", "r1", "r0", "r5", "r4", "r3"});
    // At most two blocks are full at once (the one computing and the one prefetched), beside the root.
    INFO("peak unsharded bytes " << s.peak_unsharded_bytes << ", bound " << in_flight_bound(m, 2));
    CHECK(s.peak_unsharded_bytes <= in_flight_bound(m, 2));
    CHECK(s.peak_unsharded_bytes < in_flight_bound(m, m.num_units()));
  };
  check_parity<ShardedShuffled>([] { return Shuffled(); }, mlp_batch, run);
}

TEST_CASE(
    "a unit skipped on some steps: prefetching follows each step's order, and the skipped unit keeps its "
    "values",
    "[protocol]") {
  int step = 0;
  ParityRun run{.clip = 1.0, .forward = shuffled_path()};
  run.after_step = [&step](core::ShardedModel& m, torch::optim::Optimizer&) {
    const StepStats& s = m.last_step_stats();
    const bool skipped = step % 2 == 1;
    CHECK(s.units_run == static_cast<int>(m.num_units()) - (skipped ? 1 : 0));
    CHECK(std::count(s.forward_order.begin(), s.forward_order.end(), "r1") == (skipped ? 0 : 1));
    CHECK(s.reductions_at_end == 0);
    // A unit prefetched for the previous order but skipped is freed at the end of forward.
    CHECK(m.sharded_bytes().unsharded == 0);
    ++step;
  };
  // Steps 1 and 3 skip block 1 on every rank (the path may change per step, never per rank).
  const auto batches = [](int s) {
    g_skip_block = s % 2 == 1 ? 1 : -1;
    return mlp_batch(s);
  };
  check_parity<ShardedShuffled>([] { return Shuffled(); }, batches, run);
  g_skip_block = -1;
}

TEST_CASE("an exception in backward, and one in forward, do not poison the next step", "[protocol]") {
  auto& ctx = parity_context();
  const int W = ctx.comm.size(), r = ctx.comm.rank();
  at::manual_seed(42);
  auto reference = Shuffled();
  at::manual_seed(42);
  ShardedShuffled sharded(Shuffled(), ctx.comm);
  auto optimizer = make_adamw(sharded, adamw());
  auto ref_optimizer = reference_adamw(*reference);
  // Steps 2 and 3 fail (in backward, then in forward); the reference never sees them. Every step that
  // completes is compared with the reference's from the same weights (StepParity).
  StepParity parity(step_bounds(shuffled_path(), mlp_batch(0).y.numel()));
  for (int step = 0; step < 6; ++step) {
    const Batch b = mlp_batch(step);
    const auto mine = rows(b.x.size(0), W, 0, 1, r);
    optimizer.zero_grad();
    if (step == 2 || step == 3) {
      g_throw_in_backward = step == 2;
      g_throw_in_forward = step == 3;
      const auto fail = [&] { sharded(b.x.index_select(0, mine), b.y.index_select(0, mine)).backward(); };
      REQUIRE_THROWS_WITH(fail(), Contains("injected failure"));
      g_throw_in_backward = g_throw_in_forward = false;
      continue;
    }
    ref_optimizer.zero_grad();
    reference->forward(b.x, b.y).backward();
    sharded(b.x.index_select(0, mine), b.y.index_select(0, mine)).backward();
    step_both(parity, sharded, optimizer, *reference, ref_optimizer);
    if (step > 3) CHECK(sharded.last_step_stats().reductions_at_end == 0);
  }
  INFO(parity.summary());
  REQUIRE(parity.holds());
}

/// A block that, when asked, calls itself through fsdpx::forward inside its own forward.
struct SelfCallingImpl : torch::nn::Module {
  SelfCallingImpl() { fc = register_module("fc", torch::nn::Linear(4, 4)); }
  at::Tensor forward(const at::Tensor& x) {
    if (call_itself) {
      call_itself = false;
      torch::nn::ModuleHolder<SelfCallingImpl> self(std::dynamic_pointer_cast<SelfCallingImpl>(shared_from_this()));
      return fsdpx::forward(self, x);
    }
    return fc(x);
  }
  torch::nn::Linear fc{nullptr};
  bool call_itself = false;
};
TORCH_MODULE(SelfCalling);
struct SelfCallingNetImpl : torch::nn::Module {
  SelfCallingNetImpl() { block = register_module("block", SelfCalling()); }
  at::Tensor forward(const at::Tensor& x) { return fsdpx::forward(block, x).sum(); }
  SelfCalling block{nullptr};
};
TORCH_MODULE(SelfCallingNet);

// Issue 47: every unit transition checks where it starts (detail::move_phase). A unit called inside its
// own forward would gather over itself and free its parameters under its running caller: an error
// naming the unit and both phases, before anything is gathered, and the next step trains.
TEST_CASE("a unit called inside its own forward is refused, naming the unit and both phases", "[protocol][errors]") {
  auto& ctx = parity_context();
  at::manual_seed(7);  // every rank builds the same weights, whichever tests ran before
  Fsdp<SelfCallingNet, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<SelfCallingImpl>> sharded(
      SelfCallingNet(), ctx.comm);
  const at::Tensor x = at::ones({2, 4});
  sharded->block->call_itself = true;
  REQUIRE_THROWS_WITH(sharded(x),
                      Contains("unit 'block': pre_forward found it in phase \"forward\" but starts only from "
                               "idle, after forward, backward, reduced (to forward); a unit cannot be called "
                               "inside its own forward"));
  CHECK(sharded.sharded().stage() == core::PassStage::idle);
  sharded(x).backward();
  CHECK(sharded.sharded().stage() == core::PassStage::idle);
  CHECK(sharded.last_step_stats().forward_order == std::vector<std::string>{"block"});
}

/// A model that calls one of its two units through fsdpx::forward and the other directly.
struct DirectCallNetImpl : torch::nn::Module {
  DirectCallNetImpl() {
    through = register_module("through", ResBlock(4));
    direct = register_module("direct", ResBlock(4));
  }
  at::Tensor forward(const at::Tensor& x) { return direct(fsdpx::forward(through, x)); }
  ResBlock through{nullptr}, direct{nullptr};
};
TORCH_MODULE(DirectCallNet);

TEST_CASE("a unit called directly, not through fsdpx::forward, is named in the error", "[protocol][errors]") {
  auto& ctx = parity_context();
  at::manual_seed(7);
  Fsdp<DirectCallNet, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<ResBlockImpl>> sharded(
      DirectCallNet(), ctx.comm);
  REQUIRE_THROWS_WITH(sharded(at::ones({2, 4})),
                      Contains("a module called a sharded child directly (the root module called 'direct')") &&
                          Contains("Sharded units: direct, through"));
  CHECK(sharded.sharded().stage() == core::PassStage::idle);
}

TEST_CASE("a failed construction leaves the module as it was, usable unsharded", "[protocol][errors]") {
  const int W = world().size(), r = world().rank();
  at::manual_seed(7);
  Shuffled model;
  if (W == 1) {
    // An error found before anything changes: a parameter that cannot be sharded.
    model->blocks[3]->register_parameter("count", at::zeros({2}, at::kLong), /*requires_grad=*/false);
  } else {
    // Found only when block 3's turn comes, after the root and blocks 0-2 were sharded: the last rank
    // built block 3 with other values.
    at::NoGradGuard no_grad;
    if (r == W - 1) model->blocks[3]->b->weight.add_(1.0);
  }
  std::map<std::string, at::Tensor> before;
  for (const auto& p : model->named_parameters()) before[p.key()] = p.value().detach().clone();
  const Batch b = mlp_batch(0);
  const auto loss_before = model->forward(b.x, b.y).item<double>();

  const std::string message = construction_error(model);
  INFO(message);
  if (W == 1) {
    REQUIRE_THAT(message, Contains("'r3.count'") && Contains("only floating-point parameters"));
  } else {
    REQUIRE_THAT(message, Contains("'r3.b.weight'") && Contains("rank(s) " + std::to_string(W - 1)) &&
                              Contains("broadcast_from_rank0"));
  }
  for (const auto& p : model->named_parameters()) {
    INFO(p.key());
    REQUIRE(p.value().defined());
    REQUIRE(at::equal(p.value().detach(), before[p.key()]));
  }
  REQUIRE(model->forward(b.x, b.y).item<double>() == loss_before);
  auto loss = model->forward(b.x, b.y);
  loss.backward();  // trains unsharded
  REQUIRE(model->blocks[0]->a->weight.grad().defined());
}

TEST_CASE("background shard readers: every wait runs, the first error reaches the caller, an empty one is refused",
          "[protocol][errors]") {
  at::manual_seed(11);  // every rank builds the same values (the test may run alone)
  Shuffled model;
  bool last_waited = false;
  {
    ShardedShuffled sharded(model, world());
    core::ShardedModel& m = sharded.sharded();
    REQUIRE_THROWS_WITH(m.add_shard_reader({}), Contains("the wait function is empty"));
    std::vector<int> waited;
    m.add_shard_reader([&] { waited.push_back(1); });
    m.add_shard_reader([&] {
      waited.push_back(2);
      throw std::runtime_error("reader 2 failed");
    });
    m.add_shard_reader([&] {
      waited.push_back(3);
      throw std::runtime_error("reader 3 failed");
    });
    m.add_shard_reader([&] { waited.push_back(4); });
    REQUIRE_THROWS_WITH(m.wait_for_shard_readers(), "reader 2 failed");
    CHECK(waited == std::vector<int>{1, 2, 3, 4});
    m.wait_for_shard_readers();  // nothing left to wait for
    CHECK(waited.size() == 4);
    // One still registered when the model goes: the destructor waits for it and swallows its error.
    m.add_shard_reader([&] {
      last_waited = true;
      throw std::runtime_error("reader at teardown failed");
    });
  }
  CHECK(last_waited);
}

TEST_CASE("ranks constructed with different values: broadcast_from_rank0 makes one model", "[protocol]") {
  const int W = world().size(), r = world().rank();
  at::manual_seed(100 + r);  // every rank draws other values
  Shuffled model;
  at::manual_seed(100);
  Shuffled rank0;  // rank 0's values, built everywhere for the comparison
  FsdpOptions options;
  options.replicas = ReplicaInit::broadcast_from_rank0;
  ShardedShuffled sharded(model, world(), options);
  auto scope = sharded.full_parameters();
  auto want = rank0->named_parameters();
  for (const auto& p : sharded->named_parameters()) {
    INFO(p.key() << " on rank " << r << " of " << W);
    REQUIRE(at::equal(p.value().detach(), want[p.key()].detach()));
  }
}

TEST_CASE("ranks that built different shapes fail on every rank, naming the parameter", "[protocol][errors]") {
  const int W = world().size(), r = world().rank();
  if (W == 1) return;
  Shuffled model(6, r == W - 1 ? 32 : 24);  // the last rank has another model dimension
  const std::string message = construction_error(model);
  INFO(message);
  REQUIRE_THAT(message, Contains("the ranks built different models") && Contains("'stem.weight'") &&
                            Contains("rank(s) " + std::to_string(W - 1)));
  // Nothing was sharded: the model still trains as it is.
  const Batch b = mlp_batch(0);
  if (r != W - 1) model->forward(b.x, b.y).backward();
}

TEST_CASE("units chosen by name; a pattern or policy that matches nothing is an error", "[protocol][wrap]") {
  at::manual_seed(3);
  {
    Fsdp<Shuffled, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapNames<"r*", "head">> sharded(Shuffled(),
                                                                                                           world());
    std::vector<std::string> names;
    for (size_t i = 1; i < sharded.sharded().num_units(); ++i) names.push_back(sharded.sharded().unit(i).name());
    REQUIRE(names == std::vector<std::string>{"r0", "r1", "r2", "r3", "r4", "r5", "head"});
  }
  at::manual_seed(3);
  Shuffled model;
  using Typo = Fsdp<Shuffled, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapNames<"r*", "blocks.*">>;
  REQUIRE_THROWS_WITH((Typo(model, world())), Contains("'blocks.*'") && Contains("match no module"));
  using Nothing = Fsdp<Shuffled, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapBySize<1'000'000>>;
  REQUIRE_THROWS_WITH((Nothing(model, world())), Contains("picked no module") && Contains("allow_no_units"));
  FsdpOptions options;
  options.allow_no_units = true;
  Nothing one_unit(model, world(), options);
  REQUIRE(one_unit.sharded().num_units() == 1);
}

TEST_CASE("weight decay chosen by name and shape", "[protocol][optim]") {
  at::manual_seed(3);
  FsdpOptions options;
  options.weight_decay = [](const std::string& name, const at::Tensor& p) {
    return p.dim() >= 2 && name.rfind("stem.", 0) != 0;  // no decay for the input projection
  };
  ShardedShuffled sharded(Shuffled(), world(), options);
  for (size_t i = 0; i < sharded.sharded().num_units(); ++i) {
    for (const auto& p : sharded.sharded().unit(i).layout().params()) {
      INFO(p.name);
      CHECK(p.decay == (p.param.dim() >= 2 && p.name != "stem.weight"));
    }
  }
}

TEST_CASE(
    "LoRA adapters inside every block (base weights frozen): frozen parameters are sharded, never reduced, "
    "with no gradient or optimizer state; a forward whose graph is dropped changes nothing",
    "[protocol][lora]") {
  // A dropped graph's post-backward nodes are gone: the blocks still end their backward at their inputs.
  const bool dropped_forward = GENERATE(false, true);
  INFO("dropped forward before each step: " << dropped_forward);
  ParityRun run{.clip = 1.0, .forward = lora_net_path(), .dropped_forward = dropped_forward};
  run.after_step = [](core::ShardedModel& m, torch::optim::Optimizer& opt) {
    // Root, its frozen stem, and each block with its frozen companion.
    REQUIRE(m.num_units() == 8);
    size_t stepped = 0;
    for (size_t i = 0; i < m.num_units(); ++i) {
      const core::Unit& u = m.unit(i);
      const bool frozen = u.name().ends_with("#frozen");
      INFO(u.name());
      CHECK(u.trainable() == !frozen);
      for (const auto& p : u.layout().params()) CHECK(p.param.requires_grad() == !frozen);
      if (frozen) {
        CHECK(u.shard_grads().empty());                                                 // never reduced: no gradient
        CHECK(u.shard().numel() == u.layout().padded_numel() / m.mesh().shard_size());  // sharded
      } else {
        stepped += u.optim_params().size();
      }
    }
    CHECK(opt.state().size() == stepped);  // optimizer state only for the trainable shards
    const StepStats& s = m.last_step_stats();
    // Blocks r1 and r2 end their backward at their inputs. r0's input comes from the frozen stem and
    // needs no gradient, so nothing marks the end of its backward: it is reduced at the end, with the
    // root (whose frozen stem may be needed until then).
    CHECK(s.reductions_during_backward == 2);
    CHECK(s.reductions_at_end == 2);
  };
  check_parity<Fsdp<LoraNet, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<LoraBlockImpl>>>(
      [] { return LoraNet(); }, mlp_batch, run);
}

// Policies of a user's own: any type that satisfies the concept is a policy. Policies are compile-time
// configuration read once at construction (docs/policies.md, "What a policy is"): these two mean
// what CpuOffload<false> and FullPrecision mean, and train the same.
struct HostShardsUnpinned {
  static constexpr bool offload_to_cpu = true;
  static constexpr bool pin_memory = false;
};
struct AllFloat32 {
  static constexpr c10::ScalarType param_dtype = c10::ScalarType::Float;
  static constexpr c10::ScalarType reduce_dtype = c10::ScalarType::Float;
  static constexpr std::optional<c10::ScalarType> output_dtype{};
};
static_assert(OffloadPolicy<HostShardsUnpinned> && PrecisionPolicy<AllFloat32>);

TEST_CASE("policies of the user's own type train like the library's tags with the same values",
          "[protocol][policies]") {
  ParityRun run{.clip = 1.0, .forward = lora_net_path()};
  run.after_step = [](core::ShardedModel& m, torch::optim::Optimizer&) {
    for (size_t i = 0; i < m.num_units(); ++i) {
      INFO(m.unit(i).name());
      CHECK(m.unit(i).shard_device().is_cpu());
      CHECK(m.unit(i).options().offload_to_cpu);
      CHECK_FALSE(m.unit(i).options().pin_memory);
      CHECK(m.unit(i).options().param_dtype == at::kFloat);
    }
  };
  check_parity<Fsdp<LoraNet, FullShard, HostShardsUnpinned, AllFloat32, ShardedStateDict, WrapModules<LoraBlockImpl>>>(
      [] { return LoraNet(); }, mlp_batch, run);
}

TEST_CASE("BatchNorm: running statistics equal the unsharded reference's after training", "[protocol][buffers]") {
  // Every rank sees the whole batch, so each rank's statistics are the reference's, and averaging the
  // gradients over the ranks gives the reference's gradients: buffers and parameters must match.
  const auto policy = GENERATE(BufferSync::none, BufferSync::average, BufferSync::broadcast_from_rank0);
  INFO("buffer_sync " << static_cast<int>(policy));
  at::manual_seed(5);
  BnMlp reference;
  at::manual_seed(5);
  FsdpOptions options;
  options.buffer_sync = policy;
  ShardedBnMlp sharded(BnMlp(), world(), options);
  auto optimizer = make_adamw(sharded, adamw());
  auto ref_optimizer = reference_adamw(*reference);
  // Each step from the same weights (StepParity); the buffers are each run's own throughout. They lie on
  // the forward path (the batch statistics: two sums over the rows), and averaging the ranks' buffers is
  // one more sum over the ranks: their bound relative to their scale.
  const int64_t rows_n = bn_batch(0).y.numel();
  StepParity parity(step_bounds(bn_mlp_path(), rows_n));
  for (int step = 0; step < 5; ++step) {
    const Batch b = bn_batch(step);
    ref_optimizer.zero_grad();
    reference->forward(b.x, b.y).backward();
    optimizer.zero_grad();
    sharded(b.x, b.y).backward();
    step_both(parity, sharded, optimizer, *reference, ref_optimizer);
  }
  INFO(parity.summary());
  CHECK(parity.holds());
  const rounding::Path buffers_path = bn_mlp_path();
  const double buffer_bound = rounding::relative(
      {.length = std::max<int64_t>(buffers_path.length, world().size()), .depth = buffers_path.depth + 1});
  // Mean, variance and counter per BatchNorm, and the root's buffer.
  REQUIRE(check_buffers(sharded.sharded(), *reference, buffer_bound) == 3 * 3 + 1);
  // And in evaluation (the running statistics normalize): the same weights, their buffers within the bound.
  sharded->eval();
  reference->eval();
  const Batch b = bn_batch(99);
  const double loss = sharded(b.x, b.y).item<double>(), ref_loss = reference->forward(b.x, b.y).item<double>();
  const double loss_bound = rounding::relative(rounding::loss({buffers_path.length, buffers_path.depth + 1}, rows_n));
  INFO("evaluation loss " << loss << ", reference " << ref_loss << ", bound " << loss_bound * std::abs(ref_loss));
  REQUIRE(std::abs(loss - ref_loss) <= loss_bound * std::abs(ref_loss));
}

TEST_CASE("BatchNorm on different batches per rank: buffer_sync averages or copies rank 0's statistics",
          "[protocol][buffers]") {
  const int W = world().size(), r = world().rank();
  const Batch b = bn_batch(0);
  const auto mine = rows(b.x.size(0), W, 0, 1, r);
  at::manual_seed(6);
  BnMlp reference;
  for (const auto policy : {BufferSync::none, BufferSync::average, BufferSync::broadcast_from_rank0}) {
    at::manual_seed(6);
    FsdpOptions options;
    options.buffer_sync = policy;
    ShardedBnMlp sharded(BnMlp(), world(), options);
    sharded(b.x.index_select(0, mine), b.y.index_select(0, mine)).backward();
    // The forward synchronized the buffers it started with; the ones it updated are synchronized now,
    // as a user does before saving or evaluating.
    sharded.sync_buffers(policy);
    const auto& bn0 = sharded->blocks[0]->bn;
    INFO("buffer_sync " << static_cast<int>(policy) << ", rank " << r << " of " << W);
    if (policy == BufferSync::none) {
      if (W > 1) REQUIRE_FALSE(same_on_every_rank(bn0->running_mean));  // each rank's own batch
      continue;
    }
    for (const auto& [name, buffer] : sharded.sharded().named_buffers()) {
      INFO(name);
      REQUIRE(same_on_every_rank(buffer));
    }
    REQUIRE(sharded->seen.item<double>() == static_cast<double>(b.x.size(0) / W));  // the same everywhere
    if (policy == BufferSync::average) {
      // The first BatchNorm's input does not depend on batch statistics: the ranks' averaged running
      // mean is the one the reference computes over the whole batch.
      at::NoGradGuard no_grad;
      const at::Tensor x = reference->blocks[0]->fc(reference->stem(b.x));
      const at::Tensor want = x.mean(0) * 0.1;  // momentum 0.1 from zeros
      // Both sum stem and fc (20 and 16 terms), then the rows' mean: the ranks' means of their rows,
      // averaged over the ranks (one more sum), against one mean over all 24.
      const double bound = rounding::relative({.length = 24, .depth = 4}) * want.abs().max().item<double>();
      REQUIRE((bn0->running_mean - want).abs().max().item<double>() <= bound);
    }
  }
}

TEST_CASE("a PyTorch profiler trace shows fsdpx's phases by name", "[protocol][profiler]") {
  namespace prof = torch::autograd::profiler;
  using torch::profiler::impl::ActivityType;
  using torch::profiler::impl::ProfilerConfig;
  using torch::profiler::impl::ProfilerState;
  at::manual_seed(11);
  ShardedShuffled sharded(Shuffled(), world());
  auto optimizer = make_adamw(sharded, adamw());
  const ProfilerConfig config(ProfilerState::KINETO);
  const std::set<ActivityType> activities{ActivityType::CPU};
  prof::prepareProfiler(config, activities);
  prof::enableProfiler(config, activities);
  for (int step = 0; step < 2; ++step) {  // two training steps
    const Batch b = mlp_batch(step);
    optimizer.zero_grad();
    sharded(b.x, b.y).backward();
    sharded.clip_grad_norm_(1.0);
    optimizer.step();
  }
  const auto result = prof::disableProfiler();
  std::set<std::string> names;
  for (const auto& e : result->events()) {
    if (e.name().rfind("fsdpx::", 0) == 0) names.insert(e.name());
  }
  for (const char* phase :
       {"fsdpx::pre_forward", "fsdpx::all_gather", "fsdpx::reshard", "fsdpx::pre_backward", "fsdpx::post_backward",
        "fsdpx::reduce_scatter", "fsdpx::end_of_backward", "fsdpx::finish_reduction", "fsdpx::clip_grad_norm"}) {
    INFO(phase);
    CHECK(names.count(phase) == 1);
  }
  // The same names in the Chrome trace file that TensorBoard and Perfetto open.
  const auto path = std::filesystem::temp_directory_path() /
                    ("fsdpx_trace_rank" + std::to_string(world().rank()) + "_" + std::to_string(::getpid()) + ".json");
  result->save(path.string());
  std::ifstream in(path);
  const std::string trace((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHECK(trace.find("\"fsdpx::reduce_scatter\"") != std::string::npos);
  CHECK(trace.find("\"fsdpx::end_of_backward\"") != std::string::npos);
  std::filesystem::remove(path);
}

TEST_CASE("buffer_sync leaves a graph that saved the buffers usable: two forwards before one backward",
          "[protocol][buffers]") {
  // An eval-mode BatchNorm saves its running statistics for backward; the second forward's buffer
  // sync must not invalidate the first forward's graph (as DDP's broadcast_buffers once did).
  at::manual_seed(8);
  FsdpOptions options;
  options.buffer_sync = BufferSync::average;
  ShardedBnMlp sharded(BnMlp(), world(), options);
  sharded->eval();
  const Batch a = bn_batch(1), b = bn_batch(2);
  auto loss = sharded(a.x, a.y) + sharded(b.x, b.y);
  REQUIRE_NOTHROW(loss.backward());
  REQUIRE(sharded.sharded().unit(1).shard_grads().size() > 0);
}

namespace {

/// A communicator that forwards to another and, while `armed`, refuses every reduce-scatter, as a
/// backend that lost a peer would: every rank fails at the same collective.
struct InjectedFailure {
  bool armed = false;
};

class FailingComm : public dist::BlockingCollectives<FailingComm> {
 public:
  FailingComm(dist::AnyCommunicator inner, std::shared_ptr<InjectedFailure> failure)
      : inner_(std::move(inner)), failure_(std::move(failure)) {}
  c10::DeviceType device_type() const { return inner_.device_type(); }
  std::string_view backend_name() const { return inner_.backend_name(); }
  int rank() const { return inner_.rank(); }
  int size() const { return inner_.size(); }
  std::string_view name() const { return inner_.name(); }
  dist::Work all_gather_async(at::Tensor out, const at::Tensor& in) {
    return inner_.all_gather_async(std::move(out), in);
  }
  dist::Work gather_async(at::Tensor out, const at::Tensor& in, int root) {
    return inner_.gather_async(std::move(out), in, root);
  }
  dist::Work reduce_scatter_async(at::Tensor out, const at::Tensor& in, dist::ReduceOp op) {
    if (failure_->armed)
      throw fsdpx::CommError("injected reduce-scatter failure on communicator '" + std::string(name()) + "'");
    return inner_.reduce_scatter_async(std::move(out), in, op);
  }
  dist::Work all_to_all_async(at::Tensor out, const at::Tensor& in) {
    return inner_.all_to_all_async(std::move(out), in);
  }
  dist::Work all_to_all_v_async(at::Tensor out, const at::Tensor& in, at::IntArrayRef out_splits,
                                at::IntArrayRef in_splits) {
    return inner_.all_to_all_v_async(std::move(out), in, out_splits, in_splits);
  }
  dist::Work all_reduce_async(at::Tensor t, dist::ReduceOp op) { return inner_.all_reduce_async(std::move(t), op); }
  dist::Work broadcast_async(at::Tensor t, int root) { return inner_.broadcast_async(std::move(t), root); }
  dist::Work barrier_async() { return inner_.barrier_async(); }
  std::optional<FailingComm> split(int color, int key, std::string_view name = {}) const {
    auto child = inner_.split(color, key, name);
    if (!child) return std::nullopt;
    return FailingComm(std::move(*child), failure_);
  }

 private:
  dist::AnyCommunicator inner_;
  std::shared_ptr<InjectedFailure> failure_;
};
static_assert(dist::Communicator<FailingComm>);

using ShardedLora = Fsdp<LoraNet, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<LoraBlockImpl>>;

/// Every parameter of `m`, gathered (collective).
template <class Sharded>
std::map<std::string, at::Tensor> full_values(Sharded& m) {
  auto scope = m.full_parameters();
  std::map<std::string, at::Tensor> out;
  for (const auto& p : m->named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

/// Trains `sharded` on this rank's rows of mlp_batch(step) for the steps in `steps`.
template <class Sharded>
void train_steps(Sharded& sharded, torch::optim::Optimizer& optimizer, std::vector<int> steps) {
  const int W = world().size(), r = world().rank();
  for (const int step : steps) {
    const Batch b = mlp_batch(step);
    const auto mine = rows(b.x.size(0), W, 0, 1, r);
    optimizer.zero_grad();
    sharded(b.x.index_select(0, mine), b.y.index_select(0, mine)).backward();
    optimizer.step();
  }
}

}  // namespace

TEST_CASE(
    "a shard reader that fails at the end of backward: the pass completes, its error reaches the caller, "
    "training goes on",
    "[protocol][errors]") {
  at::manual_seed(42);
  ShardedShuffled reference(Shuffled(), world());
  auto ref_optimizer = make_adamw(reference, adamw());
  train_steps(reference, ref_optimizer, {0, 1, 2, 3, 4});

  at::manual_seed(42);
  ShardedShuffled sharded(Shuffled(), world());
  auto optimizer = make_adamw(sharded, adamw());
  train_steps(sharded, optimizer, {0, 1});
  {
    const int W = world().size(), r = world().rank();
    const Batch b = mlp_batch(2);
    const auto mine = rows(b.x.size(0), W, 0, 1, r);
    optimizer.zero_grad();
    auto loss = sharded(b.x.index_select(0, mine), b.y.index_select(0, mine));
    sharded.sharded().add_shard_reader([] { throw std::runtime_error("background reader failed"); });
    REQUIRE_THROWS_WITH(loss.backward(), Contains("background reader failed"));
    // Every collective of the pass took place on every rank and its gradients reached the shards.
    CHECK(sharded.sharded().stage() == core::PassStage::idle);
    CHECK(sharded.sharded_bytes().unsharded == 0);
    CHECK(sharded.last_step_stats().units_run == static_cast<int>(sharded.sharded().num_units()));
    optimizer.step();
  }
  train_steps(sharded, optimizer, {3, 4});
  const auto want = full_values(reference), got = full_values(sharded);
  for (const auto& [name, value] : want) {
    INFO(name);
    REQUIRE(at::equal(got.at(name), value));
  }
}

TEST_CASE("a reduction that fails at the end of backward aborts the pass: no shard changes, the next step trains",
          "[protocol][errors]") {
  const int W = world().size();
  if (W == 1) {
    SUCCEED("at one rank a shard group of one reduces without a collective: there is none to fail");
    return;
  }
  auto failure = std::make_shared<InjectedFailure>();
  const dist::AnyCommunicator comm = FailingComm(world(), failure);
  // LoraNet: block r0 (whose input needs no gradient) and the root are reduced at the end of backward.
  at::manual_seed(42);
  ShardedLora reference(LoraNet(), comm);
  auto ref_optimizer = make_adamw(reference, adamw());
  train_steps(reference, ref_optimizer, {0, 1, 3, 4});  // never sees step 2

  at::manual_seed(42);
  ShardedLora sharded(LoraNet(), comm);
  auto optimizer = make_adamw(sharded, adamw());
  train_steps(sharded, optimizer, {0, 1});
  {
    const int r = world().rank();
    const Batch b = mlp_batch(2);
    const auto mine = rows(b.x.size(0), W, 0, 1, r);
    optimizer.zero_grad();
    auto loss = sharded(b.x.index_select(0, mine), b.y.index_select(0, mine));
    // The end of backward waits for shard readers first: this one arms the failure for what follows.
    sharded.sharded().add_shard_reader([failure] { failure->armed = true; });
    REQUIRE_THROWS_WITH(loss.backward(), Contains("injected reduce-scatter failure"));
    failure->armed = false;
    CHECK(sharded.sharded().stage() == core::PassStage::idle);
    CHECK(sharded.sharded_bytes().unsharded == 0);
    for (size_t i = 0; i < sharded.sharded().num_units(); ++i) {
      INFO(sharded.sharded().unit(i).name());
      CHECK(sharded.sharded().unit(i).shard_grads().empty());  // nothing of the failed pass was applied
    }
  }
  train_steps(sharded, optimizer, {3, 4});
  const auto want = full_values(reference), got = full_values(sharded);
  for (const auto& [name, value] : want) {
    INFO(name);
    REQUIRE(at::equal(got.at(name), value));
  }
}
