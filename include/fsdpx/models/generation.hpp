// Generation with a KV cache for models/decoder.hpp's CausalLM: what CausalLM::generate takes and
// returns, the cache it grows, how it picks the next tokens (greedy, or sampled with temperature,
// top-k and top-p in transformers' order), and the loop itself (generate_tokens, as transformers'
// GenerationMixin stands apart from its models).
//
//   models::GenerateOptions options{.max_new_tokens = 64, .do_sample = true, .temperature = 0.7, .top_p = 0.9,
//                                   .eos_token_ids = {2}, .seed = 1234};
//   auto out = policy.call(&models::CausalLMImpl::generate, prompts, prompt_mask, options);   // sharded
//   auto out = model->generate(prompts, prompt_mask, options);                                 // plain
//   out.sequences;   // [batch, prompt + new] int64: the prompts, then the new tokens (pad after EOS)
#pragma once

#include <concepts>
#include <cstdint>
#include <exception>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/module.h>

#include <fsdpx/core/fsdp.hpp>
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
              " after a prompt of ", prompt_length, " tokens exceeds the model's max_position_embeddings of ",
              max_positions);
  if (o.do_sample) {
    FSDPX_CHECK(std::isfinite(o.temperature) && o.temperature > 0,
                "generate: temperature must be finite and > 0 when "
                "sampling, not ",
                o.temperature);
    FSDPX_CHECK(o.top_k >= 0, "generate: top_k must be >= 0 (0: off), not ", o.top_k);
    FSDPX_CHECK(o.top_p > 0 && o.top_p <= 1, "generate: top_p must be in (0, 1], not ", o.top_p);
  }
}

/// generate()'s checks of the prompts and options against a model of `vocabulary` tokens and
/// `max_positions` positions (ConfigError naming the argument).
inline void check_prompts(const at::Tensor& input_ids, const at::Tensor& attention_mask, const GenerateOptions& o,
                          int64_t vocabulary, int64_t max_positions) {
  FSDPX_CHECK(input_ids.size(0) > 0 && input_ids.size(1) > 0,
              "generate: input_ids must hold at least one token per row, not ", input_ids.sizes());
  FSDPX_CHECK(!attention_mask.defined() || attention_mask.sizes() == input_ids.sizes(),
              "generate: attention_mask must be [batch, prompt] = ", input_ids.sizes(), ", not ",
              attention_mask.sizes());
  check_generate_options(o, input_ids.size(1), max_positions);
  const auto in_vocabulary = [&](int64_t id, const char* what) {
    FSDPX_CHECK(id >= 0 && id < vocabulary, "generate: ", what, " ", id, " is outside the vocabulary of ", vocabulary);
  };
  for (const int64_t id : o.eos_token_ids) in_vocabulary(id, "eos_token_ids holds");
  if (o.pad_token_id) in_vocabulary(*o.pad_token_id, "pad_token_id");
  FSDPX_CHECK(input_ids.min().item<int64_t>() >= 0 && input_ids.max().item<int64_t>() < vocabulary,
              "generate: input_ids hold a token outside the vocabulary of ", vocabulary);
  if (attention_mask.defined()) {
    // The next token follows the last column: a right-padded prompt would continue from padding.
    const at::Tensor last = attention_mask.select(1, attention_mask.size(1) - 1);
    FSDPX_CHECK(last.ne(0).all().item<bool>(),
                "generate: the prompts must be left-padded (attention_mask's last column is 0 in row ",
                last.eq(0).nonzero().select(1, 0)[0].item<int64_t>(), ")");
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

/// What generate_tokens needs of a model: a torch::nn::Module that checks its inputs, and that turns
/// new tokens after those in a KV cache into next-token logits (models/decoder.hpp's CausalLMImpl).
template <class M>
concept GenerativeModel = std::derived_from<M, torch::nn::Module> &&
                          requires(M& m, const M& cm, const at::Tensor& t, KvCache& cache, const GenerateOptions& o) {
                            { cm.check_generate_inputs(t, t, o) };  // ConfigError naming the argument
                            { m.next_token_logits(t, cache, t, t) } -> std::same_as<at::Tensor>;  // [batch, vocabulary]
                            { cm.num_layers() } -> std::convertible_to<int64_t>;
                            { cm.default_pad_token_id() } -> std::convertible_to<std::optional<int64_t>>;
                          };

/// New tokens after each prompt, with a KV cache: CausalLM::generate's loop (its comment says what the
/// arguments are). Runs without gradients and in eval mode (restored after). Under Fsdp::call every
/// rank runs it, and the ranks agree on every decision that changes how many unit calls follow: the
/// inputs' checks, each step's "all rows finished", each step's sampling failure.
template <GenerativeModel Model>
GenerateOutput generate_tokens(Model& model, const at::Tensor& input_ids, const at::Tensor& attention_mask,
                               const GenerateOptions& options) {
  // Checked on every rank, and agreed, before the first unit call: a rank that threw here while the
  // others gathered units would leave them waiting.
  std::string refused;
  try {
    model.check_generate_inputs(input_ids, attention_mask, options);
  } catch (const Error& e) {
    refused = e.what();
  }
  if (!on_every_rank(model, refused.empty())) {
    FSDPX_CHECK(!refused.empty(),
                "generate: another rank's inputs were refused (its error says why); no rank generated");
    throw ConfigError(refused);
  }
  const int64_t batch = input_ids.size(0), prompt = input_ids.size(1);
  at::NoGradGuard no_grad;
  // Dropout off while generating, as transformers' generate runs in eval mode; the mode is restored.
  struct EvalScope {
    torch::nn::Module& m;
    bool was_training;
    ~EvalScope() { m.train(was_training); }
  } eval_scope{model, model.is_training()};
  model.eval();
  const auto device = input_ids.device();
  const auto longs = at::TensorOptions().dtype(at::kLong).device(device);
  const int64_t pad = options.pad_token_id.value_or(
      model.default_pad_token_id().value_or(options.eos_token_ids.empty() ? 0 : options.eos_token_ids.front()));
  const at::Tensor prompt_mask = attention_mask.defined() ? attention_mask.to(longs) : at::ones({batch, prompt}, longs);
  // Positions as transformers counts them for left padding: from 0 at each row's first token.
  at::Tensor positions = (prompt_mask.cumsum(-1) - 1).masked_fill(prompt_mask == 0, 1);
  const bool padded = !prompt_mask.all().item<bool>();
  at::Tensor key_mask;
  if (padded) {
    key_mask = at::ones({batch, prompt + options.max_new_tokens}, longs);
    key_mask.narrow(1, 0, prompt).copy_(prompt_mask);
  }
  const at::Tensor eos = at::tensor(options.eos_token_ids, at::TensorOptions().dtype(at::kLong));
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(options.seed);
  KvCache cache(model.num_layers(), prompt + options.max_new_tokens);
  at::Tensor finished = at::zeros({batch}, at::TensorOptions().dtype(at::kBool));
  at::Tensor lengths = at::zeros({batch}, at::TensorOptions().dtype(at::kLong));
  std::vector<at::Tensor> new_tokens, step_logits;
  at::Tensor step = input_ids;
  for (int64_t i = 0; i < options.max_new_tokens; ++i) {
    if (on_every_rank(model, finished.all().item<bool>())) break;
    const int64_t n = step.size(1);
    const at::Tensor mask = padded ? key_mask.narrow(1, 0, cache.length + n) : at::Tensor();
    const at::Tensor logits = model.next_token_logits(step, cache, mask, positions).to(at::kFloat).to(at::kCPU);
    if (options.output_logits) step_logits.push_back(logits);
    // A draw can fail on one rank alone (its logits turned NaN): every rank learns it before the next step.
    at::Tensor next;
    std::string failed;
    try {
      next = detail::select_next_tokens(logits, options, generator).masked_fill(finished, pad);
    } catch (const std::exception& e) {
      failed = e.what();
    }
    if (!on_every_rank(model, failed.empty())) {
      throw Error(failed.empty() ? std::string("fsdpx: generate: sampling failed on another rank; no rank goes on")
                                 : "fsdpx: generate: sampling step " + std::to_string(i) + " failed: " + failed);
    }
    lengths += finished.logical_not().to(at::kLong);
    if (eos.numel() > 0) finished = finished | at::isin(next, eos);
    new_tokens.push_back(next);
    positions = positions.narrow(1, n - 1, 1) + 1;
    step = next.to(device).unsqueeze(1);
  }
  GenerateOutput out;
  out.sequences = new_tokens.empty() ? input_ids : at::cat({input_ids, at::stack(new_tokens, 1).to(device)}, 1);
  out.generated_lengths = lengths.to(device);
  if (options.output_logits && !step_logits.empty()) out.logits = at::stack(step_logits, 1).to(device);
  return out;
}

}  // namespace fsdpx::models
