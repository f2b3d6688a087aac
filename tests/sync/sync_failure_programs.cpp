// Weight sync must fail clearly, never hang, when the trainer goes away. CTest checks the output.
//   trainer_exits   (mpiexec -n 3: 2 trainers, 1 rollout) after one version the trainers leave; the
//                   rollout's next receive ends at once (not at its timeout) in a SyncError naming the
//                   update group and the trainer rank that left
//   killed_trainer  (no mpiexec) a forked trainer process publishes to this process's synchronizer
//                   server, then is SIGKILLed in the middle of the next version; the waiting reader
//                   is told at once
//   killed_server   (no mpiexec) the synchronizer server lives in a forked trainer process that is
//                   SIGKILLed; the reader's fetch ends in a SyncError naming the server
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>

#include <ATen/ATen.h>

#include <fsdpx/fsdp.hpp>
#include <fsdpx/sync.hpp>

#include "../core/models.hpp"
#include "../support/expect.hpp"
#include "raw_handshake.hpp"

using namespace fsdpx;
using namespace fsdpx::sync;
using fsdpx::test::expect_error;
using namespace std::chrono_literals;

namespace {

std::vector<NamedTensor> weights(int64_t version) {
  return {{"a.weight", at::full({512, 512}, static_cast<double>(version))},
          {"b.weight", at::full({512, 512}, static_cast<double>(-version))}};
}

int trainer_exits() {
  dist::CommOptions options;
  options.timeout = std::chrono::milliseconds(600000);  // the trainers' departure must end it, not this
  dist::AnyCommunicator world(dist::MpiCommunicator::world(options));
  auto groups = split_trainer_rollout(world, 2);
  const test::GptConfig c{.vocab = 61, .seq = 16, .dim = 32, .heads = 4, .layers = 2};
  if (groups.is_trainer()) {
    at::manual_seed(1);
    test::Gpt model(c);
    Fsdp<test::Gpt, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<test::BlockImpl>> fsdp(
        model, *groups.trainer);
    WeightBroadcaster sender(fsdp, groups.model_update);
    sender.broadcast(1);
    std::printf("trainer rank %d leaving after version 1\n", world.rank());
    return 0;  // the rollout waits for version 2 in vain
  }
  test::Gpt rollout(c);
  WeightReceiver receiver(*groups.model_update);
  if (receiver.receive_into(*rollout) != 1) return 5;
  return expect_error<SyncError>([&] { receiver.receive_into(*rollout); },
                                 {"receiving weights from the trainer over 'model_update'", "last version 1",
                                  "may have exited or crashed", "world rank 0 left the job (its program ended)"});
}

// The child: a trainer process. Its exit status is irrelevant; it is killed.
[[noreturn]] void run_trainer_child(uint16_t port, bool host_server) {
  try {
    if (host_server) {
      SynchronizerServer server;
      std::printf("SERVER-PORT %u\n", server.port());
      std::fflush(stdout);
      server.publish(1, weights(1));
      std::this_thread::sleep_for(300ms);
      raise(SIGKILL);
    }
    SynchronizerClient trainer("127.0.0.1", port, {.bucket_bytes = 64 << 10});
    trainer.publish(1, weights(1));
    // This connection leaves cleanly, so the only loss the server sees is the one mid-version 2
    // (otherwise its end and that of the connection below race when the process is killed).
    trainer.close();
    std::this_thread::sleep_for(300ms);
    // Version 2: a few buckets, then death (no goodbye, no end frame).
    const auto buckets = pack_buckets(weights(2), 64 << 10, 2);
    namespace asio = boost::asio;
    asio::io_context io;
    asio::ip::tcp::socket sock(io);
    sock.connect({asio::ip::make_address("127.0.0.1"), port});
    test::handshake_without_secret(sock, sync::Role::publish);
    const auto begin = sync::detail::make_frame(sync::detail::FrameKind::publish_begin, 2, buckets.size());
    asio::write(sock, asio::buffer(&begin, sizeof(begin)));
    for (int k = 0; k < 3; ++k) {
      const auto f = sync::detail::make_frame(sync::detail::FrameKind::bucket, 2, k, buckets[k].const_data_ptr(), buckets[k].nbytes());
      asio::write(sock, asio::buffer(&f, sizeof(f)));
      asio::write(sock, asio::buffer(buckets[k].const_data_ptr(), buckets[k].nbytes()));
    }
    raise(SIGKILL);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "trainer child failed: %s\n", e.what());
  }
  _exit(1);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "trainer_exits") return trainer_exits();
  if (mode == "killed_trainer") {
    // Fork before any thread exists; the parent then starts the server and tells the child its port.
    int fds[2];
    if (pipe(fds) != 0) return 7;
    std::fflush(stdout);
    const pid_t child = fork();
    if (child == 0) {
      close(fds[1]);
      uint16_t port = 0;
      if (read(fds[0], &port, sizeof(port)) != static_cast<ssize_t>(sizeof(port))) _exit(1);
      run_trainer_child(port, /*host_server=*/false);
    }
    close(fds[0]);
    SynchronizerServer server;
    const uint16_t port = server.port();
    if (write(fds[1], &port, sizeof(port)) != static_cast<ssize_t>(sizeof(port))) return 7;
    SynchronizerClient reader("127.0.0.1", port);
    const WeightSnapshot first = reader.fetch_newer(no_version, 20s);
    if (first.version != 1) return 5;
    const auto t0 = std::chrono::steady_clock::now();
    const int rc = expect_error<SyncError>([&] { reader.fetch_newer(1, 60s); },
                                           {"disconnected in the middle of version 2 (3 of",
                                            "partial version was discarded"});
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // CTest fails the test on TOO-SLOW: the reader must be told when the trainer dies, not at its timeout.
    std::printf("%s: the reader was told after %.2f s (it would have waited 60 s)\n", waited < 10 ? "OK" : "TOO-SLOW",
                waited);
    waitpid(child, nullptr, 0);
    return rc != 0 ? rc : (waited < 10 ? 0 : 6);
  }
  if (mode == "killed_server") {
    int fds[2];
    if (pipe(fds) != 0) return 7;
    std::fflush(stdout);
    const pid_t child = fork();
    if (child == 0) {
      dup2(fds[1], STDOUT_FILENO);
      run_trainer_child(0, /*host_server=*/true);
    }
    close(fds[1]);
    char line[64] = {};
    FILE* in = fdopen(fds[0], "r");
    unsigned port = 0;
    if (!in || !std::fgets(line, sizeof(line), in) || std::sscanf(line, "SERVER-PORT %u", &port) != 1) return 8;
    SynchronizerClient reader("127.0.0.1", static_cast<uint16_t>(port));
    if (reader.fetch_newer(no_version, 20s).version != 1) return 5;
    const int rc = expect_error<SyncError>([&] { reader.fetch_newer(1, 60s); },
                                           {"synchronizer at 127.0.0.1:"});
    waitpid(child, nullptr, 0);
    return rc;
  }
  std::fprintf(stderr, "unknown mode '%s'\n", mode.c_str());
  return 1;
}
