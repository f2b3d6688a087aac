// Generation with a KV cache for models/decoder.hpp's CausalLM: what CausalLM::generate takes and
// returns, the cache it grows, and how it picks the next tokens (greedy, or sampled with temperature,
// top-k and top-p in transformers' order).
//
//   models::GenerateOptions options{.max_new_tokens = 64, .do_sample = true, .temperature = 0.7, .top_p = 0.9,
//                                   .eos_token_ids = {2}, .seed = 1234};
//   auto out = policy.call(&models::CausalLMImpl::generate, prompts, prompt_mask, options);   // sharded
//   auto out = model->generate(prompts, prompt_mask, options);                                 // plain
//   out.sequences;   // [batch, prompt + new] int64: the prompts, then the new tokens (pad after EOS)
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <fsdpx/error.hpp>

namespace fsdpx::models {

struct GenerateOptions {
  /// New tokens per row at most; the prompt plus these must fit the model's max_position_embeddings.
  int64_t max_new_tokens = 32;
  /// false: greedy (argmax); true: sample from softmax(logits / temperature) after top-k and top-p.
  bool do_sample = false;
  double temperature = 1.0;
  int64_t top_k = 0;   // 0: every token
  double top_p = 1.0;  // 1: every token
  /// A row ends when it generates one of these (kept in the output); none: rows run max_new_tokens.
  std::vector<int64_t> eos_token_ids;
  /// What follows a row's EOS; default: the config's pad_token_id, else the first EOS, else 0.
  std::optional<int64_t> pad_token_id;
  /// The sampler's seed: the same prompts, seed and weights give the same tokens on any world size
  /// (sampling runs on the host from the same logits on every rank).
  uint64_t seed = 0;
  /// Also return each step's logits (float32, before temperature and filtering).
  bool output_logits = false;
};

struct GenerateOutput {
  at::Tensor sequences;          // [batch, prompt + steps] int64: the prompts as given, then the new tokens
  at::Tensor generated_lengths;  // [batch] int64: new tokens of each row, its EOS included, padding not
  at::Tensor logits;             // [batch, steps, vocabulary] float32, with GenerateOptions::output_logits
};

/// One layer's cached keys and values: [batch, kv_heads, capacity, head_dim] each, after RoPE,
/// allocated at the layer's first call and written in place as tokens arrive.
struct KvCacheLayer {
  at::Tensor keys, values;
};

/// The keys and values of every layer for the tokens seen so far. A step's new tokens go to
/// [length, length + n) of each layer's tensors; the cache never re-runs the prompt.
struct KvCache {
  KvCache(int64_t layers, int64_t capacity) : layers(static_cast<size_t>(layers)), capacity(capacity) {}
  std::vector<KvCacheLayer> layers;
  int64_t capacity;
  int64_t length = 0;  // tokens cached so far (in every layer, between steps)
};

namespace detail {

/// Checks GenerateOptions against the model and the prompt.
inline void check_generate_options(const GenerateOptions& o, int64_t prompt_length, int64_t max_positions) {
  FSDPX_CHECK(o.max_new_tokens >= 0, "generate: max_new_tokens must be >= 0, not ", o.max_new_tokens);
  FSDPX_CHECK(prompt_length + o.max_new_tokens <= max_positions, "generate: max_new_tokens = ", o.max_new_tokens,
              " after a prompt of ", prompt_length, " tokens exceeds the model's max_position_embeddings of ", max_positions);
  if (o.do_sample) {
    FSDPX_CHECK(std::isfinite(o.temperature) && o.temperature > 0, "generate: temperature must be finite and > 0 when "
                "sampling, not ", o.temperature);
    FSDPX_CHECK(o.top_k >= 0, "generate: top_k must be >= 0 (0: off), not ", o.top_k);
    FSDPX_CHECK(o.top_p > 0 && o.top_p <= 1, "generate: top_p must be in (0, 1], not ", o.top_p);
  }
}

/// The next token of each row from its logits [batch, vocabulary] (float32, on the host): argmax, or
/// a draw after transformers' TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper.
inline at::Tensor select_next_tokens(at::Tensor logits, const GenerateOptions& o, at::Generator& generator) {
  if (!o.do_sample) return logits.argmax(-1);
  constexpr double minus_inf = -std::numeric_limits<double>::infinity();
  if (o.temperature != 1.0) logits = logits / o.temperature;
  const int64_t vocabulary = logits.size(-1);
  if (o.top_k > 0 && o.top_k < vocabulary) {
    const at::Tensor kth = std::get<0>(logits.topk(o.top_k, -1)).narrow(-1, o.top_k - 1, 1);
    logits = logits.masked_fill(logits < kth, minus_inf);
  }
  if (o.top_p < 1.0) {
    // Drop the least likely tokens whose mass together is at most 1 - top_p; always keep the likeliest.
    const auto [sorted, order] = logits.sort(-1, /*descending=*/false);
    const at::Tensor remove_sorted = sorted.softmax(-1).cumsum(-1) <= (1.0 - o.top_p);
    remove_sorted.narrow(-1, vocabulary - 1, 1).fill_(false);
    logits = logits.masked_fill(at::zeros_like(remove_sorted).scatter(-1, order, remove_sorted), minus_inf);
  }
  return at::multinomial(logits.softmax(-1), 1, /*replacement=*/false, generator).squeeze(-1);
}

}  // namespace detail

}  // namespace fsdpx::models
