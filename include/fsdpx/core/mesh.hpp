// A mesh policy (FullShard, HybridShard<N>, NoShard, SequenceParallel<P, Mesh>) made into a device
// mesh: the shard and sequence sizes it asks for at a world size, checked against what the user requested.
#pragma once

#include <optional>

#include <fsdpx/dist/mesh.hpp>
#include <fsdpx/error.hpp>
#include <fsdpx/policies/mesh.hpp>

namespace fsdpx::core {

/// The shard size a mesh policy asks for at this world size. HybridShard<runtime_shard_size> takes
/// `requested`; HybridShard<auto_shard_size> is resolved from the model by the FSDP core, which passes
/// its choice as `requested` too.
template <MeshPolicy Policy>
int resolve_shard_size(int world_size, std::optional<int> requested = std::nullopt) {
  if constexpr (Policy::kind == MeshKind::full_shard) {
    FSDPX_CHECK(!requested || *requested == world_size, "FullShard shards over the whole world (", world_size,
                " ranks) but shard size ", *requested, " was requested; use HybridShard for smaller groups");
    return world_size;
  } else if constexpr (Policy::kind == MeshKind::no_shard) {
    FSDPX_CHECK(!requested || *requested == 1, "NoShard replicates every parameter but shard size ", *requested,
                " was requested");
    return 1;
  } else if constexpr (Policy::shard_size > 0) {
    FSDPX_CHECK(!requested || *requested == Policy::shard_size, "HybridShard<", Policy::shard_size,
                "> fixes the shard size at compile time but ", *requested, " was requested at run time");
    return Policy::shard_size;
  } else {
    FSDPX_CHECK(requested.has_value(), Policy::shard_size == runtime_shard_size
                                           ? "HybridShard<runtime_shard_size> needs the shard size at run time"
                                           : "HybridShard<auto_shard_size> needs the model to choose a shard size");
    return *requested;
  }
}

/// The sequence group size a mesh policy asks for: 1 without a sequence dimension,
/// SequenceParallel<runtime_sequence_size, ...> takes `requested`.
template <MeshPolicy Policy>
int resolve_sequence_size(std::optional<int> requested = std::nullopt) {
  constexpr int fixed = sequence_size_of<Policy>;
  if constexpr (fixed == runtime_sequence_size) {
    FSDPX_CHECK(requested.has_value(),
                "SequenceParallel<runtime_sequence_size> needs the sequence parallel size at run time "
                "(FsdpOptions::sequence_size)");
    return *requested;
  } else if constexpr (fixed == 1 && !requires { Policy::sequence_size; }) {
    FSDPX_CHECK(!requested || *requested == 1, "sequence parallel size ", *requested,
                " was requested, but the mesh policy has no sequence dimension; use SequenceParallel<P, Mesh>");
    return 1;
  } else {
    FSDPX_CHECK(!requested || *requested == fixed, "SequenceParallel<", fixed,
                "> fixes the sequence parallel size at compile time but ", *requested, " was requested at run time");
    return fixed;
  }
}

/// Builds the mesh a policy describes.
template <MeshPolicy Policy, dist::Communicator Comm>
dist::DeviceMesh<Comm> make_mesh(Comm world, std::optional<int> requested_shard_size = std::nullopt,
                                 std::optional<int> requested_sequence_size = std::nullopt) {
  const int shard = resolve_shard_size<Policy>(world.size(), requested_shard_size);
  return dist::DeviceMesh<Comm>::build(std::move(world), shard, resolve_sequence_size<Policy>(requested_sequence_size));
}

}  // namespace fsdpx::core
