// Sequence parallelism's building blocks at the world size mpiexec gives (CTest runs 1, 2 and 4): Ulysses'
// all-to-alls put every value where attention needs it and every gradient back where its value came from,
// exactly (they only move data), and attention over the exchanged heads equals attention over the whole
// sequence.
#include <catch2/catch.hpp>

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <fsdpx/dist/any.hpp>
#include <fsdpx/dist/mpi.hpp>
#include <fsdpx/models/attention.hpp>

#include "../support/mpi_world.hpp"

using fsdpx::test::world;
namespace models = fsdpx::models;

namespace {

// The same on every rank: seeded, then drawn in the same order everywhere.
at::Tensor shared_randn(at::IntArrayRef sizes, uint64_t seed) {
  at::manual_seed(seed);
  return at::randn(sizes);
}

// This rank's slice of dimension 1 (its consecutive tokens) or of dimension 2 (its group of heads).
at::Tensor slice(const at::Tensor& t, int64_t dim, int rank, int ranks) {
  const int64_t n = t.size(dim) / ranks;
  return t.narrow(dim, rank * n, n).contiguous();
}

}  // namespace

TEST_CASE("Ulysses: each rank gets its heads for the whole sequence and gives them back, values and gradients exact",
          "[ulysses]") {
  const int P = world().size(), r = world().rank();
  const fsdpx::dist::AnyCommunicator group(world());
  const int64_t b = 2, T = 3 * P, H = 2 * P, D = 4;
  const at::Tensor whole = shared_randn({b, T, H, D}, 11);
  const at::Tensor mine = slice(whole, 1, r, P).requires_grad_(true);

  const at::Tensor heads = models::sequence_to_heads(mine, group);
  REQUIRE(heads.sizes() == at::IntArrayRef({b, T, H / P, D}));
  CHECK(at::equal(heads, slice(whole, 2, r, P)));
  const at::Tensor back = models::heads_to_sequence(heads, group);
  CHECK(at::equal(back, mine));

  // The gradient of sum over ranks of <w, heads> reaches each value's owner: w at its place.
  const at::Tensor w = shared_randn({b, T, H, D}, 12);
  (heads * slice(w, 2, r, P)).sum().backward();
  CHECK(at::equal(mine.grad(), slice(w, 1, r, P)));

  // Through both exchanges the gradient is the upstream one, untouched.
  mine.mutable_grad() = at::Tensor();
  const at::Tensor round_trip = models::heads_to_sequence(models::sequence_to_heads(mine, group), group);
  (round_trip * slice(w, 1, r, P)).sum().backward();
  CHECK(at::equal(mine.grad(), slice(w, 1, r, P)));
}

TEST_CASE("Ulysses: causal attention over the exchanged heads equals attention over the whole sequence", "[ulysses]") {
  const int P = world().size(), r = world().rank();
  const fsdpx::dist::AnyCommunicator group(world());
  const int64_t b = 1, T = 8 * P, H = 2 * P, D = 16;
  const at::Tensor q = shared_randn({b, T, H, D}, 21), k = shared_randn({b, T, H, D}, 22),
                   v = shared_randn({b, T, H, D}, 23);
  const auto attend = [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {  // [b, t, h, d] layout
    return at::scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), {}, 0.0,
                                            /*is_causal=*/true)
        .transpose(1, 2);
  };
  const at::Tensor want = slice(attend(q, k, v), 1, r, P);
  const at::Tensor got = models::heads_to_sequence(
      attend(models::sequence_to_heads(slice(q, 1, r, P), group), models::sequence_to_heads(slice(k, 1, r, P), group),
             models::sequence_to_heads(slice(v, 1, r, P), group))
          .contiguous(),
      group);
  // Each head's attention is the same computation on the same values, on however many heads a rank holds.
  CHECK(at::equal(got, want));
}

TEST_CASE("Ulysses: shapes that do not split over the group are refused, naming the remedy", "[ulysses][errors]") {
  const int P = world().size();
  const fsdpx::dist::AnyCommunicator group(world());
  using Catch::Matchers::Contains;
  CHECK_THROWS_WITH(models::sequence_to_heads(at::zeros({2, 3, 4}), group),
                    Contains("must be [batch, tokens, heads, head_dim]"));
  if (P > 1) {
    CHECK_THROWS_WITH(models::sequence_to_heads(at::zeros({1, 2, P + 1, 4}), group),
                      Contains(std::to_string(P + 1) + " heads do not split over a sequence group of " +
                               std::to_string(P) + " ranks; repeat the key/value heads"));
    CHECK_THROWS_WITH(models::heads_to_sequence(at::zeros({1, P + 1, 2, 4}), group),
                      Contains("tokens (the whole sequence) do not split into " + std::to_string(P) + " slices"));
  }
  world().barrier();
}
