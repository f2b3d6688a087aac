// The unit of weight sync: a tensor with its parameter name, and "no version yet".
#pragma once

#include <cstdint>
#include <string>

#include <ATen/ATen.h>

namespace fsdpx::sync {

/// "No version yet": what a reader that holds nothing passes to wait for the first version.
inline constexpr int64_t no_version = -1;

struct Manifest;  // sync/manifest.hpp

/// A tensor with its fully qualified parameter name ("blocks.3.mlp.fc.weight").
struct NamedTensor {
  std::string name;
  at::Tensor tensor;
};

}  // namespace fsdpx::sync
