// FlatParamLayout: a unit's parameters one after another in one flat buffer, each starting at an
// aligned element, padded so every rank of the shard group holds an equal, aligned slice.
// Weight-decayed parameters (matrices) come first, then the rest (biases, norms, embeddings' gains),
// so each rank's slice splits into at most two contiguous optimizer groups (FSDP1's flat layout: one
// collective per unit, few large optimizer tensors).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include <fsdpx/error.hpp>

namespace fsdpx::core {

struct ParamInfo {
  std::string name;  // fully qualified name in the model ("blocks.3.mlp.fc.weight")
  at::Tensor param;  // the module's own parameter tensor (identity is kept for the module)
  std::vector<int64_t> shape;
  bool decay = true;  // weight decay applies
  int64_t offset = 0;
  int64_t numel = 0;
};

/// Where a slice of the flat layout falls.
struct FlatRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
};

class FlatParamLayout {
 public:
  /// Every parameter starts at a multiple of this many elements, and every shard spans a multiple of
  /// it: in a buffer aligned as PyTorch allocates them, each parameter and shard then begins 128-byte
  /// aligned in float32 (64 in bfloat16). Copies of unaligned ranges run far slower (a CPU rank's
  /// shared-memory read into a misaligned destination: docs/sync.md, "Measured"); vectorised kernels
  /// and NCCL gain too.
  /// The cost: fewer than this many padding elements per parameter, and per shard.
  static constexpr int64_t alignment_elements = 32;

  FlatParamLayout() = default;
  /// Parameters with dim() >= 2 decay by default (GPT-2 / LightRFT convention); `decay` may override.
  FlatParamLayout(std::vector<ParamInfo> params, int shard_count) : params_(std::move(params)), shards_(shard_count) {
    FSDPX_CHECK(shard_count >= 1, "a flat layout needs at least one shard, got ", shard_count);
    std::stable_partition(params_.begin(), params_.end(), [](const ParamInfo& p) { return p.decay; });
    int64_t end = 0;  // of the last parameter placed
    for (auto& p : params_) {
      p.shape = p.param.sizes().vec();
      p.numel = p.param.numel();
      p.offset = align_up(end);
      if (p.offset > end) padding_.push_back({end, p.offset});
      end = p.offset + p.numel;
      numel_ += p.numel;
      if (p.decay) decay_numel_ = end;
    }
    shard_numel_ = align_up((end + shards_ - 1) / shards_);
    if (padded_numel() > end) padding_.push_back({end, padded_numel()});
  }

  const std::vector<ParamInfo>& params() const { return params_; }
  int shard_count() const { return shards_; }
  /// The parameters' elements (padding excluded).
  int64_t numel() const { return numel_; }
  /// The flat buffer's elements: the parameters, the padding between them and at the end.
  int64_t padded_numel() const { return shard_numel_ * shards_; }
  int64_t shard_numel() const { return shard_numel_; }
  /// The elements no parameter covers (zero in every buffer: their gradients must be zero too).
  const std::vector<FlatRange>& padding() const { return padding_; }
  /// Elements [0, decay_numel) hold the weight-decayed parameters (and the padding between them).
  int64_t decay_numel() const { return decay_numel_; }

  /// The part of the flat layout shard `r` holds.
  FlatRange shard_range(int r) const { return {r * shard_numel_, (r + 1) * shard_numel_}; }

  /// The decayed and undecayed parts of shard `r`, relative to the shard's start (either may be empty;
  /// the undecayed part includes the padding, whose gradient is always zero).
  std::pair<FlatRange, FlatRange> shard_groups(int r) const {
    const FlatRange s = shard_range(r);
    const int64_t split = std::clamp(decay_numel_, s.begin, s.end) - s.begin;
    return {{0, split}, {split, shard_numel_}};
  }

 private:
  std::vector<ParamInfo> params_;
  int shards_ = 1;
  int64_t numel_ = 0;
  int64_t decay_numel_ = 0;
  int64_t shard_numel_ = 0;
  std::vector<FlatRange> padding_;

  static int64_t align_up(int64_t n) { return (n + alignment_elements - 1) / alignment_elements * alignment_elements; }
};

}  // namespace fsdpx::core
