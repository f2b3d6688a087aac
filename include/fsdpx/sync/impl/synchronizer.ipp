// Synchronizer's member functions, out of line: included by fsdpx/sync/synchronizer.hpp (header-only) or by
// fsdpx/impl/src.hpp (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <fsdpx/sync/synchronizer.hpp>

namespace fsdpx::sync {

FSDPX_DECL void Synchronizer::publish(int64_t version, std::vector<NamedTensor> tensors) {
  FSDPX_CHECK_AS(SyncError, version >= 0, "cannot publish version ", version, ": versions are >= 0");
  auto snapshot = std::make_shared<WeightSnapshot>(WeightSnapshot{version, std::move(tensors)});
  slot_.publish(version, std::move(snapshot));
}

}  // namespace fsdpx::sync
