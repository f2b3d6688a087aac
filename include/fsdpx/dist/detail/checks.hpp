// Argument checks shared by the backends, so every backend rejects bad input with the same words.
// `ctx` names the collective: an OpContext, or its text.
#pragma once

#include <cstdint>
#include <memory>
#include <ostream>
#include <sstream>
#include <string>
#include <string_view>

#include <ATen/core/Tensor.h>

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

}  // namespace fsdpx::dist::detail
