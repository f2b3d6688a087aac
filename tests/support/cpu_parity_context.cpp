// The parity harness's context for the test programs run under mpiexec on CPU ranks (parity,
// protocol, checkpointing): the MPI world and the CPU. tests/nccl/gpu_parity.cpp has the GPU's.
#include "../core/parity.hpp"
#include "mpi_world.hpp"

fsdpx::test::ParityContext& fsdpx::test::parity_context() {
  static ParityContext ctx{world(), at::Device(at::kCPU)};
  return ctx;
}
