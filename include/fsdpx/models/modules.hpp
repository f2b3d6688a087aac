// The small modules a decoder layer is made of, as transformers' modeling files define them: a linear
// map, the LM head, the token embedding, RMSNorm and the SwiGLU MLP, each with transformers'
// initialization (init_decoder_module).
//
// They are this header's own rather than torch::nn's: torch::nn::Linear initializes its weights in its
// constructor, which for a model built only to be loaded (or built under deferred_init) is a wasted
// pass over every parameter. Here parameters are created uninitialized and reset_parameters fills them.
#pragma once

#include <cstdint>
#include <optional>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <fsdpx/error.hpp>
#include <fsdpx/models/config.hpp>

namespace fsdpx::models {

/// y = x W^T (+ b), as torch.nn.Linear; parameters are created uninitialized (reset_parameters fills them).
struct LinearImpl : torch::nn::Module {
  LinearImpl(int64_t in_features, int64_t out_features, bool bias) {
    weight = register_parameter("weight", at::empty({out_features, in_features}));
    if (bias) this->bias = register_parameter("bias", at::empty({out_features}));
  }
  at::Tensor forward(const at::Tensor& x) { return at::linear(x, weight, bias); }
  /// transformers' _init_weights: weight ~ N(0, std), bias = 0.
  void reset_parameters(double std) {
    at::NoGradGuard no_grad;
    weight.normal_(0.0, std);
    if (bias.defined()) bias.zero_();
  }
  at::Tensor weight, bias;
};
TORCH_MODULE(Linear);

/// The LM head: a Linear without bias, of a type of its own so that a wrap policy can make it a unit
/// (DecoderUnits) without picking every projection.
struct LmHeadImpl : LinearImpl {
  LmHeadImpl(int64_t hidden, int64_t vocabulary) : LinearImpl(hidden, vocabulary, /*bias=*/false) {}
};
TORCH_MODULE(LmHead);

/// Token embedding, as torch.nn.Embedding with padding_idx: the padding row gets no gradient.
struct EmbeddingImpl : torch::nn::Module {
  EmbeddingImpl(int64_t num_embeddings, int64_t dim, std::optional<int64_t> padding_idx) {
    weight = register_parameter("weight", at::empty({num_embeddings, dim}));
    if (padding_idx) this->padding_idx = *padding_idx < 0 ? *padding_idx + num_embeddings : *padding_idx;
  }
  at::Tensor forward(const at::Tensor& ids) { return at::embedding(weight, ids, padding_idx); }
  void reset_parameters(double std) {
    at::NoGradGuard no_grad;
    weight.normal_(0.0, std);
    if (padding_idx >= 0) weight[padding_idx].zero_();
  }
  at::Tensor weight;
  int64_t padding_idx = -1;
};
TORCH_MODULE(Embedding);

/// The token ids a decoder takes: int64 [batch, seq].
inline void check_input_ids(const at::Tensor& input_ids) {
  FSDPX_CHECK(input_ids.defined() && input_ids.dim() == 2 && input_ids.scalar_type() == at::kLong,
              "DecoderModel: input_ids must be int64 [batch, seq], not ",
              input_ids.defined() ? input_ids.toString() : "undefined", " ",
              input_ids.defined() ? input_ids.sizes() : at::IntArrayRef{});
}

/// Root-mean-square normalization as transformers computes it: in float32, cast back to the input's
/// dtype, then scaled by the gain.
struct RMSNormImpl : torch::nn::Module {
  RMSNormImpl(int64_t dim, double eps) : eps(eps) { weight = register_parameter("weight", at::empty({dim})); }
  at::Tensor forward(const at::Tensor& x) {
    const auto dtype = x.scalar_type();
    const at::Tensor h = x.to(at::kFloat);
    return weight * (h * at::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps)).to(dtype);
  }
  void reset_parameters() {
    at::NoGradGuard no_grad;
    weight.fill_(1.0);
  }
  at::Tensor weight;
  double eps;
};
TORCH_MODULE(RMSNorm);

/// SwiGLU: down(silu(gate(x)) * up(x)).
struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(const DecoderConfig& c) : MlpImpl(c.hidden_size, c.intermediate_size, c.mlp_bias) {}
  MlpImpl(int64_t hidden, int64_t intermediate, bool bias) {
    gate_proj = register_module("gate_proj", Linear(hidden, intermediate, bias));
    up_proj = register_module("up_proj", Linear(hidden, intermediate, bias));
    down_proj = register_module("down_proj", Linear(intermediate, hidden, bias));
  }
  at::Tensor forward(const at::Tensor& x) { return down_proj(at::silu(gate_proj(x)) * up_proj(x)); }
  Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(Mlp);

/// transformers' initialization of one of this header's modules (Linear, Embedding: N(0,
/// initializer_range); biases 0; RMSNorm gains 1). False for other modules.
inline bool init_decoder_module(torch::nn::Module& m, double std) {
  if (auto* l = dynamic_cast<LinearImpl*>(&m)) {
    l->reset_parameters(std);
  } else if (auto* e = dynamic_cast<EmbeddingImpl*>(&m)) {
    e->reset_parameters(std);
  } else if (auto* n = dynamic_cast<RMSNormImpl*>(&m)) {
    n->reset_parameters();
  } else {
    return false;
  }
  return true;
}

}  // namespace fsdpx::models
