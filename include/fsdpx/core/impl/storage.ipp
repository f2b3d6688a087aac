// core/detail/storage.hpp's definitions: included by that header (header-only) or by
// fsdpx/impl/src.hpp (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <cstring>
#include <utility>

#include <c10/core/CPUAllocator.h>
#include <c10/core/StorageImpl.h>

#include <fsdpx/core/detail/storage.hpp>

namespace fsdpx::core::detail {

FSDPX_DECL bool storage_allocated(const at::Tensor& t) { return t.storage().nbytes() > 0 || t.numel() == 0; }

FSDPX_DECL void free_storage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  s->set_data_ptr_noswap(at::DataPtr(nullptr, s->device()));
  s->set_nbytes(0);
}

FSDPX_DECL void allocate_storage(const at::Tensor& t, at::DataPtr data) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  const size_t nbytes = static_cast<size_t>(t.numel()) * t.element_size();
  s->set_data_ptr_noswap(data ? std::move(data) : s->allocator()->allocate(nbytes));
  s->set_nbytes(nbytes);
}

FSDPX_DECL c10::DataPtr ScratchCpuAllocator::allocate(size_t n) {
  std::lock_guard lock(mutex_);
  if (buffers_.empty() || n > capacity_) {
    buffers_.push_back(real_->allocate(n));
    capacity_ = n;
  }
  void* p = buffers_.back().get();
  return {p, p, &no_delete, c10::Device(c10::kCPU)};
}

FSDPX_DECL void ScratchCpuAllocator::copy_data(void* dest, const void* src, std::size_t count) const {
  std::memcpy(dest, src, count);
}

FSDPX_DECL ScratchAllocationScope::ScratchAllocationScope()
    : previous_(c10::GetCPUAllocator()), scratch_(std::make_shared<ScratchCpuAllocator>(previous_)) {
  c10::SetCPUAllocator(scratch_.get(), /*priority=*/255);
}

FSDPX_DECL ScratchAllocationScope::~ScratchAllocationScope() { c10::SetCPUAllocator(previous_, 255); }

}  // namespace fsdpx::core::detail
