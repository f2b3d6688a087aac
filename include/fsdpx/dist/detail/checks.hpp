// Argument checks shared by the backends, so every backend rejects bad input with the same words.
// `ctx` names the collective: an OpContext, or its text.
#pragma once

#include <cstdint>
#include <memory>
#include <ostream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/accumulate.h>

#include <fsdpx/dist/types.hpp>
#include <fsdpx/error.hpp>

namespace fsdpx::dist::detail {

inline std::ostream& write_op_context(std::ostream& os, std::string_view op, std::string_view comm_name, int rank,
                                      int size) {
  return os << op << " on communicator '" << comm_name << "' (rank " << rank << " of " << size << ")";
}

/// "all_gather on communicator 'world' (rank 1 of 4)"
inline std::string op_context(std::string_view op, std::string_view comm_name, int rank, int size) {
  std::ostringstream os;
  write_op_context(os, op, comm_name, rank, size);
  return os.str();
}

/// Names a collective in its errors, as op_context() does, without building the text: a collective
/// carries one, and the words are written only when an error or a report needs them. `op` is short
/// ("all_gather", within std::string's inline capacity), so carrying one does not allocate.
struct OpContext {
  std::string op;
  std::shared_ptr<const std::string> comm_name;  // the communicator's, shared by its collectives
  int rank = 0;
  int size = 1;

  friend std::ostream& operator<<(std::ostream& os, const OpContext& c) {
    return write_op_context(os, c.op, c.comm_name ? std::string_view(*c.comm_name) : std::string_view("?"), c.rank,
                            c.size);
  }
};

template <class Context>
inline void check_tensor(const Context& ctx, std::string_view role, const at::Tensor& t, c10::DeviceType device_type) {
  FSDPX_CHECK(t.defined(), ctx, ": the ", role, " tensor is undefined");
  FSDPX_CHECK(t.device().type() == device_type, ctx, ": the ", role, " tensor is on ", t.device(),
              " but this backend works on ", c10::DeviceTypeName(device_type, /*lower_case=*/true), " tensors");
  FSDPX_CHECK(t.is_contiguous(), ctx, ": the ", role, " tensor must be contiguous");
}

template <class Context>
inline void check_same_dtype(const Context& ctx, const at::Tensor& output, const at::Tensor& input) {
  FSDPX_CHECK(output.scalar_type() == input.scalar_type(), ctx, ": output dtype ", output.scalar_type(),
              " differs from input dtype ", input.scalar_type());
  FSDPX_CHECK(output.device() == input.device(), ctx, ": output is on ", output.device(), " but input is on ",
              input.device());
}

/// For all_gather (big = output) and reduce_scatter (big = input): big.numel() == size * small.numel().
template <class Context>
inline void check_scatter_sizes(const Context& ctx, const at::Tensor& big, std::string_view big_role,
                                const at::Tensor& small, std::string_view small_role, int size) {
  FSDPX_CHECK(big.numel() == small.numel() * size, ctx, ": the ", big_role, " must hold world size x ", small_role,
              " elements (", size, " x ", small.numel(), " = ", small.numel() * size, "), got ", big.numel(),
              "; pad the ", small_role, " so every rank contributes the same count");
}

template <class Context>
inline void check_root(const Context& ctx, int root, int size) {
  FSDPX_CHECK(root >= 0 && root < size, ctx, ": root ", root, " is not a rank of a communicator of size ", size);
}

/// Average needs a floating dtype; integer averages would silently truncate.
template <class Context>
inline void check_reduce_dtype(const Context& ctx, bool is_avg, const at::Tensor& t) {
  FSDPX_CHECK(!is_avg || at::isFloatingType(t.scalar_type()), ctx, ": ReduceOp::avg needs a floating dtype, got ",
              t.scalar_type());
}

/// Whether two tensors' bytes overlap (empty tensors overlap nothing).
inline bool overlaps(const at::Tensor& a, const at::Tensor& b) {
  const auto* a0 = static_cast<const char*>(a.const_data_ptr());
  const auto* b0 = static_cast<const char*>(b.const_data_ptr());
  return a.nbytes() > 0 && b.nbytes() > 0 && a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

/// all_to_all's blocks in elements of the flattened tensors: block c of the input goes to rank c,
/// block c of the output comes from rank c.
struct AllToAllPlan {
  std::vector<int64_t> send_offset, send_count, recv_offset, recv_count;
};

/// Checks all_to_all_v's splits (rows of dimension 0, one count per rank) against the tensors and
/// lays out its blocks; this rank's own block is copied, so it must be the same size both ways.
template <class Context>
inline AllToAllPlan all_to_all_plan(const Context& ctx, const at::Tensor& output, const at::Tensor& input,
                                    at::IntArrayRef output_splits, at::IntArrayRef input_splits, int rank, int size) {
  FSDPX_CHECK(output_splits.size() == static_cast<size_t>(size) && input_splits.size() == static_cast<size_t>(size),
              ctx, ": output_splits and input_splits must hold one row count per rank (", size, "), not ",
              output_splits.size(), " and ", input_splits.size());
  FSDPX_CHECK(input.dim() >= 1 && output.dim() >= 1, ctx, ": the input and the output are split along dimension 0; ",
              "a scalar has none");
  FSDPX_CHECK(input.sizes().slice(1) == output.sizes().slice(1), ctx, ": the input's rows ", input.sizes().slice(1),
              " and the output's rows ", output.sizes().slice(1), " must have one shape");
  const auto checked_total = [&](at::IntArrayRef splits, const char* role, const at::Tensor& t) {
    int64_t total = 0;
    for (size_t c = 0; c < splits.size(); ++c) {
      FSDPX_CHECK(splits[c] >= 0, ctx, ": ", role, "_splits[", c, "] is ", splits[c], "; a row count is >= 0");
      total += splits[c];
    }
    FSDPX_CHECK(total == t.size(0), ctx, ": ", role, "_splits add up to ", total, " rows but the ", role, " has ",
                t.size(0));
  };
  checked_total(output_splits, "output", output);
  checked_total(input_splits, "input", input);
  FSDPX_CHECK(!overlaps(output, input), ctx, ": the output overlaps the input");
  FSDPX_CHECK(output_splits[rank] == input_splits[rank], ctx, ": this rank keeps ", input_splits[rank],
              " rows of its input (input_splits[", rank, "]) but output_splits[", rank, "] makes room for ",
              output_splits[rank]);
  const int64_t row = c10::multiply_integers(input.sizes().slice(1));
  AllToAllPlan plan;
  int64_t sent = 0, received = 0;
  for (int c = 0; c < size; ++c) {
    plan.send_offset.push_back(sent * row);
    plan.send_count.push_back(input_splits[c] * row);
    plan.recv_offset.push_back(received * row);
    plan.recv_count.push_back(output_splits[c] * row);
    sent += input_splits[c];
    received += output_splits[c];
  }
  return plan;
}

/// all_to_all's equal blocks as all_to_all_v's: the flattened tensors, size x n elements each, and n
/// elements per rank both ways.
template <class Context>
inline std::vector<int64_t> equal_all_to_all_splits(const Context& ctx, const at::Tensor& output,
                                                    const at::Tensor& input, int size) {
  FSDPX_CHECK(output.defined() && input.defined(), ctx, ": the input and the output must be defined");
  FSDPX_CHECK(output.is_contiguous() && input.is_contiguous(), ctx, ": the input and the output must be contiguous");
  FSDPX_CHECK(input.numel() % size == 0 && output.numel() == input.numel(), ctx,
              ": the input and the output must each hold world size x n elements (", size, " x n), got ", input.numel(),
              " and ", output.numel());
  return std::vector<int64_t>(static_cast<size_t>(size), input.numel() / size);
}

}  // namespace fsdpx::dist::detail
