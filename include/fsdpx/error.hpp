// fsdpx error types and the FSDPX_CHECK family (TORCH_CHECK-style: the message names the cause).
#pragma once

#include <algorithm>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

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

/// An invariant of fsdpx itself broke: a bug in fsdpx, not a cause in the user's input or system.
class InternalError : public Error {
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

/// "a, b, c and 7 more": the distinct names, sorted, the first `shown` of them (for an error that lists
/// what is missing or wrong).
inline std::string join_names(std::vector<std::string> names, size_t shown = 20) {
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  std::string s;
  for (size_t i = 0; i < std::min(shown, names.size()); ++i) s += (i ? ", " : "") + names[i];
  if (names.size() > shown) s += str(" and ", names.size() - shown, " more");
  return s;
}

/// An error's text without the "fsdpx: " that starts every message, to quote it inside another.
inline std::string_view unprefixed(std::string_view text) {
  return text.starts_with("fsdpx: ") ? text.substr(7) : text;
}

/// Throws `ErrorType` with "fsdpx: " followed by the message parts; for paths that cannot go on.
template <class ErrorType, class... Args>
[[noreturn]] void fail(const Args&... args) {
  throw ErrorType(::fsdpx::detail::str("fsdpx: ", args...));
}

}  // namespace detail
}  // namespace fsdpx

/// Throws `ErrorType` with "fsdpx: " followed by the streamed message parts when `cond` is false.
#define FSDPX_CHECK_AS(ErrorType, cond, ...)                         \
  do {                                                               \
    if (!(cond)) [[unlikely]] {                                      \
      throw ErrorType(::fsdpx::detail::str("fsdpx: ", __VA_ARGS__)); \
    }                                                                \
  } while (false)

/// Argument and configuration checks.
#define FSDPX_CHECK(cond, ...) FSDPX_CHECK_AS(::fsdpx::ConfigError, cond, __VA_ARGS__)

/// Throws `ErrorType` unconditionally (a path that cannot go on); the compiler knows it does not return.
#define FSDPX_FAIL(ErrorType, ...) ::fsdpx::detail::fail<ErrorType>(__VA_ARGS__)

/// An invariant of fsdpx's own (not a check of the user's input): InternalError, asking for a report.
#define FSDPX_INTERNAL_ASSERT(cond, ...) \
  FSDPX_CHECK_AS(::fsdpx::InternalError, cond, "internal error (a bug in fsdpx, please report it): ", __VA_ARGS__)
