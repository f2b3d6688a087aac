// Mesh policies: how ranks are arranged into (replicate x shard) for sharding.
//
//   FullShard          every rank holds 1/world of each unit (ZeRO-3).
//   HybridShard<N>     shard within groups of N ranks, replicate across groups (HSDP).
//                      N may be fixed at compile time, given at run time, or chosen automatically.
//   NoShard            every rank holds everything; gradients are all-reduced (plain data parallel).
#pragma once

#include <concepts>

namespace fsdpx {

enum class MeshKind { full_shard, hybrid_shard, no_shard };

/// HybridShard<runtime_shard_size>: the shard size is passed when the mesh is built.
inline constexpr int runtime_shard_size = 0;
/// HybridShard<auto_shard_size>: the shard size is derived from the model's parameter count.
inline constexpr int auto_shard_size = -1;

struct FullShard {
  static constexpr MeshKind kind = MeshKind::full_shard;
  static constexpr int shard_size = runtime_shard_size;  // resolved to the world size
};

template <int ShardSize = runtime_shard_size>
struct HybridShard {
  static_assert(ShardSize > 0 || ShardSize == runtime_shard_size || ShardSize == auto_shard_size,
                "HybridShard<N>: N must be a positive shard size, fsdpx::runtime_shard_size or "
                "fsdpx::auto_shard_size");
  static constexpr MeshKind kind = MeshKind::hybrid_shard;
  static constexpr int shard_size = ShardSize;
};

struct NoShard {
  static constexpr MeshKind kind = MeshKind::no_shard;
  static constexpr int shard_size = 1;
};

/// A mesh policy names its kind and its (possibly deferred) shard size.
template <class P>
concept MeshPolicy = requires {
  { P::kind } -> std::convertible_to<MeshKind>;
  { P::shard_size } -> std::convertible_to<int>;
} && (P::shard_size > 0 || P::shard_size == runtime_shard_size || P::shard_size == auto_shard_size);

}  // namespace fsdpx
