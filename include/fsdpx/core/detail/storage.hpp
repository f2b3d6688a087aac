// Where fsdpx reaches into LibTorch's storage and allocator (c10::StorageImpl, c10::SetCPUAllocator),
// for the flat parameters and deferred construction; core/detail/autograd.hpp is its twin for autograd.
// Checked against LibTorch's sources and exercised by the parity and deferred-construction tests. The
// definitions are in core/impl/storage.ipp.
#pragma once

#include <fsdpx/detail/config.hpp>

#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>

namespace fsdpx::core::detail {

// ---- memory: release and refill a buffer's bytes while every view of it stays valid --------------
// Autograd saves views of parameters (e.g. weight.t() in linear), so dropping tensor references would
// not free anything; freeing the storage's bytes does, like FSDP's untyped_storage().resize_(0).

FSDPX_DECL bool storage_allocated(const at::Tensor& t);

FSDPX_DECL void free_storage(const at::Tensor& t);

/// Gives `t`'s storage `data` (at least t.nbytes()), or, without it, fresh bytes from its allocator.
FSDPX_DECL void allocate_storage(const at::Tensor& t, at::DataPtr data = {});

// ---- deferred construction: build a model without materializing its parameters --------------------
// While a ScratchAllocationScope lives, every CPU allocation returns the same scratch buffer (grown to
// the largest request; older buffers stay alive for the tensors that point into them). A model
// constructed then costs the size of its largest tensor; its values are garbage until each unit is
// materialized, initialized, sharded and released in turn. No other thread may allocate CPU tensors
// meanwhile: the allocator is process-wide.

class ScratchCpuAllocator final : public c10::Allocator {
 public:
  explicit ScratchCpuAllocator(c10::Allocator* real) : real_(real) {}
  FSDPX_DECL c10::DataPtr allocate(size_t n) override;
  c10::DeleterFnPtr raw_deleter() const override { return &no_delete; }
  FSDPX_DECL void copy_data(void* dest, const void* src, std::size_t count) const override;

 private:
  static void no_delete(void*) {}
  c10::Allocator* real_;
  std::mutex mutex_;
  std::vector<c10::DataPtr> buffers_;
  size_t capacity_ = 0;
};

class ScratchAllocationScope {
 public:
  FSDPX_DECL ScratchAllocationScope();
  ScratchAllocationScope(const ScratchAllocationScope&) = delete;
  ScratchAllocationScope& operator=(const ScratchAllocationScope&) = delete;
  FSDPX_DECL ~ScratchAllocationScope();
  /// The scratch buffers, which the deferred model's tensors point into until materialized.
  std::shared_ptr<ScratchCpuAllocator> scratch() const { return scratch_; }

 private:
  c10::Allocator* previous_;
  std::shared_ptr<ScratchCpuAllocator> scratch_;
};

}  // namespace fsdpx::core::detail

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/core/impl/storage.ipp>
#endif
