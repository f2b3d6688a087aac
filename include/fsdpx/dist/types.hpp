// Vocabulary shared by every communication backend.
#pragma once

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <limits>
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

namespace detail {
/// The environment variable `name` as milliseconds, or `fallback` when it is unset or empty. Any value
/// that fits in 64 bits is accepted (positive; zero too where `zero_means` says what it means).
inline std::chrono::milliseconds env_milliseconds(const char* name, std::chrono::milliseconds fallback,
                                                  const char* zero_means = nullptr) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  errno = 0;
  const long long ms = std::strtoll(v, &end, 10);
  FSDPX_CHECK(errno != ERANGE, name, "='", v, "' does not fit in 64 bits; use at most ",
              std::numeric_limits<long long>::max(), " (in effect no deadline)");
  FSDPX_CHECK(end != v && *end == '\0' && (ms > 0 || (ms == 0 && zero_means != nullptr)), name, " must be a ",
              zero_means != nullptr ? "non-negative" : "positive", " integer number of milliseconds",
              zero_means != nullptr ? str(" (0: ", zero_means, ")") : std::string(), ", got '", v, "'");
  return std::chrono::milliseconds(ms);
}
}  // namespace detail

/// Deadline for collectives when nothing else is said: FSDPX_TIMEOUT_MS, else 10 minutes (as c10d).
/// A value too large for a clock to add (1e13 ms and more) means "no deadline" in effect: every
/// deadline saturates (see deadline_after).
inline std::chrono::milliseconds default_timeout() {
  return detail::env_milliseconds("FSDPX_TIMEOUT_MS", std::chrono::minutes(10));
}

/// How long a rank may stay silent before its neighbour declares it unresponsive (stopped, hung, or
/// its host gone) and the collectives waiting for it fail: FSDPX_HEARTBEAT_TIMEOUT_MS, else 15 s; 0:
/// this rank watches no one (set it on every rank to pause one in a debugger; every rank still sends
/// heartbeats). They come from each rank's communication thread, so a rank busy computing for any
/// length of time still answers.
inline std::chrono::milliseconds default_heartbeat_timeout() {
  return detail::env_milliseconds("FSDPX_HEARTBEAT_TIMEOUT_MS", std::chrono::seconds(15), "this rank watches no one");
}

/// `now + timeout`, saturated at the clock's largest time point instead of overflowing (an overflowed
/// deadline lies in the past, and every wait on it would fail at once). Every fsdpx deadline is made
/// here.
template <class Clock = std::chrono::steady_clock, class Rep, class Period>
typename Clock::time_point deadline_after(std::chrono::duration<Rep, Period> timeout,
                                          typename Clock::time_point now = Clock::now()) {
  using D = typename Clock::duration;
  if (timeout <= std::chrono::duration<Rep, Period>::zero()) return now;
  const D room = Clock::time_point::max() - now;
  // Compare in the coarser unit, so converting `timeout` to the clock's unit cannot overflow either.
  if (std::chrono::duration_cast<std::chrono::duration<Rep, Period>>(room) <= timeout) return Clock::time_point::max();
  return now + std::chrono::duration_cast<D>(timeout);
}

/// When a wait that reports every `interval` next speaks: deadline_after(interval), or never when the
/// interval is 0 (reports off).
template <class Clock = std::chrono::steady_clock>
typename Clock::time_point next_report_after(std::chrono::milliseconds interval,
                                             typename Clock::time_point now = Clock::now()) {
  return interval.count() > 0 ? deadline_after<Clock>(interval, now) : Clock::time_point::max();
}

struct CommOptions {
  /// A collective that has not completed after this long fails with fsdpx::TimeoutError and
  /// leaves its communicator broken (peers cannot be trusted to agree on what happened).
  std::chrono::milliseconds timeout = default_timeout();
  /// MPI: a collective still waiting after this long says so on stderr, and again each interval (its
  /// peers answer heartbeats, so they are alive, but have not joined it). 0: never.
  std::chrono::milliseconds report_interval = std::chrono::minutes(1);
  /// Shown in every error message about this communicator.
  std::string name = "world";
};

}  // namespace fsdpx::dist
