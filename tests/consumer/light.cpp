// The smallest program that proves a way of consuming fsdpx (a subproject, a Conan consumer) finds its
// headers, LibTorch and MPI, links and runs: one header of fsdpx, an all-reduce across ranks. The
// umbrella header's program (main.cpp) is built by the installed-package and Conan package tests; this
// one costs a fraction of its compile time.
#include <cstdio>

#include <fsdpx/version.hpp>

#include "all_reduce_check.hpp"

int main() {
  auto world = fsdpx::dist::MpiCommunicator::world();
  if (!all_reduce_sums(world)) return 1;
  std::printf("consumer: fsdpx %s, rank %d of %d: all_reduce ok\n", fsdpx::version, world.rank(), world.size());
  return 0;
}
