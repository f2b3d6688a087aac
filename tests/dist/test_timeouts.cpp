// Timeouts as users write them: FSDPX_TIMEOUT_MS and FSDPX_HEARTBEAT_TIMEOUT_MS parsing, and deadlines
// that saturate instead of overflowing into the past.
#include <catch2/catch.hpp>

#include <chrono>
#include <cstdlib>
#include <optional>
#include <string>

#include <fsdpx/dist/types.hpp>

using namespace fsdpx::dist;
using Catch::Matchers::Contains;
using std::chrono::milliseconds;

namespace {
/// Sets an environment variable for one scope, restoring what was there.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    ::setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (old_) {
      ::setenv(name_, old_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};
}  // namespace

TEST_CASE("deadlines saturate at the clock's end instead of overflowing into the past", "[timeout]") {
  using Clock = std::chrono::steady_clock;
  const auto now = Clock::now();
  CHECK(deadline_after(milliseconds(1500), now) == now + milliseconds(1500));
  CHECK(deadline_after(milliseconds(0), now) == now);
  CHECK(deadline_after(milliseconds(-5), now) == now);
  // 1e13 ms is more nanoseconds than steady_clock can add: the naive sum wraps to a negative time.
  CHECK(deadline_after(milliseconds(10'000'000'000'000LL), now) == Clock::time_point::max());
  CHECK(deadline_after(milliseconds::max(), now) == Clock::time_point::max());
  CHECK(deadline_after(std::chrono::hours(24 * 365 * 1000), now) == Clock::time_point::max());
  CHECK(deadline_after(std::chrono::hours(24), now) == now + std::chrono::hours(24));
  CHECK(deadline_after(milliseconds(10'000'000'000'000LL)) > Clock::now() + std::chrono::hours(24 * 365));
}

TEST_CASE("FSDPX_TIMEOUT_MS: any 64-bit value works, anything else names the variable", "[timeout]") {
  {
    ScopedEnv env("FSDPX_TIMEOUT_MS", "10000000000000");  // 1e13 ms, about 317 years
    CHECK(default_timeout() == milliseconds(10'000'000'000'000LL));
    CHECK(deadline_after(default_timeout()) > std::chrono::steady_clock::now());
  }
  {
    ScopedEnv env("FSDPX_TIMEOUT_MS", "9223372036854775807");
    CHECK(default_timeout() == milliseconds::max());
  }
  {
    ScopedEnv env("FSDPX_TIMEOUT_MS", "99999999999999999999");
    CHECK_THROWS_WITH(default_timeout(), Contains("FSDPX_TIMEOUT_MS='99999999999999999999' does not fit in 64 bits"));
  }
  for (const char* bad : {"0", "-1", "1e13", "ten", "12ms"}) {
    ScopedEnv env("FSDPX_TIMEOUT_MS", bad);
    CHECK_THROWS_WITH(default_timeout(),
                      Contains("FSDPX_TIMEOUT_MS must be a positive integer number of milliseconds"));
  }
  {
    ScopedEnv env("FSDPX_TIMEOUT_MS", "");
    CHECK(default_timeout() == std::chrono::minutes(10));
  }
}

TEST_CASE("FSDPX_HEARTBEAT_TIMEOUT_MS: 15 s by default, 0 means this rank watches no one", "[timeout]") {
  {
    ScopedEnv env("FSDPX_HEARTBEAT_TIMEOUT_MS", "");
    CHECK(default_heartbeat_timeout() == std::chrono::seconds(15));
  }
  {
    ScopedEnv env("FSDPX_HEARTBEAT_TIMEOUT_MS", "0");
    CHECK(default_heartbeat_timeout() == milliseconds(0));
  }
  {
    ScopedEnv env("FSDPX_HEARTBEAT_TIMEOUT_MS", "-3");
    CHECK_THROWS_WITH(default_heartbeat_timeout(), Contains("FSDPX_HEARTBEAT_TIMEOUT_MS must be a non-negative integer "
                                                            "number of milliseconds (0: this rank watches no one)"));
  }
}
