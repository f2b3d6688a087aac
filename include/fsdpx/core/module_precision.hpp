// Which modules keep their parameters in float32 under a mixed precision policy
// (FsdpOptions::keep_full_precision). Such a module's parameters form a second flat buffer of their
// unit, gathered and freed with it, computed and reduced in float32; the unit's other parameters and
// its inputs stay in the policy's dtype. ATen's BatchNorm, LayerNorm, GroupNorm and InstanceNorm take a
// low-precision input with float32 parameters (and BatchNorm's float32 running statistics) and return
// the input's dtype, so a kept norm needs no cast by the user.
#pragma once

#include <fsdpx/detail/config.hpp>

#include <string>

#include <torch/nn/module.h>

namespace fsdpx {

/// BatchNorm1d, 2d or 3d, or fsdpx::SyncBatchNorm: FsdpOptions::keep_full_precision's default (as FSDP1's mixed
/// precision keeps BatchNorm in float32: bfloat16 weights beside float32 running statistics are refused by ATen).
FSDPX_DECL bool is_batch_norm(const std::string& name, const torch::nn::Module& module);

/// Any of LibTorch's normalization layers: BatchNorm, InstanceNorm (1d-3d), LayerNorm, GroupNorm.
FSDPX_DECL bool is_norm_layer(const std::string& name, const torch::nn::Module& module);

}  // namespace fsdpx

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/core/impl/module_precision.ipp>
#endif
