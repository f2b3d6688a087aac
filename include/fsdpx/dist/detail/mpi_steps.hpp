// What one MPI collective is to the progress engine (mpi_engine.hpp): its stages as closures held in
// place (no allocation per collective). Separate from the engine so that fsdpx/dist/mpi.hpp can name
// these types without the engine's definition.
#pragma once

#include <fsdpx/detail/config.hpp>

#if !defined(FSDPX_WITH_MPI)
#error "fsdpx/dist/detail/mpi_steps.hpp needs FSDPX_WITH_MPI"
#endif

#include <mpi.h>

#include <vector>

#include <fsdpx/detail/inplace_function.hpp>

namespace fsdpx::dist::detail {

/// What a receive request must deliver: `count` elements of `type` (a peer that sends fewer was
/// called with other sizes). A send, or a receive of any size, has type MPI_DATATYPE_NULL.
struct ReceiveSize {
  MPI_Datatype type = MPI_DATATYPE_NULL;
  int count = 0;
};

/// Called once to start a collective's first stage and again each time all requests of the current
/// stage complete: posts the next stage's requests (or none, when the collective is done), says for
/// each what it must receive (the engine checks it when the stage completes; empty: nothing to check)
/// and returns an MPI error code.
using MpiStep = ::fsdpx::detail::InplaceFunction<int(std::vector<MPI_Request>&, std::vector<ReceiveSize>&), 192>;
/// A collective of one nonblocking call: posts it into the request it is given.
using MpiStart = ::fsdpx::detail::InplaceFunction<int(MPI_Request*), 64>;
/// Runs when the collective completed (e.g. divide for avg).
using MpiFinish = ::fsdpx::detail::InplaceFunction<void(), 32>;

}  // namespace fsdpx::dist::detail
