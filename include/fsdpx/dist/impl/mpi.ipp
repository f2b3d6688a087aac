// The MPI backend's member functions, out of line (MpiControl, MpiEngine, MpiRuntime, MpiCommunicator):
// included by fsdpx/dist/mpi.hpp (header-only) or by fsdpx/impl/src.hpp (FSDPX_SEPARATE_COMPILATION;
// fsdpx/detail/config.hpp).
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

#include <ATen/ops/add.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/maximum.h>
#include <ATen/ops/minimum.h>

#include <fsdpx/dist/detail/health.hpp>
#include <fsdpx/dist/detail/mpi_runtime.hpp>
#include <fsdpx/dist/env.hpp>
#include <fsdpx/dist/mpi.hpp>
#include <fsdpx/memory/host.hpp>

namespace fsdpx::dist::detail {

FSDPX_DECL std::shared_ptr<std::atomic<std::uint64_t>> MpiControl::counter(std::uint64_t comm) {
  std::lock_guard lock(mutex_);
  auto& slot = counters_[comm];
  if (!slot) {
    slot = std::make_shared<std::atomic<std::uint64_t>>(0);
    counter_order_.push_back(comm);
  }
  return slot;
}

FSDPX_DECL void MpiControl::open(MPI_Comm control, std::chrono::milliseconds heartbeat_timeout) {
  comm_ = control;
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
  heartbeat_timeout_ = heartbeat_timeout;
  post_notice_receive();
  if (size_ > 1) MPI_Irecv(&heartbeat_in_, 1, MPI_INT, MPI_ANY_SOURCE, heartbeat_tag, comm_, &heartbeat_receive_);
  watch_since_ = Clock::now();
}

FSDPX_DECL bool MpiControl::poll(Clock::time_point now) {
  if (!is_open()) return false;
  bool changed = false;
  for (int flag = 1; flag != 0;) {
    MPI_Status status;
    flag = 0;
    if (MPI_Test(&notice_receive_, &flag, &status) != MPI_SUCCESS || flag == 0) break;
    take_notice(status, now);
    changed = true;
    post_notice_receive();
  }
  for (int flag = 1; flag != 0 && heartbeat_receive_ != MPI_REQUEST_NULL;) {
    MPI_Status status;
    flag = 0;
    if (MPI_Test(&heartbeat_receive_, &flag, &status) != MPI_SUCCESS || flag == 0) break;
    last_heard_[status.MPI_SOURCE] = now;
    MPI_Irecv(&heartbeat_in_, 1, MPI_INT, MPI_ANY_SOURCE, heartbeat_tag, comm_, &heartbeat_receive_);
  }
  if (size_ > 1 && now >= next_heartbeat_) {
    int done = 1;
    if (heartbeat_send_ != MPI_REQUEST_NULL) MPI_Test(&heartbeat_send_, &done, MPI_STATUS_IGNORE);
    if (const auto next = neighbour(+1); done != 0 && next) {
      static int beat = 0;
      MPI_Isend(&beat, 1, MPI_INT, *next, heartbeat_tag, comm_, &heartbeat_send_);
    }
    next_heartbeat_ = now + heartbeat_interval;
  }
  if (heartbeat_timeout_.count() > 0) changed = watch(now) || changed;
  drain_sends();
  return changed;
}

FSDPX_DECL std::optional<Verdict> MpiControl::verdict(const std::vector<int>& members, CollectiveId id,
    Clock::time_point now) const {
  for (const auto& [rank, d] : departed_) {
    if (!std::binary_search(members.begin(), members.end(), rank)) continue;
    switch (d.kind) {
      case Kind::unresponsive: return Verdict{str("world rank ", rank, " ", d.why), false};
      case Kind::failed:
        if (now - d.at >= departure_grace) {
          return Verdict{str("world rank ", rank, " left the job after an error while this collective waited for it "
                             "(that rank's own output says why)")};
        }
        break;
      case Kind::finished: {
        if (id.comm == 0) break;
        const auto it = d.started.find(id.comm);
        if (id.sequence > (it == d.started.end() ? 0 : it->second)) {
          return Verdict{str("world rank ", rank, " left the job (its program ended) without joining this collective: it "
                             "ended early (did it catch an error? its own output says) or the ranks called different "
                             "collectives")};
        }
        break;
      }
    }
  }
  return std::nullopt;
}

FSDPX_DECL void MpiControl::leave(bool failing) {
  if (!is_open()) return;
  poll(Clock::now());  // a rank that left already listens no more
  auto notice = std::make_shared<Notice>();
  (*notice)[0] = static_cast<std::uint64_t>(failing ? Kind::failed : Kind::finished);
  (*notice)[1] = static_cast<std::uint64_t>(rank_);
  std::size_t n = 0;
  {
    std::lock_guard lock(mutex_);
    // The newest communicators when there are more than a notice holds (older ones are long done).
    const std::size_t first = counter_order_.size() > max_counts ? counter_order_.size() - max_counts : 0;
    for (std::size_t i = first; i < counter_order_.size(); ++i, ++n) {
      (*notice)[3 + 2 * n] = counter_order_[i];
      (*notice)[4 + 2 * n] = counters_.at(counter_order_[i])->load();
    }
  }
  (*notice)[2] = n;
  for (int r = 0; r < size_; ++r) {
    if (r != rank_ && departed_.count(r) == 0) send_notice(notice, 3 + 2 * n, r);
  }
  const auto deadline = Clock::now() + notice_timeout;
  while (!sends_.empty() && Clock::now() < deadline) {
    drain_sends();
    MPI_Test(&heartbeat_send_, &flag_ignored_, MPI_STATUS_IGNORE);
  }
  // What did not go out (a peer that stopped receiving) is let go: the buffers stay with the requests.
  for (auto& s : sends_) MPI_Request_free(&s.request);
  if (heartbeat_send_ != MPI_REQUEST_NULL) MPI_Request_free(&heartbeat_send_);
  for (MPI_Request* r : {&notice_receive_, &heartbeat_receive_}) {
    if (*r == MPI_REQUEST_NULL) continue;
    MPI_Cancel(r);
    MPI_Wait(r, MPI_STATUS_IGNORE);
  }
  if (!failing) MPI_Comm_free(&comm_);
  comm_ = MPI_COMM_NULL;
}

FSDPX_DECL void MpiControl::take_notice(const MPI_Status& status, Clock::time_point now) {
  int count = 0;
  MPI_Get_count(&status, MPI_UINT64_T, &count);
  if (count < 3) return;  // not ours
  const auto kind = static_cast<Kind>(notice_in_[0]);
  const int subject = static_cast<int>(notice_in_[1]);
  if (subject < 0 || subject >= size_ || subject == rank_) return;
  Departure d{now, kind, {}, {}};
  if (kind == Kind::finished) {
    const std::size_t n = std::min<std::size_t>(notice_in_[2], (static_cast<std::size_t>(count) - 3) / 2);
    for (std::size_t i = 0; i < n; ++i) d.started[notice_in_[3 + 2 * i]] = notice_in_[4 + 2 * i];
  } else if (kind == Kind::unresponsive) {
    d.why = str("stopped answering: world rank ", status.MPI_SOURCE,
                " heard no heartbeat from it within its FSDPX_HEARTBEAT_TIMEOUT_MS (stopped, hung, or its host is gone)");
  }
  record(subject, std::move(d));
}

FSDPX_DECL void MpiControl::record(int rank, Departure d) {
  const bool lost = d.kind != Kind::finished;
  if (const auto it = departed_.find(rank); it == departed_.end()) {
    departed_.emplace(rank, std::move(d));
  } else if (it->second.kind == Kind::finished && lost) {
    it->second = std::move(d);  // worse news wins
  }
  if (lost) {
    std::lock_guard lock(mutex_);
    lost_.insert(rank);
  }
}

FSDPX_DECL bool MpiControl::watch(Clock::time_point now) {
  const auto previous = neighbour(-1);
  if (!previous) return false;
  if (previous != watched_) {  // a new predecessor (the old one left): give it a full timeout
    watched_ = previous;
    watch_since_ = now;
  }
  const auto heard = last_heard_.find(*previous);
  const auto last = std::max(watch_since_, heard == last_heard_.end() ? watch_since_ : heard->second);
  if (now - last <= heartbeat_timeout_) return false;
  record(*previous, Departure{now, Kind::unresponsive, {},
                              str("has not answered for ", heartbeat_timeout_.count(),
                                  " ms (stopped, hung, or its host is gone; FSDPX_HEARTBEAT_TIMEOUT_MS sets how "
                                  "long)")});
  auto notice = std::make_shared<Notice>();
  (*notice)[0] = static_cast<std::uint64_t>(Kind::unresponsive);
  (*notice)[1] = static_cast<std::uint64_t>(*previous);
  (*notice)[2] = 0;
  for (int r = 0; r < size_; ++r) {
    if (r != rank_ && departed_.count(r) == 0) send_notice(notice, 3, r);
  }
  return true;
}

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
    fail(a, std::make_exception_ptr(CommError(str("fsdpx: ", a.task.context,
                                                  " abandoned: this rank is ending after an error"))));
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
                   str(a.task.context).c_str(), waited.count(), static_cast<long long>(a.task.timeout.count()));
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

FSDPX_DECL bool MpiControl::lost_any(const std::vector<int>& members) const {
  std::lock_guard lock(mutex_);
  return std::any_of(lost_.begin(), lost_.end(),
                     [&](int r) { return std::binary_search(members.begin(), members.end(), r); });
}

FSDPX_DECL void MpiControl::post_notice_receive() {
  MPI_Irecv(notice_in_.data(), static_cast<int>(notice_in_.size()), MPI_UINT64_T, MPI_ANY_SOURCE, notice_tag, comm_,
            &notice_receive_);
}

FSDPX_DECL void MpiControl::send_notice(std::shared_ptr<const Notice> notice, std::size_t count, int to) {
  PendingSend s{std::move(notice)};
  MPI_Isend(s.buffer->data(), static_cast<int>(count), MPI_UINT64_T, to, notice_tag, comm_, &s.request);
  sends_.push_back(std::move(s));
}

FSDPX_DECL void MpiControl::drain_sends() {
  std::erase_if(sends_, [](PendingSend& s) {
    int done = 0;
    MPI_Test(&s.request, &done, MPI_STATUS_IGNORE);
    return done != 0;
  });
}

FSDPX_DECL std::optional<int> MpiControl::neighbour(int direction) const {
  for (int k = 1; k < size_; ++k) {
    const int r = ((rank_ + direction * k) % size_ + size_) % size_;
    if (departed_.count(r) == 0) return r;
  }
  return std::nullopt;
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
  FSDPX_CHECK(finalized == 0, "MPI was already finalized in this process; keep one MpiCommunicator alive for "
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

namespace fsdpx::dist {

struct MpiCommunicator::State {
  State(std::shared_ptr<detail::MpiRuntime> rt, MPI_Comm c, CommOptions opts, std::uint64_t comm_id)
      : runtime(std::move(rt)), comm(c), options(std::move(opts)), id(comm_id),
        started(runtime->engine().control().counter(comm_id)) {
    runtime->engine().run([&] {
      MPI_Comm_rank(comm, &rank);
      MPI_Comm_size(comm, &size);
      members = world_ranks_of(comm, size);
    });
  }
  State(const State&) = delete;
  State& operator=(const State&) = delete;
  ~State() {
    // A broken communicator may still have requests inside MPI; freeing it could block.
    if (comm == MPI_COMM_NULL || health->broken()) return;
    try {
      runtime->engine().run([c = comm]() mutable { MPI_Comm_free(&c); });
    } catch (...) {
    }
  }
  std::shared_ptr<detail::MpiRuntime> runtime;
  MPI_Comm comm;
  CommOptions options;
  int rank = 0;
  int size = 1;
  std::shared_ptr<detail::CommHealth> health = std::make_shared<detail::CommHealth>();
  std::shared_ptr<const std::string> label = std::make_shared<const std::string>(options.name);  // in errors
  std::shared_ptr<const std::vector<int>> members;  // world ranks, sorted: whose departure fails our collectives
  std::uint64_t id;                                   // the same on every member (see derive_comm_id)
  std::shared_ptr<std::atomic<std::uint64_t>> started;  // collectives submitted: each one's sequence number
  std::atomic<std::uint64_t> splits{0};
  std::atomic<std::uint64_t> sequence{0};
};

FSDPX_DECL int MpiCommunicator::rank() const { return state_->rank; }
FSDPX_DECL int MpiCommunicator::size() const { return state_->size; }
FSDPX_DECL const std::string& MpiCommunicator::name() const { return state_->options.name; }
FSDPX_DECL const CommOptions& MpiCommunicator::options() const { return state_->options; }
FSDPX_DECL MPI_Comm MpiCommunicator::native_handle() const { return state_->comm; }

FSDPX_DECL detail::OpContext MpiCommunicator::context(std::string_view op) const {
  return {std::string(op), state_->label, rank(), size()};
}

FSDPX_DECL MpiCommunicator MpiCommunicator::world(CommOptions options) {
  const auto heartbeat_timeout = default_heartbeat_timeout();  // a bad value fails before any collective
  auto runtime = detail::MpiRuntime::acquire();
  const LaunchEnv env = detect_launch_env();
  const auto [world_rank, world_size] = runtime->engine().run([] {
    int r = 0, n = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &r);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    return std::pair{r, n};
  });
  // A bounded barrier first: MPI_Comm_dup blocks without a deadline if a rank never arrives.
  runtime->engine()
      .submit({detail::OpContext{"join", std::make_shared<const std::string>(options.name), world_rank, world_size},
               detail::MpiTask::single([](MPI_Request* r) { return MPI_Ibarrier(MPI_COMM_WORLD, r); }), {},
               options.timeout,
               std::make_shared<detail::CommHealth>(), all_ranks(world_size), detail::CollectiveId{}, options.report_interval})
      .wait_host();
  auto comm = runtime->engine().run([&runtime, heartbeat_timeout] {
    runtime->open_control_channel(heartbeat_timeout);
    MPI_Comm dup = MPI_COMM_NULL;
    const int rc = MPI_Comm_dup(MPI_COMM_WORLD, &dup);
    FSDPX_CHECK_AS(CommError, rc == MPI_SUCCESS, "MPI_Comm_dup(MPI_COMM_WORLD) failed: ",
                   detail::mpi_error_string(rc));
    MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN);
    return dup;
  });
  const std::uint64_t id = runtime->next_world_id();
  MpiCommunicator world(std::make_shared<State>(std::move(runtime), comm, std::move(options), id));
  FSDPX_CHECK(env.launcher == Launcher::single_process ||
                  (env.rank == world.rank() && env.world_size == world.size()),
              "the ", to_string(env.launcher), " environment says rank ", env.rank, " of ", env.world_size,
              " but MPI says rank ", world.rank(), " of ", world.size(), ": ", launcher_mismatch_hint(env.launcher));
  return world;
}

FSDPX_DECL Work MpiCommunicator::all_gather_async(at::Tensor output, const at::Tensor& input) {
  const auto ctx = context("all_gather");
  detail::check_tensor(ctx, "output", output, device_type());
  detail::check_tensor(ctx, "input", input, device_type());
  detail::check_same_dtype(ctx, output, input);
  detail::check_scatter_sizes(ctx, output, "output", input, "input", size());
  const MPI_Datatype type = detail::MpiTypes::datatype(ctx, input.scalar_type());
  const int count = checked_count(ctx, input.numel());
  const int W = size(), r = rank(), tag = next_tag();
  const auto mod = [W](int c) { return ((c % W) + W) % W; };
  // Slots as addresses, not tensor views: a view is a heap allocation, and this runs per unit per step.
  // The step keeps `output` and `input` alive until the collective ends.
  const auto bytes = static_cast<std::size_t>(input.nbytes());
  const auto slot = [base = static_cast<char*>(output.data_ptr()), bytes](int c) { return base + c * bytes; };
  // In place when the input already is this rank's slot of the output (FSDP's copy-in layout).
  const bool in_place = input.const_data_ptr() == slot(r);
  FSDPX_CHECK(in_place || !overlaps(output, input), ctx,
              ": the input overlaps the output but is not this rank's slot of it");
  // Stage s forwards slot r-s to rank r+1 and receives slot r-s-1 from rank r-1.
  auto step = [=, comm = native_handle(), stage = 0, keep_output = output](
                  std::vector<MPI_Request>& requests, std::vector<detail::ReceiveSize>& receives) mutable {
    if (stage == 0 && !in_place && bytes > 0) std::memcpy(slot(r), input.const_data_ptr(), bytes);
    if (stage == W - 1) return MPI_SUCCESS;
    char* const send = slot(mod(r - stage));
    char* const recv = slot(mod(r - stage - 1));
    ++stage;
    requests.resize(2, MPI_REQUEST_NULL);
    receives = {{type, count}, {}};
    if (const int rc = MPI_Irecv(recv, count, type, mod(r - 1), tag, comm, &requests[0]); rc != MPI_SUCCESS) {
      return rc;
    }
    return MPI_Isend(send, count, type, mod(r + 1), tag, comm, &requests[1]);
  };
  return submit_steps(ctx, std::move(step), {});
}

FSDPX_DECL Work MpiCommunicator::gather_async(at::Tensor output, const at::Tensor& input, int root) {
  const auto ctx = context("gather");
  detail::check_root(ctx, root, size());
  detail::check_tensor(ctx, "input", input, device_type());
  const MPI_Datatype type = detail::MpiTypes::datatype(ctx, input.scalar_type());
  checked_count(ctx, input.numel());
  const int W = size(), r = rank();
  const int64_t n = input.numel();
  const int64_t piece = std::max<int64_t>(1, gather_piece_bytes / static_cast<int64_t>(input.element_size()));
  const int64_t pieces = (n + piece - 1) / piece;
  const auto part = [piece, n](const at::Tensor& flat, int64_t j) { return flat.narrow(0, j * piece, std::min(piece, n - j * piece)); };
  if (r != root) {
    // Every piece at once: the root takes them in order (same source and tag).
    auto step = [=, comm = native_handle(), tag = next_tag(), flat = input.view({-1}), started = false](
                    std::vector<MPI_Request>& requests, std::vector<detail::ReceiveSize>&) mutable {
      if (started) return MPI_SUCCESS;
      started = true;
      for (int64_t j = 0; j < pieces; ++j) {
        const at::Tensor p = part(flat, j);
        requests.emplace_back(MPI_REQUEST_NULL);
        if (const int rc = MPI_Isend(p.const_data_ptr(), static_cast<int>(p.numel()), type, root, tag, comm, &requests.back());
            rc != MPI_SUCCESS) {
          return rc;
        }
      }
      return MPI_SUCCESS;
    };
    return submit_steps(ctx, std::move(step), {});
  }
  detail::check_tensor(ctx, "output", output, device_type());
  detail::check_same_dtype(ctx, output, input);
  detail::check_scatter_sizes(ctx, output, "output", input, "input", size());
  const auto slot = [flat = output.view({-1}), n](int c) { return flat.narrow(0, c * n, n); };
  const bool in_place = input.const_data_ptr() == slot(r).const_data_ptr();
  FSDPX_CHECK(in_place || !overlaps(output, input), ctx,
              ": the input overlaps the output but is not the root's slot of it");
  // The tag is taken after every check, so a rejected call leaves the ranks' sequences in step.
  auto step = [=, comm = native_handle(), tag = next_tag(), j = int64_t{0}](
                  std::vector<MPI_Request>& requests, std::vector<detail::ReceiveSize>& receives) mutable {
    if (j == 0 && !in_place) slot(r).copy_(input.view({-1}));
    if (j == pieces) return MPI_SUCCESS;
    for (int c = 0; c < W; ++c) {
      if (c == r) continue;
      const at::Tensor p = part(slot(c), j);
      requests.emplace_back(MPI_REQUEST_NULL);
      receives.push_back({type, static_cast<int>(p.numel())});
      if (const int rc = MPI_Irecv(p.data_ptr(), static_cast<int>(p.numel()), type, c, tag, comm, &requests.back());
          rc != MPI_SUCCESS) {
        return rc;
      }
    }
    ++j;
    return MPI_SUCCESS;
  };
  return submit_steps(ctx, std::move(step), {});
}

FSDPX_DECL Work MpiCommunicator::reduce_scatter_async(at::Tensor output, const at::Tensor& input, ReduceOp op) {
  const auto ctx = context("reduce_scatter");
  detail::check_tensor(ctx, "output", output, device_type());
  detail::check_tensor(ctx, "input", input, device_type());
  detail::check_same_dtype(ctx, output, input);
  detail::check_scatter_sizes(ctx, input, "input", output, "output", size());
  detail::check_reduce_dtype(ctx, op == ReduceOp::avg, input);
  FSDPX_CHECK(input.scalar_type() != at::kBool, ctx, ": reductions over bool tensors are not supported");
  FSDPX_CHECK(!overlaps(output, input), ctx, ": the output overlaps the input");
  const MPI_Datatype type = detail::MpiTypes::datatype(ctx, input.scalar_type());
  const int count = checked_count(ctx, output.numel());
  const int W = size(), r = rank(), tag = next_tag();
  const auto mod = [W](int c) { return ((c % W) + W) % W; };
  const auto flat_out = output.view({-1});
  const auto chunk = [flat_in = input.view({-1}), n = output.numel()](int c) { return flat_in.narrow(0, c * n, n); };
  // Stage s sends the partial reduction of chunk r-s-1 to rank r+1 and receives chunk r-s-2's from
  // rank r-1; the partial received last (stage W-2) is chunk r, which only lacks our own share.
  auto buffers = W > 1 ? std::array{memory::empty_step_buffer(flat_out.numel(), flat_out.options()),
                                    memory::empty_step_buffer(flat_out.numel(), flat_out.options())}
                    : std::array<at::Tensor, 2>{};
  auto step = [=, comm = native_handle(), stage = 0](std::vector<MPI_Request>& requests,
                                                     std::vector<detail::ReceiveSize>& receives) mutable {
    if (W == 1) {
      flat_out.copy_(chunk(0));
      return MPI_SUCCESS;
    }
    if (stage > 0) {
      at::Tensor& got = buffers[(stage - 1) % 2];
      const auto own = chunk(mod(r - stage - 1));
      if (stage == W - 1) {
        combine(op, flat_out, got, own);
        return MPI_SUCCESS;
      }
      combine(op, got, got, own);
    }
    const at::Tensor send = stage == 0 ? chunk(mod(r - 1)) : buffers[(stage - 1) % 2];
    const at::Tensor& recv = buffers[stage % 2];
    ++stage;
    requests.resize(2, MPI_REQUEST_NULL);
    receives = {{type, count}, {}};
    if (const int rc = MPI_Irecv(recv.data_ptr(), count, type, mod(r - 1), tag, comm, &requests[0]); rc != MPI_SUCCESS) {
      return rc;
    }
    return MPI_Isend(send.const_data_ptr(), count, type, mod(r + 1), tag, comm, &requests[1]);
  };
  return submit_steps(ctx, std::move(step), average_after(op, output));
}

FSDPX_DECL Work MpiCommunicator::all_reduce_async(at::Tensor tensor, ReduceOp op) {
  const auto ctx = context("all_reduce");
  detail::check_tensor(ctx, "tensor", tensor, device_type());
  detail::check_reduce_dtype(ctx, op == ReduceOp::avg, tensor);
  const MPI_Datatype type = detail::MpiTypes::datatype(ctx, tensor.scalar_type());
  const MPI_Op mpi_op = state_->runtime->types().reduction(ctx, op, tensor.scalar_type());
  const int count = checked_count(ctx, tensor.numel());
  return submit(
      ctx,
      [=, comm = native_handle()](MPI_Request* r) {
        return MPI_Iallreduce(MPI_IN_PLACE, tensor.data_ptr(), count, type, mpi_op, comm, r);
      },
      average_after(op, tensor));
}

FSDPX_DECL Work MpiCommunicator::broadcast_async(at::Tensor tensor, int root) {
  const auto ctx = context("broadcast");
  detail::check_tensor(ctx, "tensor", tensor, device_type());
  detail::check_root(ctx, root, size());
  const MPI_Datatype type = detail::MpiTypes::datatype(ctx, tensor.scalar_type());
  const int count = checked_count(ctx, tensor.numel());
  return submit(
      ctx, [=, comm = native_handle()](MPI_Request* r) { return MPI_Ibcast(tensor.data_ptr(), count, type, root, comm, r); },
      {});
}

FSDPX_DECL std::optional<MpiCommunicator> MpiCommunicator::split(int color, int key, std::string_view name) const {
  const auto ctx = context("split");
  FSDPX_CHECK(color >= 0 || color == no_color, ctx, ": color ", color, " must be >= 0 or fsdpx::dist::no_color");
  MpiCommunicator(*this).barrier();
  const std::uint64_t split_index = state_->splits++;  // on every rank of the parent, in the same order
  MPI_Comm parent = native_handle();
  MPI_Comm child = state_->runtime->engine().run([&] {
    MPI_Comm c = MPI_COMM_NULL;
    const int rc = MPI_Comm_split(parent, color == no_color ? MPI_UNDEFINED : color, key, &c);
    FSDPX_CHECK_AS(CommError, rc == MPI_SUCCESS, ctx, " failed: ", detail::mpi_error_string(rc));
    if (c != MPI_COMM_NULL) MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN);
    return c;
  });
  if (child == MPI_COMM_NULL) return std::nullopt;
  CommOptions options = state_->options;
  options.name = name.empty() ? detail::str(this->name(), "/", color) : std::string(name);
  return MpiCommunicator(std::make_shared<State>(state_->runtime, child, std::move(options),
                                                 detail::derive_comm_id(state_->id, split_index, static_cast<std::uint64_t>(color))));
}

FSDPX_DECL std::shared_ptr<const std::vector<int>> MpiCommunicator::world_ranks_of(MPI_Comm comm, int n) {
  MPI_Group group = MPI_GROUP_NULL, world = MPI_GROUP_NULL;
  MPI_Comm_group(comm, &group);
  MPI_Comm_group(MPI_COMM_WORLD, &world);
  std::vector<int> local(static_cast<size_t>(n)), ranks(static_cast<size_t>(n), MPI_UNDEFINED);
  std::iota(local.begin(), local.end(), 0);
  MPI_Group_translate_ranks(group, n, local.data(), world, ranks.data());
  MPI_Group_free(&group);
  MPI_Group_free(&world);
  std::erase(ranks, MPI_UNDEFINED);  // not in MPI_COMM_WORLD (dynamic processes): not watched
  std::sort(ranks.begin(), ranks.end());
  return std::make_shared<const std::vector<int>>(std::move(ranks));
}

FSDPX_DECL bool MpiCommunicator::overlaps(const at::Tensor& a, const at::Tensor& b) {
  const auto* a0 = static_cast<const char*>(a.const_data_ptr());
  const auto* b0 = static_cast<const char*>(b.const_data_ptr());
  return a.nbytes() > 0 && b.nbytes() > 0 && a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

FSDPX_DECL Work MpiCommunicator::submit_steps(detail::OpContext ctx, detail::MpiStep step,
    detail::MpiFinish finish) {
  return state_->runtime->engine().submit(
      {std::move(ctx), std::move(step), std::move(finish), state_->options.timeout, state_->health, state_->members,
       detail::CollectiveId{state_->id, ++*state_->started}, state_->options.report_interval});
}

FSDPX_DECL void MpiCommunicator::combine(ReduceOp op, const at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg: at::add_out(const_cast<at::Tensor&>(out), a, b); break;
    case ReduceOp::max: at::maximum_out(const_cast<at::Tensor&>(out), a, b); break;
    case ReduceOp::min: at::minimum_out(const_cast<at::Tensor&>(out), a, b); break;
  }
}

FSDPX_DECL std::uint64_t detail::MpiRuntime::next_world_id() {
  return detail::derive_comm_id(0x776f726c64ULL, world_count_++, 0);
}

FSDPX_DECL bool MpiCommunicator::is_broken() const {
  return state_->health->broken() || state_->runtime->engine().control().lost_any(*state_->members);
}

FSDPX_DECL Work MpiCommunicator::barrier_async() {
  return submit(context("barrier"), [comm = native_handle()](MPI_Request* r) { return MPI_Ibarrier(comm, r); }, {});
}

FSDPX_DECL std::shared_ptr<const std::vector<int>> MpiCommunicator::all_ranks(int n) {
  std::vector<int> ranks(static_cast<size_t>(n));
  std::iota(ranks.begin(), ranks.end(), 0);
  return std::make_shared<const std::vector<int>>(std::move(ranks));
}

FSDPX_DECL int MpiCommunicator::checked_count(const detail::OpContext& ctx, int64_t numel) {
  FSDPX_CHECK(numel <= INT_MAX, ctx, ": ", numel, " elements exceed MPI's int count limit (", INT_MAX,
              "); split the tensor");
  return static_cast<int>(numel);
}

FSDPX_DECL detail::MpiFinish MpiCommunicator::average_after(ReduceOp op, const at::Tensor& result) const {
  if (op != ReduceOp::avg) return {};
  return [result, n = size()]() mutable { result.div_(n); };
}

FSDPX_DECL Work MpiCommunicator::submit(detail::OpContext ctx, detail::MpiStart start,
    detail::MpiFinish finish) {
  return submit_steps(std::move(ctx), detail::MpiTask::single(std::move(start)), std::move(finish));
}

FSDPX_DECL int MpiCommunicator::next_tag() const { return 1 + static_cast<int>(state_->sequence.fetch_add(1) % 32000); }

}  // namespace fsdpx::dist
