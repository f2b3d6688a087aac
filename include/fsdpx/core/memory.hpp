// Memory a trainer logs and hands back: the accelerator's caching allocator (allocated, reserved,
// free on the device) and this process's resident set on the host.
//
//   model.offload_model();                        // releases the device's cached blocks too
//   std::cout << fsdpx::memory_report(device);    // "cuda:0 allocated 1.2 GiB, reserved 1.3 GiB, ..."
//
// Device-generic through at::accelerator (CUDA, XPU, ...), so CPU builds compile the same code.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <ostream>
#include <string>

#include <sys/resource.h>
#include <unistd.h>

#include <ATen/Context.h>
#include <c10/core/Device.h>
#include <torch/version.h>

// The device-generic allocator interface (at::accelerator's memory statistics, getMemoryInfo and
// emptyCache) is complete from PyTorch 2.10; with an older LibTorch the report holds the host side
// only and nothing is released.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 10)
#define FSDPX_HAS_ACCELERATOR_MEMORY 1
#include <ATen/DeviceAccelerator.h>
#else
#define FSDPX_HAS_ACCELERATOR_MEMORY 0
#endif

namespace fsdpx {

struct MemoryReport {
  c10::Device device = c10::Device(c10::kCPU);
  // The accelerator's caching allocator (0 on the CPU).
  int64_t allocated_bytes = 0;       // held by live tensors
  int64_t reserved_bytes = 0;        // held by the allocator, live or cached
  int64_t peak_allocated_bytes = 0;  // since the process started or the last resetPeakStats
  // The whole device as its driver sees it (cudaMemGetInfo); nullopt on the CPU.
  std::optional<int64_t> device_free_bytes;
  std::optional<int64_t> device_total_bytes;
  // This process's resident set on the host, now and at its peak.
  int64_t host_rss_bytes = 0;
  int64_t host_peak_rss_bytes = 0;
};

namespace detail {

/// The resident set of this process (Linux: /proc/self/statm), 0 where unknown.
inline int64_t resident_set_bytes() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return 0;
  long long pages_total = 0, pages_resident = 0;
  const int read = std::fscanf(f, "%lld %lld", &pages_total, &pages_resident);
  std::fclose(f);
  return read == 2 ? pages_resident * static_cast<int64_t>(::sysconf(_SC_PAGESIZE)) : 0;
}

/// The peak resident set of this process (getrusage; Linux counts KiB).
inline int64_t peak_resident_set_bytes() {
  rusage usage{};
  return ::getrusage(RUSAGE_SELF, &usage) == 0 ? static_cast<int64_t>(usage.ru_maxrss) * 1024 : 0;
}

inline bool is_accelerator(const c10::Device& device) {
#if FSDPX_HAS_ACCELERATOR_MEMORY
  const auto accelerator = at::accelerator::getAccelerator(/*checked=*/false);
  return !device.is_cpu() && accelerator && *accelerator == device.type();
#else
  (void)device;
  return false;
#endif
}

}  // namespace detail

/// The memory of `device` (an accelerator's allocator and driver) and of this process's host side.
inline MemoryReport memory_report(c10::Device device = c10::Device(c10::kCPU)) {
  MemoryReport r;
  r.device = device;
  r.host_rss_bytes = detail::resident_set_bytes();
  // The kernel's peak may lag the current resident set by a few pages.
  r.host_peak_rss_bytes = std::max(detail::peak_resident_set_bytes(), r.host_rss_bytes);
#if FSDPX_HAS_ACCELERATOR_MEMORY
  if (detail::is_accelerator(device)) {
    at::globalContext().lazyInitDevice(device.type());  // the allocator's statistics need an initialized device
    const c10::DeviceIndex index = device.has_index() ? device.index() : at::accelerator::getDeviceIndex();
    r.device = c10::Device(device.type(), index);
    const auto stats = at::accelerator::getDeviceStats(index);
    constexpr auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    r.allocated_bytes = stats.allocated_bytes[all].current;
    r.reserved_bytes = stats.reserved_bytes[all].current;
    r.peak_allocated_bytes = stats.allocated_bytes[all].peak;
    const auto [free, total] = at::accelerator::getMemoryInfo(index);
    r.device_free_bytes = static_cast<int64_t>(free);
    r.device_total_bytes = static_cast<int64_t>(total);
  }
#endif
  return r;
}

/// Returns the accelerator's cached, unused blocks to its driver, so another process (a rollout
/// engine) can allocate them. No-op without an accelerator.
inline void release_cached_device_memory() {
#if FSDPX_HAS_ACCELERATOR_MEMORY
  const auto accelerator = at::accelerator::getAccelerator(/*checked=*/false);
  if (!accelerator) return;
  at::globalContext().lazyInitDevice(*accelerator);  // once per process; a no-op after
  at::accelerator::emptyCache();
#endif
}

inline std::ostream& operator<<(std::ostream& os, const MemoryReport& r) {
  const auto gib = [](int64_t b) { return static_cast<double>(b) / static_cast<double>(int64_t{1} << 30); };
  char line[256];
  if (r.device_total_bytes) {
    std::snprintf(
        line, sizeof line,
        "%s allocated %.3f GiB (peak %.3f), reserved %.3f GiB, free %.3f of %.3f GiB; host RSS %.3f GiB (peak %.3f)",
        r.device.str().c_str(), gib(r.allocated_bytes), gib(r.peak_allocated_bytes), gib(r.reserved_bytes),
        gib(*r.device_free_bytes), gib(*r.device_total_bytes), gib(r.host_rss_bytes), gib(r.host_peak_rss_bytes));
  } else {
    std::snprintf(line, sizeof line, "host RSS %.3f GiB (peak %.3f)", gib(r.host_rss_bytes),
                  gib(r.host_peak_rss_bytes));
  }
  return os << line;
}

}  // namespace fsdpx
