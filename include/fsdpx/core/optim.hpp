// Optimizers over an Fsdp model's shards. The shards are a few large flat float32 tensors per unit,
// so LibTorch's per-tensor optimizer loops step them quickly.
#pragma once

#include <memory>
#include <vector>

#include <torch/optim/adamw.h>

namespace fsdpx {

/// AdamW with two groups: matrices with `options.weight_decay()`, everything else (biases, norms)
/// without weight decay.
template <class Sharded>
torch::optim::AdamW make_adamw(const Sharded& model, const torch::optim::AdamWOptions& options) {
  auto no_decay = options;
  no_decay.weight_decay(0.0);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(model.parameters(true), std::make_unique<torch::optim::AdamWOptions>(options));
  groups.emplace_back(model.parameters(false), std::make_unique<torch::optim::AdamWOptions>(no_decay));
  return torch::optim::AdamW(std::move(groups), options);
}

}  // namespace fsdpx
