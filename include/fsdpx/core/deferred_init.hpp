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

#include <fsdpx/detail/config.hpp>

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>

#include <torch/nn/module.h>

#include <fsdpx/core/detail/storage.hpp>
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
  FSDPX_DECL static DeferredModels& instance();
  FSDPX_DECL void add(const torch::nn::Module* m, std::shared_ptr<ScratchCpuAllocator> scratch);
  FSDPX_DECL bool contains(const torch::nn::Module* m) const;
  FSDPX_DECL void remove(const torch::nn::Module* m);

 private:
  DeferredModels() = default;
  mutable std::mutex mutex_;
  std::unordered_map<const torch::nn::Module*, std::shared_ptr<ScratchCpuAllocator>> models_;
};

/// Initializes `m` when it is a LibTorch module with reset_parameters() that fsdpx knows.
FSDPX_DECL bool reset_known_module(torch::nn::Module& m);

/// Gives `m`'s own parameters and buffers real memory and initializes them.
FSDPX_DECL void materialize_module(torch::nn::Module& m, const std::string& name, const ModuleInit& user_init);

}  // namespace core::detail

/// True while deferred_init constructs a model on this process: a module's constructor may then skip
/// initializing its parameters (the values are discarded; Fsdp initializes each unit as it
/// materializes it), which saves a pass over the whole model.
FSDPX_DECL bool in_deferred_init();

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

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/core/impl/deferred_init.ipp>
#endif
