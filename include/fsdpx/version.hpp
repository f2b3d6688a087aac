#pragma once

#define FSDPX_VERSION_MAJOR 0
#define FSDPX_VERSION_MINOR 1
#define FSDPX_VERSION_PATCH 0

namespace fsdpx {
inline constexpr const char* version = "0.1.0";
}  // namespace fsdpx
