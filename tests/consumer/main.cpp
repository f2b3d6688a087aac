// Built against the installed package: include the umbrella header, all-reduce across ranks.
#include <cstdio>

#include <ATen/ATen.h>
#include <fsdpx/fsdp.hpp>

int main() {
  auto world = fsdpx::dist::MpiCommunicator::world();
  auto t = at::full({4}, world.rank() + 1.0f);
  world.all_reduce(t, fsdpx::dist::ReduceOp::sum);
  const float want = world.size() * (world.size() + 1) / 2.0f;
  if (!at::equal(t, at::full({4}, want))) {
    std::fprintf(stderr, "consumer: rank %d got a wrong sum\n", world.rank());
    return 1;
  }
  std::printf("consumer: fsdpx %s, rank %d of %d: all_reduce ok\n", fsdpx::version, world.rank(), world.size());
  return 0;
}
