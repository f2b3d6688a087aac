// The only place fsdpx touches LibTorch internals (torch/csrc/autograd, c10::StorageImpl). Everything
// here was checked against LibTorch's sources and is exercised by the parity tests (tests/core): LibTorch
// modules have no hooks, so the unit protocol runs from a call-site function plus these autograd
// triggers. docs/core.md ("The unit boundary") explains the design.
#pragma once

#include <cstddef>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/StorageImpl.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

namespace fsdpx::core::detail {

// ---- memory: release and refill a buffer's bytes while every view of it stays valid --------------
// Autograd saves views of parameters (e.g. weight.t() in linear), so dropping tensor references would
// not free anything; freeing the storage's bytes does, like FSDP's untyped_storage().resize_(0).

inline bool storage_allocated(const at::Tensor& t) { return t.storage().nbytes() > 0 || t.numel() == 0; }

inline void free_storage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  s->set_data_ptr_noswap(at::DataPtr(nullptr, s->device()));
  s->set_nbytes(0);
}

/// Gives `t`'s storage `data` (at least t.nbytes()), or, without it, fresh bytes from its allocator.
inline void allocate_storage(const at::Tensor& t, at::DataPtr data = {}) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  const size_t nbytes = static_cast<size_t>(t.numel()) * t.element_size();
  s->set_data_ptr_noswap(data ? std::move(data) : s->allocator()->allocate(nbytes));
  s->set_nbytes(nbytes);
}

// ---- pre-backward: runs when the gradient of a unit's output arrives, before the unit's backward --

using BackwardHook = std::function<void()>;

/// Registers `hook` on `x` (which must require grad). The graph owns the hook, so a graph that is
/// dropped without a backward pass frees it.
inline void add_pre_backward_hook(const at::Tensor& x, std::shared_ptr<BackwardHook> hook) {
  x.register_hook([hook = std::move(hook)](const at::Tensor&) { (*hook)(); });
}

// ---- post-backward: after a parameter's gradient is accumulated -----------------------------------

class PostAccumulateHook final : public torch::autograd::FunctionPostHook {
 public:
  explicit PostAccumulateHook(std::function<void()> fn) : fn_(std::move(fn)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    fn_();
    return outputs;
  }

 private:
  std::function<void()> fn_;
};

/// Runs `fn` each time autograd has accumulated `param`'s gradient (as PyTorch's C++ DDP reducer does).
/// The returned node must be kept alive: the parameter only holds it weakly.
inline c10::intrusive_ptr<torch::autograd::Node> add_post_accumulate_hook(const at::Tensor& param,
                                                                          std::function<void()> fn) {
  auto accumulator = torch::autograd::impl::grad_accumulator(param);
  accumulator->add_post_hook(std::make_unique<PostAccumulateHook>(std::move(fn)));
  return accumulator;
}

// ---- post-backward: after the backward of one unit call has reached the call's inputs --------------
// FSDP2's RegisterPostBackwardFunction in C++: one identity node over every input of a unit call that
// requires grad. Autograd runs it once the gradients of all those inputs are complete, which is when
// the call's backward (and the accumulation of the parameter gradients on the way) is done.

class PostBackwardHolder final : public torch::CustomClassHolder {
 public:
  explicit PostBackwardHolder(std::shared_ptr<BackwardHook> hook) : hook(std::move(hook)) {}
  std::shared_ptr<BackwardHook> hook;
};

struct PostBackwardFunction : torch::autograd::Function<PostBackwardFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                at::TensorList inputs, std::shared_ptr<BackwardHook> hook) {
    ctx->set_materialize_grads(false);  // an input without a gradient passes an undefined one on
    ctx->saved_data["hook"] = c10::IValue::make_capsule(c10::make_intrusive<PostBackwardHolder>(std::move(hook)));
    return inputs.vec();  // autograd returns views of them with this node as their grad_fn
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto holder = ctx->saved_data["hook"].toCapsule();
    (*static_cast<PostBackwardHolder*>(holder.get())->hook)();
    grads.emplace_back();  // no gradient for the hook argument
    return grads;
  }
};

/// Returns `inputs` (each requiring grad) routed through one node that runs `hook` in backward.
inline std::vector<at::Tensor> add_post_backward_hook(std::vector<at::Tensor> inputs, std::shared_ptr<BackwardHook> hook) {
  // A TensorList argument (not a std::vector) is what autograd records as differentiable inputs.
  return PostBackwardFunction::apply(at::TensorList(inputs), std::move(hook));
}

// ---- end of backward --------------------------------------------------------------------------------

/// Runs `fn` once the current backward pass has finished. Valid only while a backward pass runs.
/// Autograd drops it, unrun, when the pass ends with an exception.
inline void at_end_of_backward(std::function<void()> fn) {
  torch::autograd::Engine::get_default_engine().queue_callback(std::move(fn));
}

/// The backward pass (graph task) this thread is running, or -1 outside backward. Each pass has its
/// own id, so a pass that began and never ended is told apart from the one running now.
inline int current_backward_pass_id() { return torch::autograd::get_current_graph_task_id(); }

// ---- deferred construction: build a model without materializing its parameters --------------------
// While a ScratchAllocationScope lives, every CPU allocation returns the same scratch buffer (grown to
// the largest request; older buffers stay alive for the tensors that point into them). A model
// constructed then costs the size of its largest tensor; its values are garbage until each unit is
// materialized, initialized, sharded and released in turn. No other thread may allocate CPU tensors
// meanwhile: the allocator is process-wide.

class ScratchCpuAllocator final : public c10::Allocator {
 public:
  explicit ScratchCpuAllocator(c10::Allocator* real) : real_(real) {}
  c10::DataPtr allocate(size_t n) override {
    std::lock_guard lock(mutex_);
    if (buffers_.empty() || n > capacity_) {
      buffers_.push_back(real_->allocate(n));
      capacity_ = n;
    }
    void* p = buffers_.back().get();
    return {p, p, &no_delete, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &no_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }

 private:
  static void no_delete(void*) {}
  c10::Allocator* real_;
  std::mutex mutex_;
  std::vector<c10::DataPtr> buffers_;
  size_t capacity_ = 0;
};

class ScratchAllocationScope {
 public:
  ScratchAllocationScope() : previous_(c10::GetCPUAllocator()), scratch_(std::make_shared<ScratchCpuAllocator>(previous_)) {
    c10::SetCPUAllocator(scratch_.get(), /*priority=*/255);
  }
  ScratchAllocationScope(const ScratchAllocationScope&) = delete;
  ScratchAllocationScope& operator=(const ScratchAllocationScope&) = delete;
  ~ScratchAllocationScope() { c10::SetCPUAllocator(previous_, 255); }
  /// The scratch buffers, which the deferred model's tensors point into until materialized.
  std::shared_ptr<ScratchCpuAllocator> scratch() const { return scratch_; }

 private:
  c10::Allocator* previous_;
  std::shared_ptr<ScratchCpuAllocator> scratch_;
};

}  // namespace fsdpx::core::detail
