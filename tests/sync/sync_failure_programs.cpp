// Weight sync must fail clearly, never hang, when the trainer goes away. CTest checks the output.
//   trainer_exits   (mpiexec -n 3: 2 trainers, 1 rollout) after one version the trainers leave; the
//                   rollout's next receive ends at once (not at its timeout) in a SyncError naming the
//                   update group and the trainer rank that left
//   killed_trainer  (no mpiexec) a forked trainer process publishes to this process's synchronizer
//                   server, then is SIGKILLed in the middle of the next version; the waiting reader
//                   is told at once
//   killed_server   (no mpiexec) the synchronizer server lives in a forked trainer process that is
//                   SIGKILLed; the reader's fetch ends in a SyncError naming the server
//   hostile_broadcast (mpiexec -n 2: a raw sender, 1 rollout) the broadcast's own frames, crafted: a
//                   wrong announcement, a corrupt one, a version announced then aborted, an oversized manifest,
//                   a streamed version whose manifest disagrees with its data, a cut delta writing out
//                   of its tensor, a delta from a base the receiver does not hold: each a SyncError
//                   naming the cause, the receiver's weights intact, and the group still in step
//                   (the last, honest version arrives exactly)
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <thread>

#include <ATen/ATen.h>

#include <fsdpx/fsdp.hpp>
#include <fsdpx/sync.hpp>
#if defined(FSDPX_WITH_SYNC_SERVICE)
#include <fsdpx/sync/service.hpp>
#endif

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

/// What WeightBroadcaster sends after a version's announcement, by hand: the preamble, the header sizes
/// and each bucket of `tensors` (its header, then its payload in one broadcast per run).
void send_buckets(dist::AnyCommunicator& g, int64_t version, const std::vector<NamedTensor>& tensors) {
  std::vector<sync::detail::TensorSpec> specs;
  for (const auto& t : tensors) specs.push_back({t.name, t.tensor.sizes().vec(), t.tensor.scalar_type()});
  const auto plan = sync::detail::plan_buckets(specs, 64 << 10, version);
  constexpr int64_t staged = std::numeric_limits<int64_t>::max();
  int64_t largest = 0, largest_header = 0;
  std::vector<int64_t> header_sizes;
  for (const auto& b : plan) {
    header_sizes.push_back(b.header_bytes);
    largest = std::max(largest, b.total_bytes);
    largest_header = std::max(largest_header, b.header_bytes);
  }
  g.broadcast(at::tensor({sync::detail::preamble_magic, version, static_cast<int64_t>(plan.size()), largest_header,
                          staged, largest},
                         at::kLong),
              0);
  g.broadcast(at::tensor(header_sizes, at::kLong), 0);
  for (const auto& b : plan) {
    auto bucket = at::zeros({b.total_bytes}, at::kByte);
    sync::detail::write_header(bucket, b);
    for (const auto& e : b.entries) {
      for (const auto& t : tensors) {
        if (t.name == e.name && e.numel > 0) sync::detail::pack_entry(bucket, e, t.tensor);
      }
    }
    g.broadcast(bucket.narrow(0, 0, b.header_bytes), 0);
    for (const auto& sg : sync::detail::segments_of(b, staged))
      g.broadcast(bucket.narrow(0, sg.begin, sg.end - sg.begin), 0);
  }
}

int hostile_broadcast() {
  dist::AnyCommunicator world(dist::MpiCommunicator::world());
  auto groups = split_trainer_rollout(world, 1);
  auto& g = *groups.model_update;
  constexpr int64_t streamed = sync::detail::Announcement::streamed, cut = sync::detail::Announcement::cut;
  const std::vector<NamedTensor> v1 = weights(1);
  std::vector<NamedTensor> v2 = {{"a.weight", v1[0].tensor.clone()}, {"b.weight", v1[1].tensor.clone()}};
  v2[0].tensor[3][5] = 2.5;  // one element of one tensor: sparse deltas
  std::vector<NamedTensor> v3 = {{"a.weight", v2[0].tensor.clone()}, {"b.weight", v2[1].tensor.clone()}};
  v3[1].tensor[0][0] = 9.0;

  if (groups.is_trainer()) {
    const auto announce = [&](int64_t version, int64_t kind, int64_t base, int64_t digest, int64_t flags) {
      g.broadcast(
          at::tensor(std::vector<int64_t>{sync::detail::announce_magic, version, kind, base, digest, flags}, at::kLong),
          0);
    };
    const auto vote = [&] {
      auto hold = at::ones({1}, at::kLong);
      g.all_reduce(hold, dist::ReduceOp::min);
      return hold.item<int64_t>();
    };
    const auto send_manifest = [&](int64_t size, const at::Tensor& bytes) {
      g.broadcast(at::tensor(std::vector<int64_t>{size}, at::kLong), 0);
      if (bytes.defined()) g.broadcast(bytes, 0);
    };
    g.broadcast(at::tensor(std::vector<int64_t>{0x1234, 1, streamed, no_version, 0, 1}, at::kLong),
                0);                           // not an announcement
    announce(1, 7, no_version, 0, 1);         // a kind that is none
    announce(5, streamed, no_version, 0, 1);  // an honest streamed version
    send_buckets(g, 5, v1);
    send_manifest(full_manifest(5, v1).encode().numel(), full_manifest(5, v1).encode());
    announce(4, streamed, no_version, 0, 1);  // lower: a restarted trainer's broadcaster, taken
    send_buckets(g, 4, v2);
    send_manifest(full_manifest(4, v2).encode().numel(), full_manifest(4, v2).encode());
    announce(5, cut, no_version, 0, 0);  // announced, then the sender fails: an aborted preamble
    g.broadcast(
        at::tensor(std::vector<int64_t>{sync::detail::preamble_magic, 5, sync::detail::aborted_version, 0, 1, 0},
                   at::kLong),
        0);
    announce(6, streamed, no_version, 0, 1);  // a manifest of 1 TiB
    send_buckets(g, 6, v1);
    send_manifest(int64_t{1} << 40, at::Tensor());
    Manifest lying = full_manifest(7, v1);  // a streamed version whose manifest disagrees with a tensor
    lying.entries[0].crc ^= 1u;
    lying.digest = lying.compute_digest();
    announce(7, streamed, no_version, 0, 1);
    send_buckets(g, 7, v1);
    send_manifest(lying.encode().numel(), lying.encode());

    sync::detail::VersionStore store;  // cut versions: 8 whole, then a delta from it that writes outside its tensor
    sync::detail::EncodedVersion e8 = store.cut(8, v1);
    announce(8, cut, no_version, 0, 0);
    send_buckets(g, 8, e8.tensors);
    store.commit(std::move(e8));
    sync::detail::EncodedVersion d9 = store.cut(9, v2);
    for (auto& t : d9.tensors) {
      if (t.name == "a.weight") {
        const uint32_t outside = 1u << 30;
        std::memcpy(t.tensor.data_ptr(), &outside, sizeof(outside));
      }
    }
    announce(9, cut, 8, int64_t{store.digest()}, 0);
    if (vote() != 1 || !d9.manifest.is_delta()) return 10;
    send_buckets(g, 9, d9.tensors);
    announce(10, cut, 8, int64_t{store.digest()}, 0);  // the receiver dropped version 8 when 9 failed
    if (vote() != 0) return 11;
    store.clear();
    sync::detail::EncodedVersion e10 = store.cut(10, v2);
    send_buckets(g, 10, e10.tensors);
    store.commit(std::move(e10));
    announce(11, cut, 10, int64_t{store.digest()}, 0);  // an honest delta
    if (vote() != 1) return 12;
    sync::detail::EncodedVersion d11 = store.cut(11, v3);
    if (!d11.manifest.is_delta()) return 13;
    send_buckets(g, 11, d11.tensors);
    store.commit(std::move(d11));
    sync::detail::VersionStore other;  // a delta cut from a version the receiver never held, announced as from 11
    other.commit(other.cut(3, v1));
    announce(12, cut, 11, int64_t{store.digest()}, 0);
    if (vote() != 1) return 14;
    send_buckets(g, 12, other.cut(12, v3).tensors);
    announce(13, cut, 11, int64_t{store.digest()}, 0);  // whole again, and exact
    if (vote() != 0) return 15;
    store.clear();
    send_buckets(g, 13, store.cut(13, v3).tensors);
    Manifest lying14 = full_manifest(14, v1);  // streamed into a module: it fails after the module changed
    lying14.entries[1].crc ^= 1u;
    lying14.digest = lying14.compute_digest();
    announce(14, streamed, no_version, 0, 1);
    send_buckets(g, 14, v1);
    send_manifest(lying14.encode().numel(), lying14.encode());
    announce(15, streamed, no_version, 0, 1);  // the next, honest version repairs it
    send_buckets(g, 15, v2);
    send_manifest(full_manifest(15, v2).encode().numel(), full_manifest(15, v2).encode());
    world.barrier();
    return 0;
  }

  WeightReceiver receiver(g);
  int rc = 0;
  const auto expect = [&](std::initializer_list<std::string_view> needles) {
    if (rc == 0) rc = expect_error<SyncError>([&] { receiver.receive(); }, needles);
  };
  const auto expect_exact = [&](int64_t version, const std::vector<NamedTensor>& want, bool delta) {
    const WeightVersion s = receiver.receive();
    bool ok =
        s.version == version && s.tensors.size() == want.size() && s.manifest && receiver.last_was_delta() == delta;
    for (size_t i = 0; ok && i < want.size(); ++i)
      ok = s.tensors[i].name == want[i].name && at::equal(s.tensors[i].tensor, want[i].tensor);
    if (!ok && rc == 0) {
      std::fprintf(stderr, "WRONG-VERSION: version %lld is not what was sent\n", static_cast<long long>(version));
      rc = 20;
    }
  };
  expect({"is not a weight-sync announcement"});
  expect({"corrupt weight-sync announcement of version 1: kind 7"});
  expect_exact(5, v1, false);
  expect_exact(4, v2, false);
  expect({"the trainer could not send version 5", "nothing was received"});
  expect({"the manifest of version 6", "would take 1099511627776 bytes"});
  expect({"version 7 from the trainer over 'model_update' did not arrive intact",
          "'a.weight' does not match its checksum"});
  expect_exact(8, v1, false);
  expect({"tensor 'a.weight' (sparse): index 1073741824 lies outside its 262144 elements"});
  expect_exact(10, v2, false);
  expect_exact(11, v3, true);
  expect({"it is a delta from version 3", "this receiver holds version 11"});
  expect_exact(13, v3, false);
  // A streamed version into a module that fails its check: the error says the module holds parts of two
  // versions, and last_version() no longer claims one; the next version repairs both.
  torch::nn::Module module;
  for (const char* name : {"a", "b"}) {
    auto layer = std::make_shared<torch::nn::Module>();
    layer->register_parameter("weight", at::zeros({512, 512}), /*requires_grad=*/false);
    module.register_module(name, layer);
  }
  if (rc == 0) {
    rc = expect_error<SyncError>([&] { receiver.receive_into(module); },
                                 {"version 14 from the trainer over 'model_update' did not arrive intact",
                                  "'b.weight' does not match its checksum", "parts of it and of version 13",
                                  "no whole version until the next one arrives"});
  }
  if (rc == 0 && receiver.last_version() != no_version) rc = 21;
  if (rc == 0 && (receiver.receive_into(module) != 15 || receiver.last_version() != 15 ||
                  !at::equal(module.named_parameters()["a.weight"], v2[0].tensor) ||
                  !at::equal(module.named_parameters()["b.weight"], v2[1].tensor)))
    rc = 22;
  world.barrier();
  if (rc == 0) std::printf("HOSTILE-BROADCAST-REFUSED: every crafted frame was refused naming its cause\n");
  return rc;
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
    const auto buckets = sync::detail::pack_buckets(weights(2), 64 << 10, 2);
    namespace asio = boost::asio;
    asio::io_context io;
    asio::ip::tcp::socket sock(io);
    sock.connect({asio::ip::make_address("127.0.0.1"), port});
    test::handshake_without_secret(sock, sync::Role::publish);
    // The trainer's own run (this process's, as its client sent with version 1): its loss is the trainer's.
    const std::string& run = sync::detail::process_run();
    const auto begin =
        sync::detail::make_frame(sync::detail::FrameKind::publish_begin, 2, buckets.size(), run.data(), run.size());
    asio::write(sock, asio::buffer(&begin, sizeof(begin)));
    asio::write(sock, asio::buffer(run));
    for (int k = 0; k < 3; ++k) {
      const auto f = sync::detail::make_frame(sync::detail::FrameKind::bucket, 2, k, buckets[k].const_data_ptr(),
                                              buckets[k].nbytes());
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
  if (mode == "hostile_broadcast") return hostile_broadcast();
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
    const WeightVersion first = reader.fetch_newer(no_version, 20s);
    if (first.version != 1) return 5;
    const auto t0 = std::chrono::steady_clock::now();
    const int rc =
        expect_error<SyncError>([&] { reader.fetch_newer(1, 60s); },
                                {"disconnected in the middle of version 2 (3 of", "partial version was discarded"});
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
    const int rc = expect_error<SyncError>([&] { reader.fetch_newer(1, 60s); }, {"synchronizer at 127.0.0.1:"});
    waitpid(child, nullptr, 0);
    return rc;
  }
  std::fprintf(stderr, "unknown mode '%s'\n", mode.c_str());
  return 1;
}
