// One connection of the synchronizer server (detail::Session): the handshake, the frames read and
// dispatched, a fetch, the deadlines. A publish is sync/impl/session_publish.ipp; how a connection ends,
// sync/impl/session_close.ipp. Included by sync/impl/server.ipp.
#pragma once

#include <fsdpx/sync/detail/server_core.hpp>

namespace fsdpx::sync::detail {

inline Session::Session(ServerCore* core, tcp::socket socket)
    : core_(core),
      stream_(std::move(socket), core->tls ? &*core->tls : nullptr),
      watchdog_(core->io),
      fetch_timer_(core->io) {
  boost::system::error_code ec;
  const auto ep = stream_.socket().remote_endpoint(ec);
  address_ = ec ? std::string("?") : ep.address().to_string();
  peer_ = ec ? std::string("?") : address_ + ":" + std::to_string(ep.port());
  ++core_->stats.live;
  ++core_->stats.handshaking;
  ++core_->handshaking_from[address_];
  core_->handshake_pool.push_back(this);
}

inline Session::~Session() {
  --core_->stats.live;
  leave_handshake_pool();
  unstage();
}

inline void Session::leave_handshake_pool() {
  if (!in_handshake_pool_) return;
  in_handshake_pool_ = false;
  --core_->stats.handshaking;
  std::erase(core_->handshake_pool, this);
  if (auto it = core_->handshaking_from.find(address_); it != core_->handshaking_from.end() && --it->second <= 0) {
    core_->handshaking_from.erase(it);
  }
}

/// Closes a connection still in its handshake at once, its slot freed now; counted as refused over a limit.
inline void Session::evict_unauthenticated(const std::string& why) {
  ++core_->stats.refused_over_limit;
  leave_handshake_pool();
  // A plain connection whose hello went out has no write in flight: the reason goes as an error frame.
  if (!core_->tls && hello_sent_) {
    ServerCore::write_plain_error(stream_.socket(), "the server closed the connection: " + why, refused_busy);
  }
  on_closed(asio::error::connection_aborted);
}

/// Runs a step of this connection's protocol; whatever it throws ends this connection only.
template <class Fn>
void Session::guarded(Fn&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    refuse(std::string("the server could not handle it: ") + e.what(), &ServerStats::handler_errors);
  } catch (...) {
    refuse("the server could not handle it", &ServerStats::handler_errors);
  }
}

inline void Session::start() {
  guarded([&] {
    // The whole handshake (TLS's, then the secret's), not each frame of it, must end within handshake_timeout.
    arm(core_->options.limits.handshake_timeout);
    stream_.async_handshake(asio::ssl::stream_base::server,
                            [self = shared_from_this()](const boost::system::error_code& ec) {
                              if (ec) {
                                if (!self->closed_)
                                  ++self->core_->stats.failed_auth;  // not TLS, or no acceptable version or cipher
                                return self->on_closed(ec);
                              }
                              self->guarded([&] { self->send_hello(); });
                            });
  });
}

inline void Session::send_hello() {
  server_nonce_ = fresh_nonce();
  FrameHeader hello = make_frame(FrameKind::hello, no_version, protocol_version, server_nonce_.data(), nonce_bytes);
  hello.flags = static_cast<uint16_t>((core_->publish_secret.empty() ? 0 : 1) | (core_->fetch_secret.empty() ? 0 : 2));
  auto owned = std::make_shared<std::pair<FrameHeader, Nonce>>(hello, server_nonce_);
  std::array<asio::const_buffer, 2> buffers{asio::buffer(&owned->first, sizeof(FrameHeader)),
                                            asio::buffer(owned->second)};
  stream_.async_write(buffers, [self = shared_from_this(), owned](const boost::system::error_code& ec, size_t) {
    if (ec) return self->on_closed(ec);
    self->hello_sent_ = true;
    self->guarded([&] { self->read_header(); });
  });
}

/// Closes the connection when `after` passes before the next arm() or close.
inline void Session::arm(std::chrono::milliseconds after) {
  const uint64_t generation = ++watch_generation_;
  watchdog_.expires_after(std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::min(after, std::chrono::milliseconds(std::chrono::hours(24 * 365)))));
  watchdog_.async_wait([self = shared_from_this(), generation](const boost::system::error_code& ec) {
    if (ec || generation != self->watch_generation_ || self->closed_) return;
    if (self->lingering_) return self->on_closed(asio::error::timed_out);  // refused already, counted there
    ++self->core_->stats.timed_out;
    // The server ending an idle connection is no sign that the trainer is gone (it reconnects for its
    // next publish); a publish that stalls midway is.
    if (!self->pending_) self->said_goodbye_ = true;
    // A TLS client starts the TLS handshake at once; a peer that sent nothing by the deadline is most
    // likely a client without TLS, waiting for a plain hello: it is told so, in plain, not just dropped.
    if (self->stream_.tls_not_started()) {
      ServerCore::write_plain_error(
          self->stream_.socket(),
          ::fsdpx::detail::str(
              "this synchronizer speaks TLS, and no TLS handshake began within its handshake_timeout of ",
              self->core_->options.limits.handshake_timeout.count(),
              " ms: set TLS on the client (ClientOptions::tls and tls_ca_file; "
              "Python: tls=True, tls_ca_file=...)"),
          0);
    }
    self->on_closed(asio::error::timed_out);
  });
}

inline void Session::read_header() {
  if (closed_ || closing_) return;
  if (role_) arm(pending_ ? core_->options.limits.io_timeout : core_->options.limits.idle_timeout);
  reading_ = true;
  stream_.async_read(asio::buffer(&in_, sizeof(in_)),
                     [self = shared_from_this()](const boost::system::error_code& ec, size_t) {
                       self->reading_ = false;
                       self->guarded([&] { self->on_header(ec); });
                     });
}

inline uint64_t Session::allowed_payload(FrameKind kind) const {
  if (!role_) return kind == FrameKind::auth ? 2 * nonce_bytes : 0;
  if (kind == FrameKind::publish_begin) return max_run_bytes;
  if (kind == FrameKind::fetch) return max_fetch_bytes;
  if (kind == FrameKind::bucket && pending_) {
    const int64_t room =
        core_->options.limits.max_version_bytes - pending_->bytes - pending_->coverage.bookkeeping_bytes();
    return static_cast<uint64_t>(std::max<int64_t>(0, std::min(core_->options.limits.max_bucket_bytes, room)));
  }
  return 0;
}

inline void Session::on_header(const boost::system::error_code& ec) {
  if (closing_) return lingering_ ? drain() : void();
  if (ec) return on_closed(ec);
  const auto kind = FrameKind(in_.kind);
  const int64_t max_version = core_->options.limits.max_version_bytes;
  if (kind == FrameKind::bucket && pending_ && in_.magic == frame_magic &&
      in_.length <= static_cast<uint64_t>(core_->options.limits.max_bucket_bytes) &&
      in_.length > allowed_payload(kind)) {
    return refuse(
        ::fsdpx::detail::str("version ", pending_->version, " takes more than max_version_bytes (", max_version,
                             "): ", pending_->bytes, " bytes arrived, and a bucket of ", in_.length, " more"),
        &ServerStats::protocol_errors);
  }
  if (const std::string problem = frame_problem(in_, allowed_payload(kind)); !problem.empty()) {
    return refuse(problem, role_ ? &ServerStats::protocol_errors : &ServerStats::failed_auth);
  }
  if (!role_ && kind != FrameKind::auth) {
    return refuse(::fsdpx::detail::str("a ", to_string(kind), " frame before the handshake"),
                  &ServerStats::failed_auth);
  }
  if (in_.length == 0) {
    payload_ = at::Tensor();
    return on_payload({});
  }
  if (role_) arm(core_->options.limits.io_timeout);
  void* into = small_.data();
  if (kind == FrameKind::bucket) {
    payload_ = at::empty({static_cast<int64_t>(in_.length)}, at::kByte);
    into = payload_.data_ptr();
  }
  reading_ = true;
  stream_.async_read(asio::buffer(into, in_.length),
                     [self = shared_from_this()](const boost::system::error_code& e, size_t) {
                       self->reading_ = false;
                       self->guarded([&] { self->on_payload(e); });
                     });
}

inline void Session::on_payload(const boost::system::error_code& ec) {
  if (closing_) return lingering_ ? drain() : void();
  if (ec) return on_closed(ec);
  const void* data = payload_.defined() ? payload_.const_data_ptr() : static_cast<const void*>(small_.data());
  if (frame_checksum(data, in_.length) != in_.checksum) {
    return refuse(::fsdpx::detail::str("a ", to_string(FrameKind(in_.kind)),
                                       " frame whose checksum does not match its "
                                       "payload (corrupted in transit)"),
                  role_ ? &ServerStats::protocol_errors : &ServerStats::failed_auth);
  }
  handle();
}

inline void Session::handle() {
  const auto kind = FrameKind(in_.kind);
  if (kind == FrameKind::auth) return on_auth();
  const bool may_publish = role_ == Role::publish;
  switch (kind) {
    case FrameKind::publish_begin:
    case FrameKind::bucket:
    case FrameKind::publish_end:
    case FrameKind::goodbye:
      if (!may_publish) {
        return refuse(::fsdpx::detail::str("a ", to_string(kind), " frame on a connection authenticated to fetch only"),
                      &ServerStats::protocol_errors);
      }
      break;
    default: break;
  }
  switch (kind) {
    case FrameKind::publish_begin: return begin_publish();
    case FrameKind::bucket: return on_bucket();
    case FrameKind::publish_end: return end_publish();
    case FrameKind::fetch: {
      if (in_.version < no_version) {
        return refuse(::fsdpx::detail::str("a fetch for versions newer than ", in_.version, " (versions are >= 0)"),
                      &ServerStats::protocol_errors);
      }
      if (in_.length < sizeof(FetchBase)) {
        return refuse(::fsdpx::detail::str("a fetch of ", in_.length, " bytes (protocol ", protocol_version,
                                           " starts it with the reader's base: 8 bytes)"),
                      &ServerStats::protocol_errors);
      }
      have_ = in_.version;
      std::memcpy(&have_base_, small_.data(), sizeof(FetchBase));
      have_run_ = small_text().substr(sizeof(FetchBase));
      // A wait is capped by idle_timeout: a reader that crashed while waiting frees its slot then.
      const auto cap = static_cast<uint64_t>(std::max<int64_t>(0, core_->options.limits.idle_timeout.count()));
      deadline_ = dist::deadline_after(std::chrono::milliseconds(std::min(in_.aux, cap)));
      return check_fetch();
    }
    case FrameKind::goodbye: said_goodbye_ = true; return read_header();
    default:
      return refuse(::fsdpx::detail::str("an unexpected ", to_string(kind), " frame"), &ServerStats::protocol_errors);
  }
}

inline void Session::on_auth() {
  if (role_) return refuse("a second handshake", &ServerStats::protocol_errors);
  if (in_.aux != static_cast<uint64_t>(Role::publish) && in_.aux != static_cast<uint64_t>(Role::fetch)) {
    return refuse(::fsdpx::detail::str("a handshake for unknown role ", in_.aux), &ServerStats::failed_auth);
  }
  if (in_.length != 2 * nonce_bytes) {
    return refuse(::fsdpx::detail::str("a handshake of ", in_.length, " bytes (", 2 * nonce_bytes, " expected)"),
                  &ServerStats::failed_auth);
  }
  const Role role = Role(in_.aux);
  const Secret& secret = core_->secret(role);
  Nonce client_nonce;
  std::copy_n(small_.begin(), nonce_bytes, client_nonce.begin());
  Mac proof{};
  if (!secret.empty()) {
    const Mac expected = handshake_mac(secret.value, client_label, role, server_nonce_, client_nonce);
    if (!same_mac(expected, small_.data() + nonce_bytes)) {
      return refuse(::fsdpx::detail::str("authentication failed: the connection did not prove it holds the ",
                                         to_string(role), " secret"),
                    &ServerStats::failed_auth);
    }
    proof = handshake_mac(secret.value, server_label, role, client_nonce, server_nonce_);
  }
  role_ = role;
  leave_handshake_pool();
  ++watch_generation_;  // the handshake's deadline no longer applies
  send(make_frame(FrameKind::welcome, no_version, static_cast<uint64_t>(role), proof.data(), proof.size()),
       std::string(reinterpret_cast<const char*>(proof.data()), proof.size()));
}

/// Runs `job(session)` on the committer, then what it returns on the I/O thread (through guarded()).
/// The session's last reference always comes back to the I/O thread, whose state its destructor updates.
template <class Fn>
void Session::off_io_thread(Fn&& job) {
  asio::post(core_->committer, [self = shared_from_this(), job = std::forward<Fn>(job)]() mutable {
    std::function<void(Session&)> then;
    std::string failed;
    try {
      then = job(*self);
    } catch (const std::exception& e) {
      failed = e.what();
    } catch (...) {
      failed = "unknown error";
    }
    ServerCore* core = self->core_;
    asio::post(core->io, [self = std::move(self), then = std::move(then), failed = std::move(failed)] {
      if (!failed.empty()) {
        return self->refuse("the server could not handle it: " + failed, &ServerStats::handler_errors);
      }
      self->guarded([&] { then(*self); });
    });
  });
}

inline void Session::check_fetch() {
  if (closed_ || closing_) return;
  auto [version, latest] = core_->slot.latest();
  // Newer: a higher version, or any version of another run than the reader's (a new run took over,
  // maybe with lower versions: the reader gets a whole version of it).
  if (latest != nullptr && (version > have_ || (!have_run_.empty() && latest->run != have_run_))) {
    std::shared_ptr<const EncodedSnapshot> snapshot = core_->ready_snapshot_for(*latest, have_, have_base_);
    ++watch_generation_;
    arm(core_->options.limits.io_timeout);
    if (snapshot == nullptr) {
      // The version came as a delta and this reader needs it whole: built from the store on the
      // committer, then the fetch is looked at again (a newer version may have come meanwhile). The
      // binding is captured by copy through a name: clang before 16 refuses to capture a binding itself.
      return off_io_thread([latest = std::move(latest), version = version](Session& self) {
        self.core_->build_full(*latest, version);
        return [](Session& s) { s.check_fetch(); };
      });
    }
    std::array<asio::const_buffer, 2> begin{asio::buffer(&snapshot->begin, sizeof(FrameHeader)),
                                            asio::buffer(snapshot->run)};
    stream_.async_write(begin, [self = shared_from_this(), snapshot](const boost::system::error_code& ec, size_t) {
      if (ec) return self->on_closed(ec);
      self->guarded([&] { self->send_bucket(snapshot, 0); });
    });
    return;
  }
  if (!core_->publisher_lost.empty()) {
    return send(make_frame(FrameKind::error, version),
                ::fsdpx::detail::str("no weight version newer than ", have_, " will come (latest: ", version,
                                     "): ", core_->publisher_lost));
  }
  if (std::chrono::steady_clock::now() >= deadline_) return send(make_frame(FrameKind::timeout, version));
  waiting_ = true;
  ++watch_generation_;  // the fetch's own deadline governs now
  if (!listed_) {
    listed_ = true;
    core_->add_waiter(weak_from_this());
  }
  fetch_timer_.expires_at(deadline_);
  fetch_timer_.async_wait([self = shared_from_this()](const boost::system::error_code&) {
    self->waiting_ = false;
    self->guarded([&] { self->check_fetch(); });
  });
}

inline void Session::wake() {
  listed_ = false;
  if (waiting_) fetch_timer_.cancel();
}

/// One bucket at a time, each within io_timeout: a reader that stops reading is closed, and holds
/// the (immutable, shared) snapshot no longer than that.
inline void Session::send_bucket(std::shared_ptr<const EncodedSnapshot> s, size_t index) {
  if (closed_ || closing_) return;
  if (index == s->buckets.size()) return read_header();
  arm(core_->options.limits.io_timeout);
  std::array<asio::const_buffer, 2> buffers{
      asio::buffer(&s->headers[index], sizeof(FrameHeader)),
      asio::buffer(s->buckets[index].const_data_ptr(), s->buckets[index].nbytes())};
  stream_.async_write(buffers, [self = shared_from_this(), s, index](const boost::system::error_code& ec, size_t) {
    if (ec) return self->on_closed(ec);  // the reader left mid-transfer: nothing else is affected
    self->guarded([&] { self->send_bucket(s, index + 1); });
  });
}

inline void Session::send(FrameHeader frame, std::string text, bool then_close) {
  if (closed_ || closing_) return;
  if (text.size() > max_error_bytes) text.resize(max_error_bytes);  // texts can quote what peers sent
  auto owned = std::make_shared<std::pair<FrameHeader, std::string>>(frame, std::move(text));
  if (!owned->second.empty()) {
    owned->first.length = owned->second.size();
    owned->first.checksum = frame_checksum(owned->second.data(), owned->second.size());
  }
  arm(core_->options.limits.io_timeout);
  std::array<asio::const_buffer, 2> buffers{asio::buffer(&owned->first, sizeof(FrameHeader)),
                                            asio::buffer(owned->second)};
  stream_.async_write(buffers,
                      [self = shared_from_this(), owned, then_close](const boost::system::error_code& ec, size_t) {
                        if (ec) return self->on_closed(ec);
                        if (then_close)
                          return self->role_ ? self->linger() : self->on_closed(asio::error::connection_aborted);
                        self->guarded([&] { self->read_header(); });
                      });
}

}  // namespace fsdpx::sync::detail
