// Programs that must fail, and fail clearly, under mpiexec. CTest checks their output.
//   early_exit        the last rank leaves; the others' all_gather fails at once (not at its 10-minute
//                     timeout) naming the op and the rank that left
//   exception_unwinds the last rank throws between collectives and its handler prints the cause; the
//                     others' next collective fails naming that rank, after its message
//   indivisible_mesh  shard size 2 on a world of 3
//   env_mismatch      torchrun variables that contradict mpirun's
//   stopped           the last rank stops itself (SIGSTOP) after a barrier; rank 0, which watches it, fails
//                     its all_gather once the heartbeat misses it (15 s by default) and tells the others
//   root_leaves       the last rank broadcasts and leaves; rank 1 joins that broadcast 2.5 s later, and
//                     every rank gets its data (a rank that took part in a collective before it left
//                     never fails it)
//   broken_after_timeout  a rank that stays but never joins: after the timeout, the communicator refuses
//                     further work with the cause
//   different_sizes   the last rank passes one element more to all_gather (a rank that built another
//                     model): in the ring, rank 0 receives too much and the last rank too little, and
//                     both name the cause instead of reading or writing past a buffer
//   all_to_all_counts rank 1 sends rank 0 one row more than rank 0's output_splits make room for:
//                     rank 0 names rank 1 instead of writing past its block
#include <csignal>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>

#include <fsdpx/dist/mesh.hpp>
#include <fsdpx/dist/mpi.hpp>

#include "../support/expect.hpp"

using namespace fsdpx;
using fsdpx::detail::str;
using fsdpx::test::expect_error;

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "env_mismatch") {
    return expect_error<ConfigError>([] { dist::MpiCommunicator::world(); }, {"contradicts OMPI_COMM_WORLD_"});
  }
  dist::CommOptions options;
  // A departure must end the collective long before this; a timeout only where the mode needs one.
  options.timeout = std::chrono::milliseconds(mode == "broken_after_timeout" ? 3000 : 600000);
  options.report_interval = std::chrono::milliseconds(1000);
  if (mode == "exception_unwinds") {
    int r = -1;
    try {
      // The documented pattern: the communicator lives inside the try block, so it is destroyed while
      // the exception propagates, before the handler prints.
      auto world = dist::MpiCommunicator::world(options);
      r = world.rank();
      const int W = world.size();
      world.barrier();
      if (r == W - 1) throw std::runtime_error("the injected failure of the last rank");
      auto out = at::empty({W * 4});
      return expect_error<CommError>(
          [&] { world.all_gather(out, at::ones({4})); },
          {"all_gather on communicator 'world'", str("world rank ", W - 1, " left the job after an error")});
    } catch (const std::exception& e) {
      std::fprintf(stderr, "CAUSE-PRINTED: rank %d: %s\n", r, e.what());
      return 1;
    }
  }
  auto world = dist::MpiCommunicator::world(options);
  const int W = world.size(), r = world.rank();

  if (mode == "indivisible_mesh") {
    return expect_error<ConfigError>([&] { dist::DeviceMesh<dist::MpiCommunicator>::build(world, 2); },
                                     {"cannot be split into shard groups of 2 ranks"});
  }
  auto out = at::empty({W * 4});
  if (mode == "early_exit") {
    world.barrier();
    if (r == W - 1) {
      std::printf("rank %d leaving early\n", r);
      return 0;  // finalizes MPI without taking part in the all_gather below
    }
    return expect_error<CommError>(
        [&] { world.all_gather(out, at::ones({4})); },
        {"all_gather on communicator 'world'", str("world rank ", W - 1, " left the job (its program ended)")});
  }
  if (mode == "stopped") {
    world.barrier();
    if (r == W - 1) {
      std::printf("rank %d stopping itself\n", r);
      std::fflush(stdout);
      std::raise(SIGSTOP);  // the job's end kills it
      return 0;
    }
    const auto start = std::chrono::steady_clock::now();
    // Rank 0 watches the last rank (its ring predecessor); the others learn it from rank 0.
    const int rc = r == 0 ? expect_error<CommError>([&] { world.all_gather(out, at::ones({4})); },
                                                    {"all_gather on communicator 'world'",
                                                     str("world rank ", W - 1, " has not answered for")})
                          : expect_error<CommError>(
                                [&] { world.all_gather(out, at::ones({4})); },
                                {"all_gather on communicator 'world'",
                                 str("world rank ", W - 1, " stopped answering: world rank 0 heard no heartbeat")});
    const auto waited = std::chrono::duration_cast<std::chrono::seconds>(std::chrono::steady_clock::now() - start);
    std::printf("rank %d: the all_gather failed after %lld s\n", r, static_cast<long long>(waited.count()));
    return rc;
  }
  if (mode == "root_leaves") {
    world.barrier();
    auto t = at::full({8}, r == W - 1 ? 42.0 : 0.0);
    if (r == W - 1) {
      world.broadcast(t, W - 1);
      return 0;
    }
    // Rank 1 joins long after the root's notice arrived; with 4 ranks, libnbc's binomial tree has it
    // forward the data to rank 2, which joined at once and so waits all that time for a rank that left.
    if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(2500));
    world.broadcast(t, W - 1);
    if (!at::equal(t, at::full({8}, 42.0))) return 6;
    std::printf("rank %d: LATE-BROADCAST-OK\n", r);
    return 0;
  }
  if (mode == "different_sizes") {
    const int64_t n = r == W - 1 ? 5 : 4;
    return expect_error<CommError>([&] { world.all_gather(at::zeros({n * W}), at::ones({n})); },
                                   {"all_gather on communicator 'world'", "different sizes"});
  }
  if (mode == "all_to_all_counts") {
    // Every rank sends 2 rows to each other rank, rank 1 sends 3 to rank 0.
    std::vector<int64_t> out_splits(static_cast<size_t>(W), 2), in_splits(static_cast<size_t>(W), 2);
    if (r == 1) in_splits[0] = 3;
    const auto rows = [](const std::vector<int64_t>& s) { return std::accumulate(s.begin(), s.end(), int64_t{0}); };
    const auto exchange = [&] {
      world.all_to_all_v(at::zeros({rows(out_splits), 4}), at::ones({rows(in_splits), 4}), out_splits, in_splits);
    };
    if (r != 0) {
      exchange();  // its sends complete; rank 0 refuses what it received
      return 0;
    }
    return expect_error<CommError>(exchange,
                                   {"all_to_all on communicator 'world'", "rank 1 of the communicator sent more"});
  }
  if (mode == "broken_after_timeout") {
    world.barrier();
    if (r == W - 1) {
      std::this_thread::sleep_for(std::chrono::seconds(6));  // alive, but never joins the all_gather
      return 0;
    }
    const int rc =
        expect_error<TimeoutError>([&] { world.all_gather(out, at::ones({4})); },
                                   {"all_gather on communicator 'world'", "did not complete within 3000 ms"});
    if (rc != 0) return rc;
    return expect_error<CommError>(
        [&] { world.all_reduce(at::ones({1})); },
        {"all_reduce on communicator 'world'", "unusable after an earlier failure", "all_gather"});
  }
  std::fprintf(stderr, "unknown mode '%s'\n", mode.c_str());
  return 1;
}
