// Out-of-line functions of fsdpx/checkpoint/merge.hpp: included by it (header-only) or by fsdpx/impl/src.hpp
// (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <fsdpx/checkpoint/merge.hpp>

namespace fsdpx::checkpoint::detail {

FSDPX_DECL fs::path model_dir(const fs::path& dir) {
  const auto has_checkpoint = [](const fs::path& d) {
    std::error_code ec;
    if (!fs::is_directory(d, ec)) return false;
    if (fs::exists(d / config_file, ec)) return true;
    for (const auto& e : fs::directory_iterator(d, ec)) {
      if (parse_shard_file_name(e.path().filename().string())) return true;
    }
    return false;
  };
  if (!has_checkpoint(dir) && has_checkpoint(dir / "actor")) return dir / "actor";
  return dir;
}

FSDPX_DECL std::string local_kind_message(const fs::path& what) {
  return ::fsdpx::detail::str("fsdpx: '", what.string(), "' holds a \"local\" state dict (each unit's raw, padded "
                              "flat shard): it cannot be merged without the model, which alone knows how parameters "
                              "lie in the flat shards. Load it into the same model at the same world size and save "
                              "a full or sharded state dict, or save with ShardedStateDict/FullStateDict");
}

}  // namespace fsdpx::checkpoint::detail

namespace fsdpx::checkpoint {

FSDPX_DECL fs::path huggingface_dir(const fs::path& step_dir) {
  const fs::path dir = detail::model_dir(step_dir);
  std::error_code ec;
  for (const fs::path& hf : {dir / "huggingface", dir.parent_path() / "huggingface"}) {
    if (fs::is_directory(hf, ec) && !fs::is_symlink(hf, ec)) return hf;
  }
  return {};
}

}  // namespace fsdpx::checkpoint
