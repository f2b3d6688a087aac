// Deferred construction for models larger than one rank may hold.
//
//   auto model = fsdpx::deferred_init<Gpt>(config);   // costs the size of its largest tensor
//   fsdpx::Fsdp<Gpt, ...> sharded(model, world);     // materializes, initializes and shards unit by unit
//
// While the model is constructed every CPU allocation returns the same scratch memory, so a module's
// constructor must not compute tensors it keeps (a table derived from its configuration): compute
// them at first use instead. Its parameters' values are discarded anyway (in_deferred_init()).
//
// Fsdp initializes each module of a deferred model with its own reset_parameters() (Linear,
// Embedding, LayerNorm, GroupNorm, Conv1d/2d/3d, BatchNorm1d/2d/3d), or with FsdpOptions::init_module
// for modules it does not know. The values equal a fresh construction's in distribution, not in the
// exact random draw (the order of initialization differs).
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>

#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <fsdpx/core/detail/autograd.hpp>
#include <fsdpx/error.hpp>

namespace fsdpx {

/// Initializes one module's own parameters and buffers in place; returns false when it does not know
/// the module.
using ModuleInit = std::function<bool(torch::nn::Module&)>;

namespace core::detail {

/// Models built by deferred_init, until Fsdp has materialized them (the scratch buffers they point
/// into stay alive until then).
class DeferredModels {
 public:
  static DeferredModels& instance() {
    static DeferredModels models;
    return models;
  }
  void add(const torch::nn::Module* m, std::shared_ptr<ScratchCpuAllocator> scratch) {
    std::lock_guard lock(mutex_);
    models_[m] = std::move(scratch);
  }
  bool contains(const torch::nn::Module* m) const {
    std::lock_guard lock(mutex_);
    return models_.count(m) != 0;
  }
  void remove(const torch::nn::Module* m) {
    std::lock_guard lock(mutex_);
    models_.erase(m);
  }

 private:
  mutable std::mutex mutex_;
  std::unordered_map<const torch::nn::Module*, std::shared_ptr<ScratchCpuAllocator>> models_;
};

template <class Impl>
bool reset_if(torch::nn::Module& m) {
  if (auto* typed = dynamic_cast<Impl*>(&m)) {
    typed->reset_parameters();
    return true;
  }
  return false;
}

inline bool reset_known_module(torch::nn::Module& m) {
  return reset_if<torch::nn::LinearImpl>(m) || reset_if<torch::nn::EmbeddingImpl>(m) ||
         reset_if<torch::nn::LayerNormImpl>(m) || reset_if<torch::nn::GroupNormImpl>(m) ||
         reset_if<torch::nn::Conv1dImpl>(m) || reset_if<torch::nn::Conv2dImpl>(m) ||
         reset_if<torch::nn::Conv3dImpl>(m) || reset_if<torch::nn::BatchNorm1dImpl>(m) ||
         reset_if<torch::nn::BatchNorm2dImpl>(m) || reset_if<torch::nn::BatchNorm3dImpl>(m);
}

/// Gives `m`'s own parameters and buffers real memory and initializes them.
inline void materialize_module(torch::nn::Module& m, const std::string& name, const ModuleInit& user_init) {
  const auto own_params = m.named_parameters(/*recurse=*/false);
  const auto own_buffers = m.named_buffers(/*recurse=*/false);
  if (own_params.is_empty() && own_buffers.is_empty()) return;
  at::NoGradGuard no_grad;
  for (const auto& p : own_params) p.value().set_data(at::empty(p.value().sizes(), p.value().options()));
  for (const auto& b : own_buffers) b.value().set_data(at::empty(b.value().sizes(), b.value().options()));
  const bool done = (user_init && user_init(m)) || reset_known_module(m);
  FSDPX_CHECK(done, "deferred_init: module '", name.empty() ? "(root)" : name, "' (", m.name(),
              ") has its own parameters but fsdpx does not know how to initialize it; pass FsdpOptions::init_module");
}

}  // namespace core::detail

/// True while deferred_init constructs a model on this process: a module's constructor may then skip
/// initializing its parameters (the values are discarded; Fsdp initializes each unit as it
/// materializes it), which saves a pass over the whole model.
inline bool in_deferred_init() {
  return dynamic_cast<core::detail::ScratchCpuAllocator*>(c10::GetCPUAllocator()) != nullptr;
}

/// A ModuleInit that leaves materialized parameters uninitialized: only for a model whose every
/// parameter is loaded right after construction (a strict load of pretrained weights).
inline bool skip_init(torch::nn::Module&) { return true; }

/// Constructs `Model(args...)` without materializing its parameters (see the top of this header).
template <class Model, class... Args>
Model deferred_init(Args&&... args) {
  core::detail::ScratchAllocationScope scope;
  Model model(std::forward<Args>(args)...);
  core::detail::DeferredModels::instance().add(model.ptr().get(), scope.scratch());
  return model;
}

}  // namespace fsdpx
