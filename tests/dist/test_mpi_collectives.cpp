// Every collective of the MPI backend, for every dtype, blocking and async, at the world size
// mpiexec gives (CTest runs 1, 2, 3 and 4).
#include <catch2/catch.hpp>

#include <chrono>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include <fsdpx/dist/mpi.hpp>

#include "../support/mpi_world.hpp"

using fsdpx::dist::ReduceOp;
using fsdpx::test::world;

namespace {

const std::vector<at::ScalarType> all_dtypes = {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf, at::kInt, at::kLong};
const std::vector<at::ScalarType> float_dtypes = {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf};

at::TensorOptions opts(at::ScalarType t) { return at::TensorOptions().dtype(t); }

// Values are small integers, exact in every dtype including bfloat16 (8 significant bits).
void require_equal(const at::Tensor& got, const at::Tensor& want) {
  INFO("got " << got << " want " << want);
  REQUIRE(got.scalar_type() == want.scalar_type());
  REQUIRE(at::equal(got, want));
}

}  // namespace

TEST_CASE("all_gather concatenates every rank's input in rank order", "[mpi][all_gather]") {
  const int W = world().size(), r = world().rank(), n = 5;
  for (auto dtype : all_dtypes) {
    INFO("dtype " << dtype);
    auto input = (at::arange(n) + 10 * r).to(dtype);
    auto output = at::empty({W * n}, opts(dtype));
    world().all_gather(output, input);
    require_equal(output, (at::arange(n).repeat({W}) + 10 * at::arange(W).repeat_interleave(n)).to(dtype));
  }
}

TEST_CASE("all_gather in place: the input is this rank's slot of the output", "[mpi][all_gather]") {
  const int W = world().size(), r = world().rank(), n = 3;
  auto output = at::zeros({W * n}, opts(at::kBFloat16));
  auto slot = output.narrow(0, r * n, n);
  slot.fill_(r + 1);
  world().all_gather(output, slot);
  require_equal(output, (at::arange(W) + 1).repeat_interleave(n).to(at::kBFloat16));
}

TEST_CASE("reduce_scatter sums (and averages) chunk `rank` over ranks", "[mpi][reduce_scatter]") {
  const int W = world().size(), r = world().rank(), n = 4;
  // Rank q contributes (q + 1) * (c + 1) + j at element j of chunk c.
  const auto chunk = at::arange(W).unsqueeze(1), elem = at::arange(n).unsqueeze(0);
  const auto expected_sum = (r + 1) * W * (W + 1) / 2 + W * at::arange(n);
  for (auto dtype : all_dtypes) {
    INFO("dtype " << dtype);
    auto input = ((r + 1) * (chunk + 1) + elem).reshape({-1}).to(dtype);
    auto output = at::empty({n}, opts(dtype));
    world().reduce_scatter(output, input, ReduceOp::sum);
    require_equal(output, expected_sum.to(dtype));
  }
  for (auto dtype : float_dtypes) {
    INFO("dtype " << dtype);
    auto input = ((r + 1) * (chunk + 1) + elem).reshape({-1}).to(dtype);
    auto output = at::empty({n}, opts(dtype));
    world().reduce_scatter(output, input, ReduceOp::avg);
    require_equal(output, (expected_sum.to(at::kDouble) / W).to(dtype));
  }
}

TEST_CASE("all_reduce: sum, avg, max, min", "[mpi][all_reduce]") {
  const int W = world().size(), r = world().rank(), n = 6;
  const auto j1 = at::arange(1, n + 1);
  for (auto dtype : all_dtypes) {
    INFO("dtype " << dtype);
    auto make = [&] { return ((r + 1) * j1).to(dtype); };
    auto t = make();
    world().all_reduce(t, ReduceOp::sum);
    require_equal(t, (W * (W + 1) / 2 * j1).to(dtype));
    t = make();
    world().all_reduce(t, ReduceOp::max);
    require_equal(t, (W * j1).to(dtype));
    t = make();
    world().all_reduce(t, ReduceOp::min);
    require_equal(t, j1.to(dtype));
    if (at::isFloatingType(dtype)) {
      t = make();
      world().all_reduce(t, ReduceOp::avg);
      require_equal(t, ((W + 1) / 2.0 * j1.to(at::kDouble)).to(dtype));
    }
  }
}

TEST_CASE("half-precision sums round like the float computation", "[mpi][all_reduce]") {
  const int W = world().size(), r = world().rank();
  for (auto dtype : {at::kBFloat16, at::kHalf}) {
    auto base = at::linspace(-3, 3, 257, at::kFloat) * 0.37f * (r + 1);
    auto t = base.to(dtype);
    world().all_reduce(t, ReduceOp::sum);
    auto want = base.to(dtype).to(at::kFloat);
    world().all_reduce(want, ReduceOp::sum);
    // Each pairwise add rounds to the dtype: at most W - 1 roundings of relative size eps.
    const double eps = dtype == at::kBFloat16 ? 1.0 / 128 : 1.0 / 1024;
    REQUIRE(at::allclose(t.to(at::kFloat), want, W * eps, W * eps));
  }
}

TEST_CASE("broadcast copies the root's tensor to every rank", "[mpi][broadcast]") {
  const int W = world().size(), r = world().rank();
  for (auto dtype : all_dtypes) {
    for (int root : {0, W - 1}) {
      INFO("dtype " << dtype << " root " << root);
      auto t = r == root ? (at::arange(7) * 3).to(dtype) : at::zeros({7}, opts(dtype));
      world().broadcast(t, root);
      require_equal(t, (at::arange(7) * 3).to(dtype));
    }
  }
}

TEST_CASE("gather fills only the root's output, in rank order; in place leaves the root's slot alone",
          "[mpi][gather]") {
  const int W = world().size(), r = world().rank(), n = 5;
  for (auto dtype : all_dtypes) {
    for (int root : {0, W - 1}) {
      INFO("dtype " << dtype << " root " << root);
      const auto mine = (at::arange(n) + 10 * r).to(dtype);
      const auto want = (at::arange(n).repeat({W}) + 10 * at::arange(W).repeat_interleave(n)).to(dtype);
      // Separate input: every slot written.
      auto out = r == root ? at::zeros({W * n}, opts(dtype)) : at::Tensor();
      world().gather(out, mine, root);
      if (r == root) require_equal(out, want);
      // In place: the root's slot keeps what it held.
      out = at::zeros({W * n}, opts(dtype));
      const auto slot = out.narrow(0, r * n, n);
      world().gather(out, r == root ? slot : mine, root);
      if (r == root) {
        auto expect = want.clone();
        expect.narrow(0, r * n, n).zero_();
        require_equal(out, expect);
      } else {
        require_equal(out, at::zeros({W * n}, opts(dtype)));  // a non-root's output is never written
      }
    }
  }
}

TEST_CASE("all_to_all: slot c of the output is rank c's chunk for this rank", "[mpi][all_to_all]") {
  const int W = world().size(), r = world().rank(), n = 3;
  // Rank q's chunk c holds q * 16 + c * 4 + j: small integers, exact in every dtype.
  const auto values = [n](int from, int to) { return from * 16 + to * 4 + at::arange(n); };
  for (auto dtype : all_dtypes) {
    INFO("dtype " << dtype);
    std::vector<at::Tensor> chunks, want;
    for (int c = 0; c < W; ++c) {
      chunks.push_back(values(r, c));
      want.push_back(values(c, r));
    }
    auto output = at::empty({W, n}, opts(dtype));  // any shape of W x n elements
    world().all_to_all(output, at::cat(chunks).to(dtype));
    require_equal(output.view({-1}), at::cat(want).to(dtype));
  }
}

TEST_CASE("all_to_all_v: blocks of rows of any size, empty ones too, each from and to the rank it names",
          "[mpi][all_to_all]") {
  const int W = world().size(), r = world().rank(), cols = 5;
  // Rank q sends (q + 2c) % 3 rows to rank c; row i of that block holds q * 100 + c * 10 + i.
  const auto rows = [](int from, int to) { return int64_t{(from + 2 * to) % 3}; };
  const auto block = [cols](int from, int to, int64_t n) {
    return (from * 100 + to * 10 + at::arange(n)).unsqueeze(1).expand({n, cols}).contiguous();
  };
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kLong}) {
    INFO("dtype " << dtype);
    std::vector<int64_t> input_splits, output_splits;
    std::vector<at::Tensor> sent, want;
    for (int c = 0; c < W; ++c) {
      input_splits.push_back(rows(r, c));
      output_splits.push_back(rows(c, r));
      sent.push_back(block(r, c, rows(r, c)));
      want.push_back(block(c, r, rows(c, r)));
    }
    const auto input = at::cat(sent).to(dtype);
    auto output = at::full({at::cat(want).size(0), cols}, -1, opts(dtype));
    auto work = world().all_to_all_v_async(output, input, output_splits, input_splits);
    work.wait_host();
    require_equal(output, at::cat(want).to(dtype));
  }
  // Nothing to send anywhere is a valid exchange.
  const std::vector<int64_t> none(static_cast<size_t>(W), 0);
  auto empty = at::empty({0, cols});
  world().all_to_all_v(empty, at::empty({0, cols}), none, none);
}

TEST_CASE("all_to_all refuses bad splits and shapes before any communication, naming the cause",
          "[mpi][all_to_all][errors]") {
  const int W = world().size(), r = world().rank();
  using Catch::Matchers::Contains;
  const std::vector<int64_t> ones(static_cast<size_t>(W), 1);
  REQUIRE_THROWS_WITH(world().all_to_all(at::empty({W * 2}), at::empty({W * 2 + 1})),
                      Contains("all_to_all on communicator 'world'") && Contains("world size x n elements"));
  REQUIRE_THROWS_WITH(world().all_to_all(at::empty({W * 2}), at::empty({W * 2}, at::kDouble)),
                      Contains("output dtype Float differs from input dtype Double"));
  const std::vector<int64_t> one_too_many(static_cast<size_t>(W + 1), 0);
  REQUIRE_THROWS_WITH(world().all_to_all_v(at::empty({W, 2}), at::empty({W, 2}), ones, one_too_many),
                      Contains("one row count per rank (" + std::to_string(W) + ")"));
  REQUIRE_THROWS_WITH(world().all_to_all_v(at::empty({W, 2}), at::empty({W, 3}), ones, ones),
                      Contains("must have one shape"));
  REQUIRE_THROWS_WITH(
      world().all_to_all_v(at::empty({W + 1, 2}), at::empty({W, 2}), ones, ones),
      Contains("output_splits add up to " + std::to_string(W) + " rows but the output has " + std::to_string(W + 1)));
  std::vector<int64_t> negative = ones;
  negative[0] = -1;
  negative[static_cast<size_t>(W - 1)] += 1;
  if (W > 1) {
    REQUIRE_THROWS_WITH(world().all_to_all_v(at::empty({W, 2}), at::empty({W, 2}), ones, negative),
                        Contains("input_splits[0] is -1"));
  }
  std::vector<int64_t> more_here = ones;
  more_here[static_cast<size_t>(r)] = 2;
  REQUIRE_THROWS_WITH(world().all_to_all_v(at::empty({W + 1, 2}), at::empty({W, 2}), more_here, ones),
                      Contains("this rank keeps 1 rows of its input"));
  REQUIRE_THROWS_WITH(world().all_to_all(at::empty({W * 8}).view({4, 2 * W}).t(), at::empty({W * 8})),
                      Contains("must be contiguous"));
  auto both = at::zeros({2 * W});
  REQUIRE_THROWS_WITH(world().all_to_all(both, both), Contains("the output overlaps the input"));
  world().barrier();  // still usable
}

TEST_CASE("bool tensors travel through all_gather and broadcast", "[mpi]") {
  const int W = world().size(), r = world().rank();
  auto input = at::full({2}, r % 2 == 1, at::kBool);
  auto output = at::empty({2 * W}, at::kBool);
  world().all_gather(output, input);
  require_equal(output, (at::arange(W) % 2 == 1).repeat_interleave(2));
}

TEST_CASE("async collectives overlap and complete in any wait order", "[mpi][async]") {
  const int W = world().size(), r = world().rank(), n = 1 << 16;
  auto gathered = at::empty({W * n});
  auto shard = at::full({n}, float(r));
  auto summed = at::full({n}, 1.0f);
  auto big = at::ones({W * n}, at::kBFloat16);
  auto scattered = at::empty({n}, at::kBFloat16);
  auto w1 = world().all_gather_async(gathered, shard);
  auto w2 = world().all_reduce_async(summed, ReduceOp::sum);
  auto w3 = world().reduce_scatter_async(scattered, big, ReduceOp::sum);
  auto w4 = world().barrier_async();
  w4.wait_host();
  w3.wait_stream();  // the host backend: blocks too
  w2.wait_host();
  w1.wait_host();
  REQUIRE(w1.is_completed());
  REQUIRE(w3.is_completed());
  require_equal(gathered, at::arange(W).to(at::kFloat).repeat_interleave(n));
  require_equal(summed, at::full({n}, float(W)));
  require_equal(scattered, at::full({n}, W, at::kBFloat16));
  w1.wait_host();  // idempotent
  w1.wait_stream();
}

TEST_CASE("empty tensors are valid collectives", "[mpi]") {
  auto out = at::empty({0});
  world().all_gather(out, at::empty({0}));
  auto t = at::empty({0});
  world().all_reduce(t);
  world().barrier();
  REQUIRE(out.numel() == 0);
}

TEST_CASE("split: groups by color, ordered by key; no_color gets nothing", "[mpi][split]") {
  const int W = world().size(), r = world().rank();
  // Two groups by parity, reverse rank order within a group.
  auto sub = world().split(r % 2, -r, "parity");
  REQUIRE(sub.has_value());
  const int members = (W - r % 2 + 1) / 2;
  REQUIRE(sub->size() == members);
  REQUIRE(sub->name() == "parity");
  auto ids = at::full({1}, r, at::kInt);
  auto all = at::empty({members}, at::kInt);
  sub->all_gather(all, ids);
  // Highest rank of this parity first.
  for (int i = 0; i < members; ++i) REQUIRE(all[i].item<int>() == (W - 1 - (W - 1 - r % 2) % 2) - 2 * i);
  REQUIRE(all[sub->rank()].item<int>() == r);

  auto without_zero = world().split(r == 0 ? fsdpx::dist::no_color : 0, r);
  REQUIRE(without_zero.has_value() == (r != 0));
  if (without_zero) {
    auto t = at::ones({1});
    without_zero->all_reduce(t);
    REQUIRE(t.item<float>() == W - 1);
  }
}

TEST_CASE("bad arguments fail before any communication, naming the cause", "[mpi][errors]") {
  const int W = world().size();
  using Catch::Matchers::Contains;
  REQUIRE_THROWS_AS(world().all_gather(at::empty({W * 3 + 1}), at::empty({3})), fsdpx::ConfigError);
  REQUIRE_THROWS_WITH(world().all_gather(at::empty({W * 3 + 1}), at::empty({3})),
                      Contains("all_gather on communicator 'world'") && Contains("world size x input"));
  REQUIRE_THROWS_WITH(world().reduce_scatter(at::empty({2}), at::empty({2 * W}, at::kDouble)),
                      Contains("output dtype Float differs from input dtype Double"));
  REQUIRE_THROWS_WITH(world().all_reduce(at::empty({4, 4}).t()), Contains("must be contiguous"));
  REQUIRE_THROWS_WITH(world().all_reduce(at::ones({2}, at::kInt), ReduceOp::avg), Contains("floating dtype"));
  REQUIRE_THROWS_WITH(world().broadcast(at::ones({2}), W), Contains("root " + std::to_string(W)));
  REQUIRE_THROWS_WITH(world().gather(at::empty({3}), at::empty({3}), -1),
                      Contains("gather on communicator 'world'") && Contains("root -1"));
  if (world().rank() == 0) {
    // Only the root checks the output (the others have none); nothing is sent when it is wrong.
    REQUIRE_THROWS_WITH(world().gather(at::empty({W * 3 + 1}), at::empty({3}), 0), Contains("world size x input"));
  }
  REQUIRE_THROWS_WITH(world().all_reduce(at::ones({2}, at::kComplexFloat)),
                      Contains("not supported by the MPI backend"));
  REQUIRE_THROWS_WITH(world().all_reduce(at::Tensor()), Contains("undefined"));
  if (W > 1) {
    auto out = at::zeros({W * 2});
    REQUIRE_THROWS_WITH(world().all_gather(out, out.narrow(0, 1, 2)), Contains("overlaps the output"));
  }
  world().barrier();  // still usable
}

TEST_CASE("a timeout too large for the clock means no deadline, not an instant failure", "[mpi][timeout]") {
  fsdpx::dist::CommOptions options;
  options.timeout = std::chrono::milliseconds(10'000'000'000'000LL);  // FSDPX_TIMEOUT_MS=10000000000000
  options.name = "patient";
  auto patient = fsdpx::dist::MpiCommunicator::world(options);
  auto t = at::full({4}, static_cast<double>(patient.rank() + 1));
  patient.all_reduce(t);
  const int W = patient.size();
  require_equal(t, at::full({4}, static_cast<double>(W * (W + 1) / 2)));
  auto out = at::empty({W * 2});
  patient.all_gather(out, at::full({2}, static_cast<double>(patient.rank())));
  CHECK(out[2 * (W - 1)].item<double>() == W - 1);
}
