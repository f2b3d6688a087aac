// DeviceMesh: the world arranged as (replicate x shard), with sequence groups across it; which shape a
// mesh policy asks for is the FSDP core's business (core/mesh.hpp). Shard groups are runs of
// consecutive ranks (on a multi-GPU node: the node's GPUs), replicate groups take one rank from each
// shard group. Sequence groups (sequence parallelism) are runs of consecutive ranks too, whose ranks
// hold slices of the same sequences; parameters are sharded over the shard groups whatever they are.
//
//   world 8, shard 4:  shard groups {0,1,2,3} {4,5,6,7};  replicate groups {0,4} {1,5} {2,6} {3,7}
//   sequence 2:        sequence groups {0,1} {2,3} {4,5} {6,7}
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <fsdpx/dist/communicator.hpp>
#include <fsdpx/error.hpp>

namespace fsdpx::dist {

struct MeshShape {
  int replicate = 1;
  int shard = 1;
  int sequence = 1;  // ranks per sequence group (across the other two dimensions)
};

namespace detail {
inline std::string divisors_of(int n) {
  std::string out;
  for (int d = 1; d <= n; ++d) {
    if (n % d == 0) out += str(out.empty() ? "" : ", ", d);
  }
  return out;
}
}  // namespace detail

/// Validates that `shard_size` and `sequence_size` tile `world_size`; the error lists the sizes that would.
inline MeshShape make_mesh_shape(int world_size, int shard_size, int sequence_size = 1) {
  FSDPX_CHECK(world_size >= 1, "world size ", world_size, " must be at least 1");
  FSDPX_CHECK(shard_size >= 1 && shard_size <= world_size && world_size % shard_size == 0, "a world of ", world_size,
              " ranks cannot be split into shard groups of ", shard_size,
              " ranks; the shard size must divide the world size (one of: ", detail::divisors_of(world_size), ")");
  FSDPX_CHECK(
      sequence_size >= 1 && sequence_size <= world_size && world_size % sequence_size == 0, "a world of ", world_size,
      " ranks cannot be split into sequence groups of ", sequence_size,
      " ranks; the sequence parallel size must divide the world size (one of: ", detail::divisors_of(world_size), ")");
  return {world_size / shard_size, shard_size, sequence_size};
}

template <Communicator Comm>
class DeviceMesh {
 public:
  /// Collective over `world`. shard_size == world size gives a 1-D mesh (no replication),
  /// shard_size == 1 gives pure replication (plain data parallel); sequence_size > 1 adds sequence groups.
  static DeviceMesh build(Comm world, int shard_size, int sequence_size = 1) {
    const MeshShape shape = make_mesh_shape(world.size(), shard_size, sequence_size);
    const int r = world.rank();
    const auto name = [&](std::string_view dim, int group) { return detail::str(world.name(), "/", dim, group); };
    // Splits are collective over the world: every rank makes both, in the same order.
    Comm shard =
        shape.replicate == 1 ? world : *world.split(r / shard_size, r % shard_size, name("shard", r / shard_size));
    Comm replicate =
        shape.shard == 1 ? world : *world.split(r % shard_size, r / shard_size, name("replicate", r % shard_size));
    std::optional<Comm> sequence;
    if (sequence_size > 1) {
      sequence = sequence_size == world.size()
                     ? world
                     : *world.split(r / sequence_size, r % sequence_size, name("sequence", r / sequence_size));
    }
    return DeviceMesh(std::move(world), std::move(shard), std::move(replicate), std::move(sequence), shape);
  }

  const Comm& world() const { return world_; }
  Comm& world() { return world_; }
  /// Ranks that together hold one copy of the sharded parameters.
  Comm& shard_group() { return shard_; }
  const Comm& shard_group() const { return shard_; }
  /// Ranks that hold the same shard (all-reduce of gradients across replicas).
  Comm& replicate_group() { return replicate_; }
  const Comm& replicate_group() const { return replicate_; }

  /// Ranks that hold consecutive slices of the same sequences (nullopt without sequence parallelism).
  const std::optional<Comm>& sequence_group() const { return sequence_; }

  MeshShape shape() const { return shape_; }
  int shard_size() const { return shape_.shard; }
  int replicate_size() const { return shape_.replicate; }
  int sequence_size() const { return shape_.sequence; }
  bool is_hybrid() const { return shape_.replicate > 1 && shape_.shard > 1; }

 private:
  DeviceMesh(Comm world, Comm shard, Comm replicate, std::optional<Comm> sequence, MeshShape shape)
      : world_(std::move(world)),
        shard_(std::move(shard)),
        replicate_(std::move(replicate)),
        sequence_(std::move(sequence)),
        shape_(shape) {}

  Comm world_;
  Comm shard_;
  Comm replicate_;
  std::optional<Comm> sequence_;
  MeshShape shape_;
};

}  // namespace fsdpx::dist
