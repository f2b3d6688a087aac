// The synchronizer service under attack (label "security"): loopback only, bounded in count and time.
// Each test case runs in its own process (catch_discover_tests), so the descriptor limit one of them
// lowers and the RSS another measures are its own.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <fcntl.h>
#include <csignal>
#include <cstdlib>
#include <unistd.h>

#include <fsdpx/sync/detail/handshake.hpp>  // the handshake and frames, built by hand to attack the server
#include <fsdpx/sync/detail/frame.hpp>
#include <fsdpx/sync/service.hpp>

using namespace std::chrono_literals;
namespace fxs = fsdpx::sync;
namespace sd = fsdpx::sync::detail;

namespace {

/// A blocking loopback socket with receive and send timeouts: the attacker's side.
class RawConnection {
 public:
  explicit RawConnection(uint16_t port, std::chrono::milliseconds timeout = 3000ms) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd_ < 0) return;
    timeval tv{static_cast<time_t>(timeout.count() / 1000), static_cast<suseconds_t>((timeout.count() % 1000) * 1000)};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    ::setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      ::close(fd_);
      fd_ = -1;
    }
  }
  RawConnection(const RawConnection&) = delete;
  RawConnection(RawConnection&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  ~RawConnection() {
    if (fd_ >= 0) ::close(fd_);
  }
  bool ok() const { return fd_ >= 0; }

  bool send_bytes(const void* data, size_t n) {
    const auto* p = static_cast<const char*>(data);
    while (n > 0) {
      const ssize_t k = ::send(fd_, p, n, MSG_NOSIGNAL);
      if (k <= 0) return false;
      p += k;
      n -= static_cast<size_t>(k);
    }
    return true;
  }
  bool send_frame(sd::FrameHeader h, const std::string& payload = {}) {
    return send_bytes(&h, sizeof(h)) && (payload.empty() || send_bytes(payload.data(), payload.size()));
  }
  bool recv_bytes(void* data, size_t n) {
    auto* p = static_cast<char*>(data);
    while (n > 0) {
      const ssize_t k = ::recv(fd_, p, n, 0);
      if (k <= 0) return false;
      p += k;
      n -= static_cast<size_t>(k);
    }
    return true;
  }
  /// The next frame, or nothing when the connection ends (or the timeout passes) first.
  std::optional<std::pair<sd::FrameHeader, std::string>> recv_frame() {
    sd::FrameHeader h;
    if (!recv_bytes(&h, sizeof(h)) || h.length > (1u << 20)) return std::nullopt;
    std::string payload(h.length, '\0');
    if (h.length > 0 && !recv_bytes(payload.data(), payload.size())) return std::nullopt;
    return std::pair{h, payload};
  }
  /// True when the server closed the connection (after its error frame, if any).
  bool closed_by_server() {
    char c;
    while (true) {
      const ssize_t k = ::recv(fd_, &c, 1, 0);
      if (k == 0) return true;
      if (k < 0) return errno == ECONNRESET;
    }
  }
  /// Reads the hello and answers it for `role`, with `secret` (empty: an all-zero MAC).
  std::optional<sd::Nonce> handshake(fxs::Role role, const std::string& secret, bool* welcomed = nullptr) {
    auto hello = recv_frame();
    if (!hello || hello->first.kind != static_cast<uint16_t>(sd::FrameKind::hello)) return std::nullopt;
    sd::Nonce server_nonce;
    std::memcpy(server_nonce.data(), hello->second.data(), server_nonce.size());
    std::string auth = auth_payload(role, secret, server_nonce);
    send_frame(sd::make_frame(sd::FrameKind::auth, fxs::no_version, static_cast<uint64_t>(role), auth.data(), auth.size()),
               auth);
    auto reply = recv_frame();
    if (welcomed) *welcomed = reply && reply->first.kind == static_cast<uint16_t>(sd::FrameKind::welcome);
    return server_nonce;
  }
  static std::string auth_payload(fxs::Role role, const std::string& secret, const sd::Nonce& server_nonce) {
    const sd::Nonce mine = sd::fresh_nonce();
    sd::Mac mac{};
    if (!secret.empty()) mac = sd::handshake_mac(secret, sd::client_label, role, server_nonce, mine);
    std::string out(reinterpret_cast<const char*>(mine.data()), mine.size());
    out.append(reinterpret_cast<const char*>(mac.data()), mac.size());
    return out;
  }

 private:
  int fd_ = -1;
};

/// The weights of version `v`: values derived from v, so a reader can check them bit for bit.
std::vector<fxs::NamedTensor> weights_of(int64_t v) {
  std::vector<fxs::NamedTensor> w;
  w.push_back({"embed.weight", at::arange(40000, at::kFloat).mul_(0.001).add_(static_cast<double>(v)).view({200, 200})});
  w.push_back({"blocks.0.norm.weight", at::full({200}, static_cast<double>(v) * 0.5, at::kBFloat16)});
  w.push_back({"blocks.0.attn.rope.inv_freq", at::arange(64, at::kFloat).add_(static_cast<double>(v))});  // a buffer
  w.push_back({"steps", at::full({1}, v, at::kLong)});
  return w;
}

bool bit_equal(const fxs::WeightSnapshot& s, const std::vector<fxs::NamedTensor>& expected) {
  if (s.tensors.size() != expected.size()) return false;
  for (size_t i = 0; i < expected.size(); ++i) {
    const auto& got = s.tensors[i];
    const auto& want = expected[i];
    if (got.name != want.name || got.tensor.scalar_type() != want.tensor.scalar_type() ||
        got.tensor.sizes() != want.tensor.sizes() ||
        std::memcmp(got.tensor.const_data_ptr(), want.tensor.const_data_ptr(), want.tensor.nbytes()) != 0) {
      return false;
    }
  }
  return true;
}

int64_t rss_bytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  }
  return 0;
}

std::string bucket_with_entry_count(uint32_t entries, int64_t version) {
  // A well-formed prefix whose entry count lies: the header holds none of them.
  std::string b(64, '\0');
  const uint32_t magic = 0x42535846;
  const uint16_t format = 1, flags = 1;
  const uint32_t header_bytes = 64, index = 0, count = 1;
  const uint64_t total = 64;
  char* p = b.data();
  std::memcpy(p, &magic, 4);
  std::memcpy(p + 4, &format, 2);
  std::memcpy(p + 6, &flags, 2);
  std::memcpy(p + 8, &entries, 4);
  std::memcpy(p + 12, &header_bytes, 4);
  std::memcpy(p + 16, &total, 8);
  std::memcpy(p + 24, &version, 8);
  std::memcpy(p + 32, &index, 4);
  std::memcpy(p + 36, &count, 4);
  return b;
}

}  // namespace

TEST_CASE("security: a server bound beyond loopback without a secret does not start", "[security]") {
  ::unsetenv("FSDPX_SYNC_SECRET");
  ::unsetenv("FSDPX_SYNC_PUBLISH_SECRET");
  ::unsetenv("FSDPX_SYNC_FETCH_SECRET");
  CHECK_THROWS_WITH(fxs::SynchronizerServer({.host = "0.0.0.0"}),
                    Catch::Contains("refusing to listen on 0.0.0.0 without a publish secret") &&
                        Catch::Contains("allow_unauthenticated"));
  CHECK_THROWS_WITH(fxs::SynchronizerServer({.host = "0.0.0.0", .publish_secret = "p"}),
                    Catch::Contains("without a fetch secret"));
  CHECK_NOTHROW(fxs::SynchronizerServer({.host = "0.0.0.0", .secret = "s"}));
  CHECK_NOTHROW(fxs::SynchronizerServer({.host = "0.0.0.0", .allow_unauthenticated = true}));
  ::setenv("FSDPX_SYNC_SECRET", "from-the-environment", 1);
  CHECK_NOTHROW(fxs::SynchronizerServer({.host = "0.0.0.0"}));
  ::unsetenv("FSDPX_SYNC_SECRET");
  CHECK_NOTHROW(fxs::SynchronizerServer({.host = "127.0.0.1"}));  // loopback: a local trainer and rollout
}

TEST_CASE("security: wrong secret, no secret and a replayed handshake are refused, and nothing is published",
          "[security]") {
  fxs::SynchronizerServer server({.publish_secret = "publisher-secret", .fetch_secret = "reader-secret"});
  const auto port = server.port();

  CHECK_THROWS_WITH(fxs::SynchronizerClient("127.0.0.1", port, {.secret = "guess"}).publish(1, weights_of(1)),
                    Catch::Contains("refused to let this client publish") &&
                        Catch::Contains("did not prove it holds the publish secret"));
  CHECK_THROWS_WITH(fxs::SynchronizerClient("127.0.0.1", port).publish(1, weights_of(1)),
                    Catch::Contains("refused to let this client publish") && Catch::Contains("has no secret"));
  // The fetch secret lets a client read, never publish.
  CHECK_THROWS_WITH(fxs::SynchronizerClient("127.0.0.1", port, {.secret = "reader-secret"}).publish(1, weights_of(1)),
                    Catch::Contains("refused to let this client publish"));
  CHECK(server.latest_version() == fxs::no_version);

  // A handshake recorded on one connection is worthless on another: the server's nonce differs.
  {
    RawConnection first(port), second(port);
    auto hello1 = first.recv_frame();
    auto hello2 = second.recv_frame();
    REQUIRE((hello1 && hello2));
    sd::Nonce nonce1;
    std::memcpy(nonce1.data(), hello1->second.data(), nonce1.size());
    const std::string recorded = RawConnection::auth_payload(fxs::Role::publish, "publisher-secret", nonce1);
    second.send_frame(sd::make_frame(sd::FrameKind::auth, fxs::no_version, 1, recorded.data(), recorded.size()), recorded);
    auto reply = second.recv_frame();
    REQUIRE(reply);
    CHECK(reply->first.kind == static_cast<uint16_t>(sd::FrameKind::error));
    CHECK_THAT(reply->second, Catch::Contains("authentication failed"));
    CHECK(second.closed_by_server());
    // Then publishing on the refused connection goes nowhere.
    CHECK(server.latest_version() == fxs::no_version);
  }

  // The right secrets work; a reader checks that the server holds its secret too.
  fxs::SynchronizerClient trainer("127.0.0.1", port, {.secret = "publisher-secret"});
  trainer.publish(1, weights_of(1));
  fxs::SynchronizerClient reader("127.0.0.1", port, {.secret = "reader-secret"});
  CHECK(bit_equal(reader.fetch_newer(fxs::no_version, 5s), weights_of(1)));
  CHECK_THROWS_WITH(fxs::SynchronizerClient("127.0.0.1", port).fetch_newer(fxs::no_version, 1s),
                    Catch::Contains("refused to let this client fetch"));

  // An impostor server (no secret) cannot feed a reader that holds one.
  fxs::SynchronizerServer impostor;
  impostor.publish(1, weights_of(1));
  CHECK_THROWS_WITH(fxs::SynchronizerClient("127.0.0.1", impostor.port(), {.secret = "reader-secret"})
                        .fetch_newer(fxs::no_version, 1s),
                    Catch::Contains("did not prove it holds the fetch secret"));
  CHECK(server.stats().failed_auth >= 4);
}

TEST_CASE("security: versions cannot be hijacked, and a publish that never completes holds nobody back", "[security]") {
  fxs::SynchronizerServer server({.secret = "s", .max_version_jump = 1000, .io_timeout = 1500ms});
  const auto port = server.port();
  {
    // Even the first version is bounded: nothing can be published before the trainer's first.
    fxs::SynchronizerClient rogue("127.0.0.1", port, {.secret = "s"});
    CHECK_THROWS_WITH(rogue.publish(int64_t{1} << 62, weights_of(1)), Catch::Contains("max_version_jump (1000)"));
  }
  {
    // A fetch for versions newer than -2 (or INT64_MIN) before anything is published is refused.
    RawConnection c(port);
    bool welcomed = false;
    REQUIRE(c.handshake(fxs::Role::fetch, "s", &welcomed));
    REQUIRE(welcomed);
    c.send_frame(sd::make_frame(sd::FrameKind::fetch, std::numeric_limits<int64_t>::min(), 1000));
    auto reply = c.recv_frame();
    REQUIRE(reply);
    CHECK_THAT(reply->second, Catch::Contains("a fetch for versions newer than"));
  }
  fxs::SynchronizerClient trainer("127.0.0.1", port, {.secret = "s"});
  trainer.publish(10, weights_of(10));
  {
    fxs::SynchronizerClient rogue("127.0.0.1", port, {.secret = "s"});
    CHECK_THROWS_WITH(rogue.publish(int64_t{1} << 62, weights_of(1)),
                      Catch::Contains("more than max_version_jump (1000) above the latest, 10"));
  }
  CHECK(server.latest_version() == 10);

  // A publisher begins version 11, sends one bucket of two, and stalls.
  RawConnection stalled(port);
  bool welcomed = false;
  REQUIRE(stalled.handshake(fxs::Role::publish, "s", &welcomed));
  REQUIRE(welcomed);
  std::vector<sd::FrameHeader> unused;
  const auto buckets = fxs::pack_buckets(weights_of(11), 64 << 10, 11);
  REQUIRE(buckets.size() >= 2);
  stalled.send_frame(sd::make_frame(sd::FrameKind::publish_begin, 11, buckets.size()));
  stalled.send_frame(sd::make_frame(sd::FrameKind::bucket, 11, 0, buckets[0].const_data_ptr(), buckets[0].nbytes()),
                     std::string(static_cast<const char*>(buckets[0].const_data_ptr()), buckets[0].nbytes()));
  // Readers are served the latest complete version meanwhile...
  fxs::SynchronizerClient reader("127.0.0.1", port, {.secret = "s"});
  CHECK(bit_equal(reader.fetch_newer(fxs::no_version, 1s), weights_of(10)));
  // ...and the real trainer's next publish supersedes the stalled one.
  trainer.publish(11, weights_of(11));
  CHECK(bit_equal(reader.fetch_newer(10, 5s), weights_of(11)));
  CHECK(stalled.closed_by_server());
}

TEST_CASE("security: fuzzed frames from many connections never end the server, and an honest reader gets every version "
          "bit-exact", "[security]") {
  fxs::SynchronizerServer server({.publish_secret = "trainer-only",
                                   .fetch_secret = "readers",
                                   .max_bucket_bytes = 1 << 20,
                                   .max_version_bytes = 16 << 20,
                                   .max_connections = 256,
                                   .handshake_timeout = 1000ms,
                                   .idle_timeout = 3000ms,
                                   .io_timeout = 1000ms});
  const auto port = server.port();
  constexpr int64_t versions = 40;
  std::atomic<int64_t> fetched{fxs::no_version};
  std::atomic<bool> reader_ok{true}, stop_fuzz{false};
  std::string reader_error;

  // Warm up (allocator pools, one version in memory) before taking the baseline.
  {
    fxs::SynchronizerClient warm("127.0.0.1", port, {.bucket_bytes = 64 << 10, .secret = "trainer-only"});
    warm.publish(0, weights_of(0));
  }
  const int64_t rss_before = rss_bytes();

  std::atomic<int64_t> frames_sent{0}, connections_made{0};
  const auto fuzz = [&](unsigned seed) {
    std::mt19937_64 rng(seed);
    const auto pick = [&](uint64_t n) { return static_cast<uint64_t>(rng() % n); };
    while (!stop_fuzz) {
      RawConnection c(port, 500ms);
      if (!c.ok()) continue;
      ++connections_made;
      const uint64_t attack = pick(10);
      if (attack >= 6) {  // authenticated as a reader, then lying
        bool welcomed = false;
        if (!c.handshake(fxs::Role::fetch, "readers", &welcomed) || !welcomed) continue;
      } else {
        if (!c.recv_frame()) continue;  // the hello
      }
      for (int k = 0; k < 8 && !stop_fuzz; ++k) {
        sd::FrameHeader h = sd::make_frame(static_cast<sd::FrameKind>(1 + pick(12)), static_cast<int64_t>(rng()), rng());
        std::string payload;
        switch (attack % 6) {
          case 0: {  // random bytes
            payload.resize(pick(200));
            for (auto& ch : payload) ch = static_cast<char>(rng());
            c.send_bytes(payload.data(), payload.size());
            ++frames_sent;
            continue;
          }
          case 1: h.length = uint64_t{1} << (20 + pick(44)); break;  // oversized, payload never sent
          case 2: {  // truncated header
            c.send_bytes(&h, pick(sizeof(h)));
            ++frames_sent;
            k = 8;
            continue;
          }
          case 3: {  // a bucket whose entry count lies, with a valid checksum
            payload = bucket_with_entry_count(0xffffffffu, h.version);
            h = sd::make_frame(sd::FrameKind::bucket, h.version, 0, payload.data(), payload.size());
            break;
          }
          case 4: {  // a well-formed frame of a random kind with a payload and a wrong checksum
            payload.assign(pick(100) + 1, 'x');
            h.length = payload.size();
            h.checksum = rng() & 0xffffffffu;
            break;
          }
          default: {  // a handshake with a wrong MAC, or a publish without the publish secret
            sd::Nonce zero{};
            payload = RawConnection::auth_payload(fxs::Role::publish, "guess", zero);
            h = sd::make_frame(sd::FrameKind::auth, fxs::no_version, 1 + pick(3), payload.data(), payload.size());
            break;
          }
        }
        const bool sent = c.send_frame(h, payload);
        ++frames_sent;
        if (!sent) break;
      }
    }
  };

  std::thread trainer([&] {
    try {
      fxs::SynchronizerClient t("127.0.0.1", port, {.bucket_bytes = 64 << 10, .secret = "trainer-only"});
      for (int64_t v = 1; v <= versions && reader_ok; ++v) {
        t.publish(v, weights_of(v));
        const auto until = std::chrono::steady_clock::now() + 30s;
        while (fetched < v && reader_ok && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(2ms);
      }
    } catch (const std::exception& e) {
      reader_error = std::string("trainer: ") + e.what();
      reader_ok = false;
    }
  });
  std::vector<std::thread> fuzzers;
  for (unsigned s = 0; s < 3; ++s) fuzzers.emplace_back(fuzz, 1234 + s);

  const auto started = std::chrono::steady_clock::now();
  try {
    fxs::SynchronizerClient r("127.0.0.1", port, {.io_timeout = 10000ms, .secret = "readers"});
    int64_t have = 0;
    while (have < versions) {
      const auto s = r.fetch_newer(have, 20s);
      if (s.version != have + 1 || !bit_equal(s, weights_of(s.version))) {
        reader_error = fsdpx::detail::str("version ", s.version, " after ", have, " or its bytes differ");
        reader_ok = false;
        break;
      }
      have = s.version;
      fetched = have;
      // Keep the attack going until it has sent its frames, within a bound.
      if (have == versions - 1) {
        while (frames_sent < 30000 && std::chrono::steady_clock::now() - started < 60s) std::this_thread::sleep_for(10ms);
      }
    }
  } catch (const std::exception& e) {
    reader_error = e.what();
    reader_ok = false;
  }
  trainer.join();
  stop_fuzz = true;
  for (auto& f : fuzzers) f.join();
  const int64_t rss_after = rss_bytes();
  const auto stats = server.stats();
  INFO("frames sent: " << frames_sent << " over " << connections_made << " connections; reader: " << reader_error
                       << "; RSS " << rss_before / 1e6 << " MB -> " << rss_after / 1e6 << " MB; failed_auth "
                       << stats.failed_auth << ", protocol_errors " << stats.protocol_errors << ", timed_out "
                       << stats.timed_out << ", handler_errors " << stats.handler_errors);
  CHECK(reader_ok);
  CHECK(fetched == versions);
  CHECK(frames_sent >= 30000);
  CHECK(stats.failed_auth > 100);
  CHECK(stats.protocol_errors > 100);
  CHECK(rss_after - rss_before < (int64_t{256} << 20));  // the versions are < 1 MB; no frame was allocated
  // Still serving.
  fxs::SynchronizerClient after("127.0.0.1", port, {.secret = "readers"});
  CHECK(after.fetch_newer(versions - 1, 1s).version == versions);
}

TEST_CASE("security: idle and half-open connections are closed, and the connection cap holds", "[security]") {
  fxs::SynchronizerServer server({.max_connections = 8, .handshake_timeout = 500ms, .idle_timeout = 800ms});
  const auto port = server.port();
  server.publish(1, weights_of(1));
  std::vector<RawConnection> silent;
  for (int i = 0; i < 20; ++i) silent.emplace_back(port);
  std::this_thread::sleep_for(200ms);
  auto stats = server.stats();
  CHECK(stats.live <= 8);
  CHECK(stats.refused_over_limit >= 12);
  // The silent ones are closed at the handshake deadline; then an honest reader is served.
  const auto start = std::chrono::steady_clock::now();
  for (auto& c : silent) {
    if (c.recv_frame()) CHECK(c.closed_by_server());  // the hello, then the close
  }
  CHECK(std::chrono::steady_clock::now() - start < 5s);
  fxs::SynchronizerClient reader("127.0.0.1", port);
  CHECK(reader.fetch_newer(fxs::no_version, 1s).version == 1);
  // An authenticated connection idle beyond idle_timeout is closed; the client reconnects on its own.
  std::this_thread::sleep_for(1500ms);
  server.publish(2, weights_of(2));
  CHECK(reader.fetch_newer(1, 1s).version == 2);
  CHECK(server.stats().timed_out >= 9);
}

TEST_CASE("security: the server's deadlines never pass for a lost trainer, and clients outlive them", "[security]") {
  fxs::SynchronizerServer server({.handshake_timeout = 300ms, .idle_timeout = 600ms});
  const auto port = server.port();
  // Constructed long before its first use: the server closed the connection at its handshake deadline.
  fxs::SynchronizerClient trainer("127.0.0.1", port);
  std::this_thread::sleep_for(700ms);
  trainer.publish(1, weights_of(1));
  // The trainer then stays quiet beyond idle_timeout: the server closes its connection, which is no
  // sign that it is gone. A waiting reader keeps waiting, and gets the next version.
  fxs::SynchronizerClient reader("127.0.0.1", port);
  CHECK(reader.fetch_newer(fxs::no_version, 1s).version == 1);
  std::thread later([&] {
    std::this_thread::sleep_for(1200ms);
    trainer.publish(2, weights_of(2));
  });
  const auto s = reader.fetch_newer(1, 5s);
  later.join();
  CHECK(s.version == 2);
  CHECK(bit_equal(s, weights_of(2)));
}

TEST_CASE("security: out of file descriptors, the server pauses accepting instead of spinning", "[security]") {
  fxs::SynchronizerServer server({.handshake_timeout = 3000ms});
  const auto port = server.port();
  server.publish(1, weights_of(1));
  rlimit saved{};
  REQUIRE(::getrlimit(RLIMIT_NOFILE, &saved) == 0);
  int open_now = 0;
  for (int fd = 0; fd < 65536 && fd < static_cast<int>(saved.rlim_cur); ++fd) open_now += ::fcntl(fd, F_GETFD) != -1;
  // This process may open nothing more: the server's accepts fail (EMFILE) while connections wait.
  rlimit none = saved;
  none.rlim_cur = static_cast<rlim_t>(open_now);
  REQUIRE(::setrlimit(RLIMIT_NOFILE, &none) == 0);
  // The connections come from a child process (system calls only after the fork: this process has
  // threads). The child inherits the lowered limit and every descriptor, so it raises its own limit
  // back first; without that its sockets fail and the server never sees a connection to refuse.
  const pid_t child = ::fork();
  if (child == 0) {
    if (::setrlimit(RLIMIT_NOFILE, &saved) != 0) ::_exit(3);
    for (int i = 0; i < 30; ++i) {
      const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_port = htons(port);
      addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      if (fd >= 0) ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    }
    ::sleep(30);
    ::_exit(0);
  }
  REQUIRE(child > 0);
  // Measure only once the server has met the full table, however slowly a loaded machine forks.
  const auto met_emfile_by = std::chrono::steady_clock::now() + 10s;
  while (server.stats().accept_errors == 0 && std::chrono::steady_clock::now() < met_emfile_by)
    std::this_thread::sleep_for(20ms);
  std::this_thread::sleep_for(100ms);
  rusage before{}, after{};
  ::getrusage(RUSAGE_SELF, &before);
  std::this_thread::sleep_for(1000ms);
  ::getrusage(RUSAGE_SELF, &after);
  const auto cpu_us = [](const rusage& r) {
    return (r.ru_utime.tv_sec + r.ru_stime.tv_sec) * 1000000LL + r.ru_utime.tv_usec + r.ru_stime.tv_usec;
  };
  const double cpu_seconds = static_cast<double>(cpu_us(after) - cpu_us(before)) / 1e6;
  const auto stats = server.stats();
  REQUIRE(::setrlimit(RLIMIT_NOFILE, &saved) == 0);
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  INFO("CPU over 1 s out of descriptors: " << cpu_seconds << " s");
  CHECK(stats.accept_errors > 0);
  CHECK(cpu_seconds < 0.5);  // a spinning accept loop takes a whole core
  fxs::SynchronizerClient reader("127.0.0.1", port, {.connect_timeout = 10000ms});
  CHECK(reader.fetch_newer(fxs::no_version, 5s).version == 1);
}

namespace {

/// A self-signed certificate for 127.0.0.1 and its key, made with the openssl command (tools/setup.sh
/// installs it), in a fresh directory; returns {certificate, key}.
std::pair<std::string, std::string> self_signed_certificate(const std::string& name) {
  const std::string dir = "/tmp/fsdpx_tls_" + name + "_" + std::to_string(::getpid());
  const std::string cert = dir + "/cert.pem", key = dir + "/key.pem";
  const std::string cmd = "mkdir -p " + dir + " && openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 "
                          "-subj /CN=fsdpx-test -addext subjectAltName=IP:127.0.0.1 -keyout " + key + " -out " + cert +
                          " >/dev/null 2>&1";
  REQUIRE(std::system(cmd.c_str()) == 0);
  return {cert, key};
}

}  // namespace

TEST_CASE("security: TLS: versions travel encrypted, the server's certificate is verified, and plain peers are refused",
          "[security]") {
  const auto [cert, key] = self_signed_certificate("server");
  const auto [other_cert, other_key] = self_signed_certificate("other");
  fxs::SynchronizerServer server({.secret = "s", .tls_certificate_file = cert, .tls_private_key_file = key,
                                  .handshake_timeout = 1500ms});
  const auto port = server.port();
  const fxs::ClientOptions tls{.secret = "s", .tls = true, .tls_ca_file = cert};
  fxs::SynchronizerClient trainer("127.0.0.1", port, tls);
  trainer.publish(1, weights_of(1));
  fxs::SynchronizerClient reader("127.0.0.1", port, tls);
  CHECK(bit_equal(reader.fetch_newer(fxs::no_version, 5s), weights_of(1)));
  trainer.publish(2, weights_of(2));
  CHECK(bit_equal(reader.fetch_newer(1, 5s), weights_of(2)));

  // On the wire: no frame magic and no weight bytes in the clear (a raw TLS ClientHello gets a TLS answer).
  {
    RawConnection raw(port, 2000ms);
    REQUIRE(raw.ok());
    CHECK_FALSE(raw.recv_frame().has_value());  // the server waits for a TLS hello, then gives up
    CHECK(raw.closed_by_server());
  }
  // A certificate signed by someone else: the client refuses the server.
  fxs::ClientOptions wrong_ca = tls;
  wrong_ca.tls_ca_file = other_cert;
  CHECK_THROWS_WITH(fxs::SynchronizerClient("127.0.0.1", port, wrong_ca),
                    Catch::Contains("TLS handshake with the synchronizer at 127.0.0.1:") &&
                        Catch::Contains("certificate verify failed"));
  // The right certificate under another name.
  fxs::ClientOptions wrong_name = tls;
  wrong_name.tls_server_name = "rollout.example.com";
  CHECK_THROWS_WITH(fxs::SynchronizerClient("127.0.0.1", port, wrong_name), Catch::Contains("certificate verify failed"));
  // A plain client never gets the server's hello; a TLS client to a plain server is told what is wrong.
  fxs::ClientOptions plain{.connect_timeout = 2000ms, .io_timeout = 3000ms, .secret = "s"};
  CHECK_THROWS_AS(fxs::SynchronizerClient("127.0.0.1", port, plain).fetch_newer(fxs::no_version, 1s), fsdpx::SyncError);
  fxs::SynchronizerServer plain_server({.secret = "s"});
  CHECK_THROWS_WITH(fxs::SynchronizerClient("127.0.0.1", plain_server.port(), tls),
                    Catch::Contains("TLS handshake") && Catch::Contains("does not speak TLS"));
  CHECK(server.stats().failed_auth >= 2);  // the refused certificate and name: the clients abort the handshake
  CHECK(server.stats().timed_out >= 2);    // the raw and the plain connections never started TLS
  // Misconfiguration is named.
  CHECK_THROWS_WITH(fxs::SynchronizerServer({.tls_certificate_file = cert}), Catch::Contains("needs both"));
  CHECK_THROWS_WITH(fxs::SynchronizerServer({.tls_certificate_file = cert, .tls_private_key_file = "/nonexistent/key.pem"}),
                    Catch::Contains("the TLS private key '/nonexistent/key.pem' cannot be used"));
  CHECK(bit_equal(reader.fetch_newer(fxs::no_version, 5s), weights_of(2)));  // the honest ones were served throughout
}
