// SynchronizerClient's implementation: the connection, over Boost.Asio (TLS through OpenSSL).
// Included by sync/client.hpp (header-only) or by fsdpx/impl/src.hpp (FSDPX_SEPARATE_COMPILATION).
#pragma once

#include <fsdpx/sync/client.hpp>
#include <fsdpx/sync/detail/client_connection.hpp>

namespace fsdpx::sync {

namespace detail {

inline ClientConnection::Received ClientConnection::fetch_once(int64_t have, detail::FetchBase base,
                                                               std::chrono::milliseconds wait,
                                                               const std::string& what) {
  wait = std::clamp(wait, std::chrono::milliseconds(0), std::chrono::milliseconds(std::chrono::hours(24 * 365)));
  const auto deadline = dist::deadline_after(wait);
  // The whole fetch ends by `deadline`, whatever the server sends (a server trickling frames, each
  // within io_timeout, cannot keep it longer).
  const FetchDeadline scope(*this, deadline, wait);
  // The run of the version this client fetched last: a version of another run is newer.
  const std::string have_run = have != no_version && have == last_version_ ? last_run_ : std::string();
  detail::FrameHeader begin;
  std::string run;
  while (true) {
    const auto now = std::chrono::steady_clock::now();
    const auto left =
        std::max(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now), std::chrono::milliseconds(0));
    // The server answers `timeout` a little before this fetch's deadline, so that the answer arrives
    // in time; it may answer earlier (it caps a wait at its idle_timeout): then ask again.
    const auto server_wait = left - std::min(left / 4, std::chrono::milliseconds(250));
    std::string payload(reinterpret_cast<const char*>(&base), sizeof(base));
    payload += have_run;
    write_frame(detail::make_frame(detail::FrameKind::fetch, have, static_cast<uint64_t>(server_wait.count()),
                                   payload.data(), payload.size()),
                payload.data(), what);
    auto [reply, text] = read_frame(left + options_.io_timeout, what);
    if (reply.kind == static_cast<uint16_t>(detail::FrameKind::timeout) &&
        std::chrono::steady_clock::now() + std::chrono::milliseconds(10) < now + server_wait) {
      continue;
    }
    begin = reply;
    if (reply.kind == static_cast<uint16_t>(detail::FrameKind::error)) {
      throw SyncError(::fsdpx::detail::str("fsdpx: the synchronizer at ", where_, " answered: ", text));
    }
    run = std::move(text);
    break;
  }
  switch (detail::FrameKind(begin.kind)) {
    case detail::FrameKind::snapshot_begin: break;
    case detail::FrameKind::timeout:
      throw SyncError(::fsdpx::detail::str("fsdpx: no weight version newer than ", have, " was published within ",
                                           wait.count(), " ms (the synchronizer at ", where_, " has version ",
                                           begin.version, "); the trainer may be slow, stopped or dead"));
    default:
      fail(::fsdpx::detail::str("an unexpected ", detail::to_string(detail::FrameKind(begin.kind)), " frame"), what);
  }
  if (begin.version <= have && (have_run.empty() || run == have_run)) {
    fail(::fsdpx::detail::str("it sent version ", begin.version, " of run ", detail::quoted_run(run),
                              " for a request newer than ", have),
         what);
  }
  if (begin.aux == 0 || begin.aux > static_cast<uint64_t>(options_.max_version_bytes / detail::prefix_bytes)) {
    fail(::fsdpx::detail::str("a version of ", begin.aux, " buckets"), what);
  }
  detail::TensorCollector collector(at::kCPU, options_.max_version_bytes,
                                    /*huge_pages=*/false);  // the server is a peer
  std::vector<NamedTensor> tensors;
  for (uint64_t k = 0; k < begin.aux; ++k) {
    fetch_progress_ = ::fsdpx::detail::str("version ", begin.version, ": ", k, " of ", begin.aux, " buckets received");
    const detail::FrameHeader frame =
        read_frame(options_.io_timeout, what, /*small=*/false, /*keep_payload=*/true).first;
    if (frame.kind != static_cast<uint16_t>(detail::FrameKind::bucket)) fail("a bucket frame was expected", what);
    try {
      const detail::BucketLayout b =
          detail::check_bucket(payload_, begin.version, k, begin.aux, "synchronizer " + where_, deadline);
      for (size_t i = 0; i < b.entries.size(); ++i) {
        // A header of many entries takes time to take in: the fetch's deadline holds within it too.
        if (i % 4096 == 4095 && std::chrono::steady_clock::now() >= deadline) {  // told once, by the catch
          throw SyncError(::fsdpx::detail::str("fsdpx: did not finish within the fetch's wait of ", wait.count(),
                                               " ms (bucket ", k, " of ", begin.aux, ": ", i, " of ", b.entries.size(),
                                               " entries taken in)"));
        }
        collector.accept_from(payload_, b.entries[i]);
      }
    } catch (const SyncError& e) {
      fail(::fsdpx::detail::str("version ", begin.version, ": ", detail::unprefixed(e.what())), what);
    }
  }
  payload_ = at::Tensor();
  try {
    // Every element of every tensor exactly once: a version covered twice in part is refused, never
    // handed out with its other part uninitialised.
    tensors = collector.finish();
  } catch (const SyncError& e) {
    fail(::fsdpx::detail::str("version ", begin.version, ": ", detail::unprefixed(e.what())), what);
  }
  int64_t bytes = 0;
  for (const auto& t : tensors) bytes += static_cast<int64_t>(t.tensor.nbytes());
  last_transfer_ = {begin.version, false, bytes, 0};
  // Its manifest first, and of this version: what the caller applies is checked against it.
  if (tensors.empty() || tensors.front().name != detail::manifest_name) {
    fail(::fsdpx::detail::str("version ", begin.version, " does not start with its manifest ('", detail::manifest_name,
                              "'): the server speaks another protocol, or the version is corrupt"),
         what);
  }
  try {
    // Its prefix only (the store decodes and checks it whole as it takes the version).
    std::optional<detail::ManifestPrefix> prefix = detail::peek_manifest(tensors.front().tensor);
    if (!prefix) Manifest::decode(tensors.front().tensor, "the synchronizer at " + where_);  // says why
    if (!prefix || prefix->version != begin.version) {
      fail(::fsdpx::detail::str("version ", begin.version, " carries the manifest of version ",
                                prefix ? prefix->version : no_version),
           what);
    }
    last_transfer_.delta = prefix->delta;
  } catch (const SyncError& e) {
    fail(::fsdpx::detail::str("version ", begin.version, ": ", detail::unprefixed(e.what())), what);
  }
  return {begin.version, std::move(run), std::move(tensors)};
}

}  // namespace detail

FSDPX_DECL SynchronizerClient::SynchronizerClient(std::string host, uint16_t port, ClientOptions options)
    : connection_(std::make_unique<detail::ClientConnection>(std::move(host), port, std::move(options))) {}
FSDPX_DECL SynchronizerClient::SynchronizerClient(SynchronizerClient&&) noexcept = default;
FSDPX_DECL SynchronizerClient& SynchronizerClient::operator=(SynchronizerClient&&) noexcept = default;
FSDPX_DECL SynchronizerClient::~SynchronizerClient() = default;

FSDPX_DECL void SynchronizerClient::publish(int64_t version, const std::vector<NamedTensor>& tensors) {
  FSDPX_CHECK_AS(SyncError, connection_ != nullptr, "cannot publish version ", version, ": this client was moved from");
  connection_->publish(version, tensors, /*handed_over=*/false);
}

FSDPX_DECL void SynchronizerClient::publish(int64_t version, std::vector<NamedTensor>&& tensors) {
  FSDPX_CHECK_AS(SyncError, connection_ != nullptr, "cannot publish version ", version, ": this client was moved from");
  const std::vector<NamedTensor> mine = std::move(tensors);
  connection_->publish(version, mine, /*handed_over=*/true);
}

FSDPX_DECL WeightVersion SynchronizerClient::fetch_newer(int64_t have, std::chrono::milliseconds wait) {
  FSDPX_CHECK_AS(SyncError, connection_ != nullptr, "cannot fetch: this client was moved from");
  return connection_->fetch_newer(have, wait);
}

FSDPX_DECL int64_t SynchronizerClient::fetch_newer_into(torch::nn::Module& module, int64_t have,
                                                        std::chrono::milliseconds wait) {
  FSDPX_CHECK_AS(SyncError, connection_ != nullptr, "cannot fetch: this client was moved from");
  return connection_->fetch_newer_into(module, have, wait);
}

FSDPX_DECL void SynchronizerClient::verify(torch::nn::Module& module) const {
  FSDPX_CHECK_AS(SyncError, connection_ != nullptr, "cannot verify: this client was moved from");
  connection_->verify(module);
}

FSDPX_DECL void SynchronizerClient::verify(const std::vector<NamedTensor>& tensors) const {
  FSDPX_CHECK_AS(SyncError, connection_ != nullptr, "cannot verify: this client was moved from");
  connection_->verify(tensors);
}

FSDPX_DECL int64_t SynchronizerClient::last_version() const {
  return connection_ ? connection_->last_version() : no_version;
}

FSDPX_DECL SynchronizerClient::Transfer SynchronizerClient::last_transfer() const {
  return connection_ ? connection_->last_transfer() : Transfer{};
}

FSDPX_DECL void SynchronizerClient::close() {
  if (connection_) connection_->close();
}

}  // namespace fsdpx::sync
