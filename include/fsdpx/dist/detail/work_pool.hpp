// Recycled blocks for the Work states a backend hands out (fsdpx/dist/work.hpp): a collective started
// on a warm communicator allocates no state of its own.
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace fsdpx::dist::detail {

/// Work states of a backend's collectives, recycled: a finished collective's block serves the next
/// one, so a warm communicator hands out Work handles without allocating. Blocks may be returned by a
/// Work a user keeps after every communicator is gone, so the free lists live as long as the process.
class WorkStatePool {
 public:
  /// A State (a WorkState subclass) made from `args`, in a recycled block when one is free.
  template <class State, class... Args>
  static std::shared_ptr<State> make(Args&&... args) {
    return std::allocate_shared<State>(Allocator<State>{}, std::forward<Args>(args)...);
  }

 private:
  static constexpr std::size_t max_free = 256;  // more collectives than this in flight: plain new/delete

  struct FreeList {
    std::mutex mutex;
    std::vector<void*> blocks;
  };

  /// One list per block type (shared_ptr's control block holding one State type).
  template <class T>
  static FreeList& free_list() {
    static auto* list = new FreeList();  // never destroyed, on purpose (see the class comment)
    return *list;
  }

  template <class T>
  struct Allocator {
    using value_type = T;
    Allocator() = default;
    template <class U>
    Allocator(const Allocator<U>&) noexcept {}  // NOLINT(google-explicit-constructor): rebinding
    T* allocate(std::size_t n) {
      if (n == 1) {
        FreeList& list = free_list<T>();
        std::lock_guard lock(list.mutex);
        if (!list.blocks.empty()) {
          void* block = list.blocks.back();
          list.blocks.pop_back();
          return static_cast<T*>(block);
        }
      }
      return std::allocator<T>().allocate(n);
    }
    void deallocate(T* p, std::size_t n) noexcept {
      if (n == 1) {
        FreeList& list = free_list<T>();
        std::lock_guard lock(list.mutex);
        if (list.blocks.size() < max_free && reserve_once(list)) {
          list.blocks.push_back(p);
          return;
        }
      }
      std::allocator<T>().deallocate(p, n);
    }
    /// The list's room for max_free blocks, taken on first use (the only allocation the pool makes).
    static bool reserve_once(FreeList& list) noexcept {
      try {
        if (list.blocks.capacity() < max_free) list.blocks.reserve(max_free);
        return true;
      } catch (...) {
        return false;  // no room: the block is freed instead of kept
      }
    }
    template <class U>
    bool operator==(const Allocator<U>&) const noexcept {
      return true;
    }
  };
};

}  // namespace fsdpx::dist::detail
