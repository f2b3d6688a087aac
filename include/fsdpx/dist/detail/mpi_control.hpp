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

#include <fsdpx/detail/config.hpp>

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
  FSDPX_DECL std::shared_ptr<std::atomic<std::uint64_t>> counter(std::uint64_t comm);

  /// Any thread: whether a rank of `members` (world ranks) left after an error or stopped answering.
  FSDPX_DECL bool lost_any(const std::vector<int>& members) const;

  bool is_open() const { return comm_ != MPI_COMM_NULL; }

  /// Starts listening on `control` (a private duplicate of MPI_COMM_WORLD: its ranks are world ranks).
  /// `heartbeat_timeout` 0: this rank watches no one (it still sends heartbeats).
  FSDPX_DECL void open(MPI_Comm control, std::chrono::milliseconds heartbeat_timeout);

  /// Takes the notices and heartbeats that arrived, sends this rank's heartbeat when due, and declares
  /// the watched rank unresponsive after the timeout. Returns whether anything changed.
  FSDPX_DECL bool poll(Clock::time_point now);

  /// Why `members`' collective `id` cannot complete any more, or nothing.
  FSDPX_DECL std::optional<Verdict> verdict(const std::vector<int>& members, CollectiveId id,
                                            Clock::time_point now) const;

  /// Tells every rank still in the job that this one leaves (`failing`: with an error), with how many
  /// collectives it started on each communicator; waits a bounded time for the notices to go out and
  /// stops listening.
  FSDPX_DECL void leave(bool failing);

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
    std::string why;                                 // unresponsive: the text of the error
  };
  struct PendingSend {
    std::shared_ptr<const Notice> buffer;
    MPI_Request request = MPI_REQUEST_NULL;
  };

  FSDPX_DECL void post_notice_receive();

  FSDPX_DECL void send_notice(std::shared_ptr<const Notice> notice, std::size_t count, int to);

  FSDPX_DECL void drain_sends();

  FSDPX_DECL void take_notice(const MPI_Status& status, Clock::time_point now);

  FSDPX_DECL void record(int rank, Departure d);

  /// The nearest rank still in the job after (+1) or before (-1) this one.
  FSDPX_DECL std::optional<int> neighbour(int direction) const;

  FSDPX_DECL bool watch(Clock::time_point now);

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
