// The synchronizer service under a long burst, as its processes: benchmarks/sync_soak.py runs a server,
// one publisher and readers that come and go, and samples every process's resident memory (issue 50:
// a long run's memory stays flat).
//
//   bench_sync_soak host                        a server on 127.0.0.1 with nothing published; prints
//                                               "PORT <port>"; serves until stdin closes
//   bench_sync_soak publish <port> <n> <MiB>    publishes versions 1..n of <MiB> of bfloat16 weights (16
//                                               tensors) back to back, each changing 1% of every tensor's
//                                               elements (what an RL step at a small learning rate does,
//                                               so most versions go as deltas); prints "PUBLISHED <v>"
//                                               every 50 versions
//   bench_sync_soak follow <port>               a reader that connects, fetches 1-4 newer versions,
//                                               leaves, pauses 0-200 ms and comes back, until no version
//                                               came for 5 s after the first; prints "FETCHED <count>
//                                               LAST <version>"
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include <fsdpx/sync/service.hpp>

namespace {

using namespace fsdpx::sync;

int host() {
  SynchronizerServer server;
  std::printf("PORT %u\n", server.port());
  std::fflush(stdout);
  std::string line;
  while (std::getline(std::cin, line)) {
  }
  return 0;
}

int publish(uint16_t port, int64_t versions, int64_t mib) {
  constexpr int tensors = 16;
  const int64_t per_tensor = (mib << 20) / tensors / 2;  // bfloat16 elements
  std::vector<NamedTensor> weights;
  for (int i = 0; i < tensors; ++i) {
    weights.push_back({"layers." + std::to_string(i) + ".weight", at::randn({per_tensor}).to(at::kBFloat16)});
  }
  SynchronizerClient publisher("127.0.0.1", port);
  const int64_t changed = std::max<int64_t>(1, per_tensor / 100);
  for (int64_t v = 1; v <= versions; ++v) {
    for (auto& w : weights) {  // a fresh tensor each version: the publisher keeps its own copy of the last
      at::Tensor next = w.tensor.clone();
      next.index_put_({at::randint(per_tensor, {changed})}, at::randn({changed}).to(at::kBFloat16));
      w.tensor = next;
    }
    publisher.publish(v, weights);
    if (v % 50 == 0) {
      std::printf("PUBLISHED %lld\n", static_cast<long long>(v));
      std::fflush(stdout);
    }
  }
  return 0;
}

int follow(uint16_t port) {
  std::mt19937 random(port ^ static_cast<unsigned>(::getpid()));
  int64_t fetched = 0, last = no_version;
  for (bool over = false; !over;) {
    SynchronizerClient reader("127.0.0.1", port);
    const int visits = std::uniform_int_distribution<int>(1, 4)(random);
    for (int i = 0; i < visits && !over; ++i) {
      try {
        last = reader.fetch_newer(last, std::chrono::seconds(last == no_version ? 60 : 5)).version;
        ++fetched;
      } catch (const fsdpx::SyncError& e) {  // no newer version within the wait: the burst is over
        if (std::string(e.what()).find("was published within") == std::string::npos) throw;
        over = true;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(std::uniform_int_distribution<int>(0, 200)(random)));
  }
  std::printf("FETCHED %lld LAST %lld\n", static_cast<long long>(fetched), static_cast<long long>(last));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  try {
    if (mode == "host" && argc == 2) return host();
    if (mode == "publish" && argc == 5)
      return publish(static_cast<uint16_t>(std::stoi(argv[2])), std::stoll(argv[3]), std::stoll(argv[4]));
    if (mode == "follow" && argc == 3) return follow(static_cast<uint16_t>(std::stoi(argv[2])));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_sync_soak: %s\n", e.what());
    return 1;
  }
  std::fprintf(stderr, "usage: %s host | publish <port> <versions> <MiB> | follow <port>\n", argv[0]);
  return 2;
}
