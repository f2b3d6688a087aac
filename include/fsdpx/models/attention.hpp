// Attention of models/decoder.hpp's layers: rotary position embedding, the masks of padded, windowed,
// packed and cached batches (transformers' masking_utils), the kernels that attend, and the Attention
// module (q/k/v/o projections, Qwen3's per-head norms, grouped-query heads). Sequence parallelism's
// all-to-alls, which the module runs around attention, are models/sequence_parallel.hpp's.
//
// The kernel is one explicit choice per model, AttentionBackend, and what ran is reported
// (CausalLM::attention_report()):
//   - a batch of whole rows (padded or not) runs at::scaled_dot_product_attention, which picks among its
//     own kernels (flash, cuDNN, memory-efficient, math) for the shape and device;
//   - packed samples (models/packing.hpp) run ATen's variable-length flash kernel over all samples at
//     once (flash_varlen), or SDPA sample by sample (sdpa).
// automatic takes flash_varlen where it can run. Where it cannot (the device, dtype or head size), or
// where it fails once on this model, packed batches run on sdpa and the report says why; a failure warns
// once. Asked for explicitly, flash_varlen never falls back: where it cannot run, the call fails saying why.
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <fsdpx/dist/any.hpp>
#include <fsdpx/error.hpp>
#include <fsdpx/models/config.hpp>
#include <fsdpx/models/generation.hpp>
#include <fsdpx/models/modules.hpp>
#include <fsdpx/models/packing.hpp>
#include <fsdpx/models/sequence_parallel.hpp>

namespace fsdpx::models {

/// The kernels a model's attention runs on (see the top of this header).
enum class AttentionBackend {
  automatic,     // packed samples on flash_varlen where it can run, else on sdpa (reported, with the reason)
  sdpa,          // at::scaled_dot_product_attention everywhere; packed samples one by one
  flash_varlen,  // packed samples on ATen's variable-length flash kernel, or an error saying why it cannot run
};

inline const char* to_string(AttentionBackend b) {
  switch (b) {
    case AttentionBackend::automatic: return "automatic";
    case AttentionBackend::sdpa: return "sdpa";
    case AttentionBackend::flash_varlen: return "flash_varlen";
  }
  return "?";
}

/// What a model's attention was asked to run on, and what its packed batches ran on.
struct AttentionReport {
  AttentionBackend requested = AttentionBackend::automatic;
  /// The kernel of the last packed batch (nullopt: none ran yet). Batches of whole rows always run SDPA.
  std::optional<AttentionBackend> packed{};
  /// Why packed batches run on sdpa under automatic (empty when they run on flash_varlen, or none ran).
  std::string reason{};

  /// One line, e.g. "automatic: whole rows on sdpa, packed samples on sdpa (flash_varlen needs CUDA ...)".
  std::string to_string() const {
    std::string s = std::string(models::to_string(requested)) + ": whole rows on sdpa, packed samples ";
    if (!packed) return s + "not run yet";
    s += std::string("on ") + models::to_string(*packed);
    return reason.empty() ? s : s + " (" + reason + ")";
  }
};

namespace detail {

/// The attention choice of one model, shared by its layers (and by copies of the model's modules).
class AttentionState {
 public:
  AttentionReport report() const {
    std::lock_guard lock(mutex_);
    return report_;
  }
  void request(AttentionBackend b) {
    std::lock_guard lock(mutex_);
    report_ = AttentionReport{.requested = b};
    failed_ = false;
  }
  AttentionBackend requested() const {
    std::lock_guard lock(mutex_);
    return report_.requested;
  }
  /// Whether flash_varlen failed on this model before (automatic then stays on sdpa).
  bool failed() const {
    std::lock_guard lock(mutex_);
    return failed_;
  }
  /// Records the kernel a packed batch ran on, and why it is not flash_varlen (empty if it is).
  void ran(AttentionBackend b, std::string reason) {
    std::lock_guard lock(mutex_);
    report_.packed = b;
    report_.reason = std::move(reason);
  }
  /// Records a failure of flash_varlen; true the first time (the caller warns then, once per model).
  bool fail(const std::string& reason) {
    std::lock_guard lock(mutex_);
    report_.packed = AttentionBackend::sdpa;
    report_.reason = "flash_varlen failed on this model: " + reason;
    return !std::exchange(failed_, true);
  }
  /// The sequence group (Ulysses) the layers attend over; nullopt, or a group of one: none.
  void set_sequence_group(std::optional<dist::AnyCommunicator> group) {
    std::lock_guard lock(mutex_);
    sequence_group_ = std::move(group);
  }
  std::optional<dist::AnyCommunicator> sequence_group() const {
    std::lock_guard lock(mutex_);
    if (sequence_group_ && sequence_group_->size() > 1) return sequence_group_;
    return std::nullopt;
  }

 private:
  mutable std::mutex mutex_;
  AttentionReport report_;
  bool failed_ = false;
  std::optional<dist::AnyCommunicator> sequence_group_;
};

}  // namespace detail

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
    const at::Tensor exponents = at::arange(0, head_dim_, 2, at::TensorOptions().dtype(at::kLong)).to(at::kFloat) / dim;
    at::Tensor inv = at::pow(r.theta, exponents).reciprocal();
    if (r.type == "linear") inv = inv / r.factor;
    if (r.type == "llama3") {
      const double old_len = static_cast<double>(r.original_max_position_embeddings);
      const double low_wavelen = old_len / r.low_freq_factor, high_wavelen = old_len / r.high_freq_factor;
      const at::Tensor wavelen = inv.reciprocal() * (2 * M_PI);
      const at::Tensor scaled = at::where(wavelen > low_wavelen, inv / r.factor, inv);
      const at::Tensor smooth =
          (wavelen.reciprocal() * old_len - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
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

inline at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

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

// ---- Masks ------------------------------------------------------------------------------------------

/// As transformers, a padding mask of all ones is no mask (one look at it).
inline at::Tensor without_all_ones(const at::Tensor& attention_mask, int64_t seq) {
  if (attention_mask.defined() && attention_mask.dim() == 2 && attention_mask.size(1) == seq &&
      attention_mask.all().item<bool>()) {
    return {};
  }
  return attention_mask;
}

/// Causal masks of `seq` tokens, with padding (attention_mask [batch, seq], 1 on tokens) and the sliding
/// layers' `window` (0: no sliding layer) where they change anything; undefined when causal suffices
/// (SDPA's is_causal, and its fastest kernels). A window at least as long as the sequence is no window.
inline AttentionInputs causal_masks(const at::Tensor& attention_mask, int64_t seq, at::Device device, int64_t window) {
  const bool windowed = window > 0 && seq > window;
  if (!attention_mask.defined() && !windowed) return {};
  const auto idx = at::arange(seq, at::TensorOptions().dtype(at::kLong).device(device));
  const at::Tensor q = idx.unsqueeze(1), k = idx.unsqueeze(0);
  at::Tensor causal = (k <= q).view({1, 1, seq, seq});
  if (attention_mask.defined()) {
    FSDPX_CHECK(attention_mask.dim() == 2 && attention_mask.size(1) == seq,
                "DecoderModel: attention_mask must be "
                "[batch, seq] with seq = ",
                seq, ", not ", attention_mask.sizes());
    causal = causal & attention_mask.to(device).to(at::kBool).view({attention_mask.size(0), 1, 1, seq});
  }
  AttentionInputs masks;
  masks.full = attention_mask.defined() ? causal : at::Tensor();
  masks.sliding = windowed ? causal & (k > q - window).view({1, 1, seq, seq}) : masks.full;
  return masks;
}

/// The masks of `n` new tokens after `past` cached ones: each attends to the tokens up to itself that
/// key_mask [batch, past + n] keeps (and always to itself, so a padding query's softmax is over
/// something), within `window` on sliding layers (0: none). Undefined where SDPA's causal flag says
/// the same.
inline AttentionInputs cached_masks(const at::Tensor& key_mask, int64_t past, int64_t n, at::Device device,
                                    int64_t window) {
  const int64_t total = past + n;
  const bool windowed = window > 0 && total > window;
  if (!key_mask.defined() && !windowed && (n == 1 || past == 0)) return {};
  FSDPX_CHECK(!key_mask.defined() || (key_mask.dim() == 2 && key_mask.size(1) == total),
              "DecoderModel: the key mask "
              "must be [batch, ",
              total, "] (cached and new tokens), not ", key_mask.sizes());
  const at::Tensor q = at::arange(past, total, at::TensorOptions().dtype(at::kLong).device(device)).view({1, 1, n, 1});
  const at::Tensor k = at::arange(total, at::TensorOptions().dtype(at::kLong).device(device)).view({1, 1, 1, total});
  at::Tensor allowed = k <= q;
  if (key_mask.defined()) {
    allowed = (allowed & key_mask.to(device).to(at::kBool).view({key_mask.size(0), 1, 1, total})) | (k == q);
  }
  AttentionInputs in;
  in.full = allowed;
  in.sliding = windowed ? allowed & (k > q - window) : allowed;
  return in;
}

/// The mask of one sample of `length` tokens on a layer of sliding `window`; undefined (causal) when
/// the window covers the sample.
inline at::Tensor sample_window_mask(int64_t length, int64_t window, at::Device device) {
  if (window <= 0 || length <= window) return {};
  const at::Tensor idx = at::arange(length, at::TensorOptions().dtype(at::kLong).device(device));
  const at::Tensor q = idx.unsqueeze(1), k = idx.unsqueeze(0);
  return ((k <= q) & (k > q - window)).view({1, 1, length, length});
}

// ---- Kernels ----------------------------------------------------------------------------------------

namespace detail {

/// SDPA of q [b, heads, n, d] over k, v [b, kv_heads, m, d]: causal (aligned at the start) when `mask`
/// is undefined and n > 1, else as the mask says.
inline at::Tensor sdpa(const at::Tensor& q, at::Tensor k, at::Tensor v, const at::Tensor& mask, double dropout) {
  const int64_t heads = q.size(1), kv_heads = k.size(1), head_dim = q.size(3);
  const bool grouped = kv_heads != heads;
  // With a mask, the kernels that take one (memory-efficient) do not group heads: expand the key and
  // value heads as transformers' repeat_kv does, rather than fall back to the math kernel.
  if (mask.defined() && grouped) {
    const int64_t b = k.size(0), m = k.size(2), groups = heads / kv_heads;
    k = k.unsqueeze(2).expand({b, kv_heads, groups, m, head_dim}).reshape({b, heads, m, head_dim});
    v = v.unsqueeze(2).expand({b, kv_heads, groups, m, head_dim}).reshape({b, heads, m, head_dim});
  }
  return at::scaled_dot_product_attention(q, k, v, mask.defined() ? std::optional<at::Tensor>(mask) : std::nullopt,
                                          dropout, /*is_causal=*/!mask.defined() && q.size(2) > 1,
                                          std::pow(static_cast<double>(head_dim), -0.5),
                                          /*enable_gqa=*/grouped && !mask.defined());
}

/// Why ATen's variable-length flash kernel cannot attend over q [b, heads, n, head_dim]; empty if it can.
inline std::string flash_varlen_unavailable(const at::Tensor& q) {
  const auto dtype = q.scalar_type();
  const int64_t head_dim = q.size(3);
  if (!q.is_cuda()) return ::fsdpx::detail::str("flash_varlen needs CUDA tensors, not ", q.device());
  if (dtype != at::kHalf && dtype != at::kBFloat16) {
    return ::fsdpx::detail::str("flash_varlen needs bfloat16 or float16, not ", dtype);
  }
  if (head_dim % 8 != 0 || head_dim > 256) {
    return ::fsdpx::detail::str("flash_varlen needs a head size that is a multiple of 8 and at most 256, not ",
                                head_dim);
  }
  return {};
}

/// Attention within each packed sample by ATen's variable-length flash kernel, over all samples at once.
inline at::Tensor flash_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const PackedSamples& samples, int64_t window, double dropout) {
  const int64_t batch = q.size(0), seq = q.size(2), heads = q.size(1), head_dim = q.size(3);
  const auto tokens = [&](const at::Tensor& t) {
    return t.transpose(1, 2).reshape({batch * seq, t.size(1), head_dim});
  };
  const at::Tensor cu = samples.cu_seqlens(q.device());
  const at::Tensor out = std::get<0>(at::_flash_attention_forward(
      tokens(q), tokens(k), tokens(v), cu, cu, samples.max_length(), samples.max_length(), dropout,
      /*is_causal=*/true, /*return_debug_mask=*/false, std::pow(static_cast<double>(head_dim), -0.5),
      window > 0 ? std::optional<int64_t>(window - 1) : std::nullopt,
      window > 0 ? std::optional<int64_t>(0) : std::nullopt));
  return out.view({batch, seq, heads, head_dim}).transpose(1, 2);
}

/// Attention within each packed sample by each sample's own causal SDPA: the work of the samples'
/// lengths squared, not the row's.
inline at::Tensor per_sample_sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const PackedSamples& samples, int64_t window, double dropout) {
  std::vector<at::Tensor> rows, pieces;
  int64_t row = 0;
  for (const SampleSpan& s : samples.spans()) {
    if (s.row != row) {
      rows.push_back(at::cat(pieces, 2));
      pieces.clear();
      row = s.row;
    }
    const auto part = [&](const at::Tensor& t) { return t.narrow(0, s.row, 1).narrow(2, s.start, s.length); };
    pieces.push_back(sdpa(part(q), part(k), part(v), sample_window_mask(s.length, window, q.device()), dropout));
  }
  rows.push_back(at::cat(pieces, 2));
  return rows.size() == 1 ? rows.front() : at::cat(rows, 0);
}

}  // namespace detail

// ---- The module -------------------------------------------------------------------------------------

struct AttentionImpl : torch::nn::Module {
  AttentionImpl(const DecoderConfig& c, std::shared_ptr<detail::AttentionState> state)
      : heads(c.num_attention_heads),
        kv_heads(c.num_key_value_heads),
        head_dim(c.head_dim),
        dropout(c.attention_dropout),
        state(state ? std::move(state) : std::make_shared<detail::AttentionState>()) {
    q_proj = register_module("q_proj", Linear(c.hidden_size, heads * head_dim, c.qkv_bias));
    k_proj = register_module("k_proj", Linear(c.hidden_size, kv_heads * head_dim, c.qkv_bias));
    v_proj = register_module("v_proj", Linear(c.hidden_size, kv_heads * head_dim, c.qkv_bias));
    o_proj = register_module("o_proj", Linear(heads * head_dim, c.hidden_size, c.o_bias));
    if (c.qk_norm) {
      q_norm = register_module("q_norm", RMSNorm(head_dim, c.rms_norm_eps));
      k_norm = register_module("k_norm", RMSNorm(head_dim, c.rms_norm_eps));
    }
  }
  explicit AttentionImpl(const DecoderConfig& c) : AttentionImpl(c, nullptr) {}

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
    if (cache != nullptr) {
      const int64_t past = in.cache->length;
      append_to_cache(*cache, k, v, past, in.cache->capacity);
      y = detail::sdpa(q, cache->keys.narrow(2, 0, past + seq), cache->values.narrow(2, 0, past + seq),
                       sliding ? in.sliding : in.full, dropout_now());
    } else if (const auto group = state->sequence_group()) {
      y = ulysses_attention(q, k, v, *group, in, sliding);
    } else {
      y = attend(q, k, v, in, sliding);
    }
    return o_proj(y.transpose(1, 2).reshape({batch, seq, heads * head_dim}));
  }

  /// Attention of q [b, heads, t, d] over k and v [b, kv_heads, t, d] as `in` lays the batch out.
  at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const AttentionInputs& in,
                    bool sliding) {
    if (in.samples) return packed_attention(q, k, v, *in.samples, sliding ? in.sliding_window : 0);
    return detail::sdpa(q, k, v, sliding ? in.sliding : in.full, dropout_now());
  }

  /// q [b, heads, t, d], k and v [b, kv_heads, t, d] of this rank's slice of the sequence: attention
  /// over the whole sequence for this rank's heads (sequence_to_heads), back to the slice with every
  /// head. Key and value heads that do not split over the group are repeated up to the query heads first
  /// (each rank then gets the ones its query heads use); `in` describes the whole rows (their masks or
  /// packed samples), so packed samples run on the model's AttentionBackend as without the group.
  at::Tensor ulysses_attention(const at::Tensor& q, at::Tensor k, at::Tensor v, const dist::AnyCommunicator& group,
                               const AttentionInputs& in, bool sliding) {
    FSDPX_CHECK(heads % group.size() == 0, "Attention: ", heads, " query heads do not split over a sequence group of ",
                group.size(), " ranks; the group's size must divide the attention heads");
    if (kv_heads % group.size() != 0) {
      const int64_t b = k.size(0), t = k.size(2), groups = heads / kv_heads;
      k = k.unsqueeze(2).expand({b, kv_heads, groups, t, head_dim}).reshape({b, heads, t, head_dim});
      v = v.unsqueeze(2).expand({b, kv_heads, groups, t, head_dim}).reshape({b, heads, t, head_dim});
    }
    const auto to_heads = [&](const at::Tensor& x) {
      return sequence_to_heads(x.transpose(1, 2).contiguous(), group).transpose(1, 2);
    };
    const at::Tensor y = attend(to_heads(q), to_heads(k), to_heads(v), in, sliding);
    return heads_to_sequence(y.transpose(1, 2).contiguous(), group).transpose(1, 2);
  }

  /// Writes the new keys and values at [past, past + n) of the layer's cache (allocated at its first use).
  static void append_to_cache(KvCacheLayer& cache, const at::Tensor& k, const at::Tensor& v, int64_t past,
                              int64_t capacity) {
    const int64_t n = k.size(2);
    FSDPX_CHECK(past + n <= capacity, "KV cache: ", past, " cached tokens and ", n, " new exceed its capacity of ",
                capacity);
    if (!cache.keys.defined()) {
      cache.keys = at::empty({k.size(0), k.size(1), capacity, k.size(3)}, k.options());
      cache.values = at::empty({v.size(0), v.size(1), capacity, v.size(3)}, v.options());
    }
    cache.keys.narrow(2, past, n).copy_(k);
    cache.values.narrow(2, past, n).copy_(v);
  }

  /// Attention within each packed sample, on the model's AttentionBackend. `window` > 0: a sliding
  /// layer's window.
  at::Tensor packed_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const PackedSamples& samples, int64_t window) {
    const AttentionBackend requested = state->requested();
    if (requested == AttentionBackend::sdpa) {
      state->ran(AttentionBackend::sdpa, {});
      return detail::per_sample_sdpa(q, k, v, samples, window, dropout_now());
    }
    std::string why = detail::flash_varlen_unavailable(q);
    if (requested == AttentionBackend::flash_varlen) {
      FSDPX_CHECK_AS(ConfigError, why.empty(), "attention: AttentionBackend::flash_varlen was asked for, but ", why);
      try {
        const at::Tensor y = detail::flash_varlen(q, k, v, samples, window, dropout_now());
        state->ran(AttentionBackend::flash_varlen, {});
        return y;
      } catch (const c10::Error& e) {
        throw Error(::fsdpx::detail::str("fsdpx: attention: AttentionBackend::flash_varlen failed: ",
                                         e.what_without_backtrace()));
      }
    }
    if (why.empty() && !state->failed()) {
      try {
        const at::Tensor y = detail::flash_varlen(q, k, v, samples, window, dropout_now());
        state->ran(AttentionBackend::flash_varlen, {});
        return y;
      } catch (const c10::Error& e) {
        if (state->fail(e.what_without_backtrace())) {
          TORCH_WARN(
              "fsdpx: variable-length flash attention failed (", e.what_without_backtrace(),
              "); this model's packed "
              "samples attend one by one from now on (AttentionBackend::sdpa; CausalLM::attention_report() says so)");
        }
        return detail::per_sample_sdpa(q, k, v, samples, window, dropout_now());
      }
    }
    if (!state->failed()) state->ran(AttentionBackend::sdpa, std::move(why));
    return detail::per_sample_sdpa(q, k, v, samples, window, dropout_now());
  }

  double dropout_now() const { return is_training() ? dropout : 0.0; }

  int64_t heads, kv_heads, head_dim;
  double dropout;
  std::shared_ptr<detail::AttentionState> state;  // the model's, shared by its layers
  Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  RMSNorm q_norm{nullptr}, k_norm{nullptr};
};
TORCH_MODULE(Attention);

}  // namespace fsdpx::models
