// Out-of-line functions of fsdpx/checkpoint/resume.hpp: included by it (header-only) or by fsdpx/impl/src.hpp
// (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <fsdpx/checkpoint/resume.hpp>

namespace fsdpx::checkpoint::detail {

FSDPX_DECL void for_each_saved_file(const fs::path& dir, const CommitRecord& record, Component c,
                                    std::optional<int> only_rank, bool verify,
                                    const std::function<void(const StateDict&)>& fn) {
  for (int r = 0; r < record.world_size; ++r) {
    if (only_rank && r != *only_rank) continue;
    const std::string name = shard_file_name(c, record.world_size, r);
    fn(load_shard_file(dir, name, record.file(dir, name, verify)));
  }
}

}  // namespace fsdpx::checkpoint::detail
