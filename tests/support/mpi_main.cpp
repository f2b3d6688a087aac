// Catch2 runner for tests started by mpiexec: every rank runs every test case in the same order
// (collectives must match), and every rank exits with the worst result of all ranks.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <optional>

#include <ATen/ATen.h>

#include "mpi_world.hpp"

namespace {
std::optional<fsdpx::dist::MpiCommunicator> g_world;
}

fsdpx::dist::MpiCommunicator& fsdpx::test::world() { return *g_world; }

int main(int argc, char** argv) {
  g_world = fsdpx::dist::MpiCommunicator::world();
  Catch::Session session;
  if (const int rc = session.applyCommandLine(argc, argv); rc != 0) return rc;
  const int failed = session.run();
  auto worst = at::full({1}, failed, at::kInt);
  g_world->all_reduce(worst, fsdpx::dist::ReduceOp::max);
  const int rc = worst.item<int>();
  g_world.reset();  // finalizes MPI
  return rc;
}
