// The communication layer: launcher environment, communicators (MPI and NCCL, as built with),
// device mesh and TCP rendezvous.
#pragma once

#include <fsdpx/dist/any.hpp>
#include <fsdpx/dist/communicator.hpp>
#include <fsdpx/dist/env.hpp>
#include <fsdpx/dist/mesh.hpp>
#include <fsdpx/dist/outcome.hpp>
#if defined(FSDPX_WITH_MPI)
#include <fsdpx/dist/mpi.hpp>
#endif
#include <fsdpx/dist/rendezvous.hpp>
#include <fsdpx/dist/types.hpp>
#include <fsdpx/dist/work.hpp>

#if defined(FSDPX_WITH_NCCL)
#include <fsdpx/dist/launch.hpp>
#include <fsdpx/dist/nccl.hpp>
#endif
