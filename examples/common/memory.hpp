// Peak resident memory of this process, for the examples', benchmarks' and tests' per-step lines.
#pragma once

#include <fsdpx/core/memory.hpp>

namespace fsdpx::examples {

/// Peak resident set size so far, in MiB.
inline double peak_rss_mib() { return static_cast<double>(fsdpx::memory_report().host_peak_rss_bytes) / 1048576.0; }

}  // namespace fsdpx::examples
