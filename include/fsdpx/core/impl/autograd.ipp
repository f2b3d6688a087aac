// core/detail/autograd.hpp's definitions: included by that header (header-only) or by
// fsdpx/impl/src.hpp (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <cstring>

#include <c10/core/CPUAllocator.h>
#include <c10/core/StorageImpl.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include <fsdpx/core/detail/autograd.hpp>

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

FSDPX_DECL void add_pre_backward_hook(const at::Tensor& x, std::shared_ptr<BackwardHook> hook) {
  x.register_hook([hook = std::move(hook)](const at::Tensor&) { (*hook)(); });
}

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

FSDPX_DECL c10::intrusive_ptr<torch::autograd::Node> add_post_accumulate_hook(const at::Tensor& param,
                                                                              std::function<void()> fn) {
  auto accumulator = torch::autograd::impl::grad_accumulator(param);
  accumulator->add_post_hook(std::make_unique<PostAccumulateHook>(std::move(fn)));
  return accumulator;
}

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

FSDPX_DECL std::vector<at::Tensor> add_post_backward_hook(std::vector<at::Tensor> inputs,
                                                          std::shared_ptr<BackwardHook> hook) {
  // A TensorList argument (not a std::vector) is what autograd records as differentiable inputs.
  return PostBackwardFunction::apply(at::TensorList(inputs), std::move(hook));
}

FSDPX_DECL void at_end_of_backward(std::function<void()> fn) {
  torch::autograd::Engine::get_default_engine().queue_callback(std::move(fn));
}

FSDPX_DECL int current_backward_pass_id() { return torch::autograd::get_current_graph_task_id(); }

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
