// The MPI backend's process-wide part: MPI's lifetime, the progress engine, datatypes and ops. Internal:
// included by the backend's implementation (fsdpx/dist/impl/mpi.ipp), not by fsdpx/dist/mpi.hpp, so
// that a translation unit using the communicator does not compile the engine.
#pragma once

#include <fsdpx/detail/config.hpp>

#if !defined(FSDPX_WITH_MPI)
#error "fsdpx/dist/detail/mpi_runtime.hpp needs FSDPX_WITH_MPI"
#endif

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>

#include <fsdpx/dist/detail/mpi_engine.hpp>
#include <fsdpx/dist/detail/mpi_types.hpp>

namespace fsdpx::dist::detail {

/// Owns MPI's lifetime in this process: MPI_Init_thread, the progress engine, datatypes and ops.
/// Shared by every MpiCommunicator; MPI is finalized when the last one goes away.
class MpiRuntime {
 public:
  FSDPX_DECL static std::shared_ptr<MpiRuntime> acquire();

  MpiRuntime(const MpiRuntime&) = delete;
  MpiRuntime& operator=(const MpiRuntime&) = delete;

  /// Tells the other ranks that this one leaves (so collectives waiting for it fail at once instead
  /// of at their timeout), then ends MPI:
  /// - after a failed collective, MPI_Abort ends the job: peers may sit in collectives that will never
  ///   match, so MPI_Finalize would hang with them. When the failure was a peer leaving, this rank
  ///   first gives that peer a moment to print its own error and end the job;
  /// - while an exception propagates (the program is failing, and the handler that prints the cause
  ///   has not run yet), both are left to the process's exit, after the handler;
  /// - otherwise MPI_Finalize.
  FSDPX_DECL ~MpiRuntime();

  /// Engine thread, collective over MPI_COMM_WORLD on first use: the channel departure notices use.
  FSDPX_DECL void open_control_channel(std::chrono::milliseconds heartbeat_timeout);

  /// How a process's MPI ends: MPI_Abort after a failed collective, else MPI_Finalize when fsdpx
  /// initialized MPI.
  struct EndOfMpi {
    bool failed = false;
    bool failed_by_departure = false;
    std::string cause;
    bool finalize = false;

    void run() const {
      if (failed) {
        // The peer that left reports the cause itself and ends the job; give it a moment to.
        if (failed_by_departure) std::this_thread::sleep_for(departed_peer_grace);
        std::fprintf(stderr, "fsdpx: aborting the MPI job after a failed collective: %s\n", cause.c_str());
        std::fflush(stderr);
        MPI_Abort(MPI_COMM_WORLD, 3);
      }
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (finalize && finalized == 0) MPI_Finalize();
    }
  };

  /// How long a rank whose collective failed because a peer left waits before ending the job, so the
  /// peer's own error (the cause) is printed first.
  static constexpr std::chrono::milliseconds departed_peer_grace{2000};

  MpiEngine& engine() { return *engine_; }
  /// The id of the next communicator world() makes (every rank calls world() equally often).
  FSDPX_DECL std::uint64_t next_world_id();
  const MpiTypes& types() const { return types_; }

 private:
  FSDPX_DECL MpiRuntime();

  bool owns_mpi_ = false;
  std::atomic<std::uint64_t> world_count_{0};
  MpiTypes types_;
  std::unique_ptr<MpiEngine> engine_;
};

}  // namespace fsdpx::dist::detail
