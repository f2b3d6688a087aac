// How one connection of the synchronizer server (detail::Session) ends: a refusal told, then a lingering
// close for a peer that may still be sending; the close itself, and what it tells readers of a trainer
// that vanished. Included by sync/impl/server.ipp, after sync/impl/server_session.ipp.
#pragma once

#include <fsdpx/sync/detail/server_core.hpp>

namespace fsdpx::sync::detail {

/// Tells the peer why, then closes; counted under `counter`. Never throws.
inline void Session::refuse(const std::string& why, int64_t ServerStats::* counter) {
  if (closed_ || closing_) return;
  try {
    ++(core_->stats.*counter);
    if (is_publisher_ && !said_goodbye_ && role_ == Role::publish && publishes_served_run()) {
      core_->publisher_lost = "the trainer's connection (" + peer_ + ") sent " + why;
      core_->wake_waiters();
    }
    unstage();
    std::string text = "the synchronizer server refused the connection from " + peer_ + ": " + why;
    send(make_frame(FrameKind::error, no_version), std::move(text), /*then_close=*/true);
    closing_ = true;  // a read still in flight (a bucket the peer was still sending) is dropped when it ends
    fetch_timer_.cancel();
    if (!role_) {  // a peer that never authenticated gets no more of the server's time
      boost::system::error_code ignored;
      stream_.socket().shutdown(tcp::socket::shutdown_receive, ignored);
    }
  } catch (...) {
    on_closed(asio::error::connection_aborted);
  }
}

/// The refusal was sent to an authenticated peer, which may still be sending (a publisher mid-version):
/// closing now, with its bytes unread, would reset the connection, and a reset can destroy the refusal
/// before the peer reads it. So the server half-closes and reads what still arrives, dropping it, until
/// the peer closes, for at most linger_time and linger_bytes; then it closes.
inline void Session::linger() {
  if (closed_) return;
  lingering_ = true;
  boost::system::error_code ignored;
  stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
  arm(std::min(core_->options.limits.io_timeout, linger_time));
  if (!reading_) drain();  // else the read in flight drains when it ends
}

inline void Session::drain() {
  if (closed_) return;
  auto scratch = std::make_shared<std::array<uint8_t, 64 << 10>>();
  reading_ = true;
  stream_.socket().async_read_some(asio::buffer(*scratch),
                                   [self = shared_from_this(), scratch](const boost::system::error_code& ec, size_t n) {
                                     self->reading_ = false;
                                     if (ec) return self->on_closed(ec);  // the peer closed (or the watchdog did): done
                                     self->drained_ += static_cast<int64_t>(n);
                                     if (self->drained_ > linger_bytes)
                                       return self->on_closed(asio::error::connection_aborted);
                                     self->drain();
                                   });
}

inline void Session::on_closed(const boost::system::error_code& ec) {
  if (closed_) return;
  closed_ = true;
  ++watch_generation_;
  if (is_publisher_ && !said_goodbye_ && role_ == Role::publish && core_->publisher_lost.empty() &&
      publishes_served_run()) {
    // A trainer that vanishes (killed, crashed, network gone) will not publish again: readers waiting for
    // a newer version are told now instead of at their timeout.
    try {
      core_->publisher_lost =
          pending_ ? ::fsdpx::detail::str("the trainer publishing to this synchronizer (", peer_,
                                          ") disconnected in the middle of version ", pending_->version, " (",
                                          pending_->received, " of ", pending_->count,
                                          " buckets received; the partial version was discarded): ", ec.message())
                   : ::fsdpx::detail::str("the trainer publishing to this synchronizer (", peer_,
                                          ") disconnected without saying goodbye after version ", last_published_, ": ",
                                          ec.message());
      core_->wake_waiters();
    } catch (...) {
    }
  }
  unstage();
  boost::system::error_code ignored;
  watchdog_.cancel();
  fetch_timer_.cancel();
  stream_.socket().close(ignored);
}

}  // namespace fsdpx::sync::detail
