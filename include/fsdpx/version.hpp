#pragma once

#define FSDPX_VERSION_MAJOR 0
#define FSDPX_VERSION_MINOR 1
#define FSDPX_VERSION_PATCH 1

namespace fsdpx {
inline constexpr const char* version = "0.1.1";
}  // namespace fsdpx
