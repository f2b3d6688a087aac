// Programs that must fail, and fail clearly, under mpiexec. CTest checks their output.
//   early_exit        the last rank leaves; the others' all_gather times out naming op, rank and timeout
//   indivisible_mesh  shard size 2 on a world of 3
//   env_mismatch      torchrun variables that contradict mpirun's
//   broken_after_timeout  after a timeout, the communicator refuses further work with the cause
#include <cstdio>
#include <cstring>
#include <string>

#include <ATen/ATen.h>

#include <fsdpx/dist/mesh.hpp>
#include <fsdpx/dist/mpi.hpp>

#include "../support/expect.hpp"

using namespace fsdpx;
using fsdpx::test::expect_error;

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "env_mismatch") {
    return expect_error<ConfigError>([] { dist::MpiCommunicator::world(); },
                                     {"contradicts OMPI_COMM_WORLD_"});
  }
  dist::CommOptions options;
  options.timeout = std::chrono::milliseconds(3000);
  auto world = dist::MpiCommunicator::world(options);
  const int W = world.size(), r = world.rank();

  if (mode == "indivisible_mesh") {
    return expect_error<ConfigError>([&] { dist::DeviceMesh<dist::MpiCommunicator>::build(world, 2); },
                                     {"cannot be split into shard groups of 2 ranks"});
  }
  if (mode == "early_exit" || mode == "broken_after_timeout") {
    world.barrier();
    if (r == W - 1) {
      std::printf("rank %d leaving early\n", r);
      return 0;  // finalizes MPI without taking part in the all_gather below
    }
    auto out = at::empty({W * 4});
    const int rc = expect_error<TimeoutError>([&] { world.all_gather(out, at::ones({4})); },
                                              {"all_gather on communicator 'world'", "did not complete within 3000 ms"});
    if (rc != 0 || mode == "early_exit") return rc;
    return expect_error<CommError>([&] { world.all_reduce(at::ones({1})); },
                                   {"all_reduce on communicator 'world'", "unusable after an earlier failure",
                                    "all_gather"});
  }
  std::fprintf(stderr, "unknown mode '%s'\n", mode.c_str());
  return 1;
}
