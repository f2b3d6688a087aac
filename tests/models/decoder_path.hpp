// The Hugging Face decoder's rounding path (tests/support/rounding.hpp), and the bounds of the values the
// model tests compare. tests/support/rounding.py mirrors it for the Python tests (export_test.py checks
// that the two agree).
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>

#include <fsdpx/models.hpp>

#include "../support/rounding.hpp"
#include "../support/step_parity.hpp"

namespace fsdpx::test {

/// The sums from the token ids to the logits over `positions` positions. Per layer: the input RMSNorm,
/// q/k/v, the per-head q/k norms where the family has them, the attention scores, the softmax's
/// denominator and its weighted values, o, the second RMSNorm; then the dense MLP (gate and up, down) or
/// the experts (the router, its softmax, the top-k renormalization, gate and up, down, the weighted
/// combination). Then the final norm, the head and the log-softmax.
inline rounding::Path decoder_path(const models::DecoderConfig& c, int64_t positions,
                                   at::ScalarType storage = at::kFloat) {
  int64_t depth = 3;
  for (int64_t layer = 0; layer < c.num_hidden_layers; ++layer)
    depth += 7 + (c.qk_norm ? 1 : 0) + (c.is_sparse(layer) ? 6 : 2);
  const int64_t length =
      std::max({c.hidden_size, c.intermediate_size, c.moe.moe_intermediate_size, c.moe.shared_expert_intermediate_size,
                c.moe.num_experts, c.num_attention_heads * c.head_dim, c.vocab_size, positions});
  return {.length = length, .depth = depth, .storage = storage};
}

/// Bound on max |logits - logits'| / max |logits'| (and on per-token log-probabilities, the last stage of
/// the path) for two computations of the decoder over `positions` positions.
inline double logits_bound(const models::DecoderConfig& c, int64_t positions, at::ScalarType storage = at::kFloat) {
  return rounding::relative(decoder_path(c, positions, storage));
}

/// Bound on |loss - loss'| / |loss'| for the mean cross-entropy over `tokens` tokens.
inline double loss_bound(const models::DecoderConfig& c, int64_t positions, int64_t tokens) {
  return rounding::relative(rounding::loss(decoder_path(c, positions), tokens));
}

/// Bound on each gradient element, relative to the largest of its tensor, for a loss over `tokens`.
inline double gradient_bound(const models::DecoderConfig& c, int64_t positions, int64_t tokens,
                             at::ScalarType storage = at::kFloat) {
  return rounding::relative(rounding::backward(decoder_path(c, positions, storage), tokens));
}

/// StepParity's bounds for training the decoder on batches of `tokens` tokens over `positions` positions.
inline StepBounds decoder_step_bounds(const models::DecoderConfig& c, int64_t positions, int64_t tokens) {
  return {.loss = loss_bound(c, positions, tokens), .gradient = gradient_bound(c, positions, tokens)};
}

/// The layer of a decoder's parameter ("model.layers.3" for "model.layers.3.mlp.up_proj.weight"; "" for the
/// embedding, the final norm and the head): a gradient's rounding is relative to the terms it sums, which
/// are of the size of its layer's gradients (StepParity::note_reference_gradients says why).
inline std::string layer_of(const std::string& name) {
  const std::string prefix = "model.layers.";
  if (name.rfind(prefix, 0) != 0) return "";
  return name.substr(0, name.find('.', prefix.size()));
}

/// The largest gradient difference, relative to the largest gradient element of the tensor's layer.
inline double max_gradient_error(const std::map<std::string, at::Tensor>& got,
                                 const std::map<std::string, at::Tensor>& want) {
  std::map<std::string, double> scale;
  for (const auto& [name, g] : want)
    scale[layer_of(name)] = std::max(scale[layer_of(name)], g.abs().max().item<double>());
  double worst = 0;
  for (const auto& [name, g] : want) {
    const double error = (got.at(name) - g).abs().max().item<double>();
    if (error > 0) worst = std::max(worst, error / scale.at(layer_of(name)));
  }
  return worst;
}

}  // namespace fsdpx::test
