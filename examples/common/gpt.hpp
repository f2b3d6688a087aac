// A GPT-2-style language model in LibTorch: token + position embeddings, pre-LayerNorm blocks of
// causal self-attention and a GELU MLP (with biases), a final LayerNorm and a tied or untied head.
// Blocks are called through fsdpx::forward, so the same model runs sharded (blocks as units) and
// unsharded. Shared by the tests, the examples and the benchmarks.
#pragma once

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include <torch/nn.h>

#include <fsdpx/core/fsdp.hpp>

namespace fsdpx::examples {

struct GptConfig {
  int64_t vocab = 61;
  int64_t seq = 16;
  int64_t dim = 32;
  int64_t heads = 4;
  int64_t layers = 3;
  bool tied = false;
};

// Through at::linear, as PyTorch's F.linear, rather than torch::nn::Linear's forward: LibTorch's
// functional linear multiplies and then adds the bias for inputs of more than two dimensions, where
// at::linear folds the bias into the product (cuBLASLt's epilogue on a GPU: one kernel, not two).
inline at::Tensor linear(const torch::nn::Linear& layer, const at::Tensor& x) {
  return at::linear(x, layer->weight, layer->bias.defined() ? std::optional<at::Tensor>(layer->bias) : std::nullopt);
}

struct BlockImpl : torch::nn::Module {
  BlockImpl(const GptConfig& c) : heads(c.heads) {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})));
    qkv = register_module("qkv", torch::nn::Linear(c.dim, 3 * c.dim));
    proj = register_module("proj", torch::nn::Linear(c.dim, c.dim));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})));
    fc = register_module("fc", torch::nn::Linear(c.dim, 4 * c.dim));
    fc2 = register_module("fc2", torch::nn::Linear(4 * c.dim, c.dim));
  }
  at::Tensor forward(const at::Tensor& x) {
    const auto B = x.size(0), T = x.size(1), C = x.size(2), hd = C / heads;
    auto q_k_v = linear(qkv, ln1(x)).view({B, T, 3, heads, hd}).permute({2, 0, 3, 1, 4});
    auto att = at::matmul(q_k_v[0], q_k_v[1].transpose(-2, -1)) / std::sqrt(static_cast<double>(hd));
    att = att.masked_fill(at::ones({T, T}, at::TensorOptions().dtype(at::kBool).device(x.device())).triu(1), -1e9);
    auto y = at::matmul(at::softmax(att, -1), q_k_v[2]).transpose(1, 2).reshape({B, T, C});
    auto h = x + linear(proj, y);
    return h + linear(fc2, torch::gelu(linear(fc, ln2(h))));
  }
  int64_t heads;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Block);

struct GptImpl : torch::nn::Module {
  explicit GptImpl(const GptConfig& c) : config(c) {
    tok = register_module("tok", torch::nn::Embedding(c.vocab, c.dim));
    pos = register_module("pos", torch::nn::Embedding(c.seq, c.dim));
    // (std::string("h") + ...: GCC 12's -Wrestrict misfires on "h" + std::string&&, GCC bug 105329)
    for (int64_t i = 0; i < c.layers; ++i)
      blocks.push_back(register_module(std::string("h") + std::to_string(i), Block(c)));
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})));
    if (!c.tied)
      head = register_module("head", torch::nn::Linear(torch::nn::LinearOptions(c.dim, c.vocab).bias(false)));
  }
  /// Mean cross-entropy of next-token prediction.
  at::Tensor forward(const at::Tensor& idx, const at::Tensor& targets) {
    return torch::nn::functional::cross_entropy(logits(idx).reshape({-1, config.vocab}).to(at::kFloat),
                                                targets.reshape({-1}));
  }
  /// Next-token logits [batch, seq, vocab] (a sharded model: call through Fsdp::call).
  at::Tensor logits(const at::Tensor& idx) {
    auto x = tok(idx) + pos(at::arange(idx.size(1), at::TensorOptions().dtype(at::kLong).device(idx.device())));
    for (auto& b : blocks) x = fsdpx::forward(b, x);
    x = ln_f(x);
    return at::linear(x, config.tied ? tok->weight : head->weight);
  }
  GptConfig config;
  torch::nn::Embedding tok{nullptr}, pos{nullptr};
  std::vector<Block> blocks;
  torch::nn::LayerNorm ln_f{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Gpt);

}  // namespace fsdpx::examples
