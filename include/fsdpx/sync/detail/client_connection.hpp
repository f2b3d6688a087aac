// One client connection to the synchronizer server (detail::ClientConnection): connecting and
// reconnecting, the handshake that proves both ends hold the role's secret, the frames of a publish and
// of a fetch, each under its deadline. Internal: SynchronizerClient (sync/client.hpp) holds one; its
// implementation (sync/impl/client.ipp) is the only includer.
#pragma once

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <fsdpx/dist/types.hpp>
#include <fsdpx/error.hpp>
#include <fsdpx/sync/detail/bucket.hpp>
#include <fsdpx/sync/detail/receive.hpp>
#include <fsdpx/sync/detail/version_store.hpp>
#include <fsdpx/sync/detail/handshake.hpp>
#include <fsdpx/sync/detail/frame.hpp>
#include <fsdpx/sync/detail/stream.hpp>
#include <fsdpx/sync/client.hpp>

namespace fsdpx::sync {

namespace detail {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

inline std::string describe(const boost::system::error_code& ec) {
  if (ec == asio::error::eof) return "the server closed the connection (it exited, crashed or was stopped)";
  if (ec == asio::error::connection_reset || ec == asio::error::broken_pipe) {
    return "the connection was reset (the server exited or crashed)";
  }
  return ec.message();
}

/// SynchronizerClient's connection (the public class holds one; see sync/client.hpp).
class ClientConnection {
 public:
  ClientConnection(std::string host, uint16_t port, ClientOptions options = {})
      : options_(std::move(options)), where_(host + ":" + std::to_string(port)) {
    boost::system::error_code ec;
    const auto address = detail::asio::ip::make_address(host, ec);
    FSDPX_CHECK_AS(SyncError, !ec, "synchronizer client: '", host, "' is not an IP address: ", ec.message());
    endpoint_ = detail::tcp::endpoint(address, port);
    const std::string run_problem = detail::run_problem(options_.run);
    FSDPX_CHECK_AS(SyncError, run_problem.empty(), "synchronizer client: ClientOptions::run is ", run_problem);
    if (options_.tls) {
      if (options_.tls_server_name.empty()) options_.tls_server_name = host;
      tls_.emplace(detail::client_tls_context(options_.tls_ca_file, options_.tls_server_name));
    }
    connect(options_.connect_timeout);
  }
  ClientConnection(const ClientConnection&) = delete;
  ClientConnection& operator=(const ClientConnection&) = delete;
  ~ClientConnection() {
    try {
      close();
    } catch (...) {
    }
  }

  /// Publishes `tensors` as `version`; returns once the server committed it (readers can see it).
  /// Bucket by bucket, so the trainer holds one bucket beyond the tensors.
  /// `handed_over`: the caller gave up `tensors` (publish(version, std::vector&&)): host, contiguous
  /// ones become the base of the next delta as they are, instead of a copy.
  void publish(int64_t version, const std::vector<NamedTensor>& tensors, bool handed_over) {
    FSDPX_CHECK_AS(SyncError, version >= 0, "cannot publish version ", version, ": versions are >= 0");
    FSDPX_CHECK_AS(SyncError, !tensors.empty(), "cannot publish version ", version, ": it has no tensors");
    detail::check_unique_names(tensors, version);
    const std::string what = ::fsdpx::detail::str("publishing version ", version);
    const std::string& run = options_.run.empty() ? detail::process_run() : options_.run;
    reconnect_if_closed();
    authenticate(Role::publish, what);
    // A delta from what this client published last, when the server still holds that; else, or when
    // the server says it holds another version (another publisher came between), the version full.
    detail::EncodedVersion v = published_store_.cut(version, tensors, options_.delta);
    if (const std::string refused = send_version(version, v.tensors, run, what); !refused.empty()) {
      FSDPX_CHECK_AS(SyncError, v.manifest.is_delta() && last_error_aux_ == detail::refused_base,
                     "the synchronizer at ", where_, " refused version ", version, ": ", refused);
      published_store_.clear();
      base_is_callers_ = false;
      v = published_store_.cut(version, tensors, options_.delta);
      const std::string again = send_version(version, v.tensors, run, what);
      FSDPX_CHECK_AS(SyncError, again.empty(), "the synchronizer at ", where_, " refused version ", version, ": ",
                     again);
    }
    last_transfer_ = {version, v.manifest.is_delta(), v.bytes, v.full_bytes};
    if (options_.delta.enabled) {  // the base of the next delta
      const bool keep_as_is = handed_over && std::all_of(tensors.begin(), tensors.end(), [](const NamedTensor& t) {
                                return t.tensor.is_cpu() && t.tensor.is_contiguous();
                              });
      if (keep_as_is) {
        published_store_.adopt(tensors, v.manifest.whole());
      } else if (base_is_callers_) {
        // The base is tensors handed over before: a delta must not be applied to them (the caller may
        // still share them); the version is kept as a copy instead.
        std::vector<NamedTensor> copies;
        for (const NamedTensor& t : tensors)
          copies.push_back({t.name, t.tensor.detach().to(at::kCPU, false, true).contiguous()});
        published_store_.adopt(std::move(copies), v.manifest.whole());
      } else {
        published_store_.commit(std::move(v));
      }
      base_is_callers_ = keep_as_is;
    }
    published_ = true;
  }

  /// The newest version once it is newer than `have` (no_version: any), waiting up to `wait` for one.
  /// All of one version or a SyncError: on a timeout, when the trainer disconnected, when the server
  /// is gone, on a corrupt frame. A connection the server closed while it was idle is opened again.
  WeightVersion fetch_newer(int64_t have, std::chrono::milliseconds wait) {
    const std::string what = ::fsdpx::detail::str("fetching a version newer than ", have);
    held_.prepare(nullptr);
    const auto deadline = dist::deadline_after(wait);
    reconnect_if_closed();
    authenticate(Role::fetch, what);
    Received r = fetch_once(have, base_for(have), wait, what);
    // Copy-on-write: the tensors of snapshots returned before never change.
    auto [tensors, manifest] = held_.take(std::move(r.tensors), "the synchronizer at " + where_, deadline);
    count_full_bytes(*manifest);
    last_version_ = r.version;
    last_run_ = r.run;
    return {r.version, std::move(tensors), std::move(r.run), std::move(manifest)};
  }

  int64_t fetch_newer_into(torch::nn::Module& module, int64_t have, std::chrono::milliseconds wait) {
    const std::string what = ::fsdpx::detail::str("fetching a version newer than ", have, " into a module");
    held_.prepare(&module);
    const auto deadline = dist::deadline_after(wait);
    reconnect_if_closed();
    authenticate(Role::fetch, what);
    Received r = fetch_once(have, base_for(have), wait, what);
    held_.take_into(module, std::move(r.tensors), "the synchronizer at " + where_, deadline);
    if (const auto manifest = held_.last_manifest()) count_full_bytes(*manifest);
    last_version_ = r.version;
    last_run_ = r.run;
    return r.version;
  }

  void verify(torch::nn::Module& module) const { held_.verify(module); }
  void verify(const std::vector<NamedTensor>& tensors) const { held_.verify(tensors); }
  SynchronizerClient::Transfer last_transfer() const { return last_transfer_; }
  int64_t last_version() const { return last_version_; }

  /// Leaves: a publisher says goodbye first, so readers are not told that the trainer was lost.
  void close() {
    if (!is_open()) return;
    if (published_ && role_ == Role::publish) {
      write_frame(detail::make_frame(detail::FrameKind::goodbye, no_version), nullptr, "saying goodbye");
    }
    boost::system::error_code ignored;
    stream_->socket().shutdown(detail::tcp::socket::shutdown_both, ignored);
    close_socket();
  }

 private:
  /// The server closes connections idle beyond its idle_timeout: between requests, nothing may be
  /// waiting on an authenticated connection, so a hang-up (or anything unasked for) seen without
  /// blocking means a fresh connection.
  void reconnect_if_closed() {
    if (!is_open()) return connect(options_.connect_timeout);  // after an earlier error
    if (!role_) return;                                        // the server's hello is waiting: authenticate() reads it
    if (!readable_now()) return;
    char c;
    const ssize_t n = ::recv(stream_->socket().native_handle(), &c, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n >= 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) {  // anything, a hang-up, or an error
      connect(options_.connect_timeout);
    }
  }

  /// Whether the server sent something (or hung up) that has not been read yet; never blocks.
  bool readable_now() {
    pollfd p{stream_->socket().native_handle(), POLLIN, 0};
    return ::poll(&p, 1, 0) > 0;
  }

  bool is_open() { return stream_ && stream_->socket().is_open(); }
  void close_socket() {
    boost::system::error_code ignored;
    if (stream_) stream_->socket().close(ignored);
  }

  void connect(std::chrono::milliseconds timeout) {
    boost::system::error_code ignored;
    close_socket();
    stream_.reset();
    role_.reset();
    hello_.reset();
    peer_closed_ = false;
    const auto deadline = dist::deadline_after(timeout);
    std::string last = "no attempt";
    detail::tcp::socket socket(io_);
    while (true) {
      std::optional<boost::system::error_code> result;
      socket.async_connect(endpoint_, [&](const boost::system::error_code& e) { result = e; });
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      io_.restart();
      io_.run_for(std::max(left, std::chrono::milliseconds(1)));
      if (result && !*result) break;
      if (!result) {
        socket.close(ignored);
        io_.restart();
        io_.run();
        last = "timed out";
      } else {
        last = result->message();
        socket.close(ignored);
      }
      FSDPX_CHECK_AS(SyncError, std::chrono::steady_clock::now() < deadline,
                     "could not connect to the synchronizer at ", where_, " within ", timeout.count(), " ms: ", last,
                     " (is the server running, and is the address right?)");
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    socket.set_option(detail::tcp::no_delay(true));
    socket.set_option(detail::asio::socket_base::keep_alive(true));
    stream_.emplace(std::move(socket), tls_ ? &*tls_ : nullptr);
    if (tls_) {
      stream_->set_server_name(options_.tls_server_name);
      std::optional<boost::system::error_code> result;
      stream_->async_handshake(detail::asio::ssl::stream_base::client,
                               [&](const boost::system::error_code& e) { result = e; });
      io_.restart();
      io_.run_for(
          std::max(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()),
                   std::chrono::milliseconds(1000)));
      if (!result || *result) {
        close_socket();
        io_.restart();
        io_.run();
        throw SyncError(::fsdpx::detail::str(
            "fsdpx: the TLS handshake with the synchronizer at ", where_,
            " failed: ", result ? detail::tls_failure(*result) : std::string("it did not finish in time")));
      }
    }
  }

  /// The server refused the connection at accept for one of its limits (its reason): try again later.
  struct Busy {
    std::string reason;
  };

  /// The handshake for `role` (once per connection; a connection that fetches reconnects to publish).
  /// A server that refused or closed the connection before the handshake ended (too many waiting to
  /// authenticate, or a connection opened long before its first use and closed by the server's
  /// handshake_timeout) is asked again on a fresh connection until connect_timeout, then the error says
  /// which limit.
  void authenticate(Role role, const std::string& what) {
    if (role_ == role || role_ == Role::publish) return;
    if (role_) connect(options_.connect_timeout);
    const auto deadline = dist::deadline_after(options_.connect_timeout);
    while (true) {
      try {
        return handshake(role, what);
      } catch (const Busy& busy) {
        const auto left =
            std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
        if (left <= std::chrono::milliseconds(0)) {
          throw SyncError(::fsdpx::detail::str(
              "fsdpx: ", what, " from the synchronizer at ", where_, ": ", busy.reason, "; asked again for ",
              options_.connect_timeout.count(),
              " ms (ClientOptions::connect_timeout). Too many connections wait to "
              "authenticate: many clients connecting at once, or a peer holding connections open (the server's "
              "max_handshakes and max_handshakes_per_address)"));
        }
        std::this_thread::sleep_for(std::min(left, std::chrono::milliseconds(100)));
        connect(std::max(left, std::chrono::milliseconds(1)));
      } catch (const SyncError&) {
        const auto left =
            std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
        if (!peer_closed_ || left <= std::chrono::milliseconds(0)) throw;
        std::this_thread::sleep_for(std::min(left, std::chrono::milliseconds(20)));
        connect(std::max(left, std::chrono::milliseconds(1)));
      }
    }
  }

  void handshake(Role role, const std::string& what) {
    if (!hello_) {
      const auto [hello, payload] = read_frame(options_.io_timeout, what + " (the server's hello)", /*small=*/true);
      if (hello.kind == static_cast<uint16_t>(detail::FrameKind::error)) {
        close_socket();
        if (hello.aux == detail::refused_busy) throw Busy{payload};
        throw SyncError(::fsdpx::detail::str("fsdpx: ", what, ": the synchronizer at ", where_,
                                             " refused the connection: ", payload));
      }
      if (hello.kind != static_cast<uint16_t>(detail::FrameKind::hello) || hello.aux != detail::protocol_version ||
          payload.size() != detail::nonce_bytes) {
        fail(::fsdpx::detail::str("the server did not start with a protocol ", detail::protocol_version, " hello"),
             what);
      }
      hello_.emplace();
      std::copy(payload.begin(), payload.end(), hello_->begin());
    }
    const Secret secret = resolve_secret(role, options_.secret, "");
    const detail::Nonce mine = detail::fresh_nonce();
    std::array<uint8_t, 2 * detail::nonce_bytes> auth{};
    std::copy(mine.begin(), mine.end(), auth.begin());
    if (!secret.empty()) {
      const detail::Mac mac = detail::handshake_mac(secret.value, detail::client_label, role, *hello_, mine);
      std::copy(mac.begin(), mac.end(), auth.begin() + detail::nonce_bytes);
    }
    write_frame(
        detail::make_frame(detail::FrameKind::auth, no_version, static_cast<uint64_t>(role), auth.data(), auth.size()),
        auth.data(), what);
    const auto [reply, payload] = read_frame(options_.io_timeout, what + " (the handshake)", /*small=*/true);
    if (reply.kind == static_cast<uint16_t>(detail::FrameKind::error)) {
      close_socket();
      if (reply.aux == detail::refused_busy) throw Busy{payload};  // closed to make room for another
      throw SyncError(::fsdpx::detail::str("fsdpx: the synchronizer at ", where_, " refused to let this client ",
                                           to_string(role), ": ", payload,
                                           secret.empty() ? " (this client has no secret: set ClientOptions::secret or "
                                                            "FSDPX_SYNC_SECRET)"
                                                          : ""));
    }
    if (reply.kind != static_cast<uint16_t>(detail::FrameKind::welcome) || payload.size() != detail::mac_bytes) {
      fail("the server answered the handshake with something other than a welcome", what);
    }
    if (!secret.empty()) {
      const detail::Mac expected = detail::handshake_mac(secret.value, detail::server_label, role, mine, *hello_);
      if (!detail::same_mac(expected, reinterpret_cast<const uint8_t*>(payload.data()))) {
        fail(::fsdpx::detail::str("the server did not prove it holds the ", to_string(role),
                                  " secret (it runs without one, or with another): its weights are not trusted"),
             what);
      }
    }
    role_ = role;
  }

  /// The fetch's deadline for the duration of fetch_once: every read and write ends by it.
  struct FetchDeadline {
    ClientConnection& c;
    FetchDeadline(ClientConnection& connection, std::chrono::steady_clock::time_point at,
                  std::chrono::milliseconds wait)
        : c(connection) {
      c.fetch_deadline_ = at;
      c.fetch_wait_ = wait;
      c.fetch_progress_.clear();
    }
    ~FetchDeadline() { c.fetch_deadline_.reset(); }
  };

  /// A fetched version as it arrived (the manifest first), not yet applied.
  struct Received {
    int64_t version;
    std::string run;
    std::vector<NamedTensor> tensors;
  };

  /// What the next fetch says it holds: the version in the store, when it is `have`.
  detail::FetchBase base_for(int64_t have) const {
    detail::FetchBase base;
    if (const Manifest* held = held_.base(); held != nullptr && held->version == have) {
      base.flags = detail::fetch_holds_base;
      base.digest = held->digest;
    }
    return base;
  }

  /// What a full version of the fetched one sends (last_transfer().full_bytes).
  void count_full_bytes(const Manifest& m) {
    last_transfer_.full_bytes = 0;
    for (const auto& e : m.entries) last_transfer_.full_bytes += e.nbytes();
  }

  Received fetch_once(int64_t have, detail::FetchBase base, std::chrono::milliseconds wait, const std::string& what);

  [[noreturn]] void fail(const std::string& why, const std::string& what) {
    close_socket();
    throw SyncError(::fsdpx::detail::str("fsdpx: ", what, " from the synchronizer at ", where_, ": ", why));
  }

  /// Runs one asynchronous operation to completion or its deadline; a missed deadline closes the socket.
  template <class Start>
  void run(Start&& start, std::chrono::milliseconds timeout, const std::string& what) {
    FSDPX_CHECK_AS(SyncError, is_open(), what, ": the connection to the synchronizer at ", where_,
                   " is closed after an earlier error");
    bool by_deadline = false;  // the fetch's deadline comes first
    if (fetch_deadline_) {
      const auto left = std::max(
          std::chrono::duration_cast<std::chrono::milliseconds>(*fetch_deadline_ - std::chrono::steady_clock::now()),
          std::chrono::milliseconds(0));
      if (left < timeout) {
        timeout = left;
        by_deadline = true;
      }
    }
    std::optional<boost::system::error_code> result;
    start([&](const boost::system::error_code& ec, size_t) { result = ec; });
    io_.restart();
    io_.run_for(timeout);
    if (!result) {
      close_socket();
      io_.restart();
      io_.run();
      if (by_deadline) {
        throw SyncError(::fsdpx::detail::str(
            "fsdpx: ", what, ": the synchronizer at ", where_, " did not finish within the fetch's wait of ",
            fetch_wait_.count(), " ms", fetch_progress_.empty() ? std::string() : " (" + fetch_progress_ + ")",
            ": the server or the network is slow or stalled, or the version is too large to arrive in that time "
            "(the wait covers the transfer: pass a longer one)"));
      }
      throw SyncError(::fsdpx::detail::str("fsdpx: ", what, ": the synchronizer at ", where_, " did not answer within ",
                                           timeout.count(),
                                           " ms (the server or the trainer behind it is stalled or "
                                           "unreachable)"));
    }
    if (*result) {
      peer_closed_ = *result == detail::asio::error::eof || *result == detail::asio::error::connection_reset ||
                     *result == detail::asio::error::broken_pipe;
      fail(detail::describe(*result), what);
    }
  }

  void write_frame(const detail::FrameHeader& h, const void* payload, const std::string& what) {
    std::array<detail::asio::const_buffer, 2> buffers{detail::asio::buffer(&h, sizeof(h)),
                                                      detail::asio::buffer(payload, payload ? h.length : 0)};
    run([&](auto handler) { stream_->async_write(buffers, handler); }, options_.io_timeout, what);
  }

  /// Reads one frame. The payload of an error, hello or welcome frame (at most max_error_bytes), or of a
  /// snapshot_begin (its run), comes back as the string; a bucket payload (keep_payload) stays in
  /// payload_. Sizes are checked first.
  std::pair<detail::FrameHeader, std::string> read_frame(std::chrono::milliseconds timeout, const std::string& what,
                                                         bool small = false, bool keep_payload = false) {
    detail::FrameHeader h;
    run([&](auto handler) { stream_->async_read(detail::asio::buffer(&h, sizeof(h)), handler); }, timeout, what);
    const bool begin = h.kind == static_cast<uint16_t>(detail::FrameKind::snapshot_begin);
    const bool text = h.kind == static_cast<uint16_t>(detail::FrameKind::error) || small || begin;
    const uint64_t allowed = begin  ? detail::max_run_bytes
                             : text ? detail::max_error_bytes
                             : h.kind == static_cast<uint16_t>(detail::FrameKind::bucket)
                                 ? static_cast<uint64_t>(options_.max_bucket_bytes)
                                 : 0;
    if (const std::string problem = detail::frame_problem(h, allowed); !problem.empty()) fail(problem, what);
    at::Tensor payload = at::empty({static_cast<int64_t>(h.length)}, at::kByte);
    if (h.length > 0) {
      run([&](auto handler) { stream_->async_read(detail::asio::buffer(payload.data_ptr(), h.length), handler); },
          options_.io_timeout, what);
    }
    if (detail::frame_checksum(h.length ? payload.const_data_ptr() : nullptr, h.length) != h.checksum) {
      fail("a frame whose checksum does not match its payload (corrupted in transit)", what);
    }
    std::string body;
    if (text) body.assign(static_cast<const char*>(payload.const_data_ptr()), h.length);
    if (keep_payload) payload_ = std::move(payload);
    return {h, body};
  }

  /// Sends `tensors` as `version` and waits for the answer: empty when committed, else the server's reason
  /// (its error frame's aux in last_error_aux_).
  std::string send_version(int64_t version, const std::vector<NamedTensor>& tensors, const std::string& run,
                           const std::string& what) {
    std::vector<detail::TensorSpec> specs;
    for (const auto& t : tensors) specs.push_back({t.name, t.tensor.sizes().vec(), t.tensor.scalar_type()});
    const auto plan = detail::plan_buckets(specs, options_.bucket_bytes, version);
    write_frame(detail::make_frame(detail::FrameKind::publish_begin, version, plan.size(), run.data(), run.size()),
                run.data(), what);
    at::Tensor bucket;
    size_t next = 0;
    bool refused = false;
    for (const detail::BucketLayout& b : plan) {
      // The server says nothing during a publish unless it refuses it: then stop sending, and read why.
      if ((refused = readable_now())) break;
      if (!bucket.defined() || bucket.numel() < b.total_bytes) bucket = at::empty({b.total_bytes}, at::kByte);
      const at::Tensor view = bucket.narrow(0, 0, b.total_bytes);
      detail::write_header(view, b);
      for (const auto& e : b.entries) {
        while (tensors[next].name != e.name) ++next;  // the plan follows the tensors' order
        detail::pack_entry(view, e, tensors[next].tensor.to(at::kCPU));
      }
      write_frame(detail::make_frame(detail::FrameKind::bucket, version, b.index, view.const_data_ptr(), b.total_bytes),
                  view.const_data_ptr(), what);
    }
    if (!refused) write_frame(detail::make_frame(detail::FrameKind::publish_end, version), nullptr, what);
    const auto [reply, text] = read_frame(options_.io_timeout, what);
    if (reply.kind == static_cast<uint16_t>(detail::FrameKind::error)) {
      last_error_aux_ = reply.aux;
      return text.empty() ? std::string("(no reason given)") : text;
    }
    FSDPX_CHECK_AS(SyncError, reply.kind == static_cast<uint16_t>(detail::FrameKind::ack) && reply.version == version,
                   "the synchronizer at ", where_, " answered a publish with a ",
                   detail::to_string(detail::FrameKind(reply.kind)), " frame");
    return {};
  }

  ClientOptions options_;
  std::string where_;
  detail::tcp::endpoint endpoint_;
  detail::asio::io_context io_;
  std::optional<detail::asio::ssl::context> tls_;  // set: TLS (ClientOptions::tls)
  std::optional<detail::Stream> stream_;           // the connection, TLS or not
  at::Tensor payload_;
  std::optional<detail::Nonce> hello_;
  std::optional<Role> role_;
  bool published_ = false;
  bool peer_closed_ = false;  // the last failure was the server closing the connection
  // The version this client fetched last, and its run (sent with the next fetch).
  int64_t last_version_ = no_version;
  std::string last_run_;
  // The version fetched last, as held: the client's own copy (fetch_newer) or a module's tensors
  // (fetch_newer_into); deltas are applied to it.
  detail::HeldVersion held_;
  // What this client published last (the base of its next delta), and whether its tensors are the
  // caller's (handed over: never written).
  detail::VersionStore published_store_;
  bool base_is_callers_ = false;
  uint64_t last_error_aux_ = 0;
  SynchronizerClient::Transfer last_transfer_;
  // While a fetch runs: its deadline, its wait and how far it got (for the error).
  std::optional<std::chrono::steady_clock::time_point> fetch_deadline_;
  std::chrono::milliseconds fetch_wait_{0};
  std::string fetch_progress_;
};

}  // namespace detail

}  // namespace fsdpx::sync
