// Peak resident memory of this process, for the examples', benchmarks' and tests' per-step lines.
#pragma once

#include <sys/resource.h>

namespace fsdpx::examples {

/// Peak resident set size so far, in MiB (getrusage; Linux reports KiB).
inline double peak_rss_mib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;
}

}  // namespace fsdpx::examples
