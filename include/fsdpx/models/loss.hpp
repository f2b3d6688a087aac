// Losses over an LM head that never hold the whole logits: the causal-LM cross-entropy and RL's
// per-token log-probabilities (and entropy) of logits = hidden W^T (+ b), computed chunk by chunk of
// tokens (as Liger-Kernel's fused linear cross-entropy and verl's fused log-prob kernels do): the
// loss, a scalar, computes its gradients in forward when gradients are on (backward scales them);
// the log-probs, whose gradient depends on each token's, compute each chunk's logits again in
// backward. Peak memory holds one chunk of
// [tokens, vocabulary] in float32 instead of all of them: for a 152k vocabulary and 16k tokens that is
// 256 MiB instead of 10 GB (and as much again for its gradient).
//
//   auto loss = models::linear_cross_entropy(hidden, lm_head->weight, labels);            // mean over labels != -100
//   auto [logp, entropy] = models::linear_log_probs(hidden, lm_head->weight, targets, {.entropy = true});
//
// `hidden` is [..., H] in the head's dtype, `weight` [V, H]; labels / targets have hidden's leading
// shape. The logits are computed in the weight's dtype and the softmax in float32, as transformers'
// loss does (logits.float()). chunk_logits = 0 computes everything at once with ATen's own operations:
// the reference the chunked results are tested against.
#pragma once

#include <fsdpx/detail/config.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <utility>

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>

namespace fsdpx::models {

/// Whether every label is a token id in [0, vocabulary) (or the ignore index, when one is given),
/// asked on the labels' device and answered later. Reading a GPU's answer at once stalls the host until
/// the GPU has run everything queued before it; asked before the layers' forward and read at the head
/// (CausalLM::loss and log_probs do so), it waits only for the check itself, long done by then. On the
/// CPU it is answered at once.
class LabelCheck {
 public:
  FSDPX_DECL LabelCheck(const at::Tensor& labels, int64_t vocabulary,
                        std::optional<int64_t> ignore_index = std::nullopt);
  /// True when every label is in range (waits for the device's answer, never for later work).
  FSDPX_DECL bool passed() const;
  int64_t vocabulary() const { return vocabulary_; }
  std::optional<int64_t> ignore_index() const { return ignore_index_; }
  int64_t count() const { return count_; }

 private:
  at::Tensor answer_;                // bool scalar on the host: pinned, written by the device's stream
  std::optional<c10::Event> ready_;  // recorded after that copy (none on the CPU)
  int64_t vocabulary_;
  std::optional<int64_t> ignore_index_;
  int64_t count_;  // labels checked
};

/// How many logits one chunk may hold: chunk_tokens = max(1, chunk_logits / vocabulary).
inline constexpr int64_t default_chunk_logits = int64_t{1} << 26;  // 256 MiB in float32

enum class LossReduction { mean, sum };

struct CrossEntropyOptions {
  int64_t chunk_logits = default_chunk_logits;  // 0: no chunks
  int64_t ignore_index = -100;
  /// mean: over the labels not ignored (transformers' causal-LM loss; NaN when every label is
  /// ignored, as torch's); sum: their sum (to divide by a count of one's own).
  LossReduction reduction = LossReduction::mean;
  /// The labels' range check, asked earlier (LabelCheck with this ignore index): read instead of
  /// checking the labels here. Shared: a recomputation (activation checkpointing) reads it again.
  std::shared_ptr<const LabelCheck> labels_checked;
};

/// Cross-entropy of hidden W^T (+ bias) against `labels` (-100 ignored), as one scalar.
FSDPX_DECL at::Tensor linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels,
                                           const CrossEntropyOptions& options = {}, const at::Tensor& bias = {});

struct LogProbOptions {
  int64_t chunk_logits = default_chunk_logits;  // 0: no chunks
  /// Logits are divided by it before the softmax (a sampler's temperature, as verl's log-probs).
  double temperature = 1.0;
  /// Also the entropy of each token's distribution (undefined in the result otherwise).
  bool entropy = false;
  /// The targets' range check, asked earlier (LabelCheck without an ignore index): read instead of
  /// checking the targets here. Shared: a recomputation (activation checkpointing) reads it again.
  std::shared_ptr<const LabelCheck> targets_checked;
};

struct TokenLogProbs {
  at::Tensor log_probs;  // float32, targets' shape: log p(target | context)
  at::Tensor entropy;    // float32, targets' shape, when asked for

  /// Its tensors for a unit's call (fsdpx::forward and Fsdp::call hook and cast them).
  template <class Fn>
  void transform_tensors(Fn&& fn) {
    log_probs = fn(std::move(log_probs));
    entropy = fn(std::move(entropy));
  }
};

/// log softmax(hidden W^T (+ bias) / temperature) at each target, and optionally the entropy, both
/// differentiable. Every target must be a valid index (mask the padding afterwards).
FSDPX_DECL TokenLogProbs linear_log_probs(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                                          const LogProbOptions& options = {}, const at::Tensor& bias = {});

/// labels [batch, seq] (int64) -> the next token's label at each position, ignore_index at the last:
/// what a causal LM at position t is trained to predict.
FSDPX_DECL at::Tensor shift_labels(const at::Tensor& labels, int64_t ignore_index = -100);

/// Mean next-token cross-entropy of whole logits [batch, seq, vocabulary] against labels [batch, seq]
/// (shifted inside, ignore_index ignored), in float32: transformers' causal-LM loss, and the unchunked
/// reference of CausalLM::loss.
FSDPX_DECL at::Tensor causal_lm_loss(const at::Tensor& logits, const at::Tensor& labels, int64_t ignore_index = -100);

}  // namespace fsdpx::models

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/models/impl/loss.ipp>
#endif
