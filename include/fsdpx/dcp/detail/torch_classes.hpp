// The Python modules whose classes a DCP `.metadata` pickle names, for its reader (impl/metadata_read.ipp) and
// writer (impl/metadata_write.ipp).
#pragma once

#include <string_view>

namespace fsdpx::dcp::detail {

inline constexpr std::string_view metadata_module = "torch.distributed.checkpoint.metadata";
inline constexpr std::string_view filesystem_module = "torch.distributed.checkpoint.filesystem";
inline constexpr std::string_view layout_module = "torch.serialization";

}  // namespace fsdpx::dcp::detail
