// Optimizers over an Fsdp model's shards. The shards are a few large flat float32 tensors per unit,
// so LibTorch's per-tensor optimizer loops step them quickly.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <fsdpx/core/memory.hpp>
#include <fsdpx/error.hpp>

namespace fsdpx {

namespace detail {

/// The tensors of one parameter's optimizer state by name (the one place that knows LibTorch's
/// state types: Adam, AdamW, SGD). Undefined tensors (e.g. no amsgrad) are left out.
using StateTensors = std::vector<std::pair<std::string, at::Tensor*>>;
inline StateTensors optimizer_state_tensors(torch::optim::OptimizerParamState& state) {
  StateTensors out;
  const auto add = [&](const char* name, at::Tensor& t) {
    if (t.defined()) out.emplace_back(name, &t);
  };
  if (auto* s = dynamic_cast<torch::optim::AdamWParamState*>(&state)) {
    add("exp_avg", s->exp_avg()), add("exp_avg_sq", s->exp_avg_sq()), add("max_exp_avg_sq", s->max_exp_avg_sq());
  } else if (auto* a = dynamic_cast<torch::optim::AdamParamState*>(&state)) {
    add("exp_avg", a->exp_avg()), add("exp_avg_sq", a->exp_avg_sq()), add("max_exp_avg_sq", a->max_exp_avg_sq());
  } else if (auto* g = dynamic_cast<torch::optim::SGDParamState*>(&state)) {
    add("momentum_buffer", g->momentum_buffer());
  } else {
    FSDPX_CHECK(false, "this optimizer's state type is not known to fsdpx (Adam, AdamW and SGD are)");
  }
  return out;
}

}  // namespace detail

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
/// GPU machine, so the reload copies asynchronously; moving to the host releases the device's cached
/// blocks, so another process can use them. Call it after Fsdp::offload_model() (or
/// wait_for_snapshots()): a background checkpoint copy may still read the state.
inline void move_optimizer_state(torch::optim::Optimizer& optimizer, at::Device device, bool pin_memory = true) {
  const auto move = [&](at::Tensor& t) {
    if (!t.defined()) return;
    at::Tensor moved = t.to(device);
    if (pin_memory && device.is_cpu() && t.is_cuda()) moved = moved.pin_memory();
    t.set_data(moved);
  };
  for (auto& [key, state] : optimizer.state()) {
    for (auto& [name, tensor] : detail::optimizer_state_tensors(*state)) move(*tensor);
  }
  if (device.is_cpu()) release_cached_device_memory();  // the device's freed blocks go back to its driver
}

}  // namespace fsdpx
