// The module predicates of fsdpx/core/module_precision.hpp, out of line: they need LibTorch's
// normalization modules' headers, which a separately compiled program then compiles once.
#pragma once

#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/instancenorm.h>
#include <torch/nn/modules/normalization.h>

#include <fsdpx/core/module_precision.hpp>
#include <fsdpx/core/sync_batch_norm.hpp>

namespace fsdpx {

namespace detail {
template <class... Impl>
bool is_any_of(const torch::nn::Module& module) {
  return (... || (dynamic_cast<const Impl*>(&module) != nullptr));
}
}  // namespace detail

FSDPX_DECL bool is_batch_norm(const std::string& /*name*/, const torch::nn::Module& module) {
  return detail::is_any_of<torch::nn::BatchNorm1dImpl, torch::nn::BatchNorm2dImpl, torch::nn::BatchNorm3dImpl,
                           SyncBatchNormImpl>(module);
}

FSDPX_DECL bool is_norm_layer(const std::string& name, const torch::nn::Module& module) {
  return is_batch_norm(name, module) ||
         detail::is_any_of<torch::nn::InstanceNorm1dImpl, torch::nn::InstanceNorm2dImpl, torch::nn::InstanceNorm3dImpl,
                           torch::nn::LayerNormImpl, torch::nn::GroupNormImpl>(module);
}

}  // namespace fsdpx
