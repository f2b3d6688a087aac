// One optimizer step of a sharded model against another computation of the same step (an unsharded
// reference, or the same model at another world size), from the same weights, within bounds derived from
// the arithmetic (rounding.hpp, docs/numerics.md): the loss, the gradient norm, every gradient element
// this rank holds, and every master weight after the AdamW step.
//
// Why step by step: AdamW divides by sqrt(v) + eps, so where a gradient is tiny, its rounding becomes a
// large part of that parameter's update; and a weight that differs changes the next step's gradients by
// an amount only the model's curvature knows. So each step is compared from equal weights (the reference
// then takes the sharded model's weights), and the update's bound is AdamW's own sensitivity to a
// gradient difference, element by element, from the optimizer's second moment.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/adamw.h>

#include <fsdpx/core/sharded_model.hpp>

#include "rounding.hpp"

namespace fsdpx::test {

/// How far one AdamW update of `values` (float32 masters with second moment `exp_avg_sq` after `step`
/// steps) may lie from another computation of the same update, element by element, when every gradient
/// so far differed by at most `d`:
///   |m_hat - m_hat'| <= d, |sqrt(v_hat) - sqrt(v_hat')| <= d (weighted means and RMS of the
///   differences), |m_hat'| <= kappa_t sqrt(v_hat') (rounding::adam_moment_ratio), so
///   |update - update'| <= lr (1 + kappa_t) d / (sqrt(v_hat) + eps),
/// plus the two updates' own rounding: 4 u |theta| (decay and subtraction, both runs) and
/// 10 u lr kappa_t (t + 1) (the moments' and the quotient's roundings, accumulated over t steps), which
/// also bounds two implementations of the same update (FusedAdamW against LibTorch's AdamW) with d = 0.
inline at::Tensor adamw_update_bound(const at::Tensor& values, const at::Tensor& exp_avg_sq, int64_t step,
                                     const torch::optim::AdamWOptions& o, double lr, double d) {
  const double u = rounding::unit_roundoff(at::kFloat), b2 = std::get<1>(o.betas());
  const double kappa = rounding::adam_moment_ratio(std::get<0>(o.betas()), b2, step);
  const at::Tensor denominator = (exp_avg_sq / (1 - std::pow(b2, static_cast<double>(step)))).sqrt() + o.eps();
  return lr * (1 + kappa) * d / denominator + 4 * u * values.abs() +
         10 * u * lr * kappa * static_cast<double>(step + 1);
}

/// This rank's part of one parameter: elements [begin, end) of the flattened parameter `name`, as the
/// shard's float32 masters (`values`), their gradient (undefined: none) and, once stepped, the AdamW state
/// and hyperparameters that step them (`options` null: a frozen parameter, never stepped).
struct HeldSlice {
  std::string name;
  int64_t begin = 0, end = 0;
  at::Tensor values, grad, exp_avg_sq;
  int64_t step = 0;
  const torch::optim::AdamWOptions* options = nullptr;
};

/// Every parameter slice this rank holds, with `optimizer`'s state for it (an AdamW over the model's
/// shards, as make_adamw builds; nullptr: values and gradients only).
inline std::vector<HeldSlice> held_slices(const core::ShardedModel& m, torch::optim::Optimizer* optimizer = nullptr) {
  std::vector<HeldSlice> out;
  const auto options_of = [&](const at::Tensor& t) -> const torch::optim::AdamWOptions* {
    if (optimizer == nullptr) return nullptr;
    for (auto& group : optimizer->param_groups()) {
      for (const auto& p : group.params()) {
        if (p.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) {
          auto* o = dynamic_cast<const torch::optim::AdamWOptions*>(&group.options());
          if (o == nullptr) throw std::invalid_argument("step parity bounds AdamW steps; this optimizer is not AdamW");
          return o;
        }
      }
    }
    return nullptr;
  };
  for (size_t i = 0; i < m.num_units(); ++i) {
    const core::Unit& u = m.unit(i);
    const int64_t base = u.layout().shard_range(u.shard_rank()).begin;
    // A frozen unit has no optimizer views: its whole shard, never stepped.
    std::vector<core::Unit::OptimParam> views = u.optim_params();
    if (views.empty()) views.push_back({u.shard(), {0, u.shard().numel()}, false});
    for (const auto& view : views) {
      at::Tensor exp_avg_sq;
      int64_t step = 0;
      if (optimizer != nullptr) {
        const auto it = optimizer->state().find(view.tensor.unsafeGetTensorImpl());
        if (it != optimizer->state().end()) {
          auto& s = dynamic_cast<torch::optim::AdamWParamState&>(*it->second);
          exp_avg_sq = s.exp_avg_sq();
          step = s.step();
        }
      }
      const auto* options = u.trainable() ? options_of(view.tensor) : nullptr;
      const int64_t lo_view = base + view.range.begin, hi_view = base + view.range.end;
      for (const core::ParamInfo& p : u.layout().params()) {
        const int64_t lo = std::max(p.offset, lo_view), hi = std::min(p.offset + p.numel, hi_view);
        if (lo >= hi) continue;
        const auto part = [&](const at::Tensor& t) {
          return t.defined() ? t.detach().narrow(0, lo - lo_view, hi - lo) : t;
        };
        out.push_back({p.name, lo - p.offset, hi - p.offset, part(view.tensor), part(view.tensor.grad()),
                       part(exp_avg_sq), step, options});
      }
    }
  }
  return out;
}

/// The largest error / bound a comparison reached, and where.
struct Closest {
  double ratio = 0;
  std::string where;
  void note(double ratio_here, const std::string& here) {
    if (!(ratio_here <= ratio)) ratio = ratio_here, where = here;  // NaN counts as the worst
  }
  bool holds() const { return ratio <= 1; }
};

/// Relative bounds of one model's step (rounding::relative of its paths).
struct StepBounds {
  double loss = 0;      // the loss, relative to its value
  double gradient = 0;  // each gradient element, relative to the largest of its unit's gradients
};

/// The relative bounds of one step of a model with forward path `forward` on a batch of `tokens`.
inline StepBounds step_bounds(const rounding::Path& forward, int64_t tokens) {
  return {.loss = rounding::relative(rounding::loss(forward, tokens)),
          .gradient = rounding::relative(rounding::backward(forward, tokens))};
}

class StepParity {
 public:
  explicit StepParity(StepBounds bounds) : bounds_(bounds) {}

  /// The reference's gradients of this step, as the optimizer takes them (after clipping, if `clipped`).
  /// A gradient's rounding is relative to the terms its sums add, not to its result: a gradient whose
  /// terms nearly cancel (the keys' projection: the softmax's rows sum to zero, so its gradient sums
  /// terms of both signs over the queries) is far smaller than its terms. Those terms are of the size of
  /// the other gradients of its unit (a layer), so each gradient's bound scales with the largest gradient
  /// element of its unit. Clipping adds the norm's relative error (a norm that differs scales every
  /// clipped element).
  void note_reference_gradients(const core::ShardedModel& m, const std::map<std::string, at::Tensor>& grads,
                                bool clipped) {
    double squares = 0, scaled = 0;
    int64_t n = 0;
    std::map<std::string, double> own;
    for (const auto& [name, g] : grads) {
      const double s = g.defined() ? g.abs().max().item<double>() : 0.0;
      own[name] = s;
      if (!g.defined()) continue;
      squares += g.to(at::kDouble).pow(2).sum().item<double>();
      scaled += static_cast<double>(g.numel()) * s * s;
      n += g.numel();
    }
    norm_bound_ = norm_relative_bound(squares, scaled, n);
    std::map<std::string, double> scale = own;
    for (size_t i = 0; i < m.num_units(); ++i) {
      double unit = 0;
      for (const core::ParamInfo& p : m.unit(i).layout().params())
        unit = std::max(unit, own.count(p.name) != 0 ? own.at(p.name) : 0.0);
      for (const core::ParamInfo& p : m.unit(i).layout().params()) scale[p.name] = unit;
    }
    for (const auto& [name, s] : scale) {
      const double b = (bounds_.gradient + (clipped ? norm_bound_ : 0.0)) * s;
      step_bound_[name] = b;
      history_bound_[name] = std::max(history_bound_[name], b);
    }
  }

  /// The relative bound of the gradient norm this step (set by note_reference_gradients).
  double norm_bound() const { return norm_bound_; }

  void check_loss(double got, double want) {
    loss_.note(std::abs(got - want) / (bounds_.loss * std::abs(want)), "loss");
  }
  void check_norm(double got, double want) {
    norm_.note(std::abs(got - want) / (norm_bound_ * std::abs(want)), "gradient norm");
  }

  /// Every gradient element this rank holds against the reference's (a missing one counts as zero).
  void check_gradients(const core::ShardedModel& m, const std::map<std::string, at::Tensor>& want) {
    for (const HeldSlice& s : held_slices(m)) {
      const auto it = want.find(s.name);
      if (it == want.end() && !s.grad.defined()) continue;  // frozen here and there
      const at::Tensor ref = slice(it == want.end() ? at::Tensor() : it->second, s, s.values);
      const at::Tensor got = s.grad.defined() ? s.grad : at::zeros_like(s.values);
      const double error = (got - ref).abs().max().item<double>();
      const double bound = step_bound_.count(s.name) != 0 ? step_bound_.at(s.name) : 0.0;
      gradient_.note(ratio(error, bound), s.name + where(s));
    }
  }

  /// Every master element this rank holds after the optimizer step, against `want` (the reference's
  /// parameters after its step from the same weights): within adamw_update_bound for the gradient
  /// differences bounded so far (D_p per parameter). A frozen parameter must be unchanged, bit for bit.
  /// `lr`: the step's learning rate where a schedule has changed the optimizer's since (else the group's).
  void check_step(torch::optim::Optimizer& optimizer, const core::ShardedModel& m,
                  const std::map<std::string, at::Tensor>& want, std::optional<double> lr_of_step = std::nullopt) {
    for (const HeldSlice& s : held_slices(m, &optimizer)) {
      const at::Tensor ref = slice(want.at(s.name), s, s.values);
      const at::Tensor error = (s.values - ref).abs();
      if (s.options == nullptr || !s.exp_avg_sq.defined()) {
        update_.note(error.max().item<double>() == 0 ? 0.0 : std::numeric_limits<double>::infinity(),
                     s.name + where(s) + " (never stepped: must be unchanged)");
        continue;
      }
      const double d = history_bound_.count(s.name) != 0 ? history_bound_.at(s.name) : 0.0;
      const at::Tensor bound =
          adamw_update_bound(s.values, s.exp_avg_sq, s.step, *s.options, lr_of_step.value_or(s.options->lr()), d);
      update_.note((error / bound).max().item<double>(), s.name + where(s));
    }
  }

  const Closest& loss() const { return loss_; }
  const Closest& norm() const { return norm_; }
  const Closest& gradients() const { return gradient_; }
  const Closest& updates() const { return update_; }
  bool holds() const { return loss_.holds() && norm_.holds() && gradient_.holds() && update_.holds(); }

  /// One line: how close each comparison came to its bound (1 = at the bound).
  std::string summary() const {
    std::ostringstream s;
    s.precision(2);
    s << "of their bounds: loss " << loss_.ratio << ", gradient norm " << norm_.ratio << ", gradients "
      << gradient_.ratio << " (" << gradient_.where << "), updates " << update_.ratio << " (" << update_.where << ")";
    return s.str();
  }

 private:
  StepBounds bounds_;
  double norm_bound_ = 0;
  std::map<std::string, double> step_bound_, history_bound_;
  Closest loss_, norm_, gradient_, update_;

  /// The norm of gradients that differ elementwise by at most bound_g x their tensor's largest element
  /// differs by at most the norm of those differences: bound_g sqrt(sum_p n_p max_p^2) / |g|; plus the
  /// norm's own sum of squares (positive terms, n of them) taken in another order.
  double norm_relative_bound(double squares, double scaled, int64_t n) const {
    if (squares <= 0) return bounds_.gradient;
    return bounds_.gradient * std::sqrt(scaled / squares) + rounding::relative({.length = std::max<int64_t>(n, 1)});
  }

  static double ratio(double error, double bound) {
    if (error == 0) return 0;
    return bound > 0 ? error / bound : std::numeric_limits<double>::infinity();
  }
  static at::Tensor slice(const at::Tensor& full, const HeldSlice& s, const at::Tensor& like) {
    if (!full.defined()) return at::zeros_like(like);
    return full.detach().reshape({-1}).narrow(0, s.begin, s.end - s.begin).to(like.device(), like.scalar_type());
  }
  static std::string where(const HeldSlice& s) {
    return "[" + std::to_string(s.begin) + ", " + std::to_string(s.end) + ")";
  }
};

/// A module's parameters (or their gradients) by name, detached.
inline std::map<std::string, at::Tensor> named_values(torch::nn::Module& m) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : m.named_parameters()) out[p.key()] = p.value().detach();
  return out;
}
inline std::map<std::string, at::Tensor> named_gradients(torch::nn::Module& m) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : m.named_parameters()) {
    if (p.value().requires_grad()) out[p.key()] = p.value().grad();
  }
  return out;
}

/// The reference takes the sharded model's weights (collective: every rank of the model's world), so the
/// next step is compared from equal weights.
template <class Sharded>
void take_weights(torch::nn::Module& reference, Sharded& sharded) {
  auto scope = sharded.full_parameters();
  at::NoGradGuard no_grad;
  auto want = reference.named_parameters();
  for (const auto& p : sharded->named_parameters()) want[p.key()].copy_(p.value());
}

/// One step compared, after both backward passes (unclipped): this rank's gradients, both optimizers'
/// steps, every updated weight this rank holds; then the reference takes the sharded weights (collective).
/// `loss` (this rank's: a mean over as many tokens as every other rank's) and `ref_loss` (the whole
/// batch's), when given, are compared too.
template <class Sharded>
void step_both(StepParity& parity, Sharded& sharded, torch::optim::Optimizer& optimizer, torch::nn::Module& reference,
               torch::optim::Optimizer& ref_optimizer, const at::Tensor& loss = {}, const at::Tensor& ref_loss = {}) {
  const auto gradients = named_gradients(reference);
  parity.note_reference_gradients(sharded.sharded(), gradients, false);
  parity.check_gradients(sharded.sharded(), gradients);
  if (loss.defined()) {
    auto global = loss.detach().to(at::kDouble).reshape({1});
    sharded.sharded().mesh().world().all_reduce(global, dist::ReduceOp::avg);
    parity.check_loss(global.item<double>(), ref_loss.item<double>());
  }
  optimizer.step();
  ref_optimizer.step();
  parity.check_step(optimizer, sharded.sharded(), named_values(reference));
  take_weights(reference, sharded);
}

}  // namespace fsdpx::test
