// Activation checkpointing (CheckpointAll, CheckpointEvery, CheckpointNames): a checkpointed unit keeps
// only its inputs in forward and recomputes its forward inside backward. Checked against the same
// model with checkpointing off (bit for bit: the recomputation runs the same kernels on the same
// values, and draws the same random numbers), against unsharded training (the parity bound), with
// dropout, LoRA, a frozen unit, an unused parameter, accumulation, HybridShard, NoShard, CpuOffload and
// BF16Mixed; an exception inside a recomputation; and the memory it saves (a counting allocator).
// CTest runs this under mpiexec at world sizes 1-4 (labels memory, checkpointing).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <map>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include <c10/core/CPUAllocator.h>
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

bool g_throw_in_recompute = false;

/// A residual block with dropout, a parameter it never uses, and a switch that makes its forward
/// throw when it runs with gradients on (which a checkpointed unit does only in its recomputation).
struct DropBlockImpl : torch::nn::Module {
  DropBlockImpl(int64_t dim, double p) {
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
    a = register_module("a", torch::nn::Linear(dim, 2 * dim));
    b = register_module("b", torch::nn::Linear(2 * dim, dim));
    drop = register_module("drop", torch::nn::Dropout(p));
    unused = register_parameter("unused", at::ones({dim}));
  }
  at::Tensor forward(const at::Tensor& x) {
    if (g_throw_in_recompute && at::GradMode::is_enabled())
      throw std::runtime_error("injected failure in recomputation");
    return x + b(drop(torch::gelu(a(norm(x)))));
  }
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear a{nullptr}, b{nullptr};
  torch::nn::Dropout drop{nullptr};
  at::Tensor unused;
};
TORCH_MODULE(DropBlock);

/// A stem, five blocks (block 1 frozen; blocks 2 and 3 called through fsdpx::call, block 3 with an undefined
/// argument and result), a head.
struct DropNetImpl : torch::nn::Module {
  explicit DropNetImpl(double p = 0.2, int64_t dim = 24, int blocks_n = 5) {
    stem = register_module("stem", torch::nn::Linear(20, dim));
    for (int i = 0; i < blocks_n; ++i) blocks.push_back(register_module("d" + std::to_string(i), DropBlock(dim, p)));
    for (auto& q : blocks[1]->parameters()) q.set_requires_grad(false);
    head = register_module("head", torch::nn::Linear(dim, 5));
  }
  at::Tensor forward(const at::Tensor& x, const at::Tensor& y) {
    auto h = stem(x);
    for (size_t i = 0; i < blocks.size(); ++i) {
      if (i == 2) {
        h = fsdpx::call(blocks[i], [](DropBlock& b, const at::Tensor& in) { return b->forward(in); }, h);
      } else if (i == 3) {
        // An undefined argument and an undefined result (an optional mask; an entropy not asked for).
        auto [out, nothing] = fsdpx::call(
            blocks[i],
            [](DropBlock& b, const at::Tensor& in, const at::Tensor& mask) {
              return std::make_tuple(b->forward(mask.defined() ? in * mask : in), at::Tensor());
            },
            h, at::Tensor());
        REQUIRE_FALSE(nothing.defined());
        h = out;
      } else {
        h = fsdpx::forward(blocks[i], h);
      }
    }
    return torch::nn::functional::cross_entropy(head(h), y);
  }
  torch::nn::Linear stem{nullptr}, head{nullptr};
  std::vector<DropBlock> blocks;
};
TORCH_MODULE(DropNet);

template <class Mesh, class Offload = NoOffload, class Precision = FullPrecision, class Checkpoint = CheckpointAll>
using ShardedDropNet =
    Fsdp<DropNet, Mesh, Offload, Precision, ShardedStateDict, WrapModules<DropBlockImpl>, Checkpoint>;

/// A BatchNorm block (running statistics, num_batches_tracked) and a buffer of its own that its forward reads
/// and advances in training, as a step counter would: what a recomputation must neither advance again nor see
/// advanced.
struct CountingBlockImpl : torch::nn::Module {
  explicit CountingBlockImpl(int64_t dim) {
    block = register_module("block", BnBlock(dim));
    calls = register_buffer("calls", at::zeros({1}));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor out = block(x) * (1.0 + 0.01 * calls);
    if (is_training()) {
      at::NoGradGuard no_grad;
      calls.add_(1);
    }
    return out;
  }
  BnBlock block{nullptr};
  at::Tensor calls;
};
TORCH_MODULE(CountingBlock);

struct BufferNetImpl : torch::nn::Module {
  explicit BufferNetImpl(int64_t dim = 24, int blocks_n = 3) {
    stem = register_module("stem", torch::nn::Linear(20, dim));
    for (int i = 0; i < blocks_n; ++i) blocks.push_back(register_module("c" + std::to_string(i), CountingBlock(dim)));
    head = register_module("head", torch::nn::Linear(dim, 5));
  }
  at::Tensor forward(const at::Tensor& x, const at::Tensor& y) {
    auto h = stem(x);
    for (auto& b : blocks) h = fsdpx::forward(b, h);
    return torch::nn::functional::cross_entropy(head(h), y);
  }
  torch::nn::Linear stem{nullptr}, head{nullptr};
  std::vector<CountingBlock> blocks;
};
TORCH_MODULE(BufferNet);

struct Trained {
  std::vector<double> losses;
  std::map<std::string, at::Tensor> params;
  std::map<std::string, at::Tensor> buffers;  // running statistics, counters
  at::Tensor eval_output;                     // the model in eval mode on the first batch, after training
  int recomputations = 0;                     // over every step
};

/// Trains a fresh model (seeded alike every time) on this rank's rows, with checkpointing on or off.
template <class Sharded, class Make>
Trained train(Make make, const std::function<Batch(int)>& batch, const ParityRun& run, bool checkpointing,
              FsdpOptions options = {}) {
  const int W = world().size(), r = world().rank();
  at::manual_seed(42);
  Sharded sharded(make(), world(), options);
  sharded.set_activation_checkpointing(checkpointing);
  auto optimizer = make_adamw(sharded, adamw());
  Trained out;
  at::manual_seed(7);  // dropout draws the same on every rank and in every run
  for (int step = 0; step < run.steps; ++step) {
    const Batch b = batch(step);
    optimizer.zero_grad();
    double loss = 0;
    for (int m = 0; m < run.micro_steps; ++m) {
      const auto mine = rows(b.x.size(0), W, m, run.micro_steps, r);
      sharded.set_requires_gradient_sync(!run.no_sync || m == run.micro_steps - 1);
      auto l = sharded(b.x.index_select(0, mine), b.y.index_select(0, mine)) / run.micro_steps;
      l.backward();
      loss += l.template item<double>();
      out.recomputations += sharded.last_step_stats().recomputations;
    }
    if (run.clip) sharded.clip_grad_norm_(*run.clip);
    optimizer.step();
    out.losses.push_back(loss);
  }
  for (const auto& b : sharded->named_buffers()) out.buffers[b.key()] = b.value().detach().clone();
  {
    at::NoGradGuard no_grad;
    sharded->eval();
    const Batch b = batch(0);
    out.eval_output = sharded(b.x, b.y).detach().clone();
    sharded->train();
  }
  auto scope = sharded.full_parameters();
  for (const auto& p : sharded->named_parameters()) out.params[p.key()] = p.value().detach().clone();
  return out;
}

/// Checkpointing on and off, otherwise alike: the same losses and parameters, bit for bit.
template <class Sharded, class Make>
void check_on_equals_off(Make make, const std::function<Batch(int)>& batch, const ParityRun& run,
                         int checkpointed_calls_per_step, FsdpOptions options = {}) {
  const Trained off = train<Sharded>(make, batch, run, false, options);
  const Trained on = train<Sharded>(make, batch, run, true, options);
  CHECK(off.recomputations == 0);
  CHECK(on.recomputations == run.steps * run.micro_steps * checkpointed_calls_per_step);
  REQUIRE(on.losses == off.losses);
  for (const auto& [name, value] : off.params) {
    INFO(name);
    REQUIRE(at::equal(on.params.at(name), value));
  }
  REQUIRE(on.buffers.size() == off.buffers.size());
  for (const auto& [name, value] : off.buffers) {
    INFO(name);
    REQUIRE(at::equal(on.buffers.at(name), value));
  }
  REQUIRE(at::equal(on.eval_output, off.eval_output));
}

}  // namespace

TEST_CASE("checkpointing on and off train alike, bit for bit: dropout, a frozen unit, an unused parameter",
          "[checkpointing]") {
  // Every block recomputes in backward, the frozen one too (its input's gradient needs it).
  check_on_equals_off<ShardedDropNet<FullShard>>([] { return DropNet(); }, mlp_batch, {.clip = 1.0}, 5);
}

TEST_CASE("checkpointing leaves buffers as one forward leaves them: BatchNorm's statistics and a counter, bit for bit",
          "[checkpointing]") {
  // Every buffer once per forward, with checkpointing as without; each unit's recomputation sees the values
  // its forward saw (the counter scales the output), so gradients, weights and eval outputs agree too.
  using Sharded = Fsdp<BufferNet, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<CountingBlockImpl>,
                       CheckpointAll>;
  check_on_equals_off<Sharded>([] { return BufferNet(); }, mlp_batch, {.steps = 4, .micro_steps = 2}, 3);
  const Trained on = train<Sharded>([] { return BufferNet(); }, mlp_batch, {.steps = 4, .micro_steps = 2}, true);
  CHECK(on.buffers.at("c0.calls").item<double>() == 8);
  CHECK(on.buffers.at("c1.block.bn.num_batches_tracked").item<int64_t>() == 8);
}

TEST_CASE("checkpointing on and off train alike: HybridShard with accumulation, NoShard, CpuOffload, BF16Mixed",
          "[checkpointing]") {
  FsdpOptions hybrid;
  hybrid.shard_size = world().size() % 2 == 0 ? 2 : 1;
  check_on_equals_off<ShardedDropNet<HybridShard<>>>([] { return DropNet(); }, mlp_batch,
                                                     {.steps = 3, .micro_steps = 2, .no_sync = true}, 5, hybrid);
  check_on_equals_off<ShardedDropNet<NoShard>>([] { return DropNet(); }, mlp_batch, {.steps = 3, .micro_steps = 2}, 5);
  check_on_equals_off<ShardedDropNet<FullShard, CpuOffload<>>>([] { return DropNet(); }, mlp_batch, {.steps = 3}, 5);
  check_on_equals_off<ShardedDropNet<FullShard, NoOffload, BF16Mixed>>([] { return DropNet(); }, mlp_batch,
                                                                       {.steps = 3}, 5);
}

TEST_CASE("checkpointing a BF16Mixed ConvNet with its BatchNorms kept in float32: on equals off, buffers too",
          "[checkpointing][precision]") {
  // Each block's recomputation gathers its float32 BatchNorm member with it and restores the running
  // statistics its forward left; the frozen mixing convolution of block 1 recomputes too.
  using Sharded =
      Fsdp<ConvBnNet, FullShard, NoOffload, BF16Mixed, ShardedStateDict, WrapModules<ConvBnBlockImpl>, CheckpointAll>;
  check_on_equals_off<Sharded>([] { return ConvBnNet(); }, conv_batch, {.steps = 3, .micro_steps = 2}, 3);
}

TEST_CASE("checkpointing a ConvNet with SyncBatchNorm: on equals off, its recomputation's all-reduces included",
          "[checkpointing][sync_batch_norm]") {
  using Sharded = Fsdp<SyncConvNet, FullShard, NoOffload, FullPrecision, ShardedStateDict,
                       WrapModules<SyncConvBlockImpl>, CheckpointAll>;
  check_on_equals_off<Sharded>([] { return SyncConvNet(); }, conv_batch, {.steps = 3}, 3);
}

TEST_CASE("checkpointing chosen per unit: every second unit, or by name", "[checkpointing]") {
  check_on_equals_off<ShardedDropNet<FullShard, NoOffload, FullPrecision, CheckpointEvery<2>>>(
      [] { return DropNet(); }, mlp_batch, {.steps = 3}, 2);  // d1 and d3
  check_on_equals_off<ShardedDropNet<FullShard, NoOffload, FullPrecision, CheckpointNames<"d0", "d4">>>(
      [] { return DropNet(); }, mlp_batch, {.steps = 3}, 2);
}

TEST_CASE("LoRA blocks checkpointed: a block whose input needs no gradient still gets its adapters' gradients",
          "[checkpointing][lora]") {
  // LoraNet's stem is frozen: block r0's input needs no gradient, so only its trainable adapters put
  // the recomputation into the graph.
  using Sharded =
      Fsdp<LoraNet, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<LoraBlockImpl>, CheckpointAll>;
  check_on_equals_off<Sharded>([] { return LoraNet(); }, mlp_batch, {.clip = 1.0}, 3);
}

TEST_CASE("checkpointed units train as unsharded training does (GPT, HybridShard with accumulation)",
          "[checkpointing][parity]") {
  const GptConfig c;
  check_gpt_parity<
      Fsdp<Gpt, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<BlockImpl>, CheckpointAll>>(
      c, {.clip = 0.5});
  FsdpOptions options;
  options.shard_size = world().size() % 2 == 0 ? 2 : 1;
  check_gpt_parity<
      Fsdp<Gpt, HybridShard<>, NoOffload, FullPrecision, ShardedStateDict, WrapModules<BlockImpl>, CheckpointAll>>(
      c, {.micro_steps = 2, .no_sync = true, .clip = 1.0}, options);
}

TEST_CASE("an exception inside a recomputation leaves the next step correct", "[checkpointing][errors]") {
  const int W = world().size(), r = world().rank();
  using Sharded = ShardedDropNet<FullShard>;
  const auto make = [] { return DropNet(0.0); };  // no dropout: a skipped forward draws nothing
  // The reference never sees step 2.
  at::manual_seed(42);
  Sharded reference(make(), world());
  reference.set_activation_checkpointing(false);
  auto ref_optimizer = make_adamw(reference, adamw());
  at::manual_seed(42);
  Sharded sharded(make(), world());
  auto optimizer = make_adamw(sharded, adamw());
  for (int step = 0; step < 5; ++step) {
    const Batch b = mlp_batch(step);
    const auto mine = rows(b.x.size(0), W, 0, 1, r);
    const auto x = b.x.index_select(0, mine), y = b.y.index_select(0, mine);
    optimizer.zero_grad();
    if (step == 2) {
      auto loss = sharded(x, y);  // the forward runs with gradients off inside the checkpointed units
      g_throw_in_recompute = true;
      REQUIRE_THROWS_WITH(loss.backward(), Contains("injected failure in recomputation"));
      g_throw_in_recompute = false;
      continue;
    }
    sharded(x, y).backward();
    optimizer.step();
    ref_optimizer.zero_grad();
    reference(x, y).backward();
    ref_optimizer.step();
    if (step > 2) CHECK(sharded.last_step_stats().recomputations == 5);
  }
  auto want_scope = reference.full_parameters();
  auto got_scope = sharded.full_parameters();
  auto want = reference->named_parameters();
  for (const auto& p : sharded->named_parameters()) {
    INFO(p.key());
    REQUIRE(at::equal(p.value(), want[p.key()]));
  }
}

TEST_CASE("checkpointing turned off for one pass, and a forward without gradients, run as usual", "[checkpointing]") {
  at::manual_seed(3);
  ShardedDropNet<FullShard> sharded(DropNet(), world());
  const Batch b = mlp_batch(0);
  {
    at::NoGradGuard no_grad;  // evaluation: nothing to recompute
    sharded(b.x, b.y);
  }
  sharded.set_activation_checkpointing(false);
  sharded(b.x, b.y).backward();
  CHECK(sharded.last_step_stats().recomputations == 0);
  sharded.set_activation_checkpointing(true);
  sharded(b.x, b.y).backward();
  CHECK(sharded.last_step_stats().recomputations == 5);
}

namespace {

/// Counts the bytes the CPU allocator has handed out and not taken back, and their peak. Never
/// destroyed: tensors it allocated may outlive a measurement.
class CountingAllocator final : public c10::Allocator {
 public:
  static CountingAllocator& instance() {
    static auto* counting = new CountingAllocator(c10::GetCPUAllocator());
    return *counting;
  }
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = real_->allocate(n);
    void* data = inner.get();
    const c10::Device device = inner.device();
    {
      std::lock_guard lock(mutex_);
      current_ += static_cast<int64_t>(n);
      peak_ = std::max(peak_, current_);
      live_.emplace(data, std::make_pair(std::move(inner), n));
    }
    return {data, data, &release, device};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
  int64_t current() {
    std::lock_guard lock(mutex_);
    return current_;
  }
  int64_t peak() {
    std::lock_guard lock(mutex_);
    return peak_;
  }
  void reset_peak() {
    std::lock_guard lock(mutex_);
    peak_ = current_;
  }

 private:
  explicit CountingAllocator(c10::Allocator* real) : real_(real) {}
  static void release(void* p) {
    if (p == nullptr) return;
    CountingAllocator& self = instance();
    c10::DataPtr inner;
    {
      std::lock_guard lock(self.mutex_);
      const auto it = self.live_.find(p);
      if (it == self.live_.end()) return;
      self.current_ -= static_cast<int64_t>(it->second.second);
      inner = std::move(it->second.first);
      self.live_.erase(it);
    }
  }
  c10::Allocator* real_;
  std::mutex mutex_;
  std::unordered_map<void*, std::pair<c10::DataPtr, size_t>> live_;
  int64_t current_ = 0, peak_ = 0;
};

/// Blocks whose activations (a 4x-wide hidden layer over 256 rows) dwarf their inputs.
struct WideBlockImpl : torch::nn::Module {
  explicit WideBlockImpl(int64_t dim) {
    a = register_module("a", torch::nn::Linear(dim, 4 * dim));
    b = register_module("b", torch::nn::Linear(4 * dim, dim));
  }
  at::Tensor forward(const at::Tensor& x) { return x + b(torch::gelu(torch::gelu(a(x)))); }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(WideBlock);

struct WideNetImpl : torch::nn::Module {
  static constexpr int64_t dim = 64, blocks_n = 8;
  WideNetImpl() {
    for (int i = 0; i < blocks_n; ++i) blocks.push_back(register_module("w" + std::to_string(i), WideBlock(dim)));
    scale = register_parameter("scale", at::ones({1}));
  }
  at::Tensor forward(const at::Tensor& x) {
    auto h = x;
    for (auto& b : blocks) h = fsdpx::forward(b, h);
    return (h * scale).square().mean();
  }
  std::vector<WideBlock> blocks;
  at::Tensor scale;
};
TORCH_MODULE(WideNet);

}  // namespace

TEST_CASE("a checkpointed model holds its units' inputs, not their activations", "[checkpointing][memory]") {
  using Sharded =
      Fsdp<WideNet, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<WideBlockImpl>, CheckpointAll>;
  constexpr int64_t rows_n = 256;
  const int64_t input_bytes = rows_n * WideNetImpl::dim * 4;
  at::manual_seed(5);
  Sharded sharded(WideNet(), world());
  const at::Tensor x = at::randn({rows_n, WideNetImpl::dim}).requires_grad_(true);
  // The peak above what is allocated before the forward, for one forward and backward.
  const auto activation_peak = [&](bool checkpointing) {
    sharded.set_activation_checkpointing(checkpointing);
    sharded(x).backward();  // warm: step buffers and caches settle
    x.mutable_grad().reset();
    CountingAllocator* counting = &CountingAllocator::instance();
    c10::Allocator* real = c10::GetCPUAllocator();
    c10::SetCPUAllocator(counting, /*priority=*/255);
    counting->reset_peak();
    const int64_t before = counting->current();
    try {
      sharded(x).backward();
    } catch (...) {
      c10::SetCPUAllocator(real, 255);
      throw;
    }
    c10::SetCPUAllocator(real, 255);
    x.mutable_grad().reset();
    return counting->peak() - before;
  };
  const int64_t off = activation_peak(false), on = activation_peak(true);
  // Without checkpointing every block keeps its activations (a, gelu, gelu: 3 x 4 x the input, plus
  // the input): about blocks x 13 inputs. With it, every block keeps its input, and one block's
  // activations exist at a time, in the recomputation: blocks + 13 inputs, plus what backward needs
  // beside them: the gradients of one block's activations (a few inputs' worth) and the pass's
  // gradient shards (reduce-scatter results and shard gradients, both kept until the step ends).
  int64_t shard_bytes = 0;
  for (size_t i = 0; i < sharded.sharded().num_units(); ++i) shard_bytes += sharded.sharded().unit(i).shard().nbytes();
  INFO("activation peak without checkpointing " << off << " B, with " << on << " B, one input " << input_bytes << " B");
  if (world().rank() == 0) {
    std::printf("  activation peak: %.2f MiB without checkpointing, %.2f MiB with (%.1f and %.1f unit inputs)\n",
                off / 1048576.0, on / 1048576.0, static_cast<double>(off) / input_bytes,
                static_cast<double>(on) / input_bytes);
  }
  CHECK(off >= WideNetImpl::blocks_n * 13 * input_bytes);
  CHECK(on <= (WideNetImpl::blocks_n + 13 + 8) * input_bytes + 2 * shard_bytes);
  CHECK(on * 3 < off);
}
