// Host memory for the bytes fsdpx moves (the layer below dist: dist, core and sync use it).
//
// Two things, both for CPU tensors only (device memory has its allocator's own cache):
//
// - Huge pages. Large buffers (from 2 MiB) are 2 MiB-aligned and advised to use transparent huge
//   pages, as PyTorch's THP_MEM_ALLOC_ENABLE=1 does for every allocation, but for these buffers only
//   and without an environment variable. Why: a CPU rank's shared-memory transfer (Open MPI's CMA,
//   process_vm_readv) pins and walks every source page, so 4 KiB pages make the sync's copies much
//   slower than 2 MiB pages (a VM translates every page twice; docs/sync.md, "Measured", has the figures).
//   Where the kernel offers no huge pages (THP "never", not Linux) the advice is ignored.
//   FSDPX_HUGE_PAGES=0 turns it off.
//
// - A cache of the buffers a training step allocates again every step (a unit's full parameters,
//   its flat gradient, the reduce-scatter's output and the ring's temporaries). A fresh allocation of
//   that size is a new mapping whose every page faults in when first written; a block given back to
//   the cache is handed out again with its pages resident, as a GPU's caching allocator does. The
//   cache never holds more than the most bytes its blocks were in use at once in the last step (older
//   free blocks are freed to make room), and within a step no more free bytes than are in use or the
//   last forward used (begin_forward()), so that blocks waiting for backward do not add to the peak
//   of activations; a one-off peak (every unit gathered for an export) does not stay resident;
//   release_cached_host_buffers() returns the free blocks to the system (offload_model() does).
//   Blocks are mappings of their own: freed, their pages go back to the system at once.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <algorithm>
#include <list>
#include <mutex>
#include <string_view>

#include <ATen/ATen.h>
#include <c10/core/Storage.h>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <fsdpx/error.hpp>

namespace fsdpx::memory {

inline constexpr int64_t huge_page_bytes = int64_t{2} << 20;

/// Whether large host buffers are 2 MiB-aligned and advised to use huge pages: on Linux, unless
/// FSDPX_HUGE_PAGES=0 (read once). Elsewhere they come from PyTorch's allocator.
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

/// Step buffers below this size come from PyTorch's allocator (whose heap reuses small blocks).
inline constexpr int64_t small_step_buffer_bytes = int64_t{64} << 10;

namespace detail {

/// `bytes` of host memory (a multiple of 4 KiB, and of 2 MiB when `huge`: block_bytes() rounds), page
/// aligned, and 2 MiB-aligned and advised to use huge pages when `huge`; nullptr when the system
/// refuses. Free it with free_host_block(p, bytes, huge).
///
/// On Linux a block is a mapping of its own, never a part of malloc's heap: freeing it returns its
/// pages to the system at once (a freed heap block stays resident, and advised heap memory reused by
/// other allocations stays in whole huge pages), and the advice covers the block alone.
inline void* allocate_host_block(size_t bytes, bool huge) {
  bytes = std::max<size_t>(bytes, 1);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const size_t align = huge ? static_cast<size_t>(huge_page_bytes) : 0;
  const size_t span = bytes + align;
  void* raw = ::mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  if (!huge) return raw;
  const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (start + align - 1) / align * align;
  if (aligned > start) ::munmap(raw, aligned - start);  // the unaligned head and tail go back at once
  if (start + span > aligned + bytes)
    ::munmap(reinterpret_cast<void*>(aligned + bytes), start + span - aligned - bytes);
  void* p = reinterpret_cast<void*>(aligned);
  ::madvise(p, bytes, MADV_HUGEPAGE);  // advice: without transparent huge pages, the pages stay 4 KiB
  return p;
#else
  (void)huge;
  void* p = nullptr;
  return posix_memalign(&p, 4096, bytes) == 0 ? p : nullptr;
#endif
}

/// Frees a block of allocate_host_block(bytes, huge).
inline void free_host_block(void* p, size_t bytes, [[maybe_unused]] bool huge) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  ::munmap(p, std::max<size_t>(bytes, 1));
#else
  (void)bytes;
  std::free(p);
#endif
}

inline bool use_huge_pages(int64_t bytes) { return bytes >= huge_page_bytes && host_huge_pages(); }

/// The size of the block that holds `bytes`: whole huge pages when large, whole 4 KiB pages else.
inline size_t block_bytes(int64_t bytes) {
  const int64_t unit = use_huge_pages(bytes) ? huge_page_bytes : 4096;
  return static_cast<size_t>((std::max<int64_t>(bytes, 1) + unit - 1) / unit * unit);
}

}  // namespace detail

/// The process's cache of host blocks (see the top of this file). Thread-safe: blocks come back from
/// whichever thread drops the last reference (autograd's, a collective's progress thread).
class HostBufferCache {
 public:
  static HostBufferCache& instance() {
    static auto* cache = new HostBufferCache();  // never destroyed: blocks may come back during exit
    return *cache;
  }

  /// A block of at least `bytes` (a free one of the same rounded size when there is one), owned by
  /// the returned pointer, which gives it back here when dropped.
  at::DataPtr allocate(int64_t bytes) {
    FSDPX_CHECK(bytes >= 0, "HostBufferCache::allocate: bytes must be >= 0, got ", bytes);
    const size_t size = detail::block_bytes(bytes);
    const bool huge = detail::use_huge_pages(bytes);
    void* p = nullptr;
    {
      std::lock_guard lock(mutex_);
      for (auto it = free_.begin(); it != free_.end(); ++it) {
        if (it->size == size && it->huge == huge) {
          p = it->data;
          free_bytes_ -= size;
          free_.erase(it);
          break;
        }
      }
      if (p == nullptr) {
        // Never hold more than the most bytes in use at once (this step or the last): free the
        // oldest free blocks first.
        trim_to(std::max({step_peak_, window_peak_, in_use_ + size}) - size);
      }
      in_use_ += size;
      window_peak_ = std::max(window_peak_, in_use_);
      if (in_forward_) forward_window_ = std::max(forward_window_, in_use_);
    }
    if (p == nullptr) p = detail::allocate_host_block(size, huge);
    if (p == nullptr) {
      std::lock_guard lock(mutex_);
      in_use_ -= size;
      FSDPX_FAIL(Error, "cannot allocate ", size, " bytes of host memory (out of memory?)");
    }
    return {p, new Block{p, size, huge}, &give_back, c10::Device(c10::kCPU)};
  }

  /// A training step ended (the unit protocol calls this at the end of each backward): the blocks
  /// kept from now on are at most the step's peak in use.
  void end_step() {
    std::lock_guard lock(mutex_);
    step_peak_ = window_peak_;
    trim_to(step_peak_);
    window_peak_ = in_use_;
    in_step_ = in_forward_ = false;
  }

  /// After a one-off peak outside a step (every unit gathered at once): frees the free blocks beyond
  /// the last step's peak.
  void trim() {
    std::lock_guard lock(mutex_);
    trim_to(std::max(step_peak_, in_use_));
    window_peak_ = in_use_;
  }

  /// A forward begins, and with it a training step (the unit protocol calls this, end_forward() after
  /// the root's forward, and end_step() at the end of backward). Activations grow through a forward
  /// and are freed through backward, whose first layers run at the step's peak: from now until
  /// end_step(), the free blocks held stay within what is in use, or what the last forward had in use
  /// at once, whichever is more. Blocks only backward uses (flat gradients, reduction buffers) are
  /// then mapped again in backward and reused within it instead of sitting idle at the peak.
  void begin_forward() {
    std::lock_guard lock(mutex_);
    in_step_ = in_forward_ = true;
    forward_window_ = in_use_;
    trim_to(in_use_ + idle_allowance());
  }
  void end_forward() {
    std::lock_guard lock(mutex_);
    if (in_forward_) forward_peak_ = forward_window_;
    in_forward_ = false;
  }

  /// Frees every block not in use; the next allocations map fresh memory.
  void release() {
    std::lock_guard lock(mutex_);
    trim_to(0);
    step_peak_ = window_peak_ = forward_peak_ = in_use_;
  }

  /// Bytes of blocks held for reuse, not in use.
  size_t free_bytes() const {
    std::lock_guard lock(mutex_);
    return free_bytes_;
  }

 private:
  struct Block {
    void* data;
    size_t size;
    bool huge;  // advised to use huge pages: handed out only for requests that want them
  };

  HostBufferCache() = default;

  /// Inside a step, the free bytes held (see begin_forward). Locked.
  size_t idle_allowance() const { return std::max({in_use_, forward_peak_, in_forward_ ? forward_window_ : 0}); }

  /// Frees the oldest free blocks until in-use and free bytes together are at most `limit`. Locked.
  void trim_to(size_t limit) {
    while (!free_.empty() && in_use_ + free_bytes_ > limit) {
      detail::free_host_block(free_.back().data, free_.back().size, free_.back().huge);
      free_bytes_ -= free_.back().size;
      free_.pop_back();
    }
  }

  static void give_back(void* ctx) {
    const Block* b = static_cast<Block*>(ctx);
    instance().put(*b);
    delete b;
  }
  void put(const Block& b) {
    std::lock_guard lock(mutex_);
    in_use_ -= b.size;
    free_.push_front(b);  // most recently used first: its pages are the likeliest resident
    free_bytes_ += b.size;
    if (in_step_) trim_to(in_use_ + idle_allowance());
  }

  mutable std::mutex mutex_;
  std::list<Block> free_;
  size_t free_bytes_ = 0;
  size_t in_use_ = 0;
  size_t window_peak_ = 0;     // the most bytes in use since the last step ended
  size_t step_peak_ = 0;       // the most bytes in use during the last step
  bool in_step_ = false;       // from begin_forward() to end_step()
  bool in_forward_ = false;    // from begin_forward() to end_forward()
  size_t forward_window_ = 0;  // the most bytes in use since this forward began
  size_t forward_peak_ = 0;    // the most bytes in use during the last forward
};

/// An uninitialised 1-d CPU tensor of `numel` elements that lives for the whole run (a shard, a
/// receive buffer); from huge_page_bytes on, 2 MiB-aligned and backed by huge pages where the kernel
/// allows. Smaller ones come from PyTorch's allocator.
inline at::Tensor empty_host(int64_t numel, at::ScalarType dtype) {
  FSDPX_CHECK(numel >= 0, "empty_host: numel must be >= 0, got ", numel);
  const auto options = at::TensorOptions().dtype(dtype).device(at::kCPU);
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  if (detail::use_huge_pages(bytes)) {
    const size_t size = detail::block_bytes(bytes);
    void* p = detail::allocate_host_block(size, /*huge=*/true);
    FSDPX_CHECK_AS(Error, p != nullptr, "cannot allocate ", size, " bytes of host memory (out of memory?)");
    return at::from_blob(p, {numel}, [size](void* q) { detail::free_host_block(q, size, /*huge=*/true); }, options);
  }
  return at::empty({numel}, options);
}

/// at::empty({numel}) with `options`, through empty_host() for unpinned CPU tensors.
inline at::Tensor empty_buffer(int64_t numel, const at::TensorOptions& options) {
  if (options.device().is_cpu() && !options.pinned_memory()) return empty_host(numel, options.dtype().toScalarType());
  return at::empty({numel}, options);
}

/// An uninitialised 1-d tensor of `numel` elements needed again every step (a flat gradient, a
/// collective's output or temporary): unpinned CPU tensors come from HostBufferCache, others from
/// their device's allocator.
inline at::Tensor empty_step_buffer(int64_t numel, const at::TensorOptions& options) {
  FSDPX_CHECK(numel >= 0, "empty_step_buffer: numel must be >= 0, got ", numel);
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(options.dtype().toScalarType()));
  // Small ones stay with PyTorch's allocator: its heap reuses them without page faults.
  if (!options.device().is_cpu() || options.pinned_memory() || bytes < small_step_buffer_bytes) {
    return at::empty({numel}, options);
  }
  c10::Storage storage(c10::Storage::use_byte_size_t(), static_cast<size_t>(bytes),
                       HostBufferCache::instance().allocate(bytes), /*allocator=*/nullptr, /*resizable=*/false);
  return at::empty({0}, options).set_(storage, 0, {numel}, {1});
}

/// Returns the host blocks cached for reuse to the system.
inline void release_cached_host_buffers() { HostBufferCache::instance().release(); }

}  // namespace fsdpx::memory
