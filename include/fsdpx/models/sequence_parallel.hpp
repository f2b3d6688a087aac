// Sequence parallelism's batches (Ulysses; the attention's all-to-alls are models/attention.hpp's):
// the P ranks of a sequence group each hold consecutive tokens [r t, (r + 1) t) of the same rows.
//
//   auto group = *fsdp.sequence_group();                       // Fsdp<CausalLM, SequenceParallel<2>>
//   auto ids = models::sequence_slice(batch.input_ids, group);  // checks that the group holds the same rows
//   auto loss = fsdp->loss(ids, models::sequence_slice(batch.labels, group), batch.samples);
//
// What a slice needs from the others: the whole rows' attention mask and position ids
// (gather_sequence), each position's next token (next_across_slices), and the certainty that every
// rank passed slices of the same rows: a rank that did not is an error on every rank of the group
// before an exchange can hang on mismatched sizes (check_group_agrees).
#pragma once

#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include <fsdpx/detail/crc32c.hpp>
#include <fsdpx/dist/any.hpp>
#include <fsdpx/error.hpp>

namespace fsdpx::models {

namespace detail {

/// A device the group's collectives take: `preferred` when the group works on its type.
inline c10::Device collective_device(const dist::AnyCommunicator& group, c10::Device preferred) {
  return preferred.type() == group.device_type() ? preferred : c10::Device(group.device_type());
}

/// An error on every rank of `group` unless all of them hold the same `facts` and none found a
/// `problem` with its own inputs (collective: one all-gather of a few integers, read on the host), so
/// that no rank throws alone while the others wait in an exchange. names[i] says what facts[i] is.
inline void check_group_agrees(dist::AnyCommunicator group, const char* what, std::vector<int64_t> facts,
                               const std::vector<const char*>& names, c10::Device device,
                               const std::exception_ptr& problem = nullptr) {
  facts.insert(facts.begin(), problem ? 1 : 0);
  const auto n = static_cast<int64_t>(facts.size());
  const at::Tensor mine = at::tensor(facts, at::TensorOptions().dtype(at::kLong)).to(collective_device(group, device));
  at::Tensor all = at::empty({group.size(), n}, mine.options());
  group.all_gather(all, mine);
  const at::Tensor host = all.cpu();
  const auto* v = host.const_data_ptr<int64_t>();
  if (problem) std::rethrow_exception(problem);
  for (int r = 0; r < group.size(); ++r) {
    FSDPX_CHECK(v[r * n] == 0, what, ": rank ", r,
                " of the sequence group refused its inputs (its own error says why); no exchange was started");
  }
  for (int r = 1; r < group.size(); ++r) {
    for (int64_t i = 1; i < n; ++i) {
      FSDPX_CHECK(v[r * n + i] == v[i], what, ": rank ", r, " of the sequence group passed ", names[i - 1], " ",
                  v[r * n + i], " where rank 0 passed ", v[i],
                  "; every rank of a sequence group must pass its slice of the same rows");
    }
  }
}

/// What `check` throws (null when it passes): a rank's own checks, thrown by check_group_agrees once
/// the group knows.
template <class Check>
std::exception_ptr problem_of(Check&& check) {
  try {
    check();
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

}  // namespace detail

/// The whole rows [batch, P t] of each rank's slice [batch, t] (collective over `group`).
inline at::Tensor gather_sequence(const at::Tensor& slice, dist::AnyCommunicator group) {
  FSDPX_CHECK(slice.dim() == 2, "gather_sequence: a slice must be [batch, tokens], not ", slice.sizes());
  const int64_t p = group.size(), batch = slice.size(0), t = slice.size(1);
  if (p == 1) return slice;
  const at::Tensor mine = slice.to(detail::collective_device(group, slice.device())).contiguous();
  at::Tensor all = at::empty({p, batch, t}, mine.options());
  group.all_gather(all, mine);
  return all.permute({1, 0, 2}).reshape({batch, p * t}).to(slice.device());
}

/// Each position's next token over the group's slices [batch, t]: this slice's from the second on, then
/// the next rank's first; the last rank's last position holds `fill` (collective over `group`).
inline at::Tensor next_across_slices(const at::Tensor& slice, dist::AnyCommunicator group, int64_t fill) {
  FSDPX_CHECK(slice.dim() == 2 && slice.size(1) >= 1, "next_across_slices: a slice must be [batch, tokens], not ",
              slice.sizes());
  const int64_t p = group.size(), r = group.rank(), batch = slice.size(0);
  at::Tensor firsts = at::empty({p, batch}, slice.options().device(detail::collective_device(group, slice.device())));
  group.all_gather(firsts, slice.select(1, 0).contiguous().to(firsts.device()));
  const at::Tensor next = r + 1 < p ? firsts[r + 1].to(slice.device()) : at::full({batch}, fill, slice.options());
  return at::cat({slice.narrow(1, 1, slice.size(1) - 1), next.unsqueeze(1)}, 1);
}

/// This rank's slice of whole rows [batch, P t, ...]: tokens [r t, (r + 1) t) of dimension 1. Collective:
/// checks that every rank of the group passed the same rows (their shape and a checksum of their
/// values), so a rank fed other samples is an error on every rank, naming it.
inline at::Tensor sequence_slice(const at::Tensor& whole, dist::AnyCommunicator group) {
  const int64_t p = group.size(), r = group.rank();
  const std::exception_ptr problem = detail::problem_of([&] {
    FSDPX_CHECK(whole.dim() >= 2, "sequence_slice: rows must be [batch, tokens, ...], not ", whole.sizes());
    FSDPX_CHECK(whole.size(1) % p == 0, "sequence_slice: rows of ", whole.size(1), " tokens do not split into ", p,
                " slices; pad them to a multiple of the sequence group's size (PackOptions::pad_to_multiple_of)");
  });
  std::vector<int64_t> facts(5, -1);
  if (!problem) {
    const at::Tensor host = whole.cpu().contiguous();  // the whole rows once on the host, for their checksum
    facts = {
        whole.size(0), whole.size(1), whole.dim(), static_cast<int64_t>(whole.scalar_type()),
        static_cast<int64_t>(::fsdpx::detail::Crc32c::of(host.const_data_ptr(), static_cast<size_t>(host.nbytes())))};
  }
  detail::check_group_agrees(group, "sequence_slice", facts,
                             {"rows", "tokens per row", "dimensions", "dtype", "rows whose checksum is"},
                             whole.device(), problem);
  const int64_t t = whole.size(1) / p;
  return whole.narrow(1, r * t, t).contiguous();
}

/// Turns a model's sequence group off for a scope (generation, which runs on whole rows) and back on at
/// its end, however the scope ends: models::SequenceGroupOff whole_rows(*fsdp.module());
template <class Model>
class SequenceGroupOff {
 public:
  explicit SequenceGroupOff(Model& model) : model_(model), group_(model.sequence_group()) {
    model_.set_sequence_group(std::nullopt);
  }
  ~SequenceGroupOff() { model_.set_sequence_group(group_); }
  SequenceGroupOff(const SequenceGroupOff&) = delete;
  SequenceGroupOff& operator=(const SequenceGroupOff&) = delete;

 private:
  Model& model_;
  std::optional<dist::AnyCommunicator> group_;
};

}  // namespace fsdpx::models
