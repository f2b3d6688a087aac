// fsdpx error types and the FSDPX_CHECK family (TORCH_CHECK-style: the message names the cause).
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace fsdpx {

/// Base of every error fsdpx throws.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Wrong configuration: launcher environment, mesh shape, policy values, tensor arguments.
class ConfigError : public Error {
 public:
  using Error::Error;
};

/// A collective or rendezvous did not complete within its deadline (a peer died or never arrived).
class TimeoutError : public Error {
 public:
  using Error::Error;
};

/// A communication backend reported a failure, or a communicator is unusable after an earlier one.
class CommError : public Error {
 public:
  using Error::Error;
};

/// Reading or writing a checkpoint or a shard failed: a missing, truncated or corrupt file, a full disk,
/// an I/O error. The message names the file.
class IoError : public Error {
 public:
  using Error::Error;
};

/// Weight sync between trainer and rollout failed: a lost peer, a version that never came, a bad frame.
class SyncError : public Error {
 public:
  using Error::Error;
};

namespace detail {

template <class... Args>
std::string str(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

}  // namespace detail
}  // namespace fsdpx

/// Throws `ErrorType` with "fsdpx: " followed by the streamed message parts when `cond` is false.
#define FSDPX_CHECK_AS(ErrorType, cond, ...)                                \
  do {                                                                      \
    if (!(cond)) [[unlikely]] {                                             \
      throw ErrorType(::fsdpx::detail::str("fsdpx: ", __VA_ARGS__));        \
    }                                                                       \
  } while (false)

/// Argument and configuration checks.
#define FSDPX_CHECK(cond, ...) FSDPX_CHECK_AS(::fsdpx::ConfigError, cond, __VA_ARGS__)
