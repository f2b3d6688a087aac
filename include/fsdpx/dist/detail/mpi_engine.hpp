// The MPI progress engine: one thread per process that makes every MPI call after MPI_Init.
//
// Why a thread: Open MPI progresses nonblocking collectives only inside MPI calls, so without one an
// "async" all-gather would not move while the training thread computes. Why nonblocking requests
// with deadlines: a blocking MPI collective whose peer died hangs forever; a request we poll can
// time out and fail with the operation's name instead.
#pragma once

#if !defined(FSDPX_WITH_MPI)
#error "fsdpx's MPI engine needs FSDPX_WITH_MPI"
#endif

#include <mpi.h>

#include <chrono>
#include <deque>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <fsdpx/dist/detail/health.hpp>
#include <fsdpx/dist/work.hpp>
#include <fsdpx/error.hpp>

namespace fsdpx::dist::detail {

inline std::string mpi_error_string(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, buf, &len) != MPI_SUCCESS) return str("MPI error ", code);
  return std::string(buf, static_cast<size_t>(len));
}

/// One collective handed to the engine, as a sequence of stages. `step` is called once to start the
/// first stage and again each time all requests of the current stage complete; it posts the next
/// stage's requests (or none, when the collective is done) and returns an MPI error code.
struct MpiTask {
  using Step = std::function<int(std::vector<MPI_Request>&)>;
  std::string context;      // op_context(): names op, communicator, rank
  Step step;
  std::function<void()> finish;  // runs on completion (e.g. divide for avg); may be empty
  std::chrono::milliseconds timeout;
  std::shared_ptr<CommHealth> health;

  /// A stage list of one nonblocking call.
  template <class Start>
  static Step single(Start start) {
    return [start = std::move(start), started = false](std::vector<MPI_Request>& requests) mutable {
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

  /// Lets queued work finish (or time out), then joins the thread.
  void stop() {
    {
      std::lock_guard lock(mutex_);
      if (stopping_) return;
      stopping_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  /// True once any collective timed out or failed: MPI cannot be finalized cleanly after that.
  bool any_failure() const {
    std::lock_guard lock(mutex_);
    return any_failure_;
  }
  std::string first_failure() const {
    std::lock_guard lock(mutex_);
    return first_failure_;
  }

 private:
  using Clock = std::chrono::steady_clock;
  struct Active {
    MpiTask task;
    std::shared_ptr<HostWorkState> work;
    std::vector<MPI_Request> requests;
    Clock::time_point deadline;
  };

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
      Active a{std::move(task), work, {}, Clock::now()};
      a.deadline = Clock::now() + a.task.timeout;
      if (advance(a)) active_.push_back(std::move(a));
    } catch (...) {
      work->set_done(std::current_exception());
    }
  }

  /// Posts the next stage. Returns whether the task is still running (false: completed or failed).
  bool advance(Active& a) {
    a.requests.clear();
    int rc = MPI_SUCCESS;
    try {
      rc = a.task.step(a.requests);
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

  void fail(Active& a, std::exception_ptr error) {
    std::string what;
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      what = e.what();
    }
    a.task.health->mark_broken(what);
    {
      std::lock_guard lock(mutex_);
      if (!any_failure_) first_failure_ = what;
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
                                            MPI_STATUSES_IGNORE);
                 rc != MPI_SUCCESS) {
        fail(a, std::make_exception_ptr(CommError(str("fsdpx: ", a.task.context, " failed: ", mpi_error_string(rc)))));
        running = false;
      } else if (done != 0) {
        progressed = true;
        running = advance(a);
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
        if (active_.empty()) cv_.wait(lock, [&] { return stopping_ || !incoming_.empty(); });
        if (stopping_ && incoming_.empty() && active_.empty()) return;
        jobs.swap(incoming_);
      }
      for (auto& job : jobs) job();
      if (!jobs.empty() || poll()) {
        last_progress = Clock::now();
      } else if (Clock::now() - last_progress > std::chrono::microseconds(200)) {
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      } else {
        std::this_thread::yield();
      }
    }
  }

  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> incoming_;
  bool stopping_ = false;
  bool any_failure_ = false;
  std::string first_failure_;
  std::vector<Active> active_;  // engine thread only
  std::thread thread_;          // last: starts after every member above exists
};

}  // namespace fsdpx::dist::detail
