// Mesh policies: how ranks are arranged into (replicate x shard x sequence) for sharding.
//
//   FullShard          every rank holds 1/world of each unit (ZeRO-3).
//   HybridShard<N>     shard within groups of N ranks, replicate across groups (HSDP).
//                      N may be fixed at compile time, given at run time, or chosen automatically.
//   NoShard            every rank holds everything; gradients are all-reduced (plain data parallel).
//   SequenceParallel<P, Mesh>
//                      one of the above, with groups of P consecutive ranks each holding one slice of
//                      the same sequences (Ulysses, models/attention.hpp); parameters stay sharded as
//                      Mesh says, over the whole world (verl's layout). P may be given at run time.
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

/// SequenceParallel<runtime_sequence_size, Mesh>: the sequence group size is passed when the mesh is built.
inline constexpr int runtime_sequence_size = 0;

/// A mesh policy with a sequence dimension names its group size (1: none).
template <class P>
inline constexpr int sequence_size_of = 1;
template <class P>
  requires requires { P::sequence_size; }
inline constexpr int sequence_size_of<P> = P::sequence_size;

template <int SequenceSize = runtime_sequence_size, class Mesh = FullShard>
struct SequenceParallel {
  static_assert(SequenceSize > 0 || SequenceSize == runtime_sequence_size,
                "SequenceParallel<P, Mesh>: P must be a positive sequence group size or fsdpx::runtime_sequence_size");
  static_assert(MeshPolicy<Mesh>, "SequenceParallel<P, Mesh>: Mesh must be FullShard, HybridShard<N> or NoShard");
  static_assert(
      !requires { Mesh::sequence_size; },
      "SequenceParallel<P, Mesh>: Mesh is already sequence parallel; a mesh has one sequence dimension");
  static constexpr MeshKind kind = Mesh::kind;
  static constexpr int shard_size = Mesh::shard_size;
  static constexpr int sequence_size = SequenceSize;
  using sharding = Mesh;
};

}  // namespace fsdpx
