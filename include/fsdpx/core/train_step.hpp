// TrainStep: the trainer's one call per micro-step (LightRFT's strategy.optimizer_step). It counts
// micro-steps and acts on the last of each accumulation: global-norm clip, skip on a non-finite norm,
// optimizer step, LR scheduler step, zero gradients.
//
//   fsdpx::TrainStep train_step(model, optimizer, &scheduler, {.accumulation_steps = 4, .max_grad_norm = 1.0});
//   for (...) {
//     auto loss = model(x, y) / 4;   // the loss of one micro-batch, divided by the accumulation count
//     loss.backward();
//     const auto report = train_step.optimizer_step();
//     if (report.stepped) log(report.grad_norm, report.lr);
//   }
//
// Gradient reduction: with defer_gradient_sync (the default) only the last micro-step's backward
// reduces, the others accumulate unsharded gradients (less communication, one unsharded gradient per
// unit held meanwhile); without it every backward reduces into the shards' gradients. TrainStep
// owns the model's gradient-sync switch while it lives and turns it back on when destroyed.
//
// A skipped step (non-finite global norm, the same on every rank since the norm is all-reduced)
// changes no parameter, no optimizer state and no LR: the schedule counts the updates taken, as
// DeepSpeed's does on an fp16 overflow.
#pragma once

#include <concepts>
#include <cstdint>
#include <limits>
#include <optional>

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/optim/optimizer.h>

#include <fsdpx/core/lr_schedule.hpp>
#include <fsdpx/error.hpp>

namespace fsdpx {

struct TrainStepOptions {
  /// Micro-steps (backward passes) per optimizer step.
  int64_t accumulation_steps = 1;
  /// Clip the global gradient norm to this; nullopt: no clipping (the norm is still measured).
  std::optional<double> max_grad_norm;
  /// Reduce gradients only in the last micro-step's backward (see the file comment).
  bool defer_gradient_sync = true;
};

/// What one optimizer_step() call did, for the trainer's log.
struct StepReport {
  bool stepped = false;             // the optimizer updated the parameters
  bool skipped = false;             // the accumulation ended in a non-finite norm: nothing changed
  int64_t micro_step = 0;           // 1 .. accumulation_steps within the current accumulation
  std::optional<double> grad_norm;  // the global norm before clipping (last micro-step only)
  double lr = 0;                    // the first group's LR of this update (before the scheduler moved)
  int64_t optimizer_steps = 0;      // updates taken by this TrainStep so far
  int64_t skipped_steps = 0;        // accumulations skipped by this TrainStep so far
  bool accumulating() const { return !stepped && !skipped; }
};

/// What TrainStep needs of a model: an fsdpx::Fsdp, or anything with its clipping and sync control.
template <class M>
concept SteppableModel = requires(M& m, double max_norm, bool on) {
  { m.clip_grad_norm_(max_norm).is_finite() } -> std::convertible_to<bool>;
  m.set_requires_gradient_sync(on);
};

template <class Sharded>
class TrainStep {
  static_assert(SteppableModel<Sharded>,
                "TrainStep<Sharded>: Sharded must be an fsdpx::Fsdp<...> (it needs clip_grad_norm_(double) returning "
                "a GradNorm and set_requires_gradient_sync(bool))");

 public:
  TrainStep(Sharded& model, torch::optim::Optimizer& optimizer, LrScheduler* scheduler = nullptr,
            TrainStepOptions options = {})
      : model_(&model), optimizer_(&optimizer), scheduler_(scheduler), options_(options) {
    FSDPX_CHECK(options_.accumulation_steps >= 1, "TrainStep: accumulation_steps is ", options_.accumulation_steps,
                "; it must be >= 1");
    FSDPX_CHECK(!options_.max_grad_norm || *options_.max_grad_norm > 0, "TrainStep: max_grad_norm is ",
                options_.max_grad_norm.value_or(0), "; it must be > 0 (or unset for no clipping)");
    arm_gradient_sync();
  }
  /// Gradient sync is left on: a backward outside TrainStep then reduces as usual.
  ~TrainStep() { model_->set_requires_gradient_sync(true); }
  TrainStep(const TrainStep&) = delete;
  TrainStep& operator=(const TrainStep&) = delete;

  /// Call after each micro-step's backward.
  StepReport optimizer_step() {
    StepReport report;
    report.micro_step = ++micro_step_;
    if (micro_step_ < options_.accumulation_steps) {
      arm_gradient_sync();
      return finish(report);
    }
    micro_step_ = 0;
    arm_gradient_sync();
    const auto norm = model_->clip_grad_norm_(options_.max_grad_norm.value_or(std::numeric_limits<double>::infinity()));
    report.grad_norm = norm.value;
    report.lr = optimizer_->param_groups().front().options().get_lr();
    if (!norm.is_finite()) {  // clip_grad_norm_ cleared the gradients and warned
      ++skipped_steps_;
      report.skipped = true;
    } else {
      optimizer_->step();
      if (scheduler_ != nullptr) scheduler_->step();
      ++optimizer_steps_;
      report.stepped = true;
    }
    optimizer_->zero_grad();
    return finish(report);
  }

  /// Micro-steps into the current accumulation (0 right after an optimizer step).
  int64_t micro_step() const { return micro_step_; }
  int64_t optimizer_steps() const { return optimizer_steps_; }
  int64_t skipped_steps() const { return skipped_steps_; }
  const TrainStepOptions& options() const { return options_; }

 private:
  /// The next backward reduces when it is the accumulation's last, or always without deferral.
  void arm_gradient_sync() {
    model_->set_requires_gradient_sync(!options_.defer_gradient_sync || micro_step_ == options_.accumulation_steps - 1);
  }
  StepReport finish(StepReport report) const {
    if (!report.grad_norm) report.lr = optimizer_->param_groups().front().options().get_lr();
    report.optimizer_steps = optimizer_steps_;
    report.skipped_steps = skipped_steps_;
    return report;
  }

  Sharded* model_;
  torch::optim::Optimizer* optimizer_;
  LrScheduler* scheduler_;
  TrainStepOptions options_;
  int64_t micro_step_ = 0;
  int64_t optimizer_steps_ = 0;
  int64_t skipped_steps_ = 0;
};

}  // namespace fsdpx
