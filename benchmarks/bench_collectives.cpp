// bench_collectives: bus bandwidth of all-gather, reduce-scatter and all-to-all through fsdpx's MPI backend, next
// to the same MPI collectives called directly (blocking, no fsdpx progress engine) and next to a
// plain memcpy of the same bytes, all measured in this run on this machine.
//
//   mpiexec -n 2 bench_collectives [max_MiB=256]
//
// Bus bandwidth follows nccl-tests: busbw = total bytes / time * (W - 1) / W, the bytes each rank
// must move in a ring, so it compares with a link's (here: memory's) bandwidth at any world size.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#include <ATen/ATen.h>
#include <fsdpx/fsdp.hpp>
#include <fsdpx/dist/detail/mpi_runtime.hpp>  // the engine, to time raw MPI calls on its thread

#include "timing.hpp"

using fsdpx::dist::MpiCommunicator;
using fsdpx::dist::ReduceOp;
using Clock = std::chrono::steady_clock;

namespace {

using fsdpx::bench::time_collective;

double time_memcpy(size_t bytes, int iters) {
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  std::memcpy(dst.data(), src.data(), bytes);
  std::vector<double> samples;
  for (int i = 0; i < iters; ++i) {
    const auto t0 = Clock::now();
    std::memcpy(dst.data(), src.data(), bytes);
    samples.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return fsdpx::bench::median(std::move(samples));
}

}  // namespace

int main(int argc, char** argv) {
  auto world = MpiCommunicator::world();
  auto runtime = fsdpx::dist::detail::MpiRuntime::acquire();
  const int W = world.size(), r = world.rank();
  const int64_t max_mib = argc > 1 ? std::atoll(argv[1]) : 256;
  MPI_Comm comm = world.native_handle();

  if (r == 0) {
    std::printf("bench_collectives: %d ranks, float32, median of timed calls, slowest rank\n", W);
    std::printf("busbw in GB/s; 'raw' = the same MPI collective called directly (blocking); memcpy = one core\n\n");
    std::printf(
        "| size (MiB) | all_gather fsdpx | raw | fsdpx/raw | reduce_scatter fsdpx | raw | fsdpx/raw | memcpy | "
        "all_gather/memcpy | reduce_scatter/memcpy |\n");
    std::printf("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  }
  for (int64_t mib = 1; mib <= max_mib; mib *= 4) {
    const int64_t bytes = mib << 20, total = bytes / 4, chunk = total / W;
    const int iters = static_cast<int>(std::clamp<int64_t>(512 / mib, 5, 40));
    auto shard = at::randn({chunk});
    auto full = at::empty({chunk * W});
    auto grads = at::randn({chunk * W});
    auto grad_shard = at::empty({chunk});
    const int count = static_cast<int>(chunk);

    const double ag = time_collective(world, iters, [&] { world.all_gather(full, shard); });
    const double ag_raw = time_collective(world, iters, [&] {
      runtime->engine().run(
          [&] { MPI_Allgather(shard.data_ptr(), count, MPI_FLOAT, full.data_ptr(), count, MPI_FLOAT, comm); });
    });
    const double rs = time_collective(world, iters, [&] { world.reduce_scatter(grad_shard, grads, ReduceOp::sum); });
    const double rs_raw = time_collective(world, iters, [&] {
      runtime->engine().run(
          [&] { MPI_Reduce_scatter_block(grads.data_ptr(), grad_shard.data_ptr(), count, MPI_FLOAT, MPI_SUM, comm); });
    });
    const double copy = time_memcpy(static_cast<size_t>(chunk * W * 4), iters);

    const double b = static_cast<double>(chunk * W * 4), bus = (W - 1.0) / W;
    const auto gbps = [&](double t, double factor) { return b / t * factor / 1e9; };
    if (r == 0) {
      std::printf("| %lld | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f |\n",
                  static_cast<long long>(mib), gbps(ag, bus), gbps(ag_raw, bus), ag_raw / ag, gbps(rs, bus),
                  gbps(rs_raw, bus), rs_raw / rs, gbps(copy, 1), gbps(ag, bus) / gbps(copy, 1),
                  gbps(rs, bus) / gbps(copy, 1));
      std::fflush(stdout);
    }
  }
  // All-to-all (sequence and expert parallelism): each rank sends size / W bytes to each rank.
  if (r == 0) {
    std::printf("\n| size (MiB) | all_to_all fsdpx | raw MPI_Alltoall | fsdpx/raw |\n|---:|---:|---:|---:|\n");
  }
  for (int64_t mib = 1; mib <= max_mib; mib *= 4) {
    const int64_t total = (mib << 20) / 4, chunk = total / W;
    const int iters = static_cast<int>(std::clamp<int64_t>(512 / mib, 5, 40));
    auto input = at::randn({chunk * W});
    auto output = at::empty({chunk * W});
    const int count = static_cast<int>(chunk);
    const double a2a = time_collective(world, iters, [&] { world.all_to_all(output, input); });
    const double a2a_raw = time_collective(world, iters, [&] {
      runtime->engine().run(
          [&] { MPI_Alltoall(input.data_ptr(), count, MPI_FLOAT, output.data_ptr(), count, MPI_FLOAT, comm); });
    });
    const double b = static_cast<double>(chunk * W * 4), bus = (W - 1.0) / W;
    if (r == 0) {
      std::printf("| %lld | %.2f | %.2f | %.2f |\n", static_cast<long long>(mib), b / a2a * bus / 1e9,
                  b / a2a_raw * bus / 1e9, a2a_raw / a2a);
      std::fflush(stdout);
    }
  }
  return 0;
}
