// Optimizers over an Fsdp model's shards. The shards are a few large flat float32 tensors per unit,
// so LibTorch's per-tensor optimizer loops step them quickly.
#pragma once

#include <memory>
#include <vector>

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <fsdpx/error.hpp>

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

/// Moves an optimizer's state (Adam/AdamW moments, SGD momentum) to `device`, keeping tensor identity
/// (RL trainers: offload between steps, reload before the next). Pinned when moved to the host of a
/// GPU machine, so the reload copies asynchronously.
inline void move_optimizer_state(torch::optim::Optimizer& optimizer, at::Device device, bool pin_memory = true) {
  const auto move = [&](at::Tensor& t) {
    if (!t.defined()) return;
    at::Tensor moved = t.to(device);
    if (pin_memory && device.is_cpu() && t.is_cuda()) moved = moved.pin_memory();
    t.set_data(moved);
  };
  for (auto& [key, state] : optimizer.state()) {
    if (auto* s = dynamic_cast<torch::optim::AdamWParamState*>(state.get())) {
      move(s->exp_avg());
      move(s->exp_avg_sq());
      move(s->max_exp_avg_sq());
    } else if (auto* a = dynamic_cast<torch::optim::AdamParamState*>(state.get())) {
      move(a->exp_avg());
      move(a->exp_avg_sq());
      move(a->max_exp_avg_sq());
    } else if (auto* g = dynamic_cast<torch::optim::SGDParamState*>(state.get())) {
      move(g->momentum_buffer());
    } else {
      FSDPX_CHECK(false, "move_optimizer_state: this optimizer's state type is not known (Adam, AdamW and SGD are)");
    }
  }
}

}  // namespace fsdpx
