// The MPI backend's control channel (departures, heartbeats, collective verdicts), out of line:
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
#include <fsdpx/dist/detail/mpi_control.hpp>
#include <fsdpx/dist/env.hpp>
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
          return Verdict{str("world rank ", rank,
                             " left the job after an error while this collective waited for it "
                             "(that rank's own output says why)")};
        }
        break;
      case Kind::finished: {
        if (id.comm == 0) break;
        const auto it = d.started.find(id.comm);
        if (id.sequence > (it == d.started.end() ? 0 : it->second)) {
          return Verdict{str("world rank ", rank,
                             " left the job (its program ended) without joining this collective: it "
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
    d.why =
        str("stopped answering: world rank ", status.MPI_SOURCE,
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
  record(*previous, Departure{now,
                              Kind::unresponsive,
                              {},
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

}  // namespace fsdpx::dist::detail
