// libFuzzer harness: weight sync's readers of a peer's bytes. The first byte picks the reader, the rest is
// what the peer sent:
//   0  a bucket's header (decode_header), as a rollout checks a bucket from the server or a broadcast;
//   1  a version's manifest (Manifest::decode), as a rollout checks a version;
//   2  a connection's bytes to the synchronizer server (frames: the handshake, publish, bucket, publish end,
//      fetch), sent to a server in this process on loopback with no secret, so that frames after the
//      handshake are reached; the server must answer or close, never end or wedge (checked: every input's
//      connection ends, and every 256 inputs an honest fetch is served);
//   3  the server's bytes to a client (hello, welcome, error, snapshot frames), from a fake server in this
//      process, to a client fetching a version.
// Each must end in its value or an fsdpx::Error (a SyncError).
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <fsdpx/sync/manifest.hpp>
#include <fsdpx/sync/service.hpp>

namespace {

using namespace std::chrono_literals;

void send_all(int fd, const uint8_t* data, size_t size) {
  while (size > 0) {
    const ssize_t n = ::send(fd, data, size, MSG_NOSIGNAL);
    if (n <= 0) return;  // the peer closed: what it read was enough for it to refuse
    data += n;
    size -= static_cast<size_t>(n);
  }
}

int connect_loopback(uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(fd);
    return -1;
  }
  timeval t{2, 0};  // the server answers or closes well within its handshake timeout
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &t, sizeof(t));
  return fd;
}

/// The server under test: one version published in-process, limits small enough that a frame's claim
/// costs little, a short handshake timeout.
fsdpx::sync::SynchronizerServer& server() {
  static fsdpx::sync::SynchronizerServer s([] {
    fsdpx::sync::ServerOptions o;
    o.limits.max_bucket_bytes = 1 << 20;
    o.limits.max_version_bytes = 8 << 20;
    o.limits.handshake_timeout = 1000ms;
    o.limits.io_timeout = 1000ms;
    o.limits.idle_timeout = 1000ms;
    return o;
  }());
  static const bool published = [] {
    s.publish(1, {{"w", at::arange(12, at::kFloat).reshape({3, 4})}, {"b", at::ones({5}, at::kBFloat16)}});
    return true;
  }();
  (void)published;
  return s;
}

void to_server(const uint8_t* data, size_t size) {
  auto& s = server();
  const int fd = connect_loopback(s.port());
  if (fd < 0) __builtin_trap();  // the server stopped accepting
  send_all(fd, data, size);
  ::shutdown(fd, SHUT_WR);
  uint8_t sink[4096];
  // Until the server closes: it must, having nothing more to read (or the 2 s receive timeout fails it).
  for (;;) {
    const ssize_t n = ::recv(fd, sink, sizeof(sink), 0);
    if (n == 0) break;
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) __builtin_trap();  // the server wedged on this input
      break;                                                          // reset: a refusal
    }
  }
  ::close(fd);
  static int inputs = 0;
  if (++inputs % 256 == 0) {
    try {
      fsdpx::sync::ClientOptions o;
      o.connect_timeout = 3000ms;
      fsdpx::sync::SynchronizerClient honest("127.0.0.1", s.port(), o);
      // An input may have published a version of a run of its own (no secret here): any version will do.
      if (honest.fetch_newer(fsdpx::sync::no_version, 3000ms).version < 0) __builtin_trap();
    } catch (...) {
      __builtin_trap();  // an earlier input left the server unable to serve
    }
  }
}

/// A fake server: each connection gets the current input's bytes, then the close.
class FakeServer {
 public:
  FakeServer() {
    listener_ = ::socket(AF_INET, SOCK_STREAM, 0);
    const int one = 1;
    ::setsockopt(listener_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::bind(listener_, reinterpret_cast<const sockaddr*>(&a), sizeof(a)) != 0 || ::listen(listener_, 16) != 0)
      __builtin_trap();
    socklen_t len = sizeof(a);
    ::getsockname(listener_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    std::thread([this] {
      for (;;) {
        const int c = ::accept(listener_, nullptr, nullptr);
        if (c < 0) continue;
        std::vector<uint8_t> bytes;
        {
          std::lock_guard lock(mutex_);
          bytes = answer_;
        }
        send_all(c, bytes.data(), bytes.size());
        ::shutdown(c, SHUT_WR);
        uint8_t sink[4096];
        timeval t{0, 200000};
        ::setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &t, sizeof(t));
        while (::recv(c, sink, sizeof(sink), 0) > 0) {
        }
        ::close(c);
      }
    }).detach();
  }
  void answer_with(const uint8_t* data, size_t size) {
    std::lock_guard lock(mutex_);
    answer_.assign(data, data + size);
  }
  uint16_t port() const { return port_; }

 private:
  int listener_ = -1;
  uint16_t port_ = 0;
  std::mutex mutex_;
  std::vector<uint8_t> answer_;
};

void to_client(const uint8_t* data, size_t size) {
  static FakeServer fake;
  fake.answer_with(data, size);
  fsdpx::sync::ClientOptions o;
  o.connect_timeout = 50ms;  // a client asks again when closed in its handshake: not for long here
  o.io_timeout = 500ms;
  o.max_bucket_bytes = 1 << 20;
  o.max_version_bytes = 8 << 20;
  try {
    fsdpx::sync::SynchronizerClient client("127.0.0.1", fake.port(), o);
    (void)client.fetch_newer(fsdpx::sync::no_version, 100ms);
  } catch (const fsdpx::Error&) {  // a refusal, naming the cause
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t reader = data[0] % 4;
  ++data;
  --size;
  try {
    switch (reader) {
      case 0: (void)fsdpx::sync::detail::decode_header(data, static_cast<int64_t>(size), "fuzz"); break;
      case 1: {
        const at::Tensor bytes = at::from_blob(const_cast<uint8_t*>(data), {static_cast<int64_t>(size)}, at::kByte);
        (void)fsdpx::sync::Manifest::decode(bytes, "fuzz");
        break;
      }
      case 2: to_server(data, size); break;
      default: to_client(data, size); break;
    }
  } catch (const fsdpx::Error&) {  // a refusal, naming the cause
  }
  return 0;
}
