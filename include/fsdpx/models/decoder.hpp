// A decoder-only causal language model of the Llama family in LibTorch: LlamaForCausalLM,
// Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen2MoeForCausalLM and Qwen3MoeForCausalLM as transformers
// computes them (models/config.hpp's table of families names what differs between them). Token
// embedding, DecoderLayer x N (grouped-query attention with RoPE, a SwiGLU MLP or a mixture of SwiGLU
// experts, pre-RMSNorm residuals), a final RMSNorm and an LM head, tied to the embedding or not.
//
//   auto config = fsdpx::models::read_decoder_config(dir);
//   fsdpx::models::CausalLM model(config);                         // random weights (transformers' init)
//   auto logits = model(input_ids);                                // [batch, seq, vocab]
//
// The parts live beside this file, as transformers' modeling files keep theirs: modules.hpp (Linear,
// Embedding, RMSNorm, the MLP), attention.hpp (RoPE, masks, the attention kernels and their
// AttentionBackend), moe.hpp (the sparse MoE block, the load-balancing loss), loss.hpp (the chunked head
// losses), packing.hpp (packed batches), generation.hpp (the generation loop and its KV cache).
//
// Modules are named as transformers names them ("model.layers.3.self_attn.q_proj.weight"), so a
// checkpoint, a merge and an export carry Hugging Face's names as they are. The embedding, each
// DecoderLayer and the LM head are called through fsdpx::forward / fsdpx::call: sharded with
// Fsdp<CausalLM, ..., DecoderUnits> each is a unit of its own (as torchtitan shards them) and the root
// holds only the final norm; with WrapModules<DecoderLayerImpl> the layers are units and the
// embedding and head stay in the root; unsharded, the same code runs as a plain module.
//
// loss() and log_probs() never hold the whole logits: they run the head chunk by chunk of tokens
// (models/loss.hpp), inside the head's unit. forward, loss and log_probs take the batch's layout
// (BatchLayout: an attention mask, or packed samples); generate() samples with a KV cache, plainly or
// under Fsdp::call; attention runs on the AttentionBackend set_attention_backend() chose, and
// attention_report() says what ran.
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>

#include <fsdpx/core/deferred_init.hpp>
#include <fsdpx/core/fsdp.hpp>
#include <fsdpx/models/attention.hpp>
#include <fsdpx/models/config.hpp>
#include <fsdpx/models/generation.hpp>
#include <fsdpx/models/loss.hpp>
#include <fsdpx/models/modules.hpp>
#include <fsdpx/models/moe.hpp>
#include <fsdpx/models/packing.hpp>
#include <fsdpx/models/sequence_parallel.hpp>

namespace fsdpx::models {

/// What a layer returns: its hidden states, and a sparse layer's router logits [tokens, experts]
/// (undefined for a dense layer).
struct DecoderLayerOutput {
  at::Tensor hidden;
  at::Tensor router_logits;

  /// Its tensors for a unit's call (fsdpx::forward hooks and casts them).
  template <class Fn>
  void transform_tensors(Fn&& fn) {
    hidden = fn(std::move(hidden));
    router_logits = fn(std::move(router_logits));
  }
};

/// A causal LM's logits and, for a mixture of experts, its load-balancing loss (undefined otherwise).
struct CausalLMOutput {
  at::Tensor logits;
  at::Tensor aux_loss;

  template <class Fn>
  void transform_tensors(Fn&& fn) {
    logits = fn(std::move(logits));
    aux_loss = fn(std::move(aux_loss));
  }
};

/// One transformer layer: the FSDP unit (WrapModules<DecoderLayerImpl>). Its MLP is dense, or a
/// mixture of experts on the config's sparse layers (registered as "mlp" either way, as transformers
/// names both).
struct DecoderLayerImpl : torch::nn::Module {
  /// `attention`: the model's attention choice, shared by its layers (null: a layer's own).
  DecoderLayerImpl(const DecoderConfig& c, int64_t index, std::shared_ptr<detail::AttentionState> attention = nullptr)
      : index(index), sliding(c.is_sliding(index)) {
    input_layernorm = register_module("input_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps));
    self_attn = register_module("self_attn", Attention(c, std::move(attention)));
    post_attention_layernorm = register_module("post_attention_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps));
    if (c.is_sparse(index)) {
      moe = register_module("mlp", SparseMoeBlock(c));
    } else {
      mlp = register_module("mlp", Mlp(c));
    }
  }
  DecoderLayerOutput forward(const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin,
                             const AttentionInputs& in) {
    KvCacheLayer* cache = in.cache != nullptr ? &in.cache->layers.at(static_cast<size_t>(index)) : nullptr;
    const at::Tensor x = h + self_attn(input_layernorm(h), cos, sin, in, sliding, cache);
    if (moe) {
      auto [y, router_logits] = moe(post_attention_layernorm(x));
      return {x + y, router_logits};
    }
    return {x + mlp(post_attention_layernorm(x)), {}};
  }
  int64_t index;
  bool sliding;
  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  Attention self_attn{nullptr};
  Mlp mlp{nullptr};             // a dense layer's
  SparseMoeBlock moe{nullptr};  // a sparse layer's
};
TORCH_MODULE(DecoderLayer);

/// Embedding, layers and the final norm: hidden states [batch, seq, hidden].
struct DecoderModelImpl : torch::nn::Module {
  explicit DecoderModelImpl(const DecoderConfig& c) : config(c), rotary(c) {
    embed_tokens = register_module("embed_tokens", Embedding(c.vocab_size, c.hidden_size, c.pad_token_id));
    auto list = register_module("layers", torch::nn::ModuleList());
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      layers.emplace_back(c, i, attention);
      list->push_back(layers.back());
    }
    norm = register_module("norm", RMSNorm(c.hidden_size, c.rms_norm_eps));
  }

  /// input_ids [batch, seq] (int64). attention_mask [batch, seq]: 1 for tokens, 0 for padding
  /// (undefined: no padding). position_ids [batch or 1, seq] (undefined: 0, 1, ..., seq - 1); without
  /// an attention mask, position ids that restart at 0 describe packed samples (transformers'
  /// padding-free path): attention then stays inside each sample.
  /// With `router_logits`, a mixture of experts' sparse layers append their router logits to it.
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& attention_mask = {},
                     const at::Tensor& position_ids = {}, std::vector<at::Tensor>* router_logits = nullptr) {
    if (const auto group = attention->sequence_group()) {
      return forward_slices(input_ids, attention_mask, position_ids, nullptr, *group, router_logits);
    }
    check_input_ids(input_ids);
    const int64_t seq = input_ids.size(1);
    const auto device = input_ids.device();
    const at::Tensor mask = without_all_ones(attention_mask, seq);
    if (position_ids.defined() && !attention_mask.defined()) {  // as transformers: only without a mask
      const PackedSamples samples = PackedSamples::detect(position_ids, input_ids.size(0));
      if (!samples.empty()) return forward_packed(input_ids, samples, router_logits);
    }
    const at::Tensor positions =
        position_ids.defined() ? position_ids
                               : at::arange(seq, at::TensorOptions().dtype(at::kLong).device(device)).unsqueeze(0);
    return run_layers(input_ids, positions, causal_masks(mask, seq, device, sliding_window()), router_logits);
  }

  /// Packed samples (models/packing.hpp) in the rows of input_ids [batch, seq]: RoPE positions restart
  /// at each sample and attention stays inside it. (Not a forward overload: a module holder's call
  /// needs one forward.)
  at::Tensor forward_packed(const at::Tensor& input_ids, const PackedSamples& samples,
                            std::vector<at::Tensor>* router_logits = nullptr) {
    if (const auto group = attention->sequence_group()) {
      return forward_slices(input_ids, {}, {}, &samples, *group, router_logits);
    }
    check_input_ids(input_ids);
    const int64_t batch = input_ids.size(0), seq = input_ids.size(1);
    samples.check_shape("DecoderModel", batch, seq);
    const at::Tensor positions = samples.position_ids(input_ids.device());
    if (static_cast<int64_t>(samples.spans().size()) == batch) {  // one sample per row: plain causal attention
      return run_layers(input_ids, positions, causal_masks({}, seq, input_ids.device(), sliding_window()),
                        router_logits);
    }
    AttentionInputs in;
    in.samples = std::make_shared<const PackedSamples>(samples);
    in.sliding_window = sliding_window();
    return run_layers(input_ids, positions, in, router_logits);
  }

  /// Sequence parallelism: input_ids [batch, t] is this rank's slice (tokens [r t, (r + 1) t)) of rows
  /// of P t tokens, and so are attention_mask and position_ids; `samples` (or position ids that restart)
  /// describe the whole rows, where a sample may cross a slice. Attention sees the whole rows.
  /// `agreed`: the caller has run agree_on_slices on these arguments (CausalLM's loss and log-probs,
  /// which check their labels with it), so the group's check is not made twice.
  at::Tensor forward_slices(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                            const at::Tensor& position_ids, const PackedSamples* samples,
                            const dist::AnyCommunicator& group, std::vector<at::Tensor>* router_logits,
                            bool agreed = false) {
    if (!agreed) agree_on_slices(input_ids, attention_mask, position_ids, samples, group);
    const int64_t batch = input_ids.size(0), seq = input_ids.size(1), whole = seq * group.size();
    const auto device = input_ids.device();
    at::Tensor positions = position_ids.defined() ? position_ids
                                                  : at::arange(group.rank() * seq, (group.rank() + 1) * seq,
                                                               at::TensorOptions().dtype(at::kLong).device(device))
                                                        .unsqueeze(0);
    PackedSamples detected;  // as without the group: position ids that restart, without a mask, are packed samples
    if (samples == nullptr && position_ids.defined() && !attention_mask.defined()) {
      detected = PackedSamples::detect(gather_sequence(position_ids, group), batch);
      samples = &detected;
    }
    if (samples != nullptr && !samples->empty()) {
      samples->check_shape("DecoderModel (the whole rows of a sequence group)", batch, whole);
      if (!position_ids.defined()) positions = samples->position_ids(device).narrow(1, group.rank() * seq, seq);
      if (static_cast<int64_t>(samples->spans().size()) != batch) {
        AttentionInputs in;
        in.samples = std::make_shared<const PackedSamples>(*samples);
        in.sliding_window = sliding_window();
        return run_layers(input_ids, positions, in, router_logits);
      }
    }
    const at::Tensor mask =
        attention_mask.defined() ? without_all_ones(gather_sequence(attention_mask, group), whole) : at::Tensor();
    return run_layers(input_ids, positions, causal_masks(mask, whole, device, sliding_window()), router_logits);
  }

  /// Collective over the group, before any exchange: this rank checks its slice (and runs the caller's
  /// `more_checks` of its other arguments); then every rank throws if one found a problem with its own
  /// inputs (that rank its own error), or if the ranks passed different layouts (rows, tokens, a mask
  /// or not, position ids, other packed samples), naming the rank and what differs.
  void agree_on_slices(const at::Tensor& input_ids, const at::Tensor& attention_mask, const at::Tensor& position_ids,
                       const PackedSamples* samples, const dist::AnyCommunicator& group,
                       const std::function<void()>& more_checks = {}) const {
    const std::exception_ptr problem = detail::problem_of([&] {
      check_input_ids(input_ids);
      const int64_t batch = input_ids.size(0), seq = input_ids.size(1);
      FSDPX_CHECK(!attention_mask.defined() || attention_mask.sizes() == input_ids.sizes(),
                  "DecoderModel: attention_mask must be this rank's slice ", input_ids.sizes(), ", not ",
                  attention_mask.sizes());
      FSDPX_CHECK(!position_ids.defined() || (position_ids.dim() == 2 && position_ids.size(1) == seq &&
                                              (position_ids.size(0) == 1 || position_ids.size(0) == batch)),
                  "DecoderModel: position_ids must be this rank's slice [batch or 1, ", seq, "], not ",
                  position_ids.sizes());
      if (samples != nullptr && !samples->empty())
        samples->check_shape("DecoderModel (the whole rows of a sequence group)", batch, seq * group.size());
      if (more_checks) more_checks();
    });
    std::vector<int64_t> facts(5, -1);
    if (!problem) {
      uint32_t packing = 0;
      if (samples != nullptr && !samples->empty())
        packing = ::fsdpx::detail::Crc32c::of(samples->spans().data(), samples->spans().size() * sizeof(SampleSpan));
      facts = {input_ids.size(0), input_ids.size(1), attention_mask.defined() ? 1 : 0,
               position_ids.defined() ? position_ids.size(0) : 0, packing};
    }
    detail::check_group_agrees(
        group, "DecoderModel (sequence parallel)", facts,
        {"rows", "tokens per slice", "an attention mask (1: yes)", "position ids of rows", "packed samples (crc)"},
        input_ids.device(), problem);
  }

  /// Generation: hidden states of the new tokens input_ids [batch, n] after the `cache.length` tokens
  /// `cache` holds, whose keys and values it then holds too. key_mask [batch, cache.length + n]: 1 for
  /// tokens, 0 for padding (undefined: none); position_ids [batch, n].
  at::Tensor forward_cached(const at::Tensor& input_ids, KvCache& cache, const at::Tensor& key_mask,
                            const at::Tensor& position_ids) {
    check_input_ids(input_ids);
    FSDPX_CHECK(!attention->sequence_group(),
                "DecoderModel: generation runs without sequence parallelism; set_sequence_group(std::nullopt) first");
    // A recomputation in backward (activation checkpointing) would append to the cache again.
    FSDPX_CHECK(!at::GradMode::is_enabled(),
                "DecoderModel::forward_cached runs without gradients (at::NoGradGuard): "
                "the cache is written in place");
    FSDPX_CHECK(cache.layers.size() == layers.size(), "DecoderModel: a KV cache of ", cache.layers.size(),
                " layers for a model of ", layers.size());
    AttentionInputs in = cached_masks(key_mask, cache.length, input_ids.size(1), input_ids.device(), sliding_window());
    in.cache = &cache;
    at::Tensor h = run_layers(input_ids, position_ids, in);
    cache.length += input_ids.size(1);
    return h;
  }

  at::Tensor run_layers(const at::Tensor& input_ids, const at::Tensor& positions, const AttentionInputs& in,
                        std::vector<at::Tensor>* router_logits = nullptr) {
    at::Tensor h = fsdpx::forward(embed_tokens, input_ids);
    const auto [cos, sin] = rotary.cos_sin(positions, h.scalar_type());
    for (auto& layer : layers) {
      DecoderLayerOutput out = fsdpx::forward(layer, h, cos, sin, in);
      h = std::move(out.hidden);
      if (router_logits != nullptr && out.router_logits.defined())
        router_logits->push_back(std::move(out.router_logits));
    }
    return norm(h);
  }

  /// The sliding layers' window; 0 when no layer slides.
  int64_t sliding_window() const {
    const bool any = std::any_of(config.sliding_layers.begin(), config.sliding_layers.end(), [](bool b) { return b; });
    return any ? config.sliding_window : 0;
  }

  DecoderConfig config;
  Rotary rotary;
  std::shared_ptr<detail::AttentionState> attention = std::make_shared<detail::AttentionState>();  // the layers'
  Embedding embed_tokens{nullptr};
  std::vector<DecoderLayer> layers;
  RMSNorm norm{nullptr};
};
TORCH_MODULE(DecoderModel);

/// The units of a sharded CausalLM as torchtitan cuts it: the embedding, each layer and the LM head
/// (a tied head is the embedding's unit), so the root holds only the final norm:
///   Fsdp<CausalLM, FullShard, NoOffload, BF16Mixed, ShardedStateDict, DecoderUnits, CheckpointNames<"model.layers.*">>
using DecoderUnits = WrapModules<DecoderLayerImpl, EmbeddingImpl, LmHeadImpl>;

/// FsdpOptions::reshard_after_forward_for that keeps the LM head gathered from forward to backward:
/// it runs last in forward and first in backward, so resharding it would gather it again at once
/// (FSDP2 keeps its last unit so). Costs one head's full parameters for that time.
inline bool reshard_all_but_head(const std::string& unit) { return unit != "lm_head"; }

/// The causal LM: logits [batch, seq, vocab] over DecoderModel's hidden states.
struct CausalLMImpl : torch::nn::Module {
  /// Random weights, initialized as transformers initializes them (not under deferred_init: Fsdp then
  /// initializes each unit with FsdpOptions::init_module, e.g. models::init_module(config)).
  explicit CausalLMImpl(DecoderConfig c) : config(std::move(c)) {
    model = register_module("model", DecoderModel(config));
    if (!config.tie_word_embeddings)
      lm_head = register_module("lm_head", LmHead(config.hidden_size, config.vocab_size));
    if (!in_deferred_init()) reset_parameters();
  }

  /// Runs fn(head weight, args...) under the head's unit: the LM head's, or the embedding's when tied.
  template <class Fn, class... Args>
  auto with_head(Fn fn, const Args&... args) {
    if (config.tie_word_embeddings) {
      return fsdpx::call(
          model->embed_tokens, [fn](Embedding& e, const auto&... a) { return fn(e->weight, a...); }, args...);
    }
    return fsdpx::call(lm_head, [fn](LmHead& head, const auto&... a) { return fn(head->weight, a...); }, args...);
  }

  /// Logits [batch, seq, vocab] (all of them: for generation or inspection; training uses loss()).
  /// `layout`: an attention mask [batch, seq] (1 on tokens, 0 on padding), packed samples
  /// (models/packing.hpp), or nothing. position_ids [batch or 1, seq] (undefined: 0, 1, ..., seq - 1);
  /// position ids that restart at 0, without a mask, describe packed samples too (transformers'
  /// padding-free path).
  at::Tensor forward(const at::Tensor& input_ids, const BatchLayout& layout = {}, const at::Tensor& position_ids = {}) {
    return head(hidden_states(input_ids, layout, position_ids));
  }

  /// The LM head over hidden states (the embedding's weight when tied), under the head's unit.
  at::Tensor head(const at::Tensor& hidden) {
    return with_head([](const at::Tensor& weight, const at::Tensor& h) { return at::linear(h, weight); }, hidden);
  }

  /// Mean next-token cross-entropy as transformers' causal LM loss: labels [batch, seq] are the input
  /// ids (shifted inside), -100 ignored, computed in float32 chunk by chunk of tokens (chunk_logits).
  /// With packed samples, no sample's last token is trained to predict the next sample's first.
  /// A mixture of experts with output_router_logits adds router_aux_loss_coef x the load-balancing loss
  /// (over the tokens the attention mask keeps; every token of packed rows), as transformers does.
  at::Tensor loss(const at::Tensor& input_ids, const at::Tensor& labels, const BatchLayout& layout = {}) {
    if (const auto group = model->attention->sequence_group())
      return sequence_parallel_loss(input_ids, labels, layout, *group);
    at::Tensor shifted = shift_labels(labels).to(input_ids.device());
    if (layout.packed()) {
      shifted = shifted.masked_fill(within_samples(*layout.samples, 0, shifted.size(1), shifted.device()).logical_not(),
                                    -100);
    }
    // Asked before the layers run, read at the head: no host stall in the step (LabelCheck).
    auto labels_checked = std::make_shared<const LabelCheck>(shifted, config.vocab_size, -100);
    std::vector<at::Tensor> router_logits;
    const at::Tensor hidden = hidden_states(input_ids, layout, {}, aux_wanted() ? &router_logits : nullptr);
    return with_aux(head_loss(hidden, shifted, std::move(labels_checked)), router_logits, layout.attention_mask);
  }

  /// Logits and, for a mixture of experts, the load-balancing loss of this forward (undefined for a
  /// dense model): transformers' output.logits and output.aux_loss with output_router_logits=True.
  /// Under sequence parallelism, this slice's logits and its share of the rows' load-balancing loss.
  CausalLMOutput forward_with_aux_loss(const at::Tensor& input_ids, const BatchLayout& layout = {}) {
    std::vector<at::Tensor> router_logits;
    const at::Tensor logits = head(hidden_states(input_ids, layout, {}, &router_logits));
    return {logits, load_balancing_loss(router_logits, config.moe.num_experts, config.moe.num_experts_per_tok,
                                        layout.attention_mask, sequence_group())};
  }

  /// RL's per-token log-probabilities of the given next tokens: [batch, seq - 1] float32, position t
  /// holding log p(input_ids[t + 1] | input_ids[..t]) (and the entropy of that distribution when
  /// asked), computed chunk by chunk of tokens. Positions after padding hold values to be masked; with
  /// packed samples, a sample's last position (whose next token is another sample's) holds 0 (mask
  /// with samples.next_token_mask()). Under sequence parallelism, this slice's positions: [batch, t]
  /// (the last rank's [batch, t - 1]), so that the group's, laid end to end, are the whole rows'.
  TokenLogProbs log_probs(const at::Tensor& input_ids, const BatchLayout& layout = {},
                          const LogProbOptions& options = {}) {
    const auto check = [&] {
      FSDPX_CHECK(input_ids.dim() == 2 && input_ids.size(1) >= 2,
                  "CausalLM::log_probs: input_ids must be [batch, seq] "
                  "with seq >= 2 (each position's next token is its target), not ",
                  input_ids.sizes());
    };
    const auto group = sequence_group();
    if (group) {  // every rank's own checks, then the group's agreement: no rank throws alone into an exchange
      model->agree_on_slices(input_ids, layout.attention_mask, {}, layout.samples.get(), *group, check);
    } else {
      check();
    }
    const int64_t seq = input_ids.size(1);
    int64_t first = 0, n = seq - 1;  // this slice's first position in the rows, how many have a target here
    at::Tensor targets;
    if (group) {
      first = group->rank() * seq;
      n = group->rank() + 1 < group->size() ? seq : seq - 1;
      targets = next_across_slices(input_ids, *group, 0).narrow(1, 0, n);
    } else {
      targets = input_ids.narrow(1, 1, n);
    }
    LogProbOptions checked = options;  // asked before the layers run, read at the head (LabelCheck)
    checked.targets_checked = std::make_shared<const LabelCheck>(targets, config.vocab_size);
    const at::Tensor hidden =
        group ? model->forward_slices(input_ids, layout.attention_mask, {}, layout.samples.get(), *group, nullptr,
                                      /*agreed=*/true)
              : hidden_states(input_ids, layout);
    TokenLogProbs r = head_log_probs(hidden.narrow(1, 0, n), targets, checked);
    if (layout.packed()) {
      const at::Tensor outside = within_samples(*layout.samples, first, n, r.log_probs.device()).logical_not();
      r.log_probs = r.log_probs.masked_fill(outside, 0.0);
      if (r.entropy.defined()) r.entropy = r.entropy.masked_fill(outside, 0.0);
    }
    return r;
  }

  /// The forward of packed samples under its old name. Deprecated: forward(input_ids, samples).
  [[deprecated("fsdpx: use forward(input_ids, samples)")]] at::Tensor forward_packed(const at::Tensor& input_ids,
                                                                                     const PackedSamples& samples) {
    return forward(input_ids, samples);
  }
  /// Deprecated: loss(input_ids, labels, samples).
  [[deprecated("fsdpx: use loss(input_ids, labels, samples)")]] at::Tensor loss_packed(const at::Tensor& input_ids,
                                                                                       const at::Tensor& labels,
                                                                                       const PackedSamples& samples) {
    return loss(input_ids, labels, samples);
  }
  /// Deprecated: log_probs(input_ids, samples, options).
  [[deprecated("fsdpx: use log_probs(input_ids, samples, options)")]] TokenLogProbs log_probs_packed(
      const at::Tensor& input_ids, const PackedSamples& samples, const LogProbOptions& options = {}) {
    return log_probs(input_ids, samples, options);
  }

  /// The final norm's output [batch, seq, hidden] for a batch of either layout.
  at::Tensor hidden_states(const at::Tensor& input_ids, const BatchLayout& layout, const at::Tensor& position_ids = {},
                           std::vector<at::Tensor>* router_logits = nullptr) {
    if (layout.packed()) {
      FSDPX_CHECK(!position_ids.defined(), "CausalLM: packed samples carry their own positions; pass no position_ids");
      return model->forward_packed(input_ids, *layout.samples, router_logits);
    }
    return model->forward(input_ids, layout.attention_mask, position_ids, router_logits);
  }

  bool aux_wanted() const { return config.moe.output_router_logits && config.moe.num_experts > 0; }
  at::Tensor with_aux(const at::Tensor& loss, const std::vector<at::Tensor>& router_logits,
                      const at::Tensor& attention_mask) const {
    if (router_logits.empty()) return loss;
    return loss + config.moe.router_aux_loss_coef * load_balancing_loss(router_logits, config.moe.num_experts,
                                                                        config.moe.num_experts_per_tok, attention_mask,
                                                                        sequence_group());
  }

  /// [batch, n] bool: true at positions [first, first + n) of the rows whose next token is in the same
  /// packed sample (the rows' last position: false).
  static at::Tensor within_samples(const PackedSamples& samples, int64_t first, int64_t n, c10::Device device) {
    return at::constant_pad_nd(samples.next_token_mask(device), {0, 1}, 0).narrow(1, first, n);
  }

  /// Mean cross-entropy of the head over hidden states against already-shifted labels (-100 ignored),
  /// whose range check may have been asked already.
  at::Tensor head_loss(const at::Tensor& hidden, const at::Tensor& shifted_labels,
                       std::shared_ptr<const LabelCheck> labels_checked = nullptr,
                       LossReduction reduction = LossReduction::mean) {
    const at::Tensor shifted = shifted_labels.to(hidden.device());
    const CrossEntropyOptions ce{
        .chunk_logits = chunk_logits, .reduction = reduction, .labels_checked = std::move(labels_checked)};
    return with_head([ce](const at::Tensor& weight, const at::Tensor& h,
                          const at::Tensor& y) { return linear_cross_entropy(h, weight, y, ce); },
                     hidden, shifted);
  }

  /// log-probs (and entropy) of targets [batch, n] from the hidden states [batch, n, hidden] before them.
  TokenLogProbs head_log_probs(const at::Tensor& h, const at::Tensor& next_tokens, const LogProbOptions& options) {
    const at::Tensor targets = next_tokens.to(h.device());
    auto both = with_head(
        [options](const at::Tensor& weight, const at::Tensor& hs, const at::Tensor& t) {
          TokenLogProbs r = linear_log_probs(hs, weight, t, options);
          return std::make_tuple(r.log_probs, r.entropy);
        },
        h, targets);
    return {std::get<0>(both), std::get<1>(both)};
  }

  /// New tokens after each prompt, with a KV cache (models/generation.hpp). input_ids [batch, prompt]
  /// int64, left-padded where prompts differ in length, attention_mask [batch, prompt] 1 on tokens and 0
  /// on padding (undefined: none). Runs without gradients. Under Fsdp::call every rank runs it (each
  /// with its own prompts and the same options): each step gathers every unit, and the ranks agree
  /// when all of them are done.
  GenerateOutput generate(const at::Tensor& input_ids, const at::Tensor& attention_mask = {},
                          const GenerateOptions& options = {}) {
    return generate_tokens(*this, input_ids, attention_mask, options);
  }

  /// One generation step (models/generation.hpp's GenerativeModel): the logits [batch, vocabulary] of
  /// the token after input_ids [batch, n], which follow the tokens `cache` holds (and then it holds these).
  at::Tensor next_token_logits(const at::Tensor& input_ids, KvCache& cache, const at::Tensor& key_mask,
                               const at::Tensor& position_ids) {
    const at::Tensor hidden = model->forward_cached(input_ids, cache, key_mask, position_ids);
    return head(hidden.narrow(1, hidden.size(1) - 1, 1)).squeeze(1);
  }
  int64_t num_layers() const { return config.num_hidden_layers; }
  std::optional<int64_t> default_pad_token_id() const { return config.pad_token_id; }

  /// generate()'s checks of its inputs against the model (ConfigError naming the argument).
  void check_generate_inputs(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                             const GenerateOptions& o) const {
    check_input_ids(input_ids);
    detail::check_prompts(input_ids, attention_mask, o, config.vocab_size, config.max_position_embeddings);
  }

  /// The next token's label at each position (models/loss.hpp).
  static at::Tensor shift_labels(const at::Tensor& labels, int64_t ignore_index = -100) {
    return models::shift_labels(labels, ignore_index);
  }
  /// Mean next-token cross-entropy of whole logits (models/loss.hpp; the unchunked reference of loss()).
  static at::Tensor causal_lm_loss(const at::Tensor& logits, const at::Tensor& labels, int64_t ignore_index = -100) {
    return models::causal_lm_loss(logits, labels, ignore_index);
  }

  /// transformers' initialization of every parameter.
  void reset_parameters() {
    for (const auto& m : modules(/*include_self=*/false))
      init_decoder_module(*m, config.initializer_range);  // (no own parameters; a constructor cannot name itself)
  }

  /// The kernels attention runs on (models/attention.hpp); automatic by default.
  void set_attention_backend(AttentionBackend backend) { model->attention->request(backend); }

  /// What attention was asked to run on and what packed batches ran on, with the reason where they
  /// do not run on the fastest kernel (a line for a log: attention_report().to_string()).
  AttentionReport attention_report() const { return model->attention->report(); }

  /// Sequence parallelism (Ulysses, models/attention.hpp): the P ranks of `group` each pass the same
  /// rows' consecutive slices (rank r tokens [r t, (r + 1) t) of a sequence of P t; sequence_slice) to
  /// forward(), loss() and log_probs(), with their slices of the attention mask and position ids, or
  /// the packed samples of the whole rows; attention runs over the whole rows through two all-to-alls
  /// per layer. loss() then returns this rank's share of the rows' mean (the sum over the group is the
  /// mean), so each rank's gradients are its share too: Fsdp<CausalLM, SequenceParallel<P>> sets the
  /// group and sums them (unsharded: sum them over the group). nullopt (or a group of one) turns it off.
  /// Generation runs without it.
  void set_sequence_group(std::optional<dist::AnyCommunicator> group) {
    model->attention->set_sequence_group(std::move(group));
  }
  std::optional<dist::AnyCommunicator> sequence_group() const { return model->attention->sequence_group(); }

  /// loss() over this rank's slice of the rows: each position's label is the next token's, the last
  /// position's the first of the next rank's slice (the last rank's: none); the sum of this slice's
  /// losses over the whole group's count of labels, and this slice's share of the load-balancing loss.
  at::Tensor sequence_parallel_loss(const at::Tensor& input_ids, const at::Tensor& labels, const BatchLayout& layout,
                                    const dist::AnyCommunicator& group) {
    // Every rank's own checks first, then the group's agreement: no rank throws alone into an exchange.
    model->agree_on_slices(input_ids, layout.attention_mask, {}, layout.samples.get(), group, [&] {
      FSDPX_CHECK(labels.dim() == 2 && labels.scalar_type() == at::kLong && labels.sizes() == input_ids.sizes(),
                  "CausalLM: labels must be int64 [batch, seq] like input_ids ", input_ids.sizes(), ", not ",
                  labels.scalar_type(), " ", labels.sizes());
    });
    const int64_t seq = labels.size(1);
    at::Tensor shifted = next_across_slices(labels.to(input_ids.device()), group, -100);
    if (layout.packed()) {
      shifted = shifted.masked_fill(
          within_samples(*layout.samples, group.rank() * seq, seq, shifted.device()).logical_not(), -100);
    }
    auto labels_checked = std::make_shared<const LabelCheck>(shifted, config.vocab_size, -100);
    // The group's count of labels, on the device: dividing by it needs no host synchronization.
    at::Tensor count = shifted.ne(-100).sum().to(at::kFloat);
    dist::AnyCommunicator(group).all_reduce(count);
    std::vector<at::Tensor> router_logits;
    const at::Tensor hidden = model->forward_slices(input_ids, layout.attention_mask, {}, layout.samples.get(), group,
                                                    aux_wanted() ? &router_logits : nullptr, /*agreed=*/true);
    return with_aux(head_loss(hidden, shifted, std::move(labels_checked), LossReduction::sum) / count, router_logits,
                    layout.attention_mask);
  }

  DecoderConfig config;
  DecoderModel model{nullptr};
  LmHead lm_head{nullptr};
  /// How many logits loss() holds at once (models/loss.hpp): memory against the number of head
  /// products; 0 computes all logits at once, as transformers does.
  int64_t chunk_logits = default_chunk_logits;
};
TORCH_MODULE(CausalLM);

/// FsdpOptions::init_module for a deferred CausalLM: each module initialized as transformers does.
inline ModuleInit init_module(const DecoderConfig& c) {
  return [std = c.initializer_range](torch::nn::Module& m) { return init_decoder_module(m, std); };
}

}  // namespace fsdpx::models
