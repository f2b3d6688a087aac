// The job's NCCL world, whatever launched it: the one header that knows both backends, so that
// neither backend's header includes the other. MPI here only carries NCCL's unique id.
#pragma once

#if !defined(FSDPX_WITH_NCCL)
#error "fsdpx/dist/launch.hpp needs FSDPX_WITH_NCCL: configure fsdpx with a CUDA LibTorch and NCCL (docs/building.md)"
#endif

#include <utility>

#include <fsdpx/dist/env.hpp>
#include <fsdpx/dist/nccl.hpp>
#include <fsdpx/dist/types.hpp>
#if defined(FSDPX_WITH_MPI)
#include <fsdpx/dist/mpi.hpp>
#endif

namespace fsdpx::dist {

/// NCCL over all the job's ranks, one GPU each (LOCAL_RANK picks it). NCCL's unique id travels
/// through the TCP store when MASTER_ADDR and MASTER_PORT are set (torchrun; srun or mpirun with them
/// exported) or needs none (one process); otherwise, under mpirun or srun, over MPI, whose world then
/// lives as long as the NCCL one.
inline NcclCommunicator nccl_world(CommOptions options = {}) {
  const LaunchEnv env = detect_launch_env();
  const bool store = env.world_size == 1 || env.has_rendezvous();
#if defined(FSDPX_WITH_MPI)
  if (!store) {
    auto bootstrap = MpiCommunicator::world(options);
    return NcclCommunicator::world(std::move(bootstrap), std::move(options));
  }
#else
  (void)store;  // without MPI only the store can carry the id: world() says what is missing
#endif
  return NcclCommunicator::world(std::move(options));
}

}  // namespace fsdpx::dist
