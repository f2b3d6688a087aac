// The only place fsdpx touches LibTorch internals (torch/csrc/autograd, c10::StorageImpl). Everything
// here was checked against LibTorch (see the design brief): LibTorch modules have no hooks, so the
// unit protocol runs from a call-site function plus these autograd triggers.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <utility>

#include <c10/core/StorageImpl.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
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

inline void allocate_storage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  const size_t nbytes = static_cast<size_t>(t.numel()) * t.element_size();
  s->set_data_ptr_noswap(s->allocator()->allocate(nbytes));
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

// ---- end of backward --------------------------------------------------------------------------------

/// Runs `fn` once the current backward pass has finished. Valid only while a backward pass runs.
inline void at_end_of_backward(std::function<void()> fn) {
  torch::autograd::Engine::get_default_engine().queue_callback(std::move(fn));
}

}  // namespace fsdpx::core::detail
