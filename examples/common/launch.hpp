// The examples' world: NCCL with one GPU per rank when fsdpx was built with NCCL and a GPU is
// visible (torchrun, srun, or mpirun with MASTER_ADDR/MASTER_PORT), otherwise MPI on CPU ranks
// (mpirun / mpiexec / srun). The launcher is detected by fsdpx::dist::detect_launch_env().
#pragma once

#include <cstdio>
#include <exception>
#include <string>

#include <torch/cuda.h>

#include <fsdpx/dist.hpp>
#include <fsdpx/error.hpp>

#include "memory.hpp"

#if defined(FSDPX_WITH_NCCL)
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace fsdpx::examples {

struct World {
  fsdpx::dist::AnyCommunicator comm;
  c10::Device device;
};

/// The job's world communicator and this rank's device. FSDPX_EXAMPLE_DEVICE=cpu forces MPI on CPUs.
inline World init_world() {
  const char* forced = std::getenv("FSDPX_EXAMPLE_DEVICE");
  const bool cpu_only = forced != nullptr && std::string(forced) == "cpu";
#if defined(FSDPX_WITH_NCCL)
  if (!cpu_only && torch::cuda::is_available()) {
    const auto env = fsdpx::dist::detect_launch_env();
    const auto index = static_cast<c10::DeviceIndex>(env.local_rank);
    c10::cuda::set_device(index);
    return {fsdpx::dist::nccl_world(), c10::Device(c10::kCUDA, index)};
  }
#endif
#if defined(FSDPX_WITH_MPI)
  (void)cpu_only;
  return {fsdpx::dist::MpiCommunicator::world(), c10::Device(c10::kCPU)};
#else
  FSDPX_CHECK(false, "this example was built without MPI, so it needs a GPU (NCCL), and none is visible",
              cpu_only ? " (FSDPX_EXAMPLE_DEVICE=cpu)" : "");
  return {fsdpx::dist::AnyCommunicator(fsdpx::dist::nccl_world()), c10::Device(c10::kCPU)};
#endif
}

/// "peak RSS 812 MiB" on CPU ranks, "peak GPU 3.1 GiB" on GPU ranks (fsdpx::memory_report).
inline std::string memory_line(const c10::Device& device) {
  const fsdpx::MemoryReport r = fsdpx::memory_report(device);
  char buf[64];
  if (r.device_total_bytes) {
    std::snprintf(buf, sizeof buf, "peak GPU %.2f GiB", static_cast<double>(r.peak_allocated_bytes) / 1073741824.0);
  } else {
    std::snprintf(buf, sizeof buf, "peak RSS %.0f MiB", static_cast<double>(r.host_peak_rss_bytes) / 1048576.0);
  }
  return buf;
}

/// The examples' last words: "program: cause". The examples' own checks (FSDPX_CHECK(..., "train_gpt: ...", ...))
/// already name the program after fsdpx's prefix; that name is not printed twice.
inline int report_failure(const std::string& program, const std::exception& e) {
  std::string message = e.what();
  const std::string own = "fsdpx: " + program + ": ";
  if (message.rfind(own, 0) == 0) message = message.substr(own.size());
  std::fprintf(stderr, "%s: %s\n", program.c_str(), message.c_str());
  return 1;
}

}  // namespace fsdpx::examples
