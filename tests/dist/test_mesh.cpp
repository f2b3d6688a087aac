// DeviceMesh over MPI: every shard size that divides the world, with the groups each dimension needs.
#include <catch2/catch.hpp>

#include <ATen/ATen.h>

#include <fsdpx/core/mesh.hpp>
#include <fsdpx/dist/mpi.hpp>

#include "../support/mpi_world.hpp"

using fsdpx::test::world;

namespace {
std::vector<int> gather_ranks(fsdpx::dist::MpiCommunicator& comm) {
  auto mine = at::full({1}, world().rank(), at::kInt);
  auto all = at::empty({comm.size()}, at::kInt);
  comm.all_gather(all, mine);
  return {all.data_ptr<int>(), all.data_ptr<int>() + comm.size()};
}
}  // namespace

TEST_CASE("every divisor of the world size gives a (replicate x shard) mesh", "[mpi][mesh]") {
  const int W = world().size(), r = world().rank();
  for (int s = 1; s <= W; ++s) {
    if (W % s != 0) continue;
    INFO("shard size " << s);
    auto mesh = fsdpx::dist::DeviceMesh<fsdpx::dist::MpiCommunicator>::build(world(), s);
    REQUIRE(mesh.shard_size() == s);
    REQUIRE(mesh.replicate_size() == W / s);
    REQUIRE(mesh.is_hybrid() == (s > 1 && s < W));
    std::vector<int> shard_expected, replicate_expected;
    for (int i = 0; i < s; ++i) shard_expected.push_back(r / s * s + i);
    for (int i = 0; i < W / s; ++i) replicate_expected.push_back(r % s + i * s);
    REQUIRE(gather_ranks(mesh.shard_group()) == shard_expected);
    REQUIRE(gather_ranks(mesh.replicate_group()) == replicate_expected);
    REQUIRE(mesh.shard_group().rank() == r % s);
    REQUIRE(mesh.replicate_group().rank() == r / s);

    // HSDP's gradient path: reduce-scatter within the shard group, all-reduce across replicas,
    // equals a reduce-scatter over the world's sum.
    auto grad = (at::arange(s * 2) + r).to(at::kFloat);
    auto shard = at::empty({2});
    mesh.shard_group().reduce_scatter(shard, grad);
    mesh.replicate_group().all_reduce(shard);
    const auto expected = W * at::arange(s * 2).narrow(0, r % s * 2, 2).to(at::kFloat) + W * (W - 1) / 2.0;
    REQUIRE(at::equal(shard, expected));
  }
}

TEST_CASE("mesh policies resolve to shard sizes", "[mpi][mesh]") {
  const int W = world().size();
  auto full = fsdpx::core::make_mesh<fsdpx::FullShard>(world());
  REQUIRE(full.shard_size() == W);
  auto none = fsdpx::core::make_mesh<fsdpx::NoShard>(world());
  REQUIRE(none.shard_size() == 1);
  REQUIRE(none.replicate_size() == W);
  auto hybrid = fsdpx::core::make_mesh<fsdpx::HybridShard<>>(world(), W);
  REQUIRE(hybrid.shard_size() == W);
  REQUIRE_FALSE(hybrid.sequence_group().has_value());
}

TEST_CASE("sequence groups are runs of consecutive ranks across the shard groups", "[mpi][mesh]") {
  const int W = world().size(), r = world().rank();
  for (int p = 1; p <= W; ++p) {
    if (W % p != 0) continue;
    INFO("sequence size " << p);
    auto mesh = fsdpx::core::make_mesh<fsdpx::SequenceParallel<fsdpx::runtime_sequence_size>>(world(), {}, p);
    REQUIRE(mesh.shard_size() == W);  // parameters stay sharded over the whole world
    REQUIRE(mesh.sequence_size() == p);
    REQUIRE(mesh.sequence_group().has_value() == (p > 1));
    if (p == 1) continue;
    std::vector<int> expected;
    for (int i = 0; i < p; ++i) expected.push_back(r / p * p + i);
    auto group = *mesh.sequence_group();
    REQUIRE(gather_ranks(group) == expected);
    REQUIRE(group.rank() == r % p);
  }
}
