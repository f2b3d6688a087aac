// SynchronizerServer's implementation: the I/O thread and the server's public functions over Boost.Asio
// (TLS through OpenSSL); its shared state and admission are in sync/detail/server_core.hpp, one
// connection in sync/impl/server_session.ipp, session_publish.ipp and session_close.ipp. Included by sync/server.hpp
// (header-only) or by fsdpx/impl/src.hpp (FSDPX_SEPARATE_COMPILATION).
#pragma once

#include <fsdpx/sync/server.hpp>
#include <fsdpx/sync/detail/server_core.hpp>
#include <fsdpx/sync/impl/server_session.ipp>
#include <fsdpx/sync/impl/session_publish.ipp>
#include <fsdpx/sync/impl/session_close.ipp>

namespace fsdpx::sync {

namespace detail {

/// ServerOptions' deprecated flat limits, where set, into `limits` (the one place the server reads).
inline void fold_deprecated_limits(ServerOptions& o) {
  if (o.max_bucket_bytes) o.limits.max_bucket_bytes = *o.max_bucket_bytes;
  if (o.max_version_bytes) o.limits.max_version_bytes = *o.max_version_bytes;
  if (o.max_connections) o.limits.max_connections = *o.max_connections;
  if (o.max_handshakes) o.limits.max_handshakes = *o.max_handshakes;
  if (o.max_handshakes_per_address) o.limits.max_handshakes_per_address = *o.max_handshakes_per_address;
  if (o.handshake_timeout) o.limits.handshake_timeout = *o.handshake_timeout;
  if (o.idle_timeout) o.limits.idle_timeout = *o.idle_timeout;
  if (o.io_timeout) o.limits.io_timeout = *o.io_timeout;
}

}  // namespace detail

FSDPX_DECL SynchronizerServer::SynchronizerServer(ServerOptions options)
    : core_(std::make_unique<detail::ServerCore>()) {
  auto& core = *core_;
  core.options = std::move(options);
  detail::fold_deprecated_limits(core.options);
  const ServerOptions& o = core.options;
  FSDPX_CHECK_AS(
      SyncError,
      o.limits.max_bucket_bytes >= detail::prefix_bytes && o.limits.max_version_bytes >= o.limits.max_bucket_bytes &&
          o.limits.max_connections >= 1 && o.limits.max_handshakes >= 1 && o.limits.max_handshakes_per_address >= 1,
      "synchronizer server: inconsistent limits (max_bucket_bytes ", o.limits.max_bucket_bytes, ", max_version_bytes ",
      o.limits.max_version_bytes, ", max_connections ", o.limits.max_connections, ", max_handshakes ",
      o.limits.max_handshakes, ", max_handshakes_per_address ", o.limits.max_handshakes_per_address, ")");
  const std::string run_problem = detail::run_problem(o.run);
  FSDPX_CHECK_AS(SyncError, run_problem.empty(), "synchronizer server: ServerOptions::run is ", run_problem);
  FSDPX_CHECK_AS(SyncError, o.tls_certificate_file.empty() == o.tls_private_key_file.empty(),
                 "synchronizer server: TLS needs both tls_certificate_file and tls_private_key_file");
  if (!o.tls_certificate_file.empty())
    core.tls.emplace(detail::server_tls_context(o.tls_certificate_file, o.tls_private_key_file));
  core.publish_secret = resolve_secret(Role::publish, o.publish_secret, o.secret);
  core.fetch_secret = resolve_secret(Role::fetch, o.fetch_secret, o.secret);
  boost::system::error_code ec;
  const auto address = detail::asio::ip::make_address(o.host, ec);
  FSDPX_CHECK_AS(SyncError, !ec, "synchronizer server: '", o.host, "' is not an IP address: ", ec.message());
  if (!address.is_loopback() && !o.allow_unauthenticated) {
    for (const Role r : {Role::publish, Role::fetch}) {
      FSDPX_CHECK_AS(SyncError, !core.secret(r).empty(), "synchronizer server: refusing to listen on ", o.host,
                     " without a ", to_string(r), " secret: anyone who reaches the port could ",
                     r == Role::publish ? "publish weights into every rollout" : "read the model's weights",
                     ". Set ServerOptions::secret (or ", r == Role::publish ? "publish_secret" : "fetch_secret",
                     ", or the environment variable FSDPX_SYNC_SECRET), listen on 127.0.0.1, or set "
                     "allow_unauthenticated on a network you trust");
    }
  }
  const detail::tcp::endpoint endpoint(address, o.port);
  core.acceptor.open(endpoint.protocol(), ec);
  if (!ec) core.acceptor.set_option(detail::tcp::acceptor::reuse_address(true), ec);
  if (!ec) core.acceptor.bind(endpoint, ec);
  if (!ec) core.acceptor.listen(detail::asio::socket_base::max_listen_connections, ec);
  FSDPX_CHECK_AS(SyncError, !ec, "synchronizer server: cannot listen on ", o.host, ":", o.port, ": ", ec.message());
  port_ = core.acceptor.local_endpoint().port();
  core.accept();
  thread_ = std::thread([&core] {
    // Handlers contain their own exceptions; this is the last line, so the loop never ends early.
    while (true) {
      try {
        core.io.run();
        return;
      } catch (const std::exception& e) {
        std::fprintf(stderr, "fsdpx: synchronizer server: a handler failed (%s); serving on\n", e.what());
      } catch (...) {
        std::fprintf(stderr, "fsdpx: synchronizer server: a handler failed; serving on\n");
      }
    }
  });
}

FSDPX_DECL SynchronizerServer::~SynchronizerServer() { stop(); }
FSDPX_DECL const std::string& SynchronizerServer::host() const { return core_ ? core_->options.host : stopped_host_; }
FSDPX_DECL int64_t SynchronizerServer::latest_version() const { return core_ ? core_->slot.version() : no_version; }

FSDPX_DECL ServerStats SynchronizerServer::stats() const {
  if (!core_) return last_stats_;
  std::promise<ServerStats> taken;
  auto future = taken.get_future();
  detail::asio::post(core_->io, [&] {
    ServerStats s = core_->stats;
    s.served_full = core_->served_full;
    s.served_delta = core_->served_delta;
    taken.set_value(s);
  });
  ServerStats s = future.get();
  s.runs_taken_over = core_->runs_taken_over;
  return s;
}

FSDPX_DECL void SynchronizerServer::publish(int64_t version, const std::vector<NamedTensor>& tensors) {
  FSDPX_CHECK_AS(SyncError, core_ != nullptr, "cannot publish version ", version, ": the server was stopped");
  FSDPX_CHECK_AS(SyncError, version >= 0, "cannot publish version ", version, ": versions are >= 0");
  FSDPX_CHECK_AS(SyncError, !tensors.empty(), "cannot publish version ", version, ": it has no tensors");
  detail::check_unique_names(tensors, version);
  const std::string run = detail::run_label(core_->options.run.empty() ? detail::process_run() : core_->options.run);
  auto& core = *core_;
  const std::string refused = core.commit(run, version, [&] {
    // Cut against the version held: readers that hold it get the delta; the full version is built from
    // the store when a reader needs it (or now, when there is no delta).
    detail::EncodedVersion cut = core.store.cut(version, tensors, core.options.delta);
    auto served = std::make_shared<detail::ServedVersion>();
    served->digest = cut.manifest.digest;
    auto snapshot =
        detail::encode_snapshot(version, run, detail::pack_buckets(cut.tensors, core.options.bucket_bytes, version));
    if (cut.manifest.is_delta()) {
      served->base_version = cut.manifest.base_version;
      served->base_digest = cut.manifest.base_digest;
      served->delta = std::move(snapshot);
    } else {
      served->full = std::move(snapshot);
    }
    core.store.commit(std::move(cut));
    return served;
  });
  FSDPX_CHECK_AS(SyncError, refused.empty(), "cannot publish version ", version, ": ", refused);
  detail::asio::post(core_->io, [core = core_.get()] {
    core->publisher_lost.clear();
    core->wake_waiters();
  });
}

FSDPX_DECL void SynchronizerServer::stop() {
  if (!thread_.joinable()) return;
  last_stats_ = stats();
  stopped_host_ = core_->options.host;
  detail::asio::post(core_->io, [core = core_.get()] {
    boost::system::error_code ignored;
    core->acceptor.close(ignored);
    core->accept_pause.cancel();
    core->io.stop();
  });
  thread_.join();
  core_.reset();  // closes every connection
}

}  // namespace fsdpx::sync
