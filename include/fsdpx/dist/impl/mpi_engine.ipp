// The MPI backend's progress engine (one thread makes every MPI call), out of line:
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
#include <fsdpx/dist/detail/mpi_engine.hpp>
#include <fsdpx/dist/env.hpp>
#include <fsdpx/memory/host.hpp>

namespace fsdpx::dist::detail {

FSDPX_DECL void MpiEngine::stop(bool failing) {
  {
    std::lock_guard lock(mutex_);
    if (stopping_) return;
    stopping_ = true;
    leaving_failing_ = failing;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

FSDPX_DECL void MpiEngine::abandon_active() {
  for (Active& a : active_) {
    fail(a, std::make_exception_ptr(
                CommError(str("fsdpx: ", a.task.context, " abandoned: this rank is ending after an error"))));
    retire(std::move(a));
  }
  active_.clear();
}

FSDPX_DECL void MpiEngine::orphan(Active&& a) {
  static std::mutex m;
  static auto* kept = new std::vector<Active>();  // never freed, on purpose
  std::lock_guard lock(m);
  kept->push_back(std::move(a));
}

FSDPX_DECL void MpiEngine::start(MpiTask task, std::shared_ptr<HostWorkState> work) {
  try {
    task.health->check(task.context);
    const auto now = Clock::now();
    Active a;
    if (!spare_.empty()) {
      a = std::move(spare_.back());
      spare_.pop_back();
    }
    a.deadline = deadline_after(task.timeout, now);
    a.next_report = next_report_after(task.report_interval, now);
    a.started = now;
    a.task = std::move(task);
    a.work = work;  // `work` stays ours: a throw below still completes it
    if (advance(a)) {
      active_.push_back(std::move(a));
    } else {
      retire(std::move(a));
    }
  } catch (...) {
    work->set_done(std::current_exception());
  }
}

FSDPX_DECL void MpiEngine::retire(Active&& a) {
  if (!a.requests.empty()) {
    orphan(std::move(a));  // failed with requests inside MPI
    return;
  }
  a.task = MpiTask{};  // releases the captured tensors now
  a.work.reset();
  a.receives.clear();
  a.statuses.clear();
  if (spare_.size() < max_spare) spare_.push_back(std::move(a));
}

FSDPX_DECL bool MpiEngine::advance(Active& a) {
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

FSDPX_DECL std::optional<std::string> MpiEngine::wrong_receive_size(const Active& a) {
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

FSDPX_DECL std::string MpiEngine::receive_truncated(const Active& a, int rc) {
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

FSDPX_DECL void MpiEngine::fail(Active& a, std::exception_ptr error, bool departure) {
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

FSDPX_DECL bool MpiEngine::poll() {
  bool progressed = false;
  const auto now = Clock::now();
  for (size_t i = 0; i < active_.size();) {
    Active& a = active_[i];
    int done = 0;
    bool running = true;
    if (a.task.health->broken()) {
      // A sibling failed: its peers will never match this request either.
      fail(a, std::make_exception_ptr(CommError(str("fsdpx: ", a.task.context,
                                                    " abandoned: the communicator "
                                                    "failed earlier: ",
                                                    a.task.health->cause()))));
      running = false;
    } else if (const int rc =
                   MPI_Testall(static_cast<int>(a.requests.size()), a.requests.data(), &done, statuses_for(a));
               rc != MPI_SUCCESS) {
      fail(a, std::make_exception_ptr(CommError(
                  str("fsdpx: ", a.task.context, " failed: ", mpi_error_string(rc), receive_truncated(a, rc)))));
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
                   str(a.task.context).c_str(), waited.count(), static_cast<long long>(a.task.timeout.count()));
      std::fflush(stderr);
      a.next_report = next_report_after(a.task.report_interval, now);
    } else if (now >= a.deadline) {
      fail(a, std::make_exception_ptr(
                  TimeoutError(str("fsdpx: ", a.task.context, " did not complete within ", a.task.timeout.count(),
                                   " ms: a peer rank exited, crashed, or did not call the same collective (raise "
                                   "CommOptions::timeout or FSDPX_TIMEOUT_MS if it is only slow)"))));
      running = false;
    }
    if (running) {
      ++i;
    } else {
      progressed = true;
      retire(std::move(a));
      active_.erase(active_.begin() + static_cast<std::ptrdiff_t>(i));
    }
  }
  return progressed;
}

FSDPX_DECL void MpiEngine::loop() {
  // Spin while requests are young (shared-memory transfers need prompt progress), then back off so
  // an idle wait does not steal a core from the training thread.
  auto last_progress = Clock::now();
  for (;;) {
    {
      std::unique_lock lock(mutex_);
      const auto wake = [&] { return stopping_ || !submissions_.empty() || !jobs_.empty(); };
      if (active_.empty()) {
        // Listening for departures needs a look now and then even when idle.
        if (control_.is_open()) {
          cv_.wait_for(lock, control_poll_interval, wake);
        } else {
          cv_.wait(lock, wake);
        }
      }
      if (stopping_ && submissions_.empty() && jobs_.empty() && (active_.empty() || leaving_failing_)) {
        const bool failing = leaving_failing_;
        lock.unlock();
        if (failing) abandon_active();
        control_.leave(failing || any_failure());
        return;
      }
      taken_.swap(submissions_);
      if (!jobs_.empty()) taken_jobs_.swap(jobs_);  // an empty swap would cost the deque's allocation
    }
    // Collectives first: a job (freeing a communicator, say) must not overtake one submitted before it.
    const bool took = !taken_.empty() || !taken_jobs_.empty();
    for (Submission& s : taken_) start(std::move(s.task), std::move(s.work));
    taken_.clear();
    for (auto& job : taken_jobs_) job();
    taken_jobs_.clear();
    // Notices and heartbeats work in seconds: the spin that serves collectives need not test them.
    bool heard = false;
    if (const auto now = Clock::now(); now >= next_control_poll_) {
      heard = control_.poll(now);
      next_control_poll_ = now + control_poll_spacing;
    }
    if (took || poll() || heard) {
      last_progress = Clock::now();
    } else if (Clock::now() - last_progress > std::chrono::microseconds(200)) {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    } else {
      std::this_thread::yield();
    }
  }
}

FSDPX_DECL Work MpiEngine::submit(MpiTask task) {
  auto work = WorkStatePool::make<HostWorkState>();
  {
    std::lock_guard lock(mutex_);
    submissions_.push_back({std::move(task), work});
  }
  cv_.notify_one();
  return Work(std::move(work));
}

FSDPX_DECL bool MpiEngine::any_failure() const {
  std::lock_guard lock(mutex_);
  return any_failure_;
}

FSDPX_DECL std::string MpiEngine::first_failure() const {
  std::lock_guard lock(mutex_);
  return first_failure_;
}

FSDPX_DECL bool MpiEngine::first_failure_was_departure() const {
  std::lock_guard lock(mutex_);
  return first_failure_departure_;
}

FSDPX_DECL void MpiEngine::post(std::function<void()> job) {
  {
    std::lock_guard lock(mutex_);
    jobs_.push_back(std::move(job));
  }
  cv_.notify_one();
}

FSDPX_DECL MPI_Status* MpiEngine::statuses_for(Active& a) {
  if (a.receives.empty()) return MPI_STATUSES_IGNORE;
  a.statuses.resize(a.requests.size());
  return a.statuses.data();
}

}  // namespace fsdpx::dist::detail
