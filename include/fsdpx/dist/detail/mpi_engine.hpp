// The MPI progress engine: one thread per process that makes every MPI call after MPI_Init.
//
// Why a thread: Open MPI progresses nonblocking collectives only inside MPI calls, so without one an
// "async" all-gather would not move while the training thread computes. Why nonblocking requests
// with deadlines: a blocking MPI collective whose peer died hangs forever; a request we poll can
// time out and fail with the operation's name instead.
//
// The control channel (mpi_control.hpp) ends collectives that wait for a rank that left, failed or
// stopped answering, long before their timeout.
#pragma once

#include <fsdpx/detail/config.hpp>

#if !defined(FSDPX_WITH_MPI)
#error "fsdpx's MPI engine needs FSDPX_WITH_MPI"
#endif

#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <deque>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <fsdpx/detail/inplace_function.hpp>
#include <fsdpx/dist/detail/checks.hpp>
#include <fsdpx/dist/detail/health.hpp>
#include <fsdpx/dist/detail/mpi_control.hpp>
#include <fsdpx/dist/detail/mpi_steps.hpp>
#include <fsdpx/dist/detail/work_pool.hpp>
#include <fsdpx/dist/types.hpp>
#include <fsdpx/dist/work.hpp>
#include <fsdpx/error.hpp>

namespace fsdpx::dist::detail {

inline std::string mpi_error_string(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, buf, &len) != MPI_SUCCESS) return str("MPI error ", code);
  return std::string(buf, static_cast<size_t>(len));
}

/// One collective handed to the engine, as a sequence of stages (MpiStep, mpi_steps.hpp). Its closures
/// live inside the task: submitting a collective does not allocate.
struct MpiTask {
  using Step = MpiStep;
  using Start = MpiStart;
  using Finish = MpiFinish;

  OpContext context;
  Step step;
  Finish finish;  // runs on completion (e.g. divide for avg); may be empty
  std::chrono::milliseconds timeout{};
  std::shared_ptr<CommHealth> health;
  /// World ranks of the task's communicator, sorted; null: unknown (departures are not applied).
  std::shared_ptr<const std::vector<int>> members;
  CollectiveId id;
  std::chrono::milliseconds report_interval{std::chrono::minutes(1)};

  /// A stage list of one nonblocking call.
  static Step single(Start start) {
    return [start = std::move(start), started = false](std::vector<MPI_Request>& requests,
                                                       std::vector<ReceiveSize>&) mutable {
      if (started) return MPI_SUCCESS;
      started = true;
      requests.emplace_back(MPI_REQUEST_NULL);
      return start(&requests.back());
    };
  }
};

class MpiEngine {
 public:
  MpiEngine() : thread_([this] { loop(); }) {}
  MpiEngine(const MpiEngine&) = delete;
  MpiEngine& operator=(const MpiEngine&) = delete;
  ~MpiEngine() { stop(); }

  /// Queues a collective; the returned Work completes when MPI finishes it, fails, or times out.
  FSDPX_DECL Work submit(MpiTask task);

  /// Runs `fn` on the engine thread (between polls) and returns its result or rethrows its error.
  template <class Fn>
  auto run(Fn&& fn) -> decltype(fn()) {
    using R = decltype(fn());
    std::packaged_task<R()> task(std::forward<Fn>(fn));
    auto result = task.get_future();
    if (std::this_thread::get_id() == thread_.get_id()) {
      task();
    } else {
      post([&task] { task(); });
    }
    return result.get();
  }

  /// Joins the thread after telling the other ranks that this one leaves. `failing`: this rank ends
  /// with an error, so its collectives still running are abandoned (peers are told at once, and will
  /// fail theirs); otherwise queued work finishes (or times out) first.
  FSDPX_DECL void stop(bool failing = false);

  /// Engine thread: starts the control channel on `control` (a private duplicate of MPI_COMM_WORLD).
  void open_control(MPI_Comm control, std::chrono::milliseconds heartbeat_timeout) {
    control_.open(control, heartbeat_timeout);
  }
  /// Any thread: the control channel's counters and what it knows of lost ranks.
  MpiControl& control() { return control_; }

  /// True once any collective timed out or failed: MPI cannot be finalized cleanly after that.
  FSDPX_DECL bool any_failure() const;
  FSDPX_DECL std::string first_failure() const;
  /// True when the first failure was another rank leaving: that rank reports the cause itself.
  FSDPX_DECL bool first_failure_was_departure() const;

 private:
  using Clock = std::chrono::steady_clock;
  struct Active {
    MpiTask task;
    std::shared_ptr<HostWorkState> work;
    std::vector<MPI_Request> requests;
    Clock::time_point started;
    Clock::time_point deadline;
    Clock::time_point next_report;
    std::vector<ReceiveSize> receives;  // what the stage's receives must deliver (empty: unchecked)
    std::vector<MPI_Status> statuses;   // the stage's, when receives are checked
  };

  /// Engine thread, on a failing stop: the collectives still running fail, and their buffers are
  /// kept (MPI may still write into them until the process ends).
  FSDPX_DECL void abandon_active();

  /// A failed task with requests still inside MPI (retire() sends it here): its buffers stay alive for
  /// the rest of the process, since MPI may still write into them.
  FSDPX_DECL static void orphan(Active&& a);

  /// Queues `job` for run(): rare (communicator creation and teardown), so a std::function is fine.
  FSDPX_DECL void post(std::function<void()> job);

  FSDPX_DECL void start(MpiTask task, std::shared_ptr<HostWorkState> work);

  /// A task that left MPI: failed with requests still posted, it is kept for the rest of the process
  /// (orphan); otherwise its slot, with the request lists' capacity, serves a later task.
  FSDPX_DECL void retire(Active&& a);

  /// Posts the next stage. Returns whether the task is still running (false: completed or failed).
  FSDPX_DECL bool advance(Active& a);

  /// Statuses for the stage's requests when some receive's size is checked, else MPI_STATUSES_IGNORE.
  FSDPX_DECL static MPI_Status* statuses_for(Active& a);

  /// Why a completed stage received another size than it was posted for (none: every size matched).
  FSDPX_DECL static std::optional<std::string> wrong_receive_size(const Active& a);

  /// For a stage that failed: a receive whose peer sent more than it was posted for, named.
  FSDPX_DECL static std::string receive_truncated(const Active& a, int rc);

  FSDPX_DECL void fail(Active& a, std::exception_ptr error, bool departure = false);

  /// Tests every active task once. Returns whether any of them moved on.
  FSDPX_DECL bool poll();

  FSDPX_DECL void loop();

  static constexpr std::chrono::milliseconds control_poll_interval{50};  // idle wake-ups
  static constexpr std::chrono::milliseconds control_poll_spacing{10};   // at most this often otherwise
  static constexpr std::size_t max_spare = 64;                           // retired task slots kept for reuse

  mutable std::mutex mutex_;
  std::condition_variable cv_;
  struct Submission {
    MpiTask task;
    std::shared_ptr<HostWorkState> work;
  };
  std::vector<Submission> submissions_;           // guarded by mutex_; swapped with taken_ (both keep capacity)
  std::deque<std::function<void()>> jobs_;        // guarded by mutex_: run()'s
  std::vector<Submission> taken_;                 // engine thread only
  std::deque<std::function<void()>> taken_jobs_;  // engine thread only
  std::vector<Active> spare_;                     // engine thread only: retired slots, for start() to reuse
  bool stopping_ = false;
  bool leaving_failing_ = false;
  bool any_failure_ = false;
  std::string first_failure_;
  bool first_failure_departure_ = false;
  std::vector<Active> active_;  // engine thread only
  MpiControl control_;
  Clock::time_point next_control_poll_{};  // engine thread only
  std::thread thread_;                     // last: starts after every member above exists
};

}  // namespace fsdpx::dist::detail
