// Models for the core tests: the examples' GPT and a residual MLP. Sharded children are called
// through fsdpx::forward, so the same model trains unsharded (the reference) and sharded.
#pragma once

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include <torch/nn.h>

#include <fsdpx/core/fsdp.hpp>
#include <fsdpx/core/sync_batch_norm.hpp>

#include "../../examples/common/gpt.hpp"
#include "../support/rounding.hpp"

namespace fsdpx::test {

using examples::Block;
using examples::BlockImpl;
using examples::Gpt;
using examples::GptConfig;
using examples::GptImpl;

/// The GPT's rounding path (tests/support/rounding.hpp): per block two LayerNorms (a mean and a variance
/// each), qkv, the attention scores (over a head's dimension), the softmax's denominator and the values
/// (over positions), proj, fc and fc2; then ln_f, the head and the log-softmax over the vocabulary.
inline rounding::Path gpt_path(const GptConfig& c) {
  return {.length = std::max({4 * c.dim, c.vocab, c.seq}), .depth = 11 * c.layers + 4};
}

/// A classifier of residual blocks (ResMlp, LoraNet and the protocol tests' models): the stem, the sums
/// of each block one after another, the head and the cross-entropy's log-softmax. `widest`: the longest
/// sum (a layer's input width or the classes).
inline rounding::Path classifier_path(int64_t widest, int64_t blocks, int64_t sums_per_block) {
  return {.length = widest, .depth = sums_per_block * blocks + 3};
}

/// The classifiers' forward: a stem in the root, each block a unit, the head and the loss in the root.
template <class Blocks>
at::Tensor stem_blocks_head_loss(torch::nn::Linear& stem, Blocks& blocks, torch::nn::Linear& head, const at::Tensor& x,
                                 const at::Tensor& y) {
  auto h = stem(x);
  for (auto& b : blocks) h = fsdpx::forward(b, h);
  return torch::nn::functional::cross_entropy(head(h), y);
}

/// Second architecture: a residual MLP classifier. Each block owns a LayerNorm it never uses, so
/// those parameters get no gradient (a unit with parameters missing gradients).
struct ResBlockImpl : torch::nn::Module {
  explicit ResBlockImpl(int64_t dim) {
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
    a = register_module("a", torch::nn::Linear(dim, 2 * dim));
    b = register_module("b", torch::nn::Linear(2 * dim, dim));
    unused = register_module("unused", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
  }
  at::Tensor forward(const at::Tensor& x) {
    if (probe) probe();
    return x + b(torch::relu(a(norm(x))));
  }
  /// Called at the start of every block forward (memory tests look at the sharded state there).
  static inline std::function<void()> probe;
  torch::nn::LayerNorm norm{nullptr}, unused{nullptr};
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(ResBlock);

struct ResMlpImpl : torch::nn::Module {
  explicit ResMlpImpl(int64_t in = 20, int64_t dim = 24, int64_t blocks_n = 3, int64_t classes = 5) {
    stem = register_module("stem", torch::nn::Linear(in, dim));
    for (int64_t i = 0; i < blocks_n; ++i) blocks.push_back(register_module("r" + std::to_string(i), ResBlock(dim)));
    head = register_module("head", torch::nn::Linear(dim, classes));
  }
  at::Tensor forward(const at::Tensor& x, const at::Tensor& y) {
    return stem_blocks_head_loss(stem, blocks, head, x, y);
  }
  torch::nn::Linear stem{nullptr}, head{nullptr};
  std::vector<ResBlock> blocks;
};
TORCH_MODULE(ResMlp);
/// A ResBlock sums 4 deep: its LayerNorm's mean and variance, a, b.
inline rounding::Path res_mlp_path(int64_t in = 20, int64_t dim = 24, int64_t blocks_n = 3, int64_t classes = 5) {
  return classifier_path(std::max({in, 2 * dim, classes}), blocks_n, 4);
}

/// A frozen base Linear plus a trainable low-rank update (LoRA): frozen and trainable in one module.
struct LoraLinearImpl : torch::nn::Module {
  LoraLinearImpl(int64_t in, int64_t out, int64_t rank = 2) {
    base = register_module("base", torch::nn::Linear(in, out));
    for (auto& p : base->parameters()) p.set_requires_grad(false);
    lora_a = register_parameter("lora_a", at::randn({rank, in}) * 0.1);
    lora_b = register_parameter("lora_b", at::randn({out, rank}) * 0.1);
  }
  at::Tensor forward(const at::Tensor& x) { return base(x) + at::linear(at::linear(x, lora_a), lora_b); }
  torch::nn::Linear base{nullptr};
  at::Tensor lora_a, lora_b;
};
TORCH_MODULE(LoraLinear);

struct LoraBlockImpl : torch::nn::Module {
  explicit LoraBlockImpl(int64_t d) {
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    for (auto& p : norm->parameters()) p.set_requires_grad(false);
    up = register_module("up", LoraLinear(d, 2 * d));
    down = register_module("down", LoraLinear(2 * d, d));
  }
  at::Tensor forward(const at::Tensor& x) { return x + down(torch::relu(up(norm(x)))); }
  torch::nn::LayerNorm norm{nullptr};
  LoraLinear up{nullptr}, down{nullptr};
};
TORCH_MODULE(LoraBlock);

/// A frozen stem and a trainable head in the root, LoRA in every block.
struct LoraNetImpl : torch::nn::Module {
  LoraNetImpl() {
    stem = register_module("stem", torch::nn::Linear(20, 16));
    for (auto& p : stem->parameters()) p.set_requires_grad(false);
    for (int i = 0; i < 3; ++i) blocks.push_back(register_module("r" + std::to_string(i), LoraBlock(16)));
    head = register_module("head", torch::nn::Linear(16, 5));
  }
  at::Tensor forward(const at::Tensor& x, const at::Tensor& y) {
    return stem_blocks_head_loss(stem, blocks, head, x, y);
  }
  torch::nn::Linear stem{nullptr}, head{nullptr};
  std::vector<LoraBlock> blocks;
};
TORCH_MODULE(LoraNet);
/// A LoraBlock sums 6 deep: its LayerNorm's mean and variance, then in each LoraLinear the low-rank
/// path's two products (the frozen base beside them).
inline rounding::Path lora_net_path() { return classifier_path(2 * 16, 3, 6); }

/// A 1-D residual ConvNet with BatchNorm (the first-hour user's model): a stem convolution and its
/// BatchNorm in the root, three Conv + BatchNorm blocks (block 1 with a frozen 1x1 mixing convolution),
/// and a linear head on the length-averaged features. Under BF16Mixed each block's BatchNorm is kept in
/// float32 beside its bfloat16 convolutions (FsdpOptions::keep_full_precision's default). `Norm`:
/// torch::nn::BatchNorm1d (ConvBnNet) or fsdpx::SyncBatchNorm (SyncConvNet).
struct ConvNetShape {
  static constexpr int64_t in_channels = 4, channels = 8, classes = 5, length = 16, blocks_n = 3;
};

template <class Norm>
struct ConvNormBlockImpl : torch::nn::Module {
  ConvNormBlockImpl(int64_t channels, bool frozen_mix) {
    // No bias before the BatchNorm (as conv-BN blocks do): its gradient is analytically zero.
    conv = register_module("conv",
                           torch::nn::Conv1d(torch::nn::Conv1dOptions(channels, channels, 3).padding(1).bias(false)));
    bn = register_module("bn", Norm(channels));
    if (frozen_mix) {
      mix = register_module("mix", torch::nn::Conv1d(torch::nn::Conv1dOptions(channels, channels, 1).bias(false)));
      for (auto& p : mix->parameters()) p.set_requires_grad(false);
    }
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = torch::relu(bn(conv(x)));
    if (mix) h = mix(h);
    return h + x;
  }
  torch::nn::Conv1d conv{nullptr}, mix{nullptr};
  Norm bn{nullptr};
};

template <class Norm>
struct ConvNormNetImpl : torch::nn::Module, ConvNetShape {
  using Block = torch::nn::ModuleHolder<ConvNormBlockImpl<Norm>>;
  ConvNormNetImpl() {
    stem = register_module(
        "stem", torch::nn::Conv1d(torch::nn::Conv1dOptions(in_channels, channels, 3).padding(1).bias(false)));
    stem_bn = register_module("stem_bn", Norm(channels));
    for (int64_t i = 0; i < blocks_n; ++i)
      blocks.push_back(register_module("b" + std::to_string(i), Block(channels, i == 1)));
    head = register_module("head", torch::nn::Linear(channels, classes));
  }
  at::Tensor forward(const at::Tensor& x, const at::Tensor& y) {
    at::Tensor h = torch::relu(stem_bn(stem(x)));
    for (auto& b : blocks) h = fsdpx::forward(b, h);
    return torch::nn::functional::cross_entropy(head(h.mean(2)), y);
  }
  torch::nn::Conv1d stem{nullptr};
  Norm stem_bn{nullptr};
  std::vector<Block> blocks;
  torch::nn::Linear head{nullptr};
};

using ConvBnBlockImpl = ConvNormBlockImpl<torch::nn::BatchNorm1d>;
using ConvBnNetImpl = ConvNormNetImpl<torch::nn::BatchNorm1d>;
TORCH_MODULE_IMPL(ConvBnNet, ConvBnNetImpl);
using SyncConvBlockImpl = ConvNormBlockImpl<SyncBatchNorm>;
using SyncConvNetImpl = ConvNormNetImpl<SyncBatchNorm>;
TORCH_MODULE_IMPL(SyncConvNet, SyncConvNetImpl);
/// The stem, then per block its convolution (channels x 3 terms), its batch statistics (a mean and a
/// variance over rows x length) and block 1's mixing; the length average, the head and the log-softmax.
inline rounding::Path conv_bn_net_path(int64_t rows) {
  return classifier_path(rows * ConvNetShape::length, ConvNetShape::blocks_n + 1, 4);
}

}  // namespace fsdpx::test
