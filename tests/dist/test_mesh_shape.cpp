// Mesh shapes and mesh-policy resolution, without communication.
#include <catch2/catch.hpp>

#include <fsdpx/core/mesh.hpp>

using namespace fsdpx;
using Catch::Matchers::Contains;

static_assert(MeshPolicy<FullShard>);
static_assert(MeshPolicy<NoShard>);
static_assert(MeshPolicy<HybridShard<4>>);
static_assert(MeshPolicy<HybridShard<runtime_shard_size>>);
static_assert(MeshPolicy<HybridShard<auto_shard_size>>);
static_assert(!MeshPolicy<int>);
struct NotAMeshPolicy {
  static constexpr int shard_size = 2;
};
static_assert(!MeshPolicy<NotAMeshPolicy>);
static_assert(MeshPolicy<SequenceParallel<2>>);
static_assert(MeshPolicy<SequenceParallel<runtime_sequence_size, HybridShard<4>>>);
static_assert(SequenceParallel<2, HybridShard<4>>::kind == MeshKind::hybrid_shard);
static_assert(SequenceParallel<2, HybridShard<4>>::shard_size == 4);
static_assert(sequence_size_of<SequenceParallel<2, NoShard>> == 2 && sequence_size_of<FullShard> == 1);

TEST_CASE("mesh shapes", "[mesh]") {
  CHECK(dist::make_mesh_shape(8, 4).replicate == 2);
  CHECK(dist::make_mesh_shape(8, 4).shard == 4);
  CHECK(dist::make_mesh_shape(3, 3).replicate == 1);
  CHECK(dist::make_mesh_shape(3, 1).replicate == 3);
  CHECK(dist::make_mesh_shape(8, 4, 2).sequence == 2);
  CHECK(dist::make_mesh_shape(8, 4).sequence == 1);
}

TEST_CASE("a shard size that does not divide the world is an error listing the sizes that do", "[mesh][errors]") {
  CHECK_THROWS_AS(dist::make_mesh_shape(6, 4), ConfigError);
  CHECK_THROWS_WITH(
      dist::make_mesh_shape(6, 4),
      Contains("a world of 6 ranks cannot be split into shard groups of 4 ranks") && Contains("one of: 1, 2, 3, 6"));
  CHECK_THROWS_WITH(dist::make_mesh_shape(4, 0), Contains("shard groups of 0"));
  CHECK_THROWS_WITH(dist::make_mesh_shape(4, 8), Contains("shard groups of 8"));
  CHECK_THROWS_WITH(dist::make_mesh_shape(6, 6, 4), Contains("a world of 6 ranks cannot be split into sequence groups "
                                                             "of 4 ranks") &&
                                                        Contains("one of: 1, 2, 3, 6"));
}

TEST_CASE("mesh policies resolve their shard size", "[mesh]") {
  CHECK(core::resolve_shard_size<FullShard>(6) == 6);
  CHECK(core::resolve_shard_size<NoShard>(6) == 1);
  CHECK(core::resolve_shard_size<HybridShard<2>>(6) == 2);
  CHECK(core::resolve_shard_size<HybridShard<>>(6, 3) == 3);
  CHECK_THROWS_WITH(core::resolve_shard_size<HybridShard<>>(6), Contains("needs the shard size at run time"));
  CHECK_THROWS_WITH(core::resolve_shard_size<HybridShard<auto_shard_size>>(6),
                    Contains("needs the model to choose a shard size"));
  CHECK_THROWS_WITH(core::resolve_shard_size<HybridShard<2>>(6, 3), Contains("fixes the shard size at compile time"));
  CHECK_THROWS_WITH(core::resolve_shard_size<FullShard>(6, 2), Contains("use HybridShard"));
}

TEST_CASE("mesh policies resolve their sequence size", "[mesh]") {
  CHECK(core::resolve_sequence_size<FullShard>() == 1);
  CHECK(core::resolve_sequence_size<SequenceParallel<2>>() == 2);
  CHECK(core::resolve_sequence_size<SequenceParallel<2>>(2) == 2);
  CHECK(core::resolve_sequence_size<SequenceParallel<runtime_sequence_size, NoShard>>(4) == 4);
  CHECK_THROWS_WITH(core::resolve_sequence_size<SequenceParallel<>>(),
                    Contains("needs the sequence parallel size at run time (FsdpOptions::sequence_size)"));
  CHECK_THROWS_WITH(core::resolve_sequence_size<SequenceParallel<2>>(4),
                    Contains("fixes the sequence parallel size at compile time"));
  CHECK_THROWS_WITH(core::resolve_sequence_size<HybridShard<2>>(2), Contains("use SequenceParallel<P, Mesh>"));
  CHECK(core::resolve_sequence_size<HybridShard<2>>(1) == 1);
}
