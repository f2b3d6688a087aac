// A decoder-only causal language model of the Llama family in LibTorch: LlamaForCausalLM,
// Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen2MoeForCausalLM and Qwen3MoeForCausalLM as transformers
// computes them (models/config.hpp names what differs between them). Token embedding, DecoderLayer x N
// (grouped-query attention with RoPE through at::scaled_dot_product_attention, a SwiGLU MLP or a
// mixture of SwiGLU experts, pre-RMSNorm residuals), a final RMSNorm and an LM head, tied to the
// embedding or not.
//
//   auto config = fsdpx::models::read_decoder_config(dir);
//   fsdpx::models::CausalLM model(config);                         // random weights (transformers' init)
//   auto logits = model(input_ids);                                // [batch, seq, vocab]
//
// Modules are named as transformers names them ("model.layers.3.self_attn.q_proj.weight"), so a
// checkpoint, a merge and an export carry Hugging Face's names as they are. The embedding, each
// DecoderLayer and the LM head are called through fsdpx::forward / fsdpx::call: sharded with
// Fsdp<CausalLM, ..., DecoderUnits> each is a unit of its own (as torchtitan shards them) and the root
// holds only the final norm; with WrapModules<DecoderLayerImpl> the layers are units and the
// embedding and head stay in the root; unsharded, the same code runs as a plain module.
//
// loss() and log_probs() never hold the whole logits: they run the head chunk by chunk of tokens
// (models/loss.hpp), inside the head's unit.
//
// Packed batches (models/packing.hpp): forward, loss and log_probs take a PackedSamples, or position
// ids that restart at 0 for each sample; attention stays inside each sample. generate() samples with a
// KV cache (models/generation.hpp), plainly or under Fsdp::call.
//
// The projections and the embedding are this header's own small modules rather than torch::nn's:
// torch::nn::Linear initializes its weights in its constructor, which for a model built only to be
// loaded (or built under deferred_init) is a wasted pass over every parameter.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>

#include <fsdpx/core/deferred_init.hpp>
#include <fsdpx/core/fsdp.hpp>
#include <fsdpx/models/config.hpp>
#include <fsdpx/models/generation.hpp>
#include <fsdpx/models/loss.hpp>
#include <fsdpx/models/packing.hpp>

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

/// Rotary position embedding: inverse frequencies of transformers' "default", "linear" and "llama3"
/// RoPE, and the cos/sin tables for given positions, in float32 with transformers' operations.
/// Computed at first use, not in the constructor: under deferred_init every allocation of a
/// constructor shares one scratch buffer, so no tensor computed there would survive.
class Rotary {
 public:
  explicit Rotary(const DecoderConfig& c) : head_dim_(c.head_dim), rope_(c.rope) {}

  /// cos and sin [batch or 1, seq, head_dim] of `positions` [batch or 1, seq], cast to `dtype`.
  std::pair<at::Tensor, at::Tensor> cos_sin(const at::Tensor& positions, at::ScalarType dtype) const {
    const at::Tensor freqs = positions.unsqueeze(-1).to(at::kFloat) * inv_freq(positions.device());
    const at::Tensor emb = at::cat({freqs, freqs}, -1);
    return {emb.cos().to(dtype), emb.sin().to(dtype)};
  }

  /// [head_dim / 2] float32 on `device`; derived from the config (not a buffer: never saved). Kept per
  /// device, so a GPU forward does not copy it from the host (and wait for the copy) every time.
  at::Tensor inv_freq(at::Device device = at::kCPU) const {
    std::lock_guard lock(cache_->mutex);
    if (!cache_->cpu.defined()) cache_->cpu = compute();
    if (device.is_cpu()) return cache_->cpu;
    for (const auto& [d, t] : cache_->on_device) {
      if (d == device) return t;
    }
    return cache_->on_device.emplace_back(device, cache_->cpu.to(device)).second;
  }

 private:
  at::Tensor compute() const {
    const double dim = static_cast<double>(head_dim_);
    const auto& r = rope_;
    at::Tensor inv = at::pow(r.theta, at::arange(0, head_dim_, 2, at::TensorOptions().dtype(at::kLong)).to(at::kFloat) / dim)
                         .reciprocal();
    if (r.type == "linear") inv = inv / r.factor;
    if (r.type == "llama3") {
      const double old_len = static_cast<double>(r.original_max_position_embeddings);
      const double low_wavelen = old_len / r.low_freq_factor, high_wavelen = old_len / r.high_freq_factor;
      const at::Tensor wavelen = inv.reciprocal() * (2 * M_PI);
      const at::Tensor scaled = at::where(wavelen > low_wavelen, inv / r.factor, inv);
      const at::Tensor smooth = (wavelen.reciprocal() * old_len - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
      const at::Tensor smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled;
      const at::Tensor medium = at::logical_not(wavelen < high_wavelen) * at::logical_not(wavelen > low_wavelen);
      inv = at::where(medium, smoothed, scaled);
    }
    return inv.to(at::kFloat);
  }

  struct Cache {
    std::mutex mutex;
    at::Tensor cpu;
    std::vector<std::pair<at::Device, at::Tensor>> on_device;
  };
  int64_t head_dim_;
  RopeConfig rope_;
  std::shared_ptr<Cache> cache_ = std::make_shared<Cache>();  // copies share it
};

/// What the attention of one forward needs besides its tokens. Masks: undefined means "causal"
/// (SDPA's is_causal), else boolean [batch or 1, 1, queries, keys] where true attends. With packed
/// samples, each sample attends causally within itself (masks undefined). With a cache, the keys are
/// the cached ones and the new.
struct AttentionInputs {
  at::Tensor full;
  at::Tensor sliding;
  std::shared_ptr<const PackedSamples> samples;  // shared: a checkpointed layer's recomputation reads it
  int64_t sliding_window = 0;                    // of the sliding layers, with packed samples
  KvCache* cache = nullptr;                      // generation only (no gradients, so no recomputation)
};

inline at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

struct AttentionImpl : torch::nn::Module {
  explicit AttentionImpl(const DecoderConfig& c)
      : heads(c.num_attention_heads), kv_heads(c.num_key_value_heads), head_dim(c.head_dim), dropout(c.attention_dropout) {
    q_proj = register_module("q_proj", Linear(c.hidden_size, heads * head_dim, c.qkv_bias));
    k_proj = register_module("k_proj", Linear(c.hidden_size, kv_heads * head_dim, c.qkv_bias));
    v_proj = register_module("v_proj", Linear(c.hidden_size, kv_heads * head_dim, c.qkv_bias));
    o_proj = register_module("o_proj", Linear(heads * head_dim, c.hidden_size, c.o_bias));
    if (c.qk_norm) {
      q_norm = register_module("q_norm", RMSNorm(head_dim, c.rms_norm_eps));
      k_norm = register_module("k_norm", RMSNorm(head_dim, c.rms_norm_eps));
    }
  }
  /// x [batch, seq, hidden]; cos/sin [batch or 1, seq, head_dim]; `cache` this layer's keys and values
  /// of earlier tokens (generation), or null.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const AttentionInputs& in,
                     bool sliding, KvCacheLayer* cache = nullptr) {
    const int64_t batch = x.size(0), seq = x.size(1);
    at::Tensor q = q_proj(x).view({batch, seq, heads, head_dim});
    at::Tensor k = k_proj(x).view({batch, seq, kv_heads, head_dim});
    if (q_norm) {
      q = q_norm(q);
      k = k_norm(k);
    }
    q = q.transpose(1, 2);
    k = k.transpose(1, 2);
    const at::Tensor v = v_proj(x).view({batch, seq, kv_heads, head_dim}).transpose(1, 2);
    const at::Tensor c = cos.unsqueeze(1), s = sin.unsqueeze(1);
    q = q * c + rotate_half(q) * s;
    k = k * c + rotate_half(k) * s;
    at::Tensor y;
    if (in.samples) {
      y = packed_attention(q, k, v, *in.samples, sliding ? in.sliding_window : 0);
    } else if (cache != nullptr) {
      const int64_t past = in.cache->length;
      append_to_cache(*cache, k, v, past, in.cache->capacity);
      y = attend(q, cache->keys.narrow(2, 0, past + seq), cache->values.narrow(2, 0, past + seq),
                 sliding ? in.sliding : in.full);
    } else {
      y = attend(q, k, v, sliding ? in.sliding : in.full);
    }
    return o_proj(y.transpose(1, 2).reshape({batch, seq, heads * head_dim}));
  }

  /// SDPA of q [b, heads, n, d] over k, v [b, kv_heads, m, d]: causal (aligned at the start) when `mask`
  /// is undefined and n > 1, else as the mask says.
  at::Tensor attend(const at::Tensor& q, at::Tensor k, at::Tensor v, const at::Tensor& mask) const {
    // With a mask, the kernels that take one (memory-efficient) do not group heads: expand the key and
    // value heads as transformers' repeat_kv does, rather than fall back to the math kernel.
    const bool grouped = kv_heads != heads;
    if (mask.defined() && grouped) {
      const int64_t b = k.size(0), m = k.size(2), groups = heads / kv_heads;
      k = k.unsqueeze(2).expand({b, kv_heads, groups, m, head_dim}).reshape({b, heads, m, head_dim});
      v = v.unsqueeze(2).expand({b, kv_heads, groups, m, head_dim}).reshape({b, heads, m, head_dim});
    }
    return at::scaled_dot_product_attention(
        q, k, v, mask.defined() ? std::optional<at::Tensor>(mask) : std::nullopt, is_training() ? dropout : 0.0,
        /*is_causal=*/!mask.defined() && q.size(2) > 1, std::pow(static_cast<double>(head_dim), -0.5),
        /*enable_gqa=*/grouped && !mask.defined());
  }

  /// Writes the new keys and values at [past, past + n) of the layer's cache (allocated at its first use).
  static void append_to_cache(KvCacheLayer& cache, const at::Tensor& k, const at::Tensor& v, int64_t past,
                                    int64_t capacity) {
    const int64_t n = k.size(2);
    FSDPX_CHECK(past + n <= capacity, "KV cache: ", past, " cached tokens and ", n, " new exceed its capacity of ", capacity);
    if (!cache.keys.defined()) {
      cache.keys = at::empty({k.size(0), k.size(1), capacity, k.size(3)}, k.options());
      cache.values = at::empty({v.size(0), v.size(1), capacity, v.size(3)}, v.options());
    }
    cache.keys.narrow(2, past, n).copy_(k);
    cache.values.narrow(2, past, n).copy_(v);
  }

  /// Attention within each packed sample: flash-attention's variable-length kernel on CUDA where the
  /// build has it, else each sample's own causal SDPA (the work of the samples' lengths squared, not
  /// the row's). `window` > 0: a sliding-window layer's window.
  at::Tensor packed_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const PackedSamples& samples,
                              int64_t window) const {
    if (q.is_cuda()) {
      if (auto y = flash_varlen_attention(q, k, v, samples, window)) return *y;
    }
    std::vector<at::Tensor> rows, pieces;
    int64_t row = 0;
    for (const SampleSpan& s : samples.spans()) {
      if (s.row != row) {
        rows.push_back(at::cat(pieces, 2));
        pieces.clear();
        row = s.row;
      }
      const auto part = [&](const at::Tensor& t) { return t.narrow(0, s.row, 1).narrow(2, s.start, s.length); };
      at::Tensor mask;
      if (window > 0 && s.length > window) {
        const at::Tensor idx = at::arange(s.length, at::TensorOptions().dtype(at::kLong).device(q.device()));
        const at::Tensor qi = idx.unsqueeze(1), ki = idx.unsqueeze(0);
        mask = ((ki <= qi) & (ki > qi - window)).view({1, 1, s.length, s.length});
      }
      pieces.push_back(attend(part(q), part(k), part(v), mask));
    }
    rows.push_back(at::cat(pieces, 2));
    return rows.size() == 1 ? rows.front() : at::cat(rows, 0);
  }

  /// ATen's variable-length flash attention over the packed tokens, or nullopt where it cannot run
  /// (dtype, head size, a build without it): the caller then attends sample by sample.
  std::optional<at::Tensor> flash_varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                   const PackedSamples& samples, int64_t window) const {
    const auto dtype = q.scalar_type();
    if ((dtype != at::kHalf && dtype != at::kBFloat16) || head_dim % 8 != 0 || head_dim > 256 || !flash_varlen_usable()) {
      return std::nullopt;
    }
    const int64_t batch = q.size(0), seq = q.size(2);
    const auto tokens = [&](const at::Tensor& t) { return t.transpose(1, 2).reshape({batch * seq, t.size(1), head_dim}); };
    const at::Tensor cu = samples.cu_seqlens(q.device());
    try {
      const at::Tensor out = std::get<0>(at::_flash_attention_forward(
          tokens(q), tokens(k), tokens(v), cu, cu, samples.max_length(), samples.max_length(), is_training() ? dropout : 0.0,
          /*is_causal=*/true, /*return_debug_mask=*/false, std::pow(static_cast<double>(head_dim), -0.5),
          window > 0 ? std::optional<int64_t>(window - 1) : std::nullopt, window > 0 ? std::optional<int64_t>(0) : std::nullopt));
      return out.view({batch, seq, heads, head_dim}).transpose(1, 2);
    } catch (const c10::Error& e) {
      TORCH_WARN("fsdpx: variable-length flash attention failed (", e.what_without_backtrace(),
                 "); packed samples attend one by one from now on");
      flash_varlen_usable() = false;
      return std::nullopt;
    }
  }
  static std::atomic<bool>& flash_varlen_usable() {
    static std::atomic<bool> usable{true};
    return usable;
  }
  int64_t heads, kv_heads, head_dim;
  double dropout;
  Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  RMSNorm q_norm{nullptr}, k_norm{nullptr};
};
TORCH_MODULE(Attention);

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

/// How a sparse layer runs its experts over the tokens grouped by expert.
enum class ExpertKernel {
  automatic,   // grouped on CUDA in bfloat16/float16 where the sizes allow, per_expert elsewhere
  per_expert,  // each expert that received tokens: its own three products
  grouped,     // at::_grouped_mm over the experts' weights stacked for the call: two grouped products
};

/// A mixture-of-experts MLP (Qwen2-MoE, Qwen3-MoE; models/config.hpp's MoeConfig). Each expert is a
/// module of its own, named as the Hugging Face files name it ("mlp.experts.3.gate_proj.weight").
/// Tokens are grouped by expert and each expert that received tokens runs once on all of them: the
/// work of the tokens times num_experts_per_tok, whatever the number of experts. An expert that no
/// token chose runs nothing and gets no gradient (the unit protocol reduces it as unused).
struct SparseMoeBlockImpl : torch::nn::Module {
  explicit SparseMoeBlockImpl(const DecoderConfig& c) : top_k(c.moe.num_experts_per_tok), norm_topk_prob(c.moe.norm_topk_prob) {
    gate = register_module("gate", Linear(c.hidden_size, c.moe.num_experts, /*bias=*/false));
    auto list = register_module("experts", torch::nn::ModuleList());
    for (int64_t e = 0; e < c.moe.num_experts; ++e) {
      experts.emplace_back(c.hidden_size, c.moe.moe_intermediate_size, /*bias=*/false);
      list->push_back(experts.back());
    }
    if (c.moe.shared_expert_intermediate_size > 0) {
      shared_expert = register_module("shared_expert", Mlp(c.hidden_size, c.moe.shared_expert_intermediate_size, false));
      shared_expert_gate = register_module("shared_expert_gate", Linear(c.hidden_size, 1, /*bias=*/false));
    }
  }

  /// x [..., hidden] -> the mixture's output (x's shape) and the router's logits [tokens, experts].
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& x) {
    const at::Tensor h = x.reshape({-1, x.size(-1)});
    const at::Tensor logits = gate(h);
    // As transformers: softmax over all experts in float32, the top k, optionally renormalized, then
    // the weights in the activations' dtype.
    auto [weights, chosen] = at::softmax(logits, -1, at::kFloat).topk(top_k, -1);
    if (norm_topk_prob) weights = weights / weights.sum(-1, /*keepdim=*/true);
    weights = weights.to(h.scalar_type());
    // The (token, slot) pairs sorted by expert: each expert's tokens are one contiguous run.
    const at::Tensor expert_of = chosen.reshape({-1});
    const at::Tensor order = std::get<1>(expert_of.sort(/*stable=*/true, 0, /*descending=*/false));
    const at::Tensor counts = at::bincount(expert_of, {}, static_cast<int64_t>(experts.size())).to(at::kCPU);
    const at::Tensor token_of = order.div(top_k, "floor");
    const at::Tensor weight_of = weights.reshape({-1}).index_select(0, order).unsqueeze(1);
    at::Tensor out;
    if (use_grouped(h)) {
      out = at::zeros_like(h).index_add(0, token_of, grouped_experts(h.index_select(0, token_of), counts) * weight_of);
    } else {
      const int64_t* count = counts.data_ptr<int64_t>();
      std::vector<at::Tensor> outputs;
      int64_t start = 0;
      for (size_t e = 0; e < experts.size(); ++e) {
        const int64_t n = count[e];
        if (n == 0) continue;
        const at::Tensor tokens = token_of.narrow(0, start, n);
        outputs.push_back(experts[e](h.index_select(0, tokens)) * weight_of.narrow(0, start, n));
        start += n;
      }
      out = outputs.empty() ? at::zeros_like(h) : at::zeros_like(h).index_add(0, token_of, at::cat(outputs, 0));
    }
    if (shared_expert) out = out + at::sigmoid(shared_expert_gate(h)) * shared_expert(h);
    return {out.view(x.sizes()), logits};
  }

  /// at::_grouped_mm needs each operand's rows 16-byte aligned: the hidden and expert sizes a multiple
  /// of 16 bytes' worth of elements.
  bool groupable(const at::Tensor& h) const {
    const auto align = static_cast<int64_t>(16 / h.element_size());
    const int64_t inner = experts.empty() ? 0 : experts.front()->down_proj->weight.size(1);
    return h.size(1) % align == 0 && inner % align == 0;
  }
  bool use_grouped(const at::Tensor& h) const {
    if (kernel == ExpertKernel::per_expert || experts.empty()) return false;
    if (kernel == ExpertKernel::grouped) {
      FSDPX_CHECK(groupable(h), "SparseMoeBlock: ExpertKernel::grouped needs the hidden size (", h.size(1), ") and the "
                  "experts' intermediate size to be multiples of ", 16 / h.element_size(), " ", h.scalar_type(), " elements");
      return true;
    }
    return h.is_cuda() && (h.scalar_type() == at::kBFloat16 || h.scalar_type() == at::kHalf) && groupable(h);
  }

  /// The experts over tokens sorted by expert (counts: tokens per expert, on the host) as two grouped
  /// products. The weights are stacked for the call (a copy of the layer's experts, as large as its
  /// gather); the gradients flow back through the stack to each expert's own parameters.
  at::Tensor grouped_experts(const at::Tensor& sorted, const at::Tensor& counts) const {
    std::vector<at::Tensor> gate_up, down;
    for (const auto& e : experts) {
      gate_up.push_back(at::cat({e->gate_proj->weight, e->up_proj->weight}, 0));
      down.push_back(e->down_proj->weight);
    }
    const at::Tensor offsets = counts.cumsum(0).to(at::kInt).to(sorted.device());
    const at::Tensor both = at::_grouped_mm(sorted, at::stack(gate_up).transpose(-2, -1), offsets);
    const auto halves = both.chunk(2, -1);
    return at::_grouped_mm(at::silu(halves[0]) * halves[1], at::stack(down).transpose(-2, -1), offsets);
  }

  int64_t top_k;
  bool norm_topk_prob;
  ExpertKernel kernel = ExpertKernel::automatic;
  Linear gate{nullptr};
  std::vector<Mlp> experts;
  Mlp shared_expert{nullptr};
  Linear shared_expert_gate{nullptr};
};
TORCH_MODULE(SparseMoeBlock);

/// transformers' load_balancing_loss_func over the router logits of every sparse layer ([tokens,
/// experts] each, tokens in [batch, seq] order): E x sum over experts of (the share of top-k slots
/// routed to it) x (its mean router probability), pooled over the layers and the tokens that
/// attention_mask [batch, seq] keeps (undefined: all). Undefined when there are no router logits.
inline at::Tensor load_balancing_loss(const std::vector<at::Tensor>& router_logits, int64_t num_experts, int64_t top_k,
                                      const at::Tensor& attention_mask = {}) {
  if (router_logits.empty()) return {};
  const at::Tensor logits = at::cat(router_logits, 0);
  const at::Tensor probs = at::softmax(logits, -1);
  const at::Tensor chosen = at::one_hot(std::get<1>(probs.topk(top_k, -1)), num_experts).to(probs.scalar_type());  // [n, k, E]
  if (!attention_mask.defined()) {
    return (chosen.mean(0) * probs.mean(0).unsqueeze(0)).sum() * static_cast<double>(num_experts);
  }
  const auto layers = static_cast<int64_t>(router_logits.size());
  const at::Tensor keep = attention_mask.to(logits.device()).to(probs.scalar_type()).reshape({1, -1}).expand({layers, -1}).reshape({-1, 1});
  const at::Tensor kept = keep.sum();
  const at::Tensor tokens_per_expert = (chosen * keep.unsqueeze(2)).sum(0) / kept;
  const at::Tensor prob_per_expert = (probs * keep).sum(0) / kept;
  return (tokens_per_expert * prob_per_expert.unsqueeze(0)).sum() * static_cast<double>(num_experts);
}

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
  DecoderLayerImpl(const DecoderConfig& c, int64_t index) : index(index), sliding(c.is_sliding(index)) {
    input_layernorm = register_module("input_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps));
    self_attn = register_module("self_attn", Attention(c));
    post_attention_layernorm = register_module("post_attention_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps));
    if (c.is_sparse(index)) {
      moe = register_module("mlp", SparseMoeBlock(c));
    } else {
      mlp = register_module("mlp", Mlp(c));
    }
  }
  DecoderLayerOutput forward(const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin, const AttentionInputs& in) {
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
      layers.emplace_back(c, i);
      list->push_back(layers.back());
    }
    norm = register_module("norm", RMSNorm(c.hidden_size, c.rms_norm_eps));
  }

  /// input_ids [batch, seq] (int64). attention_mask [batch, seq]: 1 for tokens, 0 for padding
  /// (undefined: no padding). position_ids [batch or 1, seq] (undefined: 0, 1, ..., seq - 1); without
  /// an attention mask, position ids that restart at 0 describe packed samples (transformers'
  /// padding-free path): attention then stays inside each sample.
  /// With `router_logits`, a mixture of experts' sparse layers append their router logits to it.
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& attention_mask = {}, const at::Tensor& position_ids = {},
                     std::vector<at::Tensor>* router_logits = nullptr) {
    check_input_ids(input_ids);
    const int64_t seq = input_ids.size(1);
    const auto device = input_ids.device();
    const at::Tensor mask = without_all_ones(attention_mask, seq);
    if (position_ids.defined() && !attention_mask.defined()) {  // as transformers: only without a mask
      const PackedSamples samples = PackedSamples::detect(position_ids, input_ids.size(0));
      if (!samples.empty()) return forward_packed(input_ids, samples, router_logits);
    }
    const at::Tensor positions =
        position_ids.defined() ? position_ids : at::arange(seq, at::TensorOptions().dtype(at::kLong).device(device)).unsqueeze(0);
    return run_layers(input_ids, positions, make_masks(mask, seq, device), router_logits);
  }

  /// Packed samples (models/packing.hpp) in the rows of input_ids [batch, seq]: RoPE positions restart
  /// at each sample and attention stays inside it. (Not a forward overload: a module holder's call
  /// needs one forward.)
  at::Tensor forward_packed(const at::Tensor& input_ids, const PackedSamples& samples,
                            std::vector<at::Tensor>* router_logits = nullptr) {
    check_input_ids(input_ids);
    const int64_t batch = input_ids.size(0), seq = input_ids.size(1);
    samples.check_shape("DecoderModel", batch, seq);
    const at::Tensor positions = samples.position_ids(input_ids.device());
    if (static_cast<int64_t>(samples.spans().size()) == batch) {  // one sample per row: plain causal attention
      return run_layers(input_ids, positions, make_masks({}, seq, input_ids.device()), router_logits);
    }
    AttentionInputs in;
    in.samples = std::make_shared<const PackedSamples>(samples);
    in.sliding_window = any_sliding_layer() ? config.sliding_window : 0;
    return run_layers(input_ids, positions, in, router_logits);
  }

  /// Generation: hidden states of the new tokens input_ids [batch, n] after the `cache.length` tokens
  /// `cache` holds, whose keys and values it then holds too. key_mask [batch, cache.length + n]: 1 for
  /// tokens, 0 for padding (undefined: none); position_ids [batch, n].
  at::Tensor forward_cached(const at::Tensor& input_ids, KvCache& cache, const at::Tensor& key_mask,
                            const at::Tensor& position_ids) {
    check_input_ids(input_ids);
    // A recomputation in backward (activation checkpointing) would append to the cache again.
    FSDPX_CHECK(!at::GradMode::is_enabled(), "DecoderModel::forward_cached runs without gradients (at::NoGradGuard): "
                "the cache is written in place");
    FSDPX_CHECK(cache.layers.size() == layers.size(), "DecoderModel: a KV cache of ", cache.layers.size(),
                " layers for a model of ", layers.size());
    AttentionInputs in = cached_masks(key_mask, cache.length, input_ids.size(1), input_ids.device());
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
      if (router_logits != nullptr && out.router_logits.defined()) router_logits->push_back(std::move(out.router_logits));
    }
    return norm(h);
  }

  static void check_input_ids(const at::Tensor& input_ids) {
    FSDPX_CHECK(input_ids.defined() && input_ids.dim() == 2 && input_ids.scalar_type() == at::kLong,
                "DecoderModel: input_ids must be int64 [batch, seq], not ",
                input_ids.defined() ? input_ids.toString() : "undefined", " ",
                input_ids.defined() ? input_ids.sizes() : at::IntArrayRef{});
  }

  bool any_sliding_layer() const {
    return std::any_of(config.sliding_layers.begin(), config.sliding_layers.end(), [](bool b) { return b; });
  }

  /// As transformers, a padding mask of all ones is no mask (one look at it).
  static at::Tensor without_all_ones(const at::Tensor& attention_mask, int64_t seq) {
    if (attention_mask.defined() && attention_mask.dim() == 2 && attention_mask.size(1) == seq &&
        attention_mask.all().item<bool>()) {
      return {};
    }
    return attention_mask;
  }

  /// The masks of `n` new tokens after `past` cached ones: each attends to the tokens up to itself that
  /// key_mask keeps (and always to itself, so a padding query's softmax is over something), within
  /// the window on sliding layers. Undefined where SDPA's causal flag says the same.
  AttentionInputs cached_masks(const at::Tensor& key_mask, int64_t past, int64_t n, at::Device device) const {
    const int64_t total = past + n;
    const bool window = any_sliding_layer() && total > config.sliding_window;
    if (!key_mask.defined() && !window && (n == 1 || past == 0)) return {};
    FSDPX_CHECK(!key_mask.defined() || (key_mask.dim() == 2 && key_mask.size(1) == total), "DecoderModel: the key mask "
                "must be [batch, ", total, "] (cached and new tokens), not ", key_mask.sizes());
    const at::Tensor q = at::arange(past, total, at::TensorOptions().dtype(at::kLong).device(device)).view({1, 1, n, 1});
    const at::Tensor k = at::arange(total, at::TensorOptions().dtype(at::kLong).device(device)).view({1, 1, 1, total});
    at::Tensor allowed = k <= q;
    if (key_mask.defined()) {
      allowed = (allowed & key_mask.to(device).to(at::kBool).view({key_mask.size(0), 1, 1, total})) | (k == q);
    }
    AttentionInputs in;
    in.full = allowed;
    in.sliding = window ? allowed & (k > q - config.sliding_window) : allowed;
    return in;
  }

  /// Causal masks, with padding and sliding windows where they change anything; undefined when causal
  /// suffices (SDPA's is_causal, and its fastest kernels). A window at least as long as the sequence
  /// is no window.
  AttentionInputs make_masks(const at::Tensor& attention_mask, int64_t seq, at::Device device) const {
    const bool any_sliding = seq > config.sliding_window && any_sliding_layer();
    if (!attention_mask.defined() && !any_sliding) return {};
    const auto idx = at::arange(seq, at::TensorOptions().dtype(at::kLong).device(device));
    const at::Tensor q = idx.unsqueeze(1), k = idx.unsqueeze(0);
    at::Tensor causal = (k <= q).view({1, 1, seq, seq});
    if (attention_mask.defined()) {
      FSDPX_CHECK(attention_mask.dim() == 2 && attention_mask.size(1) == seq, "DecoderModel: attention_mask must be "
                  "[batch, seq] with seq = ", seq, ", not ", attention_mask.sizes());
      causal = causal & attention_mask.to(device).to(at::kBool).view({attention_mask.size(0), 1, 1, seq});
    }
    AttentionInputs masks;
    masks.full = attention_mask.defined() ? causal : at::Tensor();
    masks.sliding = any_sliding ? causal & (k > q - config.sliding_window).view({1, 1, seq, seq}) : masks.full;
    return masks;
  }

  DecoderConfig config;
  Rotary rotary;
  Embedding embed_tokens{nullptr};
  std::vector<DecoderLayer> layers;
  RMSNorm norm{nullptr};
};
TORCH_MODULE(DecoderModel);

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
    if (!config.tie_word_embeddings) lm_head = register_module("lm_head", LmHead(config.hidden_size, config.vocab_size));
    if (!in_deferred_init()) reset_parameters();
  }

  /// Runs fn(head weight, args...) under the head's unit: the LM head's, or the embedding's when tied.
  template <class Fn, class... Args>
  auto with_head(Fn fn, const Args&... args) {
    if (config.tie_word_embeddings) {
      return fsdpx::call(model->embed_tokens, [fn](Embedding& e, const auto&... a) { return fn(e->weight, a...); }, args...);
    }
    return fsdpx::call(lm_head, [fn](LmHead& head, const auto&... a) { return fn(head->weight, a...); }, args...);
  }

  /// Logits [batch, seq, vocab] (all of them: for generation or inspection; training uses loss()).
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& attention_mask = {}, const at::Tensor& position_ids = {}) {
    return head(model->forward(input_ids, attention_mask, position_ids));
  }
  /// Logits of packed samples (models/packing.hpp).
  at::Tensor forward_packed(const at::Tensor& input_ids, const PackedSamples& samples) {
    return head(model->forward_packed(input_ids, samples));
  }

  /// The LM head over hidden states (the embedding's weight when tied), under the head's unit.
  at::Tensor head(const at::Tensor& hidden) {
    return with_head([](const at::Tensor& weight, const at::Tensor& h) { return at::linear(h, weight); }, hidden);
  }

  /// Mean next-token cross-entropy as transformers' causal LM loss: labels [batch, seq] are the input
  /// ids (shifted inside), -100 ignored, computed in float32 chunk by chunk of tokens (chunk_logits).
  /// A mixture of experts with output_router_logits adds router_aux_loss_coef x the load-balancing loss
  /// (over the tokens attention_mask keeps), as transformers does.
  at::Tensor loss(const at::Tensor& input_ids, const at::Tensor& labels, const at::Tensor& attention_mask = {}) {
    std::vector<at::Tensor> router_logits;
    const at::Tensor hidden = model->forward(input_ids, attention_mask, {}, aux_wanted() ? &router_logits : nullptr);
    return with_aux(head_loss(hidden, shift_labels(labels)), router_logits, attention_mask);
  }
  /// loss() over packed samples: no sample's last token is trained to predict the next sample's first.
  /// (A name of its own, so that &CausalLMImpl::loss names one function for Fsdp::call.)
  at::Tensor loss_packed(const at::Tensor& input_ids, const at::Tensor& labels, const PackedSamples& samples) {
    std::vector<at::Tensor> router_logits;
    const at::Tensor hidden = model->forward_packed(input_ids, samples, aux_wanted() ? &router_logits : nullptr);
    const at::Tensor within = at::constant_pad_nd(samples.next_token_mask(labels.device()), {0, 1}, 0);
    return with_aux(head_loss(hidden, shift_labels(labels).masked_fill(within.logical_not(), -100)), router_logits, {});
  }

  /// Logits and, for a mixture of experts, the load-balancing loss of this forward (undefined for a
  /// dense model): transformers' output.logits and output.aux_loss with output_router_logits=True.
  CausalLMOutput forward_with_aux_loss(const at::Tensor& input_ids, const at::Tensor& attention_mask = {}) {
    std::vector<at::Tensor> router_logits;
    const at::Tensor logits = head(model->forward(input_ids, attention_mask, {}, &router_logits));
    return {logits, load_balancing_loss(router_logits, config.moe.num_experts, config.moe.num_experts_per_tok, attention_mask)};
  }

  bool aux_wanted() const { return config.moe.output_router_logits && config.moe.num_experts > 0; }
  at::Tensor with_aux(const at::Tensor& loss, const std::vector<at::Tensor>& router_logits, const at::Tensor& attention_mask) const {
    if (router_logits.empty()) return loss;
    return loss + config.moe.router_aux_loss_coef *
                      load_balancing_loss(router_logits, config.moe.num_experts, config.moe.num_experts_per_tok, attention_mask);
  }

  /// Mean cross-entropy of the head over hidden states against already-shifted labels (-100 ignored).
  at::Tensor head_loss(const at::Tensor& hidden, const at::Tensor& shifted_labels) {
    const at::Tensor shifted = shifted_labels.to(hidden.device());
    const CrossEntropyOptions ce{.chunk_logits = chunk_logits};
    return with_head([ce](const at::Tensor& weight, const at::Tensor& h, const at::Tensor& y) {
      return linear_cross_entropy(h, weight, y, ce);
    }, hidden, shifted);
  }

  /// RL's per-token log-probabilities of the given next tokens: [batch, seq - 1] float32, position t
  /// holding log p(input_ids[t + 1] | input_ids[..t]) (and the entropy of that distribution when
  /// asked), computed chunk by chunk of tokens. Positions after padding hold values to be masked.
  TokenLogProbs log_probs(const at::Tensor& input_ids, const at::Tensor& attention_mask = {},
                          const LogProbOptions& options = {}) {
    FSDPX_CHECK(input_ids.dim() == 2 && input_ids.size(1) >= 2, "CausalLM::log_probs: input_ids must be [batch, seq] "
                "with seq >= 2 (each position's next token is its target), not ", input_ids.sizes());
    return head_log_probs(model->forward(input_ids, attention_mask), input_ids, options);
  }
  /// log_probs() over packed samples; a sample's last position (whose next token is another sample's)
  /// holds 0: mask with samples.next_token_mask().
  TokenLogProbs log_probs_packed(const at::Tensor& input_ids, const PackedSamples& samples,
                                 const LogProbOptions& options = {}) {
    FSDPX_CHECK(input_ids.dim() == 2 && input_ids.size(1) >= 2, "CausalLM::log_probs: input_ids must be [batch, seq] "
                "with seq >= 2 (each position's next token is its target), not ", input_ids.sizes());
    TokenLogProbs r = head_log_probs(model->forward_packed(input_ids, samples), input_ids, options);
    const at::Tensor outside = samples.next_token_mask(r.log_probs.device()).logical_not();
    r.log_probs = r.log_probs.masked_fill(outside, 0.0);
    if (r.entropy.defined()) r.entropy = r.entropy.masked_fill(outside, 0.0);
    return r;
  }

  /// log-probs (and entropy) of input_ids[:, 1:] from hidden states [batch, seq, hidden].
  TokenLogProbs head_log_probs(const at::Tensor& hidden, const at::Tensor& input_ids, const LogProbOptions& options) {
    const int64_t seq = input_ids.size(1);
    const at::Tensor h = hidden.narrow(1, 0, seq - 1);
    const at::Tensor targets = input_ids.narrow(1, 1, seq - 1).to(hidden.device());
    auto both = with_head([options](const at::Tensor& weight, const at::Tensor& hs, const at::Tensor& t) {
      TokenLogProbs r = linear_log_probs(hs, weight, t, options);
      return std::make_tuple(r.log_probs, r.entropy);
    }, h, targets);
    return {std::get<0>(both), std::get<1>(both)};
  }

  /// New tokens after each prompt, with a KV cache (models/generation.hpp). input_ids [batch, prompt]
  /// int64, left-padded where prompts differ in length, attention_mask [batch, prompt] 1 on tokens and 0
  /// on padding (undefined: none). Runs without gradients. Under Fsdp::call every rank runs it (each
  /// with its own prompts and the same options): each step gathers every unit, and the ranks agree
  /// when all of them are done.
  GenerateOutput generate(const at::Tensor& input_ids, const at::Tensor& attention_mask = {},
                          const GenerateOptions& options = {}) {
    // Checked on every rank, and agreed, before the first unit call: a rank that threw here while the
    // others gathered units would leave them waiting.
    std::string refused;
    try {
      check_generate_inputs(input_ids, attention_mask, options);
    } catch (const Error& e) {
      refused = e.what();
    }
    if (!on_every_rank(*this, refused.empty())) {
      FSDPX_CHECK(!refused.empty(), "generate: another rank's inputs were refused (its error says why); no rank generated");
      throw ConfigError(refused);
    }
    const int64_t batch = input_ids.size(0), prompt = input_ids.size(1);
    at::NoGradGuard no_grad;
    // Dropout off while generating, as transformers' generate runs in eval mode; the mode is restored.
    struct EvalScope {
      torch::nn::Module& m;
      bool was_training;
      ~EvalScope() { m.train(was_training); }
    } eval_scope{*this, is_training()};
    eval();
    const auto device = input_ids.device();
    const auto longs = at::TensorOptions().dtype(at::kLong).device(device);
    const int64_t pad = options.pad_token_id.value_or(
        config.pad_token_id.value_or(options.eos_token_ids.empty() ? 0 : options.eos_token_ids.front()));
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
    KvCache cache(config.num_hidden_layers, prompt + options.max_new_tokens);
    at::Tensor finished = at::zeros({batch}, at::TensorOptions().dtype(at::kBool));
    at::Tensor lengths = at::zeros({batch}, at::TensorOptions().dtype(at::kLong));
    std::vector<at::Tensor> new_tokens, step_logits;
    at::Tensor step = input_ids;
    for (int64_t i = 0; i < options.max_new_tokens; ++i) {
      if (on_every_rank(*this, finished.all().item<bool>())) break;
      const int64_t n = step.size(1);
      const at::Tensor mask = padded ? key_mask.narrow(1, 0, cache.length + n) : at::Tensor();
      const at::Tensor hidden = model->forward_cached(step, cache, mask, positions);
      const at::Tensor logits = head(hidden.narrow(1, n - 1, 1)).squeeze(1).to(at::kFloat).to(at::kCPU);
      if (options.output_logits) step_logits.push_back(logits);
      // A draw can fail on one rank alone (its logits turned NaN): every rank learns it before the next step.
      at::Tensor next;
      std::string failed;
      try {
        next = detail::select_next_tokens(logits, options, generator).masked_fill(finished, pad);
      } catch (const std::exception& e) {
        failed = e.what();
      }
      if (!on_every_rank(*this, failed.empty())) {
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

  /// generate()'s checks of its inputs against the model (ConfigError naming the argument).
  void check_generate_inputs(const at::Tensor& input_ids, const at::Tensor& attention_mask, const GenerateOptions& o) const {
    DecoderModelImpl::check_input_ids(input_ids);
    FSDPX_CHECK(input_ids.size(0) > 0 && input_ids.size(1) > 0, "generate: input_ids must hold at least one token per row, not ",
                input_ids.sizes());
    FSDPX_CHECK(!attention_mask.defined() || attention_mask.sizes() == input_ids.sizes(), "generate: attention_mask must "
                "be [batch, prompt] = ", input_ids.sizes(), ", not ", attention_mask.sizes());
    detail::check_generate_options(o, input_ids.size(1), config.max_position_embeddings);
    const auto in_vocabulary = [&](int64_t id, const char* what) {
      FSDPX_CHECK(id >= 0 && id < config.vocab_size, "generate: ", what, " ", id, " is outside the vocabulary of ", config.vocab_size);
    };
    for (const int64_t id : o.eos_token_ids) in_vocabulary(id, "eos_token_ids holds");
    if (o.pad_token_id) in_vocabulary(*o.pad_token_id, "pad_token_id");
    FSDPX_CHECK(input_ids.min().item<int64_t>() >= 0 && input_ids.max().item<int64_t>() < config.vocab_size,
                "generate: input_ids hold a token outside the vocabulary of ", config.vocab_size);
    if (attention_mask.defined()) {
      // The next token follows the last column: a right-padded prompt would continue from padding.
      const at::Tensor last = attention_mask.select(1, attention_mask.size(1) - 1);
      FSDPX_CHECK(last.ne(0).all().item<bool>(), "generate: the prompts must be left-padded (attention_mask's last column "
                  "is 0 in row ", last.eq(0).nonzero().select(1, 0)[0].item<int64_t>(), ")");
    }
  }

  /// labels [batch, seq] -> the next token's label at each position, ignore_index at the last.
  static at::Tensor shift_labels(const at::Tensor& labels, int64_t ignore_index = -100) {
    FSDPX_CHECK(labels.dim() == 2 && labels.scalar_type() == at::kLong, "CausalLM: labels must be int64 [batch, seq], not ",
                labels.scalar_type(), " ", labels.sizes());
    return at::constant_pad_nd(labels, {0, 1}, static_cast<double>(ignore_index)).narrow(1, 1, labels.size(1));
  }

  /// Mean next-token cross-entropy of whole logits (the unchunked reference of loss()).
  static at::Tensor causal_lm_loss(const at::Tensor& logits, const at::Tensor& labels, int64_t ignore_index = -100) {
    const int64_t vocab = logits.size(-1);
    const at::Tensor shifted = shift_labels(labels, ignore_index);
    return at::cross_entropy_loss(logits.to(at::kFloat).reshape({-1, vocab}), shifted.reshape({-1}).to(logits.device()),
                                  std::nullopt, at::Reduction::Mean, ignore_index);
  }

  /// transformers' initialization of every parameter.
  void reset_parameters() {
    for (const auto& m : modules(/*include_self=*/false)) init_decoder_module(*m, config.initializer_range);  // (no own parameters; a constructor cannot name itself)
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
