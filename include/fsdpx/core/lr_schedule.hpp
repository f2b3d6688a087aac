// Learning-rate schedules over any LibTorch optimizer (every parameter group), the curves of
// transformers' get_*_schedule_with_warmup, step for step:
//
//   auto optimizer = fsdpx::make_adamw(model, torch::optim::AdamWOptions(1e-5));
//   fsdpx::LrScheduler scheduler(optimizer, fsdpx::LrSchedule::cosine(/*warmup=*/100, /*total=*/10000, 0.1));
//   ... optimizer.step(); scheduler.step();
//
// As with transformers' LambdaLR: constructing the scheduler sets each group's LR to base * factor(0),
// and the n-th step() sets it to base * factor(n), where base is the group's LR at construction.
// LibTorch ships no such scheduler state to save, so LrScheduler has its own (state_dict()), which the
// checkpoint coordinator stores in extra_state.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <torch/optim/optimizer.h>

#include <fsdpx/error.hpp>

namespace fsdpx {

namespace detail {

/// Why a saved schedule's values are none a run makes (empty when they are a run's): a step count no run
/// reaches, or a base LR that is not a finite number >= 0. A saved schedule is checked as a config value is,
/// by every reader of one (LrScheduler, LightRFT's scheduler_state.pt); `step_name` is the saved field's name.
inline std::string implausible_schedule(int64_t last_step, const std::vector<double>& base_lrs, const char* step_name) {
  constexpr int64_t max_steps = int64_t{1} << 40;
  if (last_step < 0 || last_step > max_steps) return str("no integer ", step_name, " in [0, 2^40]");
  for (const double lr : base_lrs) {
    if (!std::isfinite(lr) || lr < 0) return str("a base_lrs entry is ", lr, ", not a finite lr >= 0");
  }
  return {};
}

}  // namespace detail

enum class LrScheduleKind { constant, constant_with_warmup, linear, cosine };

inline std::string_view to_string(LrScheduleKind k) {
  switch (k) {
    case LrScheduleKind::constant: return "constant";
    case LrScheduleKind::constant_with_warmup: return "constant_with_warmup";
    case LrScheduleKind::linear: return "linear";
    case LrScheduleKind::cosine: return "cosine";
  }
  return "unknown";
}

/// The shape of a schedule: a factor of each group's base LR per optimizer step.
struct LrSchedule {
  LrScheduleKind kind = LrScheduleKind::constant;
  int64_t warmup_steps = 0;   // factor rises linearly from 0 to 1 over these steps
  int64_t total_steps = 0;    // linear and cosine: the decay ends here
  double min_lr_ratio = 0.0;  // cosine: the floor, a fraction of the base LR (transformers' min_lr_rate)
  double num_cycles = 0.5;    // cosine: half a cosine wave by default

  static LrSchedule constant() { return {}; }
  static LrSchedule constant_with_warmup(int64_t warmup_steps) {
    return {.kind = LrScheduleKind::constant_with_warmup, .warmup_steps = warmup_steps};
  }
  /// get_linear_schedule_with_warmup: to 0 at total_steps.
  static LrSchedule linear(int64_t warmup_steps, int64_t total_steps) {
    return {.kind = LrScheduleKind::linear, .warmup_steps = warmup_steps, .total_steps = total_steps};
  }
  /// get_cosine_schedule_with_warmup (min_lr_ratio 0) or get_cosine_with_min_lr_schedule_with_warmup.
  static LrSchedule cosine(int64_t warmup_steps, int64_t total_steps, double min_lr_ratio = 0.0,
                           double num_cycles = 0.5) {
    return {LrScheduleKind::cosine, warmup_steps, total_steps, min_lr_ratio, num_cycles};
  }

  void validate() const {
    FSDPX_CHECK(warmup_steps >= 0, "LrSchedule: warmup_steps is ", warmup_steps, "; it must be >= 0");
    const bool decays = kind == LrScheduleKind::linear || kind == LrScheduleKind::cosine;
    FSDPX_CHECK(!decays || total_steps > 0, "LrSchedule: a ", to_string(kind), " schedule needs total_steps > 0 (got ",
                total_steps, ")");
    FSDPX_CHECK(!decays || warmup_steps <= total_steps, "LrSchedule: warmup_steps (", warmup_steps,
                ") exceeds total_steps (", total_steps, ")");
    FSDPX_CHECK(min_lr_ratio >= 0.0 && min_lr_ratio <= 1.0, "LrSchedule: min_lr_ratio is ", min_lr_ratio,
                "; it must lie in [0, 1]");
    FSDPX_CHECK(num_cycles > 0.0, "LrSchedule: num_cycles is ", num_cycles, "; it must be > 0");
  }

  /// The factor of the base LR at optimizer step `step` (0-based), transformers' lr_lambda.
  double factor(int64_t step) const {
    if (kind == LrScheduleKind::constant) return 1.0;
    if (step < warmup_steps) return static_cast<double>(step) / static_cast<double>(std::max<int64_t>(1, warmup_steps));
    if (kind == LrScheduleKind::constant_with_warmup) return 1.0;
    const double decay_steps = static_cast<double>(std::max<int64_t>(1, total_steps - warmup_steps));
    if (kind == LrScheduleKind::linear) return std::max(0.0, static_cast<double>(total_steps - step) / decay_steps);
    const double progress = static_cast<double>(step - warmup_steps) / decay_steps;
    const double wave = 0.5 * (1.0 + std::cos(std::numbers::pi * num_cycles * 2.0 * progress));
    return std::max(0.0, wave * (1.0 - min_lr_ratio) + min_lr_ratio);
  }

  bool operator==(const LrSchedule&) const = default;
};

/// Applies an LrSchedule to every parameter group of an optimizer.
class LrScheduler {
 public:
  LrScheduler(torch::optim::Optimizer& optimizer, LrSchedule schedule) : optimizer_(&optimizer), schedule_(schedule) {
    schedule_.validate();
    for (auto& group : optimizer_->param_groups()) base_lrs_.push_back(group.options().get_lr());
    FSDPX_CHECK(!base_lrs_.empty(), "LrScheduler: the optimizer has no parameter groups");
    apply();
  }

  /// Moves to the next optimizer step's LR. Call once per optimizer step taken.
  void step() {
    ++last_step_;
    apply();
  }

  /// Steps taken so far: the current LRs are base * schedule().factor(last_step()).
  int64_t last_step() const { return last_step_; }
  const LrSchedule& schedule() const { return schedule_; }
  const std::vector<double>& base_lrs() const { return base_lrs_; }
  /// Each group's LR now.
  std::vector<double> last_lr() const {
    std::vector<double> out;
    for (auto& group : optimizer_->param_groups()) out.push_back(group.options().get_lr());
    return out;
  }
  /// The first group's LR now (what a trainer logs).
  double lr() const { return optimizer_->param_groups().front().options().get_lr(); }

  /// What resumes the schedule: the step, each group's base LR, and the schedule it was saved with.
  c10::IValue state_dict() const {
    c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
    d.insert("last_step", last_step_);
    d.insert("base_lrs", c10::List<double>(base_lrs_));
    for (const auto& [key, value] : shape_fields()) d.insert(key, value);
    return d;
  }

  /// Throws, naming the problem, when `state` cannot be loaded into this scheduler.
  void check_state_dict(const c10::IValue& state) const { (void)parse(state); }

  /// Restores the step and the base LRs and sets the LRs they give. The schedule's shape stays the
  /// one this scheduler was built with (a run may be extended by a larger total_steps); a saved shape
  /// that differs is reported in a warning that names each field.
  void load_state_dict(const c10::IValue& state) {
    const Saved saved = parse(state);
    const auto d = state.toGenericDict();
    std::string changed;
    for (const auto& [key, now] : shape_fields()) {
      if (d.contains(key) && d.at(key) != now)
        changed += detail::str(changed.empty() ? "" : ", ", key, " ", d.at(key), " -> ", now);
    }
    if (!changed.empty()) {
      TORCH_WARN("fsdpx: the LR schedule differs from the one saved (", changed,
                 "); the step and base LRs are restored and the new schedule is followed from there");
    }
    last_step_ = saved.last_step;
    base_lrs_ = saved.base_lrs;
    apply();
  }

  /// Sets every group's LR to base * factor(last_step()), e.g. after loading optimizer state, which
  /// brings the LRs it was saved with.
  void apply() {
    const double f = schedule_.factor(last_step_);
    auto& groups = optimizer_->param_groups();
    FSDPX_CHECK(groups.size() == base_lrs_.size(), "LrScheduler: the optimizer has ", groups.size(),
                " parameter groups, the scheduler was built for ", base_lrs_.size());
    for (size_t i = 0; i < groups.size(); ++i) groups[i].options().set_lr(base_lrs_[i] * f);
  }

 private:
  /// The schedule's shape as saved, one place for state_dict() and load_state_dict()'s comparison.
  std::vector<std::pair<const char*, c10::IValue>> shape_fields() const {
    return {{"kind", std::string(to_string(schedule_.kind))},
            {"warmup_steps", schedule_.warmup_steps},
            {"total_steps", schedule_.total_steps},
            {"min_lr_ratio", schedule_.min_lr_ratio},
            {"num_cycles", schedule_.num_cycles}};
  }

  struct Saved {
    int64_t last_step;
    std::vector<double> base_lrs;
  };
  Saved parse(const c10::IValue& state) const {
    FSDPX_CHECK(state.isGenericDict(), "LrScheduler::load_state_dict: expected a dict, got ", state.tagKind());
    const auto d = state.toGenericDict();
    const auto get = [&](const char* key) {
      FSDPX_CHECK(d.contains(key), "LrScheduler::load_state_dict: the saved scheduler state has no '", key, "'");
      return d.at(key);
    };
    const c10::IValue step = get("last_step");
    FSDPX_CHECK(step.isInt(), "LrScheduler::load_state_dict: 'last_step' must be an integer");
    const c10::IValue bases = get("base_lrs");
    FSDPX_CHECK(bases.isDoubleList(), "LrScheduler::load_state_dict: 'base_lrs' must be a list of floats");
    auto saved = bases.toDoubleVector();
    const std::string implausible = detail::implausible_schedule(step.toInt(), saved, "last_step");
    FSDPX_CHECK(implausible.empty(), "LrScheduler::load_state_dict: the saved state has ", implausible);
    FSDPX_CHECK(saved.size() == base_lrs_.size(), "LrScheduler::load_state_dict: the saved state has ", saved.size(),
                " parameter groups but the optimizer has ", base_lrs_.size());
    return {step.toInt(), std::move(saved)};
  }

  torch::optim::Optimizer* optimizer_;
  LrSchedule schedule_;
  std::vector<double> base_lrs_;
  int64_t last_step_ = 0;
};

}  // namespace fsdpx
