// Packed batches: several samples concatenated in one row of a batch, without padding between them,
// as RL trainers feed rollouts of very different lengths (verl's remove-padding, OpenRLHF's packed
// samples, transformers' padding-free collator). Attention never crosses a sample's boundary, RoPE
// positions restart at each sample, and the loss and log-probs skip the boundaries.
//
//   auto batch = models::pack_sequences(rollouts, {.token_budget = 4096});        // rows of <= 4096 tokens
//   auto logits = model->forward(batch.input_ids, batch.samples);
//   auto loss = model->loss(batch.input_ids, batch.labels, batch.samples);
//   auto logp = model->log_probs(batch.input_ids, batch.samples);                  // [rows, seq - 1]
//   std::vector<at::Tensor> per_rollout = batch.unpack(logp.log_probs, /*trim_last=*/1);
//
// PackedSamples describes where the samples lie, from the two descriptions in use: position ids that
// restart at 0 for each sample (transformers' padding-free path; CausalLM::forward recognises them by
// themselves), or cumulative sequence lengths over the flattened batch (flash-attention's varlen).
#pragma once

#include <fsdpx/detail/config.hpp>

#include <cstdint>
#include <memory>
#include <ostream>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

namespace fsdpx::models {

/// One sample of a packed batch: its tokens are row `row`, [start, start + length).
struct SampleSpan {
  int64_t row = 0;
  int64_t start = 0;
  int64_t length = 0;
  friend bool operator==(const SampleSpan&, const SampleSpan&) = default;
  friend std::ostream& operator<<(std::ostream& os, const SampleSpan& s) {
    return os << "{row " << s.row << ", start " << s.start << ", length " << s.length << "}";
  }
};

/// Where the samples of a [batch, seq] packed batch lie. Every token belongs to exactly one sample; a
/// sample never crosses a row. Default-constructed: not packed (one sample per row, the whole row).
class PackedSamples {
 public:
  PackedSamples() = default;

  /// From position ids [batch, seq] (or [1, seq] for every row) in which each sample's positions run
  /// 0, 1, ..., length - 1: a sample starts wherever a position is not the one before it plus one.
  /// Error (naming the row and token) where such a start is not 0.
  FSDPX_DECL static PackedSamples from_position_ids(const at::Tensor& position_ids, int64_t batch);
  /// From cumulative lengths [samples + 1] (int32 or int64; 0 first, strictly increasing, batch * seq
  /// last) over the batch's rows laid end to end; each row's end must be a sample's end.
  FSDPX_DECL static PackedSamples from_cu_seqlens(const at::Tensor& cu_seqlens, int64_t batch, int64_t seq);
  /// What CausalLM's forward makes of position ids given without an attention mask: packed samples
  /// when any row restarts (checked as from_position_ids), or none (empty()) when every row is one run
  /// of consecutive positions, whatever it starts at.
  FSDPX_DECL static PackedSamples detect(const at::Tensor& position_ids, int64_t batch);

  /// Not packed: no description given, or one found to hold one sample per row.
  bool empty() const { return spans_.empty(); }
  int64_t batch() const { return batch_; }
  int64_t seq() const { return seq_; }
  /// The samples, row by row, in order.
  const std::vector<SampleSpan>& spans() const { return spans_; }
  int64_t max_length() const { return max_length_; }

  /// [batch, seq] int64: each token's position in its sample.
  FSDPX_DECL at::Tensor position_ids(c10::Device device = c10::kCPU) const;
  /// [samples + 1] int32 over the flattened batch (flash-attention's cu_seqlens).
  FSDPX_DECL at::Tensor cu_seqlens(c10::Device device = c10::kCPU) const;
  /// [batch, seq - 1] bool: true where token t's next token t + 1 is in the same sample, i.e. where
  /// a next-token target (a label, a log-prob) means something.
  FSDPX_DECL at::Tensor next_token_mask(c10::Device device = c10::kCPU) const;
  /// Error (naming `what`) unless this describes a [batch, seq] batch.
  FSDPX_DECL void check_shape(const char* what, int64_t batch, int64_t seq) const;

 private:
  int64_t batch_ = 0, seq_ = 0, max_length_ = 0;
  std::vector<SampleSpan> spans_;
};

/// How the samples of a batch lie in its rows: the one argument CausalLM's forward, loss and log_probs
/// take besides the tokens. One sample per row, padded where an attention mask [batch, seq] holds 0 (or
/// unpadded: nothing), or packed samples; it converts from either, so that
///   model->loss(ids, labels, attention_mask);   model->loss(batch.input_ids, batch.labels, batch.samples);
/// read alike.
struct BatchLayout {
  BatchLayout() = default;
  BatchLayout(at::Tensor mask) : attention_mask(std::move(mask)) {}  // NOLINT(google-explicit-constructor)
  BatchLayout(const PackedSamples& packed)                           // NOLINT(google-explicit-constructor)
      : samples(std::make_shared<const PackedSamples>(packed)) {}

  /// Packed samples given (an empty PackedSamples, as PackedSamples::detect returns for unpacked rows, is not).
  bool packed() const { return samples != nullptr && !samples->empty(); }

  at::Tensor attention_mask;                     // [batch, seq]: 1 on tokens, 0 on padding; undefined: none
  std::shared_ptr<const PackedSamples> samples;  // packed samples (then no attention mask); null: none
};

struct PackOptions {
  /// Tokens per row at most; a sequence longer than this is an error.
  int64_t token_budget = 4096;
  /// Fills the tail of rows shorter than the longest (as a sample of its own, labelled -100).
  int64_t pad_token_id = 0;
  /// The rows' length is rounded up to a multiple of this (transformers' pad_to_multiple_of): e.g. the
  /// sequence parallel size, whose ranks each take an equal slice of every row. Rows may then exceed
  /// token_budget by less than it.
  int64_t pad_to_multiple_of = 1;
};

/// Sequences packed into rows: what pack_sequences returns.
struct PackedBatch {
  at::Tensor input_ids;               // [rows, seq] int64
  at::Tensor position_ids;            // [rows, seq] int64, restarting at 0 at each sample (and at the tail padding)
  at::Tensor labels;                  // input_ids with -100 on the tail padding (the loss's labels)
  at::Tensor token_mask;              // [rows, seq] bool: true on the sequences' tokens, false on the padding
  PackedSamples samples;              // every sample, the tail padding of a row included
  std::vector<SampleSpan> placement;  // placement[i]: where sequences[i] lies
  std::vector<int64_t> row_tokens;    // the tokens of sequences in each row (the rest is its tail padding)

  /// Row `row` alone, without its tail padding: [1, row_tokens[row]] (a micro-batch of one row, so
  /// that no padding is computed at all); its placement lists that row's sequences in the order given.
  FSDPX_DECL PackedBatch row(int64_t row) const;

  /// Per-token values of the batch ([rows, seq - trim_last, ...], e.g. log-probs with trim_last = 1)
  /// split back into one tensor per sequence, in the order given: sequence i gets its length -
  /// trim_last values.
  FSDPX_DECL std::vector<at::Tensor> unpack(const at::Tensor& values, int64_t trim_last = 0) const;
};

/// Packs 1-D int64 token sequences into as few rows of at most options.token_budget tokens as first-fit
/// decreasing finds, every row padded to the longest row's length. Error (naming the sequence) for an
/// empty sequence, one longer than the budget, or one that is not 1-D int64.
FSDPX_DECL PackedBatch pack_sequences(const std::vector<at::Tensor>& sequences, const PackOptions& options = {});

}  // namespace fsdpx::models

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/models/impl/packing.ipp>
#endif
