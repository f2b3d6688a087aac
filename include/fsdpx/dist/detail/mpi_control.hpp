// The MPI engine's control channel: departure notices and heartbeats, so that one rank's failure
// ends its peers' collectives within seconds instead of at their timeout.
//
// - Departures. A rank whose MPI runtime goes away first tells every other rank, with how many
//   collectives it started on each of its communicators. A collective of a peer that the departed
//   rank never started can never complete: it fails at once, naming that rank. One it did start
//   completes as usual (its part was sent before it left). A rank that leaves with an error
//   ("failed") ends every collective it is a member of, after departure_grace for data in flight.
// - Heartbeats. A rank that is alive but silent (SIGSTOP, a frozen host) sends no notice. Every engine
//   thread sends a heartbeat to the next rank still in the job each second and watches the previous
//   one; after the heartbeat timeout without one, that rank is "unresponsive": the watcher fails its
//   collectives with it and tells every other rank, which do the same.
//
// Engine thread only, except counter() and lost_any().
#pragma once

#if !defined(FSDPX_WITH_MPI)
#error "fsdpx's MPI control channel needs FSDPX_WITH_MPI"
#endif

#include <mpi.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <fsdpx/dist/types.hpp>
#include <fsdpx/error.hpp>

namespace fsdpx::dist::detail {

/// Which collective a task is, the same on every member: its communicator's id (0: unknown) and its
/// position among the collectives started on that communicator (1, 2, ...).
struct CollectiveId {
  std::uint64_t comm = 0;
  std::uint64_t sequence = 0;
};

/// An id for a communicator made from its parent's, equal on every member (splitmix64's mixer).
constexpr std::uint64_t derive_comm_id(std::uint64_t parent, std::uint64_t index, std::uint64_t color) {
  std::uint64_t z = parent ^ (index * 0x9E3779B97F4A7C15ULL) ^ ((color + 1) * 0xC2B2AE3D27D4EB4FULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  z ^= z >> 31;
  return z == 0 ? 1 : z;
}

/// Why a collective cannot complete: the text, and whether the rank it names reports its own cause
/// (it left after an error or ended; a rank that stopped answering cannot).
struct Verdict {
  std::string text;
  bool that_rank_reports = true;
};

class MpiControl {
 public:
  using Clock = std::chrono::steady_clock;

  /// How long a collective may still complete after a member left with an error (data in flight).
  static constexpr std::chrono::milliseconds departure_grace{1000};
  /// How long a leaving rank waits for its notices to go out.
  static constexpr std::chrono::milliseconds notice_timeout{2000};
  static constexpr std::chrono::milliseconds heartbeat_interval{1000};

  /// Any thread: the counter of collectives started on communicator `comm`, kept for the process's
  /// lifetime (a notice reports communicators already destroyed too).
  std::shared_ptr<std::atomic<std::uint64_t>> counter(std::uint64_t comm) {
    std::lock_guard lock(mutex_);
    auto& slot = counters_[comm];
    if (!slot) {
      slot = std::make_shared<std::atomic<std::uint64_t>>(0);
      counter_order_.push_back(comm);
    }
    return slot;
  }

  /// Any thread: whether a rank of `members` (world ranks) left after an error or stopped answering.
  bool lost_any(const std::vector<int>& members) const {
    std::lock_guard lock(mutex_);
    return std::any_of(lost_.begin(), lost_.end(),
                       [&](int r) { return std::binary_search(members.begin(), members.end(), r); });
  }

  bool is_open() const { return comm_ != MPI_COMM_NULL; }

  /// Starts listening on `control` (a private duplicate of MPI_COMM_WORLD: its ranks are world ranks).
  /// `heartbeat_timeout` 0: this rank watches no one (it still sends heartbeats).
  void open(MPI_Comm control, std::chrono::milliseconds heartbeat_timeout) {
    comm_ = control;
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    heartbeat_timeout_ = heartbeat_timeout;
    post_notice_receive();
    if (size_ > 1) MPI_Irecv(&heartbeat_in_, 1, MPI_INT, MPI_ANY_SOURCE, heartbeat_tag, comm_, &heartbeat_receive_);
    watch_since_ = Clock::now();
  }

  /// Takes the notices and heartbeats that arrived, sends this rank's heartbeat when due, and declares
  /// the watched rank unresponsive after the timeout. Returns whether anything changed.
  bool poll(Clock::time_point now) {
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

  /// Why `members`' collective `id` cannot complete any more, or nothing.
  std::optional<Verdict> verdict(const std::vector<int>& members, CollectiveId id, Clock::time_point now) const {
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

  /// Tells every rank still in the job that this one leaves (`failing`: with an error), with how many
  /// collectives it started on each communicator; waits a bounded time for the notices to go out and
  /// stops listening.
  void leave(bool failing) {
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

 private:
  enum class Kind : std::uint64_t { finished = 0, failed = 1, unresponsive = 2 };
  static constexpr int notice_tag = 1;
  static constexpr int heartbeat_tag = 2;
  static constexpr std::size_t max_counts = 256;
  // kind, subject (the world rank it is about), n, then n pairs (communicator id, collectives started)
  using Notice = std::array<std::uint64_t, 3 + 2 * max_counts>;

  struct Departure {
    Clock::time_point at;
    Kind kind;
    std::map<std::uint64_t, std::uint64_t> started;  // finished: collectives started per communicator
    std::string why;                                   // unresponsive: the text of the error
  };
  struct PendingSend {
    std::shared_ptr<const Notice> buffer;
    MPI_Request request = MPI_REQUEST_NULL;
  };

  void post_notice_receive() {
    MPI_Irecv(notice_in_.data(), static_cast<int>(notice_in_.size()), MPI_UINT64_T, MPI_ANY_SOURCE, notice_tag, comm_,
              &notice_receive_);
  }

  void send_notice(std::shared_ptr<const Notice> notice, std::size_t count, int to) {
    PendingSend s{std::move(notice)};
    MPI_Isend(s.buffer->data(), static_cast<int>(count), MPI_UINT64_T, to, notice_tag, comm_, &s.request);
    sends_.push_back(std::move(s));
  }

  void drain_sends() {
    std::erase_if(sends_, [](PendingSend& s) {
      int done = 0;
      MPI_Test(&s.request, &done, MPI_STATUS_IGNORE);
      return done != 0;
    });
  }

  void take_notice(const MPI_Status& status, Clock::time_point now) {
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

  void record(int rank, Departure d) {
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

  /// The nearest rank still in the job after (+1) or before (-1) this one.
  std::optional<int> neighbour(int direction) const {
    for (int k = 1; k < size_; ++k) {
      const int r = ((rank_ + direction * k) % size_ + size_) % size_;
      if (departed_.count(r) == 0) return r;
    }
    return std::nullopt;
  }

  bool watch(Clock::time_point now) {
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

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  Notice notice_in_{};
  MPI_Request notice_receive_ = MPI_REQUEST_NULL;
  std::deque<PendingSend> sends_;
  std::map<int, Departure> departed_;
  std::chrono::milliseconds heartbeat_timeout_{0};
  int heartbeat_in_ = 0;
  int flag_ignored_ = 0;
  MPI_Request heartbeat_send_ = MPI_REQUEST_NULL, heartbeat_receive_ = MPI_REQUEST_NULL;
  Clock::time_point next_heartbeat_{}, watch_since_{};
  std::optional<int> watched_;
  std::map<int, Clock::time_point> last_heard_;

  mutable std::mutex mutex_;  // guards the three below
  std::map<std::uint64_t, std::shared_ptr<std::atomic<std::uint64_t>>> counters_;
  std::vector<std::uint64_t> counter_order_;
  std::set<int> lost_;
};

}  // namespace fsdpx::dist::detail
