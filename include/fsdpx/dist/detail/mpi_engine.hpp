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

#include <fsdpx/dist/detail/health.hpp>
#include <fsdpx/dist/detail/mpi_control.hpp>
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

/// What a receive request must deliver: `count` elements of `type` (a peer that sends fewer was
/// called with other sizes). A send, or a receive of any size, has type MPI_DATATYPE_NULL.
struct ReceiveSize {
  MPI_Datatype type = MPI_DATATYPE_NULL;
  int count = 0;
};

/// One collective handed to the engine, as a sequence of stages. `step` is called once to start the
/// first stage and again each time all requests of the current stage complete; it posts the next
/// stage's requests (or none, when the collective is done), says for each what it must receive (the
/// engine checks it when the stage completes; empty: nothing to check) and returns an MPI error code.
struct MpiTask {
  using Step = std::function<int(std::vector<MPI_Request>&, std::vector<ReceiveSize>&)>;
  std::string context;      // op_context(): names op, communicator, rank
  Step step;
  std::function<void()> finish;  // runs on completion (e.g. divide for avg); may be empty
  std::chrono::milliseconds timeout;
  std::shared_ptr<CommHealth> health;
  /// World ranks of the task's communicator, sorted; null: unknown (departures are not applied).
  std::shared_ptr<const std::vector<int>> members;
  CollectiveId id;
  std::chrono::milliseconds report_interval{std::chrono::minutes(1)};

  /// A stage list of one nonblocking call.
  template <class Start>
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
  Work submit(MpiTask task) {
    auto work = std::make_shared<HostWorkState>();
    post([this, task = std::move(task), work]() mutable { start(std::move(task), std::move(work)); });
    return Work(work);
  }

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
  void stop(bool failing = false) {
    {
      std::lock_guard lock(mutex_);
      if (stopping_) return;
      stopping_ = true;
      leaving_failing_ = failing;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  /// Engine thread: starts the control channel on `control` (a private duplicate of MPI_COMM_WORLD).
  void open_control(MPI_Comm control, std::chrono::milliseconds heartbeat_timeout) {
    control_.open(control, heartbeat_timeout);
  }
  /// Any thread: the control channel's counters and what it knows of lost ranks.
  MpiControl& control() { return control_; }

  /// True once any collective timed out or failed: MPI cannot be finalized cleanly after that.
  bool any_failure() const {
    std::lock_guard lock(mutex_);
    return any_failure_;
  }
  std::string first_failure() const {
    std::lock_guard lock(mutex_);
    return first_failure_;
  }
  /// True when the first failure was another rank leaving: that rank reports the cause itself.
  bool first_failure_was_departure() const {
    std::lock_guard lock(mutex_);
    return first_failure_departure_;
  }

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
  void abandon_active() {
    for (Active& a : active_) {
      fail(a, std::make_exception_ptr(CommError(str("fsdpx: ", a.task.context,
                                                    " abandoned: this rank is ending after an error"))));
      orphan(std::move(a));
    }
    active_.clear();
  }

  /// A failed task whose requests may still be inside MPI keeps its buffers alive for the rest of the
  /// process (MPI may still write into them); one with no request left is simply dropped.
  static void orphan(Active&& a) {
    if (a.requests.empty()) return;
    static std::mutex m;
    static auto* kept = new std::vector<Active>();  // never freed, on purpose
    std::lock_guard lock(m);
    kept->push_back(std::move(a));
  }

  void post(std::function<void()> job) {
    {
      std::lock_guard lock(mutex_);
      incoming_.push_back(std::move(job));
    }
    cv_.notify_one();
  }

  void start(MpiTask task, std::shared_ptr<HostWorkState> work) {
    try {
      task.health->check(task.context);
      const auto now = Clock::now();
      const auto deadline = deadline_after(task.timeout, now), report = next_report_after(task.report_interval, now);
      Active a{std::move(task), work, {}, now, deadline, report, {}, {}};
      if (advance(a)) {
        active_.push_back(std::move(a));
      } else {
        orphan(std::move(a));  // a failure with requests posted
      }
    } catch (...) {
      work->set_done(std::current_exception());
    }
  }

  /// Posts the next stage. Returns whether the task is still running (false: completed or failed).
  bool advance(Active& a) {
    a.requests.clear();
    a.receives.clear();
    int rc = MPI_SUCCESS;
    try {
      rc = a.task.step(a.requests, a.receives);
    } catch (...) {
      fail(a, std::current_exception());
      return false;
    }
    if (rc != MPI_SUCCESS) {
      fail(a, std::make_exception_ptr(CommError(str("fsdpx: ", a.task.context, " failed: ", mpi_error_string(rc)))));
      return false;
    }
    if (!a.requests.empty()) return true;
    try {
      if (a.task.finish) a.task.finish();
      a.work->set_done();
    } catch (...) {
      a.work->set_done(std::current_exception());
    }
    return false;
  }

  /// Statuses for the stage's requests when some receive's size is checked, else MPI_STATUSES_IGNORE.
  static MPI_Status* statuses_for(Active& a) {
    if (a.receives.empty()) return MPI_STATUSES_IGNORE;
    a.statuses.resize(a.requests.size());
    return a.statuses.data();
  }

  /// Why a completed stage received another size than it was posted for (none: every size matched).
  static std::optional<std::string> wrong_receive_size(const Active& a) {
    for (size_t i = 0; i < a.receives.size() && i < a.statuses.size(); ++i) {
      const ReceiveSize& want = a.receives[i];
      if (want.type == MPI_DATATYPE_NULL) continue;
      int got = 0;
      MPI_Get_count(&a.statuses[i], want.type, &got);
      if (got != want.count) {
        return str("rank ", a.statuses[i].MPI_SOURCE, " of the communicator sent ", got, " elements where ", want.count,
                   " were expected: the ranks called this collective with different sizes (did they build "
                   "different models?)");
      }
    }
    return std::nullopt;
  }

  /// For a stage that failed: a receive whose peer sent more than it was posted for, named.
  static std::string receive_truncated(const Active& a, int rc) {
    int rc_class = MPI_SUCCESS;
    MPI_Error_class(rc, &rc_class);
    if (rc_class != MPI_ERR_IN_STATUS || a.receives.empty()) return {};
    for (size_t i = 0; i < a.receives.size() && i < a.statuses.size(); ++i) {
      int error_class = MPI_SUCCESS;
      if (a.receives[i].type == MPI_DATATYPE_NULL || a.statuses[i].MPI_ERROR == MPI_SUCCESS) continue;
      MPI_Error_class(a.statuses[i].MPI_ERROR, &error_class);
      if (error_class == MPI_ERR_TRUNCATE) {
        return str(" (rank ", a.statuses[i].MPI_SOURCE, " of the communicator sent more than the ", a.receives[i].count,
                   " elements expected: the ranks called this collective with different sizes)");
      }
    }
    return {};
  }

  void fail(Active& a, std::exception_ptr error, bool departure = false) {
    std::string what;
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      what = e.what();
    }
    a.task.health->mark_broken(what);
    {
      std::lock_guard lock(mutex_);
      if (!any_failure_) {
        first_failure_ = what;
        first_failure_departure_ = departure;
      }
      any_failure_ = true;
    }
    a.work->set_done(std::move(error));
  }

  /// Tests every active task once. Returns whether any of them moved on.
  bool poll() {
    bool progressed = false;
    const auto now = Clock::now();
    for (size_t i = 0; i < active_.size();) {
      Active& a = active_[i];
      int done = 0;
      bool running = true;
      if (a.task.health->broken()) {
        // A sibling failed: its peers will never match this request either.
        fail(a, std::make_exception_ptr(CommError(str("fsdpx: ", a.task.context, " abandoned: the communicator "
                                                      "failed earlier: ", a.task.health->cause()))));
        running = false;
      } else if (const int rc = MPI_Testall(static_cast<int>(a.requests.size()), a.requests.data(), &done,
                                            statuses_for(a));
                 rc != MPI_SUCCESS) {
        fail(a, std::make_exception_ptr(CommError(str("fsdpx: ", a.task.context, " failed: ", mpi_error_string(rc),
                                                      receive_truncated(a, rc)))));
        running = false;
      } else if (done != 0) {
        progressed = true;
        if (auto wrong = wrong_receive_size(a)) {
          a.requests.clear();  // all complete: nothing of MPI's still points into the buffers
          fail(a, std::make_exception_ptr(CommError(str("fsdpx: ", a.task.context, " failed: ", *wrong))));
          running = false;
        } else {
          running = advance(a);
        }
      } else if (const auto why = a.task.members ? control_.verdict(*a.task.members, a.task.id, now) : std::nullopt) {
        fail(a, std::make_exception_ptr(CommError(str("fsdpx: ", a.task.context, " failed: ", why->text))),
             /*departure=*/why->that_rank_reports);
        running = false;
      } else if (now >= a.next_report && now < a.deadline) {
        const std::chrono::duration<double> waited = now - a.started;
        std::fprintf(stderr,
                     "fsdpx: %s still waiting after %.1f s (its timeout: %lld ms) for ranks that have not joined it; "
                     "every rank must call the same collectives in the same order\n",
                     a.task.context.c_str(), waited.count(), static_cast<long long>(a.task.timeout.count()));
        std::fflush(stderr);
        a.next_report = next_report_after(a.task.report_interval, now);
      } else if (now >= a.deadline) {
        fail(a, std::make_exception_ptr(TimeoutError(str(
                    "fsdpx: ", a.task.context, " did not complete within ", a.task.timeout.count(),
                    " ms: a peer rank exited, crashed, or did not call the same collective (raise "
                    "CommOptions::timeout or FSDPX_TIMEOUT_MS if it is only slow)"))));
        running = false;
      }
      if (running) {
        ++i;
      } else {
        progressed = true;
        orphan(std::move(a));  // requests are left only after a failure
        active_.erase(active_.begin() + static_cast<std::ptrdiff_t>(i));
      }
    }
    return progressed;
  }

  void loop() {
    // Spin while requests are young (shared-memory transfers need prompt progress), then back off so
    // an idle wait does not steal a core from the training thread.
    auto last_progress = Clock::now();
    for (;;) {
      std::deque<std::function<void()>> jobs;
      {
        std::unique_lock lock(mutex_);
        const auto wake = [&] { return stopping_ || !incoming_.empty(); };
        if (active_.empty()) {
          // Listening for departures needs a look now and then even when idle.
          if (control_.is_open()) {
            cv_.wait_for(lock, control_poll_interval, wake);
          } else {
            cv_.wait(lock, wake);
          }
        }
        if (stopping_ && incoming_.empty() && (active_.empty() || leaving_failing_)) {
          const bool failing = leaving_failing_;
          lock.unlock();
          if (failing) abandon_active();
          control_.leave(failing || any_failure());
          return;
        }
        jobs.swap(incoming_);
      }
      for (auto& job : jobs) job();
      // Notices and heartbeats work in seconds: the spin that serves collectives need not test them.
      bool heard = false;
      if (const auto now = Clock::now(); now >= next_control_poll_) {
        heard = control_.poll(now);
        next_control_poll_ = now + control_poll_spacing;
      }
      if (!jobs.empty() || poll() || heard) {
        last_progress = Clock::now();
      } else if (Clock::now() - last_progress > std::chrono::microseconds(200)) {
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      } else {
        std::this_thread::yield();
      }
    }
  }

  static constexpr std::chrono::milliseconds control_poll_interval{50};  // idle wake-ups
  static constexpr std::chrono::milliseconds control_poll_spacing{10};   // at most this often otherwise

  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> incoming_;
  bool stopping_ = false;
  bool leaving_failing_ = false;
  bool any_failure_ = false;
  std::string first_failure_;
  bool first_failure_departure_ = false;
  std::vector<Active> active_;  // engine thread only
  MpiControl control_;
  Clock::time_point next_control_poll_{};  // engine thread only
  std::thread thread_;          // last: starts after every member above exists
};

}  // namespace fsdpx::dist::detail
