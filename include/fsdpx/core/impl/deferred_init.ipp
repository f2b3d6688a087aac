// deferred_init.hpp's out-of-line part: included by that header (header-only) or by
// fsdpx/impl/src.hpp (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <c10/core/CPUAllocator.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <fsdpx/core/deferred_init.hpp>

namespace fsdpx {

namespace core::detail {

FSDPX_DECL DeferredModels& DeferredModels::instance() {
  static DeferredModels models;
  return models;
}

FSDPX_DECL void DeferredModels::add(const torch::nn::Module* m, std::shared_ptr<ScratchCpuAllocator> scratch) {
  std::lock_guard lock(mutex_);
  models_[m] = std::move(scratch);
}

FSDPX_DECL bool DeferredModels::contains(const torch::nn::Module* m) const {
  std::lock_guard lock(mutex_);
  return models_.count(m) != 0;
}

FSDPX_DECL void DeferredModels::remove(const torch::nn::Module* m) {
  std::lock_guard lock(mutex_);
  models_.erase(m);
}

template <class Impl>
bool reset_if(torch::nn::Module& m) {
  if (auto* typed = dynamic_cast<Impl*>(&m)) {
    typed->reset_parameters();
    return true;
  }
  return false;
}

FSDPX_DECL bool reset_known_module(torch::nn::Module& m) {
  return reset_if<torch::nn::LinearImpl>(m) || reset_if<torch::nn::EmbeddingImpl>(m) ||
         reset_if<torch::nn::LayerNormImpl>(m) || reset_if<torch::nn::GroupNormImpl>(m) ||
         reset_if<torch::nn::Conv1dImpl>(m) || reset_if<torch::nn::Conv2dImpl>(m) ||
         reset_if<torch::nn::Conv3dImpl>(m) || reset_if<torch::nn::BatchNorm1dImpl>(m) ||
         reset_if<torch::nn::BatchNorm2dImpl>(m) || reset_if<torch::nn::BatchNorm3dImpl>(m);
}

FSDPX_DECL void materialize_module(torch::nn::Module& m, const std::string& name, const ModuleInit& user_init) {
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

FSDPX_DECL bool in_deferred_init() {
  return dynamic_cast<core::detail::ScratchCpuAllocator*>(c10::GetCPUAllocator()) != nullptr;
}

}  // namespace fsdpx
