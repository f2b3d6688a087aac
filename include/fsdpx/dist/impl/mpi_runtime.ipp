// The MPI backend's runtime (MPI_Init and MPI_Finalize, the datatypes, the engine it owns), out of line:
// included by fsdpx/dist/impl/mpi.ipp (the communicator's), so by fsdpx/dist/mpi.hpp (header-only) or
// fsdpx/impl/src.hpp (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fsdpx/dist/detail/health.hpp>
#include <fsdpx/dist/detail/mpi_runtime.hpp>
#include <fsdpx/dist/env.hpp>
#include <fsdpx/memory/host.hpp>

namespace fsdpx::dist::detail {

FSDPX_DECL std::shared_ptr<MpiRuntime> MpiRuntime::acquire() {
  static std::mutex mutex;
  static std::weak_ptr<MpiRuntime> current;
  std::lock_guard lock(mutex);
  if (auto rt = current.lock()) return rt;
  auto rt = std::shared_ptr<MpiRuntime>(new MpiRuntime());
  current = rt;
  return rt;
}

FSDPX_DECL MpiRuntime::~MpiRuntime() {
  const bool unwinding = std::uncaught_exceptions() > 0;
  engine_->stop(/*failing=*/unwinding || engine_->any_failure());
  types_.destroy();
  EndOfMpi end{engine_->any_failure(), engine_->first_failure_was_departure(), engine_->first_failure(), owns_mpi_};
  if (!unwinding) {
    end.run();
    return;
  }
  static EndOfMpi at_exit;
  at_exit = std::move(end);
  std::atexit([] { at_exit.run(); });
}

FSDPX_DECL void MpiRuntime::open_control_channel(std::chrono::milliseconds heartbeat_timeout) {
  if (engine_->control().is_open()) return;
  MPI_Comm control = MPI_COMM_NULL;
  const int rc = MPI_Comm_dup(MPI_COMM_WORLD, &control);
  FSDPX_CHECK_AS(CommError, rc == MPI_SUCCESS, "MPI_Comm_dup(MPI_COMM_WORLD) failed: ", detail::mpi_error_string(rc));
  MPI_Comm_set_errhandler(control, MPI_ERRORS_RETURN);
  engine_->open_control(control, heartbeat_timeout);
}

FSDPX_DECL MpiRuntime::MpiRuntime() {
  int initialized = 0;
  int finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  FSDPX_CHECK(finalized == 0,
              "MPI was already finalized in this process; keep one MpiCommunicator alive for "
              "as long as the program communicates");
  int provided = MPI_THREAD_SINGLE;
  if (initialized == 0) {
    const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
    FSDPX_CHECK_AS(CommError, rc == MPI_SUCCESS, "MPI_Init_thread failed: ", detail::mpi_error_string(rc));
    owns_mpi_ = true;
  } else {
    MPI_Query_thread(&provided);
  }
  FSDPX_CHECK(provided >= MPI_THREAD_SERIALIZED, "the MPI library provides thread level ", provided,
              " but fsdpx needs MPI_THREAD_SERIALIZED (its progress thread makes the MPI calls); "
              "if you call MPI_Init yourself, use MPI_Init_thread with MPI_THREAD_SERIALIZED or higher");
  types_.create();
  engine_ = std::make_unique<detail::MpiEngine>();
}

}  // namespace fsdpx::dist::detail
