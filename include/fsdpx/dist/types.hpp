// Vocabulary shared by every communication backend.
#pragma once

#include <chrono>
#include <cstdlib>
#include <string>
#include <string_view>

#include <fsdpx/error.hpp>

namespace fsdpx::dist {
namespace detail {
using ::fsdpx::detail::str;
}  // namespace detail

enum class ReduceOp { sum, avg, max, min };

constexpr std::string_view to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::avg: return "avg";
    case ReduceOp::max: return "max";
    case ReduceOp::min: return "min";
  }
  return "?";
}

/// Deadline for collectives when nothing else is said: FSDPX_TIMEOUT_MS, else 10 minutes (as c10d).
inline std::chrono::milliseconds default_timeout() {
  if (const char* v = std::getenv("FSDPX_TIMEOUT_MS"); v != nullptr && *v != '\0') {
    char* end = nullptr;
    const long long ms = std::strtoll(v, &end, 10);
    FSDPX_CHECK(end != nullptr && *end == '\0' && ms > 0,
                "FSDPX_TIMEOUT_MS must be a positive integer number of milliseconds, got '", v, "'");
    return std::chrono::milliseconds(ms);
  }
  return std::chrono::minutes(10);
}

struct CommOptions {
  /// A collective that has not completed after this long fails with fsdpx::TimeoutError and
  /// leaves its communicator broken (peers cannot be trusted to agree on what happened).
  std::chrono::milliseconds timeout = default_timeout();
  /// Shown in every error message about this communicator.
  std::string name = "world";
};

}  // namespace fsdpx::dist
