// InplaceFunction: a move-only callable kept inside the object, never on the heap.
//
// Why: the MPI engine hands a closure per collective to its thread; std::function allocates for any
// closure larger than two pointers, so every collective paid a heap allocation for its own steps.
// A closure that does not fit is a compile-time error naming the capacity, not a silent allocation.
#pragma once

#include <cstddef>
#include <functional>
#include <new>
#include <type_traits>
#include <utility>

namespace fsdpx::detail {

template <class Signature, std::size_t Capacity>
class InplaceFunction;

template <class R, class... Args, std::size_t Capacity>
class InplaceFunction<R(Args...), Capacity> {
 public:
  InplaceFunction() noexcept = default;
  InplaceFunction(std::nullptr_t) noexcept {}  // NOLINT(google-explicit-constructor): like std::function

  template <class F, class D = std::decay_t<F>>
    requires(!std::is_same_v<D, InplaceFunction> && std::is_invocable_r_v<R, D&, Args...>)
  InplaceFunction(F&& f) {  // NOLINT(google-explicit-constructor): like std::function
    static_assert(sizeof(D) <= Capacity,
                  "fsdpx: this closure is larger than the InplaceFunction's capacity; capture less (a view, an "
                  "index) or raise the capacity where the InplaceFunction type is declared");
    static_assert(alignof(D) <= alignof(std::max_align_t), "fsdpx: this closure is over-aligned for InplaceFunction");
    // A closure that captured a const tensor copies it on a move: not noexcept, but it does not throw
    // (a reference count). InplaceFunction's own move is noexcept, so vectors of tasks move, never copy.
    static_assert(std::is_move_constructible_v<D>, "fsdpx: InplaceFunction needs a movable closure");
    ::new (static_cast<void*>(storage_)) D(std::forward<F>(f));
    ops_ = &ops_for<D>;
  }

  InplaceFunction(InplaceFunction&& other) noexcept { take(other); }
  InplaceFunction& operator=(InplaceFunction&& other) noexcept {
    if (this != &other) {
      reset();
      take(other);
    }
    return *this;
  }
  InplaceFunction(const InplaceFunction&) = delete;
  InplaceFunction& operator=(const InplaceFunction&) = delete;
  ~InplaceFunction() { reset(); }

  explicit operator bool() const noexcept { return ops_ != nullptr; }

  /// Precondition: holds a callable (operator bool).
  R operator()(Args... args) { return ops_->call(storage_, std::forward<Args>(args)...); }

  /// Destroys the callable now, releasing what it captured (tensors, buffers).
  void reset() noexcept {
    if (ops_ != nullptr) {
      ops_->destroy(storage_);
      ops_ = nullptr;
    }
  }

 private:
  struct Ops {
    R (*call)(void* self, Args&&... args);
    void (*move_to)(void* from, void* to) noexcept;  // move-constructs at `to`, destroys `from`
    void (*destroy)(void* self) noexcept;
  };

  template <class D>
  static constexpr Ops ops_for{
      [](void* self, Args&&... args) -> R { return std::invoke(*static_cast<D*>(self), std::forward<Args>(args)...); },
      [](void* from, void* to) noexcept {
        ::new (to) D(std::move(*static_cast<D*>(from)));
        static_cast<D*>(from)->~D();
      },
      [](void* self) noexcept { static_cast<D*>(self)->~D(); }};

  void take(InplaceFunction& other) noexcept {
    if (other.ops_ != nullptr) {
      other.ops_->move_to(other.storage_, storage_);
      ops_ = std::exchange(other.ops_, nullptr);
    }
  }

  alignas(std::max_align_t) std::byte storage_[Capacity];
  const Ops* ops_ = nullptr;
};

}  // namespace fsdpx::detail
