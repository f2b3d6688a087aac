// Sequence parallelism (Ulysses): the P ranks of a sequence group each hold consecutive tokens
// [r t, (r + 1) t) of the same rows; attention's all-to-alls (sequence_to_heads, heads_to_sequence) give
// each rank its heads for the whole sequence and back.
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
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/custom_function.h>

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

// ---- The attention's all-to-alls ---------------------------------------------------------------------
// DeepSpeed-Ulysses: the P ranks of a sequence group each hold consecutive slices of one sequence. Before
// attention one all-to-all turns each rank's [tokens / P, heads] into [tokens, heads / P] (its heads for
// the whole sequence), so attention runs on whole sequences; after it, the inverse all-to-all turns the
// output back. The exchange only moves data, so it and its gradient (the other direction) are exact.

namespace detail {

/// The communicator of a sequence group, carried through autograd (whose saved data holds IValues).
struct SequenceGroupHolder : torch::CustomClassHolder {
  explicit SequenceGroupHolder(dist::AnyCommunicator g) : group(std::move(g)) {}
  dist::AnyCommunicator group;
};

/// [batch, tokens / P, heads, head_dim] <-> [batch, tokens, heads / P, head_dim] over `group`, in
/// `group`'s rank order (rank c holds the c-th slice of the sequence and the c-th group of heads).
inline at::Tensor ulysses_exchange(const at::Tensor& x, dist::AnyCommunicator& group, bool to_heads) {
  const int64_t p = group.size(), b = x.size(0), t = x.size(1), h = x.size(2), d = x.size(3);
  if (p == 1) return x;
  if (to_heads) {
    // Chunk c of the send buffer: heads group c of this rank's tokens, for rank c.
    const at::Tensor send = x.reshape({b, t, p, h / p, d}).permute({2, 0, 1, 3, 4}).contiguous();
    at::Tensor recv = at::empty_like(send);
    group.all_to_all(recv, send);  // slot c: rank c's slice of the sequence, this rank's heads
    return recv.permute({1, 0, 2, 3, 4}).reshape({b, p * t, h / p, d});
  }
  // Chunk c of the send buffer: slice c of the sequence, this rank's heads, for rank c.
  const at::Tensor send = x.reshape({b, p, t / p, h, d}).permute({1, 0, 2, 3, 4}).contiguous();
  at::Tensor recv = at::empty_like(send);
  group.all_to_all(recv, send);  // slot c: rank c's heads for this rank's slice
  return recv.permute({1, 2, 0, 3, 4}).reshape({b, t / p, p * h, d});
}

struct UlyssesExchange : torch::autograd::Function<UlyssesExchange> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            c10::intrusive_ptr<SequenceGroupHolder> holder, bool to_heads) {
    ctx->saved_data["group"] = c10::IValue::make_capsule(holder);
    ctx->saved_data["to_heads"] = to_heads;
    return ulysses_exchange(x, holder->group, to_heads);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};  // the output went unused
    auto holder = c10::static_intrusive_pointer_cast<SequenceGroupHolder>(ctx->saved_data["group"].toCapsule());
    const bool to_heads = ctx->saved_data["to_heads"].toBool();
    return {ulysses_exchange(grads[0].contiguous(), holder->group, !to_heads), at::Tensor(), at::Tensor()};
  }
};

inline at::Tensor ulysses(const at::Tensor& x, const dist::AnyCommunicator& group, bool to_heads) {
  const int64_t p = group.size();
  const char* what = to_heads ? "sequence_to_heads" : "heads_to_sequence";
  FSDPX_CHECK(x.dim() == 4, what, ": x must be [batch, tokens, heads, head_dim], not ", x.sizes());
  if (to_heads) {
    FSDPX_CHECK(x.size(2) % p == 0, what, ": ", x.size(2), " heads do not split over a sequence group of ", p,
                " ranks; repeat the key/value heads up to a multiple of it first");
  } else {
    FSDPX_CHECK(x.size(1) % p == 0, what, ": ", x.size(1), " tokens (the whole sequence) do not split into ", p,
                " slices; pad the sequence to a multiple of the group's size");
  }
  return UlyssesExchange::apply(x, c10::make_intrusive<SequenceGroupHolder>(group), to_heads);
}

}  // namespace detail

/// Ulysses' first all-to-all: this rank's slice of the sequence with every head, [batch, tokens / P,
/// heads, head_dim], to its heads group (heads / P of them) for the whole sequence, [batch, tokens,
/// heads / P, head_dim]. `group` is the sequence group (P = its size; rank c holds slice c and heads
/// group c). Differentiable: the gradient travels back through the inverse exchange.
inline at::Tensor sequence_to_heads(const at::Tensor& x, const dist::AnyCommunicator& group) {
  return detail::ulysses(x, group, /*to_heads=*/true);
}

/// Ulysses' second all-to-all, the inverse of sequence_to_heads: [batch, tokens, heads / P, head_dim]
/// back to this rank's slice with every head, [batch, tokens / P, heads, head_dim].
inline at::Tensor heads_to_sequence(const at::Tensor& x, const dist::AnyCommunicator& group) {
  return detail::ulysses(x, group, /*to_heads=*/false);
}

}  // namespace fsdpx::models
