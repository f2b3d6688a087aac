// NCCL backend on one GPU (NCCL refuses two ranks per GPU, so multi-rank logic is proven with MPI).
// FSDPX_TEST_BOOTSTRAP=store: torchrun-style env, unique id through the TCPStore.
// FSDPX_TEST_BOOTSTRAP=mpi:   started by mpiexec -n 1, unique id broadcast over MPI.
// Built and run when fsdpx has NCCL; on CPU-only CI this file is compiled, not run.
#define CATCH_CONFIG_RUNNER
// LibTorch first: c10/util/logging defines its own CHECK (abort on failure, never counted); Catch's,
// defined after it, must be the one these tests use.
#include <ATen/ATen.h>
#include <catch2/catch.hpp>

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <fsdpx/dist/launch.hpp>  // compiled with and without MPI
#include <fsdpx/dist/nccl.hpp>
#if defined(FSDPX_WITH_MPI)
#include <fsdpx/dist/mpi.hpp>
#endif

using fsdpx::dist::NcclCommunicator;
using fsdpx::dist::ReduceOp;

namespace {
std::optional<NcclCommunicator> g_comm;
#if defined(FSDPX_WITH_MPI)
std::optional<fsdpx::dist::MpiCommunicator> g_mpi;
#endif
NcclCommunicator& comm() { return *g_comm; }
at::TensorOptions cuda(at::ScalarType t) { return at::TensorOptions().dtype(t).device(at::kCUDA, 0); }
}  // namespace

TEST_CASE("collectives on one rank, every dtype", "[nccl]") {
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble, at::kInt, at::kLong}) {
    INFO("dtype " << dtype);
    auto x = at::arange(64, cuda(dtype));
    auto out = at::empty({64}, cuda(dtype));
    comm().all_gather(out, x);
    auto gathered = at::empty({64}, cuda(dtype));
    comm().gather(gathered, x, 0);
    REQUIRE(at::equal(gathered.cpu(), x.cpu()));
    comm().reduce_scatter(out, x, ReduceOp::sum);
    auto t = x.clone();
    comm().all_reduce(t, ReduceOp::max);
    comm().broadcast(t, 0);
    comm().barrier();
    REQUIRE(at::equal(out.cpu(), x.cpu()));
    REQUIRE(at::equal(t.cpu(), x.cpu()));
    // At one rank an all-to-all is its own block's device copy.
    auto exchanged = at::empty({64}, cuda(dtype));
    comm().all_to_all(exchanged, x);
    REQUIRE(at::equal(exchanged.cpu(), x.cpu()));
    auto rows = at::zeros({16, 4}, cuda(dtype));
    comm().all_to_all_v(rows, x.view({16, 4}), std::vector<int64_t>{16}, std::vector<int64_t>{16});
    REQUIRE(at::equal(rows.view({-1}).cpu(), x.cpu()));
  }
  auto f = at::arange(8, cuda(at::kBFloat16));
  auto avg = at::empty({8}, cuda(at::kBFloat16));
  comm().reduce_scatter(avg, f, ReduceOp::avg);
  REQUIRE(at::equal(avg.cpu(), f.cpu()));
}

TEST_CASE("collectives are ordered after the caller's stream and before its later work", "[nccl][streams]") {
  // Produce the input on a side stream with a long chain of kernels, then all_gather from that
  // stream: if the communicator did not wait for it, it would gather stale zeros.
  auto side = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, 0);
  c10::cuda::CUDAStreamGuard guard(side);
  auto a = at::randn({2048, 2048}, cuda(at::kFloat));
  auto input = at::zeros({1 << 20}, cuda(at::kFloat));
  auto output = at::empty({1 << 20}, cuda(at::kFloat));
  for (int i = 0; i < 20; ++i) a = at::tanh(at::matmul(a, a) * 1e-3);
  input.copy_(a.flatten().narrow(0, 0, 1 << 20));
  auto work = comm().all_gather_async(output, input);
  work.wait_stream();                          // side stream now waits for the collective; the host does not
  auto check = output.sub(input).abs().max();  // runs on the side stream, after the gather
  REQUIRE(check.item<float>() == 0.0f);
  REQUIRE(work.is_completed());
  REQUIRE(comm().stream() != side.stream());
}

TEST_CASE("grouped batch: several collectives, one launch", "[nccl]") {
  fsdpx::dist::NcclBatch batch;
  auto a = at::ones({16}, cuda(at::kFloat)), b = at::empty({16}, cuda(at::kFloat));
  auto c = at::full({4}, 2.0, cuda(at::kBFloat16));
  comm().add_all_gather(batch, b, a);
  comm().add_all_reduce(batch, c, ReduceOp::sum);
  auto done = comm().launch(std::move(batch));
  done.wait_host();  // the host blocks until the group has finished
  REQUIRE(done.is_completed());
  REQUIRE(at::equal(b.cpu(), a.cpu()));
  REQUIRE(at::equal(c.cpu(), at::full({4}, 2.0, at::kBFloat16)));
}

TEST_CASE("bad arguments name the cause", "[nccl][errors]") {
  using Catch::Matchers::Contains;
  REQUIRE_THROWS_WITH(comm().all_reduce(at::ones({2})), Contains("is on cpu but this backend works on cuda"));
  REQUIRE_THROWS_WITH(comm().all_gather(at::empty({3}, cuda(at::kFloat)), at::ones({2}, cuda(at::kFloat))),
                      Contains("world size x input"));
}

TEST_CASE("split keeps a working group", "[nccl][split]") {
  auto sub = comm().split(0, 0, "sub");
  REQUIRE(sub.has_value());
  auto t = at::ones({4}, cuda(at::kFloat));
  sub->all_reduce(t);
  REQUIRE(at::equal(t.cpu(), at::ones({4})));
}

int main(int argc, char** argv) {
  const char* mode = std::getenv("FSDPX_TEST_BOOTSTRAP");
  const std::string bootstrap = mode != nullptr ? mode : "store";
  if (bootstrap == "mpi") {
#if defined(FSDPX_WITH_MPI)
    // The id over MPI (what dist::nccl_world() does under mpirun without MASTER_ADDR).
    g_mpi = fsdpx::dist::MpiCommunicator::world();
    g_comm = NcclCommunicator::world(*g_mpi);
#else
    std::fprintf(stderr, "test_nccl: built without MPI; use FSDPX_TEST_BOOTSTRAP=store\n");
    return 1;
#endif
  } else {
    const auto env = fsdpx::dist::detect_launch_env();
    fsdpx::dist::Rendezvous rendezvous(env);
    g_comm = NcclCommunicator::create(env.rank, env.world_size, static_cast<c10::DeviceIndex>(env.local_rank),
                                      NcclCommunicator::unique_id(rendezvous, "test"));
  }
  const int rc = Catch::Session().run(argc, argv);
  g_comm.reset();
#if defined(FSDPX_WITH_MPI)
  g_mpi.reset();
#endif
  return rc;
}
