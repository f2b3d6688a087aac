// models/packing.hpp's definitions: included by that header (header-only) or by fsdpx/impl/src.hpp
// (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <algorithm>
#include <limits>
#include <numeric>

#include <ATen/ATen.h>

#include <fsdpx/error.hpp>
#include <fsdpx/models/packing.hpp>

namespace fsdpx::models {

namespace detail {

/// The runs of consecutive positions in each row of [rows, seq] int64 position ids (on the host).
inline std::vector<SampleSpan> position_runs(const at::Tensor& positions) {
  std::vector<SampleSpan> spans;
  const int64_t rows = positions.size(0), seq = positions.size(1);
  const auto p = positions.accessor<int64_t, 2>();
  for (int64_t r = 0; r < rows; ++r) {
    int64_t start = 0;
    for (int64_t t = 1; t <= seq; ++t) {
      if (t == seq || p[r][t] != p[r][t - 1] + 1) {
        spans.push_back({r, start, t - start});
        start = t;
      }
    }
  }
  return spans;
}

inline at::Tensor host_positions(const at::Tensor& position_ids, int64_t batch) {
  FSDPX_CHECK(position_ids.defined() && position_ids.dim() == 2 && position_ids.scalar_type() == at::kLong &&
                  (position_ids.size(0) == batch || position_ids.size(0) == 1),
              "position_ids must be int64 [batch, seq] or [1, seq] with batch = ", batch, ", not ",
              position_ids.defined() ? position_ids.toString() : "undefined", " ",
              position_ids.defined() ? position_ids.sizes() : at::IntArrayRef{});
  FSDPX_CHECK(position_ids.size(1) > 0, "position_ids: a packed row must hold at least one token");
  return position_ids.to(at::kCPU).expand({batch, position_ids.size(1)}).contiguous();
}

}  // namespace detail

FSDPX_DECL PackedSamples PackedSamples::from_position_ids(const at::Tensor& position_ids, int64_t batch) {
  const at::Tensor positions = detail::host_positions(position_ids, batch);
  PackedSamples s;
  s.batch_ = batch;
  s.seq_ = positions.size(1);
  s.spans_ = detail::position_runs(positions);
  const auto p = positions.accessor<int64_t, 2>();
  for (const SampleSpan& span : s.spans_) {
    FSDPX_CHECK(p[span.row][span.start] == 0, "position_ids do not describe packed samples: in row ", span.row,
                " a sample starts at token ", span.start, " with position ", p[span.row][span.start],
                ", not 0 (each sample's positions must run 0, 1, ..., length - 1)");
    s.max_length_ = std::max(s.max_length_, span.length);
  }
  return s;
}

FSDPX_DECL PackedSamples PackedSamples::detect(const at::Tensor& position_ids, int64_t batch) {
  const at::Tensor positions = detail::host_positions(position_ids, batch);
  if (detail::position_runs(positions).size() == static_cast<size_t>(batch)) return {};
  return from_position_ids(positions, batch);
}

FSDPX_DECL PackedSamples PackedSamples::from_cu_seqlens(const at::Tensor& cu_seqlens, int64_t batch, int64_t seq) {
  FSDPX_CHECK(cu_seqlens.defined() && cu_seqlens.dim() == 1 && cu_seqlens.size(0) >= 2 &&
                  (cu_seqlens.scalar_type() == at::kInt || cu_seqlens.scalar_type() == at::kLong),
              "cu_seqlens must be int32 or int64 [samples + 1] with at least one sample");
  FSDPX_CHECK(batch > 0 && seq > 0, "cu_seqlens: the batch must hold tokens, not [", batch, ", ", seq, "]");
  const at::Tensor cu = cu_seqlens.to(at::kCPU, at::kLong).contiguous();
  const int64_t* c = cu.data_ptr<int64_t>();
  const int64_t n = cu.size(0) - 1;
  FSDPX_CHECK(c[0] == 0, "cu_seqlens must start at 0, not ", c[0]);
  FSDPX_CHECK(c[n] == batch * seq, "cu_seqlens end at ", c[n], " but the batch holds ", batch, " x ", seq, " = ",
              batch * seq, " tokens (the samples' lengths must sum to the rows')");
  PackedSamples s;
  s.batch_ = batch;
  s.seq_ = seq;
  for (int64_t i = 0; i < n; ++i) {
    FSDPX_CHECK(c[i + 1] > c[i], "cu_seqlens: sample ", i, " is empty (cu_seqlens[", i, "] = cu_seqlens[", i + 1,
                "] = ", c[i], "); every sample holds at least one token");
    const int64_t row = c[i] / seq, start = c[i] % seq, length = c[i + 1] - c[i];
    FSDPX_CHECK(start + length <= seq, "cu_seqlens: sample ", i, " (tokens ", c[i], " to ", c[i + 1],
                ") crosses the end of row ", row, " (rows hold ", seq, " tokens; a sample lies in one row)");
    s.spans_.push_back({row, start, length});
    s.max_length_ = std::max(s.max_length_, length);
  }
  return s;
}

FSDPX_DECL void PackedSamples::check_shape(const char* what, int64_t batch, int64_t seq) const {
  FSDPX_CHECK(!empty(), what, ": the packed samples are empty (no description)");
  FSDPX_CHECK(batch_ == batch && seq_ == seq, what, ": the packed samples describe a [", batch_, ", ", seq_,
              "] batch, but the "
              "input is [",
              batch, ", ", seq, "]");
}

FSDPX_DECL at::Tensor PackedSamples::position_ids(c10::Device device) const {
  at::Tensor out = at::empty({batch_, seq_}, at::TensorOptions().dtype(at::kLong));
  auto p = out.accessor<int64_t, 2>();
  for (const SampleSpan& s : spans_) {
    for (int64_t t = 0; t < s.length; ++t) p[s.row][s.start + t] = t;
  }
  return out.to(device);
}

FSDPX_DECL at::Tensor PackedSamples::cu_seqlens(c10::Device device) const {
  FSDPX_CHECK(batch_ * seq_ <= std::numeric_limits<int32_t>::max(), "PackedSamples::cu_seqlens: ", batch_, " x ", seq_,
              " tokens do not fit flash-attention's int32 offsets");
  at::Tensor out = at::empty({static_cast<int64_t>(spans_.size()) + 1}, at::TensorOptions().dtype(at::kInt));
  int32_t* c = out.data_ptr<int32_t>();
  c[0] = 0;
  for (size_t i = 0; i < spans_.size(); ++i)
    c[i + 1] = static_cast<int32_t>(spans_[i].row * seq_ + spans_[i].start + spans_[i].length);
  return out.to(device);
}

FSDPX_DECL at::Tensor PackedSamples::next_token_mask(c10::Device device) const {
  at::Tensor out = at::ones({batch_, std::max<int64_t>(seq_ - 1, 0)}, at::TensorOptions().dtype(at::kBool));
  auto m = out.accessor<bool, 2>();
  for (const SampleSpan& s : spans_) {
    const int64_t last = s.start + s.length - 1;
    if (last < seq_ - 1) m[s.row][last] = false;
  }
  return out.to(device);
}

FSDPX_DECL std::vector<at::Tensor> PackedBatch::unpack(const at::Tensor& values, int64_t trim_last) const {
  FSDPX_CHECK(trim_last >= 0, "PackedBatch::unpack: trim_last must be >= 0, not ", trim_last);
  FSDPX_CHECK(values.defined() && values.dim() >= 2 && values.size(0) == input_ids.size(0) &&
                  values.size(1) == input_ids.size(1) - trim_last,
              "PackedBatch::unpack: values must be [rows, seq - trim_last, ...] = [", input_ids.size(0), ", ",
              input_ids.size(1) - trim_last, ", ...], not ", values.defined() ? values.sizes() : at::IntArrayRef{});
  std::vector<at::Tensor> out;
  out.reserve(placement.size());
  for (const SampleSpan& s : placement) {
    out.push_back(values[s.row].narrow(0, s.start, std::max<int64_t>(s.length - trim_last, 0)));
  }
  return out;
}

FSDPX_DECL PackedBatch PackedBatch::row(int64_t r) const {
  FSDPX_CHECK(r >= 0 && r < static_cast<int64_t>(row_tokens.size()), "PackedBatch::row: row ", r, " of a batch of ",
              row_tokens.size(), " rows");
  const int64_t n = row_tokens[static_cast<size_t>(r)];
  PackedBatch out;
  out.input_ids = input_ids.narrow(0, r, 1).narrow(1, 0, n);
  out.position_ids = position_ids.narrow(0, r, 1).narrow(1, 0, n);
  out.labels = labels.narrow(0, r, 1).narrow(1, 0, n);
  out.token_mask = token_mask.narrow(0, r, 1).narrow(1, 0, n);
  out.samples = PackedSamples::from_position_ids(out.position_ids, 1);
  out.row_tokens = {n};
  for (const SampleSpan& s : placement) {
    if (s.row == r) out.placement.push_back({0, s.start, s.length});
  }
  return out;
}

FSDPX_DECL PackedBatch pack_sequences(const std::vector<at::Tensor>& sequences, const PackOptions& options) {
  FSDPX_CHECK(options.token_budget > 0, "pack_sequences: token_budget must be positive, not ", options.token_budget);
  FSDPX_CHECK(options.pad_to_multiple_of > 0, "pack_sequences: pad_to_multiple_of must be positive, not ",
              options.pad_to_multiple_of);
  FSDPX_CHECK(!sequences.empty(), "pack_sequences: no sequences to pack");
  for (size_t i = 0; i < sequences.size(); ++i) {
    const at::Tensor& s = sequences[i];
    FSDPX_CHECK(s.defined() && s.dim() == 1 && s.scalar_type() == at::kLong, "pack_sequences: sequence ", i,
                " must be a 1-D int64 tensor of token ids");
    FSDPX_CHECK(s.size(0) > 0, "pack_sequences: sequence ", i, " is empty");
    FSDPX_CHECK(s.size(0) <= options.token_budget, "pack_sequences: sequence ", i, " holds ", s.size(0),
                " tokens, more than the token_budget of ", options.token_budget);
  }
  // First-fit decreasing: the longest first, each into the first row with room.
  std::vector<size_t> order(sequences.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return sequences[a].size(0) > sequences[b].size(0); });
  std::vector<int64_t> used;
  PackedBatch batch;
  batch.placement.resize(sequences.size());
  for (size_t i : order) {
    const int64_t length = sequences[i].size(0);
    size_t row = 0;
    while (row < used.size() && used[row] + length > options.token_budget) ++row;
    if (row == used.size()) used.push_back(0);
    batch.placement[i] = {static_cast<int64_t>(row), used[row], length};
    used[row] += length;
  }
  const int64_t rows = static_cast<int64_t>(used.size()), multiple = options.pad_to_multiple_of,
                seq = (*std::max_element(used.begin(), used.end()) + multiple - 1) / multiple * multiple;
  batch.row_tokens = used;
  const auto device = sequences.front().device();
  batch.input_ids = at::full({rows, seq}, options.pad_token_id, at::TensorOptions().dtype(at::kLong).device(device));
  batch.token_mask = at::zeros({rows, seq}, at::TensorOptions().dtype(at::kBool).device(device));
  std::vector<SampleSpan> spans = batch.placement;
  for (size_t i = 0; i < sequences.size(); ++i) {
    const SampleSpan& s = batch.placement[i];
    batch.input_ids[s.row].narrow(0, s.start, s.length).copy_(sequences[i]);
    batch.token_mask[s.row].narrow(0, s.start, s.length).fill_(true);
  }
  for (int64_t r = 0; r < rows; ++r) {
    if (used[r] < seq) spans.push_back({r, used[r], seq - used[r]});  // the tail padding: a sample of its own
  }
  std::sort(spans.begin(), spans.end(), [](const SampleSpan& a, const SampleSpan& b) {
    return a.row != b.row ? a.row < b.row : a.start < b.start;
  });
  at::Tensor cu = at::empty({static_cast<int64_t>(spans.size()) + 1}, at::TensorOptions().dtype(at::kLong));
  int64_t* c = cu.data_ptr<int64_t>();
  c[0] = 0;
  for (size_t i = 0; i < spans.size(); ++i) c[i + 1] = spans[i].row * seq + spans[i].start + spans[i].length;
  batch.samples = PackedSamples::from_cu_seqlens(cu, rows, seq);
  batch.position_ids = batch.samples.position_ids(device);
  batch.labels = batch.input_ids.masked_fill(batch.token_mask.logical_not(), -100);
  return batch;
}

}  // namespace fsdpx::models
