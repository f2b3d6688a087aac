// DeviceMesh: the world arranged as (replicate x shard); which shape a mesh policy asks for is the
// FSDP core's business (core/mesh.hpp). Shard groups are runs of consecutive ranks
// (on a multi-GPU node: the node's GPUs), replicate groups take one rank from each shard group.
//
//   world 8, shard 4:  shard groups {0,1,2,3} {4,5,6,7};  replicate groups {0,4} {1,5} {2,6} {3,7}
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
};

/// Validates that `shard_size` tiles `world_size`; the error lists the sizes that would.
inline MeshShape make_mesh_shape(int world_size, int shard_size) {
  FSDPX_CHECK(world_size >= 1, "world size ", world_size, " must be at least 1");
  std::string divisors;
  for (int d = 1; d <= world_size; ++d) {
    if (world_size % d == 0) divisors += detail::str(divisors.empty() ? "" : ", ", d);
  }
  FSDPX_CHECK(shard_size >= 1 && shard_size <= world_size && world_size % shard_size == 0, "a world of ", world_size,
              " ranks cannot be split into shard groups of ", shard_size,
              " ranks; the shard size must divide the world size (one of: ", divisors, ")");
  return {world_size / shard_size, shard_size};
}

template <Communicator Comm>
class DeviceMesh {
 public:
  /// Collective over `world`. shard_size == world size gives a 1-D mesh (no replication),
  /// shard_size == 1 gives pure replication (plain data parallel).
  static DeviceMesh build(Comm world, int shard_size) {
    const MeshShape shape = make_mesh_shape(world.size(), shard_size);
    const int r = world.rank();
    const auto name = [&](std::string_view dim, int group) { return detail::str(world.name(), "/", dim, group); };
    // Splits are collective over the world: every rank makes both, in the same order.
    Comm shard =
        shape.replicate == 1 ? world : *world.split(r / shard_size, r % shard_size, name("shard", r / shard_size));
    Comm replicate =
        shape.shard == 1 ? world : *world.split(r % shard_size, r / shard_size, name("replicate", r % shard_size));
    return DeviceMesh(std::move(world), std::move(shard), std::move(replicate), shape);
  }

  const Comm& world() const { return world_; }
  Comm& world() { return world_; }
  /// Ranks that together hold one copy of the sharded parameters.
  Comm& shard_group() { return shard_; }
  const Comm& shard_group() const { return shard_; }
  /// Ranks that hold the same shard (all-reduce of gradients across replicas).
  Comm& replicate_group() { return replicate_; }
  const Comm& replicate_group() const { return replicate_; }

  MeshShape shape() const { return shape_; }
  int shard_size() const { return shape_.shard; }
  int replicate_size() const { return shape_.replicate; }
  bool is_hybrid() const { return shape_.replicate > 1 && shape_.shard > 1; }

 private:
  DeviceMesh(Comm world, Comm shard, Comm replicate, MeshShape shape)
      : world_(std::move(world)), shard_(std::move(shard)), replicate_(std::move(replicate)), shape_(shape) {}

  Comm world_;
  Comm shard_;
  Comm replicate_;
  MeshShape shape_;
};

}  // namespace fsdpx::dist
