// The synchronizer service's receive side, C++ client: the counterpart of benchmarks/sync_receive.py,
// which compares the Python receiver (python/fsdpx_sync) with it on the same server and version.
//
//   bench_sync_receive serve <MiB>             hosts a server on 127.0.0.1 with one bfloat16 version of
//                                              <MiB> (64 tensors); prints "PORT <port>"; serves until
//                                              stdin closes
//   bench_sync_receive fetch <port> <iters>    fetches that version <iters> times; prints "SECONDS <s>"
//                                              per fetch (CRC-32C of every frame checked, tensors built)
#include <chrono>
#include <cstdio>
#include <iostream>
#include <string>

#include <fsdpx/sync/service.hpp>

int main(int argc, char** argv) {
  using namespace fsdpx::sync;
  const std::string mode = argc > 1 ? argv[1] : "";
  try {
    if (mode == "serve" && argc == 3) {
      const int64_t mib = std::stoll(argv[2]);
      SynchronizerServer server({.bucket_bytes = int64_t{32} << 20});
      std::vector<NamedTensor> weights;
      const int64_t per_tensor = (mib << 20) / 64 / 2;  // bfloat16 elements
      for (int i = 0; i < 64; ++i) {
        weights.push_back({"layers." + std::to_string(i) + ".weight", at::randn({per_tensor}).to(at::kBFloat16)});
      }
      server.publish(1, weights);
      std::printf("PORT %u\n", server.port());
      std::fflush(stdout);
      std::string line;
      while (std::getline(std::cin, line)) {
      }
      return 0;
    }
    if (mode == "fetch" && argc == 4) {
      SynchronizerClient client("127.0.0.1", static_cast<uint16_t>(std::stoi(argv[2])));
      for (int i = 0; i < std::stoi(argv[3]); ++i) {
        const auto start = std::chrono::steady_clock::now();
        const WeightVersion s = client.fetch_newer(no_version, std::chrono::seconds(10));
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        std::printf("SECONDS %.6f BYTES %lld\n", seconds, static_cast<long long>(s.nbytes()));
      }
      return 0;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_sync_receive: %s\n", e.what());
    return 1;
  }
  std::fprintf(stderr, "usage: %s serve <MiB> | fetch <port> <iters>\n", argv[0]);
  return 2;
}
