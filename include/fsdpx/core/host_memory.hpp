// Host buffers for the bytes fsdpx moves between processes (CPU shards, gather and bucket buffers,
// received weights): from 2 MiB on, 2 MiB-aligned and advised to use transparent huge pages, as
// PyTorch's THP_MEM_ALLOC_ENABLE=1 does for every allocation, but for these buffers only and without
// an environment variable. Why: a CPU rank's shared-memory transfer (Open MPI's CMA,
// process_vm_readv) pins and walks every source page; with 4 KiB pages the sync's copies ran at
// 4.5-5.7 GB/s where 2 MiB pages give 9-11 (a VM translates every page twice; docs/sync.md,
// "Measured"). Where the kernel offers no huge pages (THP "never", not Linux) the advice is ignored
// and the buffers behave as any other. FSDPX_HUGE_PAGES=0 turns the advice off.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <string_view>

#include <ATen/ATen.h>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <fsdpx/error.hpp>

namespace fsdpx::core {

inline constexpr int64_t huge_page_bytes = int64_t{2} << 20;

/// Whether empty_host() gives large buffers 2 MiB-aligned and advised to use huge pages: on Linux,
/// unless FSDPX_HUGE_PAGES=0 (read once). Elsewhere they come from PyTorch's allocator.
inline bool host_huge_pages() {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  static const bool enabled = [] {
    const char* v = std::getenv("FSDPX_HUGE_PAGES");
    return v == nullptr || std::string_view(v) != "0";
  }();
  return enabled;
#else
  return false;
#endif
}

/// Whether `t`'s data starts on a 2 MiB boundary, as empty_host()'s large buffers do.
inline bool on_huge_page_boundary(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % static_cast<uintptr_t>(huge_page_bytes) == 0;
}

/// An uninitialised 1-d CPU tensor of `numel` elements; from huge_page_bytes on, 2 MiB-aligned and
/// backed by huge pages where the kernel allows (see above). Smaller ones come from PyTorch's allocator.
inline at::Tensor empty_host(int64_t numel, at::ScalarType dtype) {
  FSDPX_CHECK(numel >= 0, "empty_host: numel must be >= 0, got ", numel);
  const auto options = at::TensorOptions().dtype(dtype).device(at::kCPU);
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (bytes >= huge_page_bytes && host_huge_pages()) {
    const size_t size = static_cast<size_t>((bytes + huge_page_bytes - 1) / huge_page_bytes * huge_page_bytes);
    void* p = nullptr;
    FSDPX_CHECK_AS(Error, posix_memalign(&p, static_cast<size_t>(huge_page_bytes), size) == 0,
                   "cannot allocate ", size, " bytes of host memory (out of memory?)");
    ::madvise(p, size, MADV_HUGEPAGE);  // advice: without transparent huge pages, the pages stay 4 KiB
    return at::from_blob(p, {numel}, [](void* q) { std::free(q); }, options);
  }
#endif
  return at::empty({numel}, options);
}

/// at::empty({numel}) with `options`, through empty_host() for unpinned CPU tensors.
inline at::Tensor empty_buffer(int64_t numel, const at::TensorOptions& options) {
  if (options.device().is_cpu() && !options.pinned_memory()) return empty_host(numel, options.dtype().toScalarType());
  return at::empty({numel}, options);
}

}  // namespace fsdpx::core
