// Agreeing on an outcome: after work that may fail on some ranks only (a write on rank 0, a read on
// each), every rank learns whether any failed, and why, before it goes on. A rank that failed and
// simply went on to the next collective would leave the others waiting in a different one.
#pragma once

#include <algorithm>
#include <exception>
#include <string>
#include <string_view>

#include <ATen/ATen.h>

#include <fsdpx/dist/any.hpp>
#include <fsdpx/error.hpp>

namespace fsdpx::dist {

/// Runs `fn`, keeping its exception instead of throwing it.
template <class Fn>
std::exception_ptr capture_failure(Fn&& fn) noexcept {
  try {
    fn();
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

/// Collective over `comm`: each rank passes its own failure (null when it succeeded). When any rank
/// failed, every rank throws: a failed rank rethrows its own exception, the others an `ErrorType`
/// saying that `what` failed on the lowest failed rank, with that rank's message.
template <class ErrorType = Error>
void agree_on_outcome(AnyCommunicator& comm, const std::exception_ptr& failure, std::string_view what) {
  std::string message;
  if (failure) {
    try {
      std::rethrow_exception(failure);
    } catch (const std::exception& e) {
      message = e.what();
    } catch (...) {
      message = "an exception that is not a std::exception";
    }
    message.resize(std::min<size_t>(message.size(), 4000));
  }
  const auto options = at::TensorOptions().device(comm.device_type());
  // The lowest failed rank (size: none) and its message's length, in one reduction: min over
  // (rank, -length) is not one op, so the rank goes first and the length follows from that rank.
  at::Tensor lowest = at::full({1}, failure ? comm.rank() : comm.size(), options.dtype(at::kLong));
  comm.all_reduce(lowest, ReduceOp::min);
  const int failed = static_cast<int>(lowest.item<int64_t>());
  if (failed == comm.size()) return;
  at::Tensor length = at::full({1}, static_cast<int64_t>(message.size()), options.dtype(at::kLong));
  comm.broadcast(length, failed);
  const int64_t n = length.item<int64_t>();
  at::Tensor text = at::zeros({std::max<int64_t>(n, 1)}, options.dtype(at::kByte));
  if (comm.rank() == failed && n > 0)
    text.copy_(at::from_blob(message.data(), {n}, at::TensorOptions().dtype(at::kByte)));
  comm.broadcast(text, failed);
  if (failure) std::rethrow_exception(failure);
  const at::Tensor host = text.to(at::kCPU);
  const std::string cause(static_cast<const char*>(host.data_ptr()), static_cast<size_t>(n));
  throw ErrorType(::fsdpx::detail::str("fsdpx: ", what, " failed on rank ", failed, " of '", comm.name(),
                                       "', and this rank stopped with it: ", ::fsdpx::detail::unprefixed(cause)));
}

}  // namespace fsdpx::dist
