// Optimizers over an Fsdp model's shards. The shards are a few large flat float32 tensors per unit,
// so LibTorch's per-tensor optimizer loops launch few kernels; FusedAdamW also makes one pass over
// each instead of AdamW's several.
#pragma once

#include <concepts>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <fsdpx/core/memory.hpp>
#include <fsdpx/error.hpp>

namespace fsdpx {

namespace detail {

// ---- the optimizers fsdpx knows: one row per LibTorch optimizer -------------------------------------
// LibTorch erases an optimizer's, its state's and its options' types behind base classes; the rows
// below are the one place that names the concrete types, and visit_optimizer_row() the one place that
// recovers them. Adam and AdamW share their fields (adam_like).

struct AdamWRow {
  using Optimizer = torch::optim::AdamW;
  using State = torch::optim::AdamWParamState;
  using Options = torch::optim::AdamWOptions;
  static constexpr bool adam_like = true;
};
struct AdamRow {
  using Optimizer = torch::optim::Adam;
  using State = torch::optim::AdamParamState;
  using Options = torch::optim::AdamOptions;
  static constexpr bool adam_like = true;
};
struct SgdRow {
  using Optimizer = torch::optim::SGD;
  using State = torch::optim::SGDParamState;
  using Options = torch::optim::SGDOptions;
  static constexpr bool adam_like = false;
};
using KnownOptimizers = std::tuple<AdamWRow, AdamRow, SgdRow>;
inline constexpr const char* known_optimizers = "Adam, AdamW and SGD";

/// Which of a row's types an object is: its Optimizer, State or Options.
struct AsOptimizer {
  template <class Row>
  using type = typename Row::Optimizer;
};
struct AsState {
  template <class Row>
  using type = typename Row::State;
};
struct AsOptions {
  template <class Row>
  using type = typename Row::Options;
};

/// Calls fn(Row{}, object as Row's type) for the row `object` belongs to; false when it is in none.
template <class As, class Base, class Fn>
bool visit_optimizer_row(Base& object, Fn&& fn) {
  return std::apply(
      [&](auto... rows) {
        const auto try_row = [&](auto row) {
          using Target = typename As::template type<decltype(row)>;
          auto* p = dynamic_cast<Target*>(&object);
          if (p != nullptr) fn(row, *p);
          return p != nullptr;
        };
        return (try_row(rows) || ...);
      },
      KnownOptimizers{});
}

/// The tensors of one parameter's optimizer state by name. Undefined tensors (e.g. no amsgrad) are
/// left out.
using StateTensors = std::vector<std::pair<std::string, at::Tensor*>>;
inline StateTensors optimizer_state_tensors(torch::optim::OptimizerParamState& state) {
  StateTensors out;
  const auto add = [&](const char* name, at::Tensor& t) {
    if (t.defined()) out.emplace_back(name, &t);
  };
  const bool known = visit_optimizer_row<AsState>(state, [&](auto row, auto& s) {
    if constexpr (decltype(row)::adam_like) {
      add("exp_avg", s.exp_avg()), add("exp_avg_sq", s.exp_avg_sq()), add("max_exp_avg_sq", s.max_exp_avg_sq());
    } else {
      add("momentum_buffer", s.momentum_buffer());
    }
  });
  FSDPX_CHECK(known, "this optimizer's state type is not known to fsdpx (", known_optimizers, " are)");
  return out;
}

}  // namespace detail

/// LibTorch's AdamW, stepped by ATen's fused kernel (`at::_fused_adamw_`, CPU and CUDA; PyTorch's
/// `AdamW(fused=True)`): one pass over each parameter, its gradient and its moments per group, device
/// and dtype, where LibTorch's AdamW runs about eight elementwise kernels per parameter. The same
/// arithmetic in another order (equal within float32 rounding: tests/core/test_flat_param.cpp), and
/// the same state, options and serialization: it is a torch::optim::AdamW everywhere fsdpx and LibTorch
/// look (checkpoints, optimizer state dicts, move_optimizer_state), so either resumes the other's state.
/// A parameter and its gradient must share their dtype and device (fsdpx's shards and gradients do).
class FusedAdamW : public torch::optim::AdamW {
 public:
  using torch::optim::AdamW::AdamW;

  at::Tensor step(LossClosure closure = nullptr) override {
    at::NoGradGuard no_grad;
    at::Tensor loss;
    if (closure) {
      at::AutoGradMode enable_grad(true);
      loss = closure();
    }
    for (auto& group : param_groups()) {
      const auto& o = static_cast<const torch::optim::AdamWOptions&>(group.options());
      // One call per device and dtype (the kernel's requirement); the step counts travel as float
      // tensors on the parameters' device, one per distinct count (usually one per group).
      std::map<std::pair<std::string, at::ScalarType>, Batch> batches;
      for (auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        const at::Tensor& grad = p.grad();
        FSDPX_CHECK(!grad.is_sparse(), "FusedAdamW does not support sparse gradients");
        FSDPX_CHECK(grad.scalar_type() == p.scalar_type() && grad.device() == p.device(), "FusedAdamW: a parameter (",
                    p.scalar_type(), " on ", p.device(), ") and its gradient (", grad.scalar_type(), " on ",
                    grad.device(), ") must share dtype and device; use torch::optim::AdamW for this model");
        auto& state = state_for(p, o);
        state.step(state.step() + 1);
        Batch& b = batches[{p.device().str(), p.scalar_type()}];
        b.params.push_back(p);
        b.grads.push_back(grad);
        b.exp_avgs.push_back(state.exp_avg());
        b.exp_avg_sqs.push_back(state.exp_avg_sq());
        if (o.amsgrad()) b.max_exp_avg_sqs.push_back(state.max_exp_avg_sq());
        auto [it, fresh] = b.step_tensors.try_emplace(state.step());
        if (fresh) {
          it->second = at::scalar_tensor(static_cast<double>(state.step()), p.options().dtype(at::kFloat));
        }
        b.steps.push_back(it->second);
      }
      for (auto& [key, b] : batches) {
        at::_fused_adamw_(b.params, b.grads, b.exp_avgs, b.exp_avg_sqs, b.max_exp_avg_sqs, b.steps, o.lr(),
                          std::get<0>(o.betas()), std::get<1>(o.betas()), o.weight_decay(), o.eps(), o.amsgrad(),
                          /*maximize=*/false);
      }
    }
    return loss;
  }

 private:
  struct Batch {
    std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps;
    std::map<int64_t, at::Tensor> step_tensors;
  };

  // The state LibTorch's AdamW would hold for `p`, created as it creates it.
  torch::optim::AdamWParamState& state_for(const at::Tensor& p, const torch::optim::AdamWOptions& o) {
    auto& slot = state_[p.unsafeGetTensorImpl()];
    if (!slot) {
      auto s = std::make_unique<torch::optim::AdamWParamState>();
      s->step(0);
      s->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
      s->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
      if (o.amsgrad()) s->max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
      slot = std::move(s);
    }
    return static_cast<torch::optim::AdamWParamState&>(*slot);
  }
};

/// AdamW with two groups: matrices with `options.weight_decay()`, everything else (biases, norms)
/// without weight decay. `Optimizer` is torch::optim::AdamW or FusedAdamW (one fused kernel per group):
///   auto optimizer = fsdpx::make_adamw<fsdpx::FusedAdamW>(model, torch::optim::AdamWOptions(1e-5));
template <class Optimizer = torch::optim::AdamW, class Sharded>
  requires std::derived_from<Optimizer, torch::optim::AdamW>
Optimizer make_adamw(const Sharded& model, const torch::optim::AdamWOptions& options) {
  auto no_decay = options;
  no_decay.weight_decay(0.0);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(model.parameters(true), std::make_unique<torch::optim::AdamWOptions>(options));
  groups.emplace_back(model.parameters(false), std::make_unique<torch::optim::AdamWOptions>(no_decay));
  return Optimizer(std::move(groups), options);
}

/// Moves an optimizer's state (Adam/AdamW moments, SGD momentum) to `device`, keeping tensor identity
/// (RL trainers: offload between steps, reload before the next). Pinned when moved to the host of a
/// GPU machine, so the reload copies asynchronously; moving to the host releases the device's cached
/// blocks, so another process can use them. Call it after Fsdp::offload_model() (or
/// wait_for_shard_readers()): a background checkpoint copy may still read the state.
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
