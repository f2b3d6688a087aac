// Models for the core tests: the examples' GPT and a residual MLP. Sharded children are called
// through fsdpx::forward, so the same model trains unsharded (the reference) and sharded.
#pragma once

#include <cmath>
#include <vector>

#include <torch/nn.h>

#include <fsdpx/core/fsdp.hpp>

#include "../../examples/common/gpt.hpp"

namespace fsdpx::test {

using examples::Block;
using examples::BlockImpl;
using examples::Gpt;
using examples::GptConfig;
using examples::GptImpl;

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
    auto h = stem(x);
    for (auto& b : blocks) h = fsdpx::forward(b, h);
    return torch::nn::functional::cross_entropy(head(h), y);
  }
  torch::nn::Linear stem{nullptr}, head{nullptr};
  std::vector<ResBlock> blocks;
};
TORCH_MODULE(ResMlp);

}  // namespace fsdpx::test
