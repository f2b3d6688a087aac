// Fsdp<Model, MeshPolicy, OffloadPolicy, PrecisionPolicy, StateDictPolicy, WrapPolicy, CheckpointPolicy>:
// a LibTorch module trained with its parameters, gradients and optimizer state sharded across ranks.
//
//   using Sharded = fsdpx::Fsdp<GPT, fsdpx::FullShard, fsdpx::NoOffload, fsdpx::BF16Mixed,
//                               fsdpx::ShardedStateDict, fsdpx::WrapModules<BlockImpl>>;
//   Sharded model(GPT(config), world);
//   auto optimizer = fsdpx::make_adamw(model, torch::optim::AdamWOptions(3e-4).weight_decay(0.1));
//   auto loss = model(tokens, targets);          // blocks run through fsdpx::forward(block, x)
//   loss.backward();
//   model.clip_grad_norm_(1.0);
//   optimizer.step();
//
// The unit boundary: LibTorch modules have no hooks, so a model calls its sharded children through
// fsdpx::forward(child, args...) — a plain call when the child is not sharded, so the same model
// runs unsharded too.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>
#include <optional>
#include <type_traits>
#include <unordered_set>
#include <utility>

#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <fsdpx/core/policy_map.hpp>
#include <fsdpx/core/sharded_model.hpp>
#include <fsdpx/dist/any.hpp>
#include <fsdpx/dist/mesh.hpp>
#include <fsdpx/policies.hpp>

namespace fsdpx {

using core::BufferSync;
using core::GradNorm;
using core::ReplicaInit;
using core::ShardedBytes;
using core::StepStats;

template <class Model, class Mesh = FullShard, class Offload = NoOffload, class Precision = FullPrecision,
          class StateDict = ShardedStateDict, class Wrap = NoWrap, class Checkpoint = NoActivationCheckpointing>
class Fsdp {
  static_assert(
      requires(Model m) { m.ptr(); } && std::is_base_of_v<torch::nn::Module, typename Model::ContainedType>,
      "Fsdp<Model, ...>: Model must be a LibTorch module holder (TORCH_MODULE(Name) over NameImpl)");
  /// Checks the policies (static_asserts naming the wrong one) and maps them onto run-time options.
  using Policies = core::PolicyMap<Mesh, Offload, Precision, StateDict, Wrap, Checkpoint>;
  static_assert(Policies::checked);
  /// A sequence-parallel mesh hands its sequence group to the model, whose forward then takes slices.
  static constexpr bool takes_sequence_group =
      requires(Model m, std::optional<dist::AnyCommunicator> g) { m->set_sequence_group(g); };
  static_assert(
      !requires { Mesh::sequence_size; } || takes_sequence_group,
      "Fsdp<Model, SequenceParallel<P, Mesh>, ...>: Model must run on slices of sequences: a member "
      "set_sequence_group(std::optional<dist::AnyCommunicator>), as models::CausalLM has");

 public:
  using ModelType = Model;
  using MeshPolicyType = Mesh;
  using OffloadPolicyType = Offload;
  using PrecisionPolicyType = Precision;
  using StateDictPolicyType = StateDict;
  using WrapPolicyType = Wrap;
  using CheckpointPolicyType = Checkpoint;

  /// Shards `model` over `world` (collective: every rank constructs the same model and calls this).
  Fsdp(Model model, dist::AnyCommunicator world, FsdpOptions options = {}) : model_(std::move(model)) {
    if (options.inference_only) {
      for (auto& p : model_->parameters()) p.set_requires_grad(false);
    }
    const core::UnitOptions unit = Policies::unit_options(options, options.device.value_or(first_device()));
    FSDPX_CHECK(unit.device.type() == world.device_type(), "the model computes on ", unit.device,
                " but the communicator (", world.backend_name(), ") works on ",
                c10::DeviceTypeName(world.device_type(), true), " tensors");
    const int shard = Policies::shard_size(world.size(), *model_, options);
    const int sequence = Policies::sequence_size(options);
    if constexpr (requires { model_->sequence_group(); }) {
      // Its gradients would be shares averaged as whole samples' (1/P of what they should be).
      FSDPX_CHECK(sequence > 1 || !model_->sequence_group(), "the model was given a sequence group of ",
                  model_->sequence_group() ? model_->sequence_group()->size() : 0,
                  " ranks but the mesh has no sequence dimension; use Fsdp<Model, SequenceParallel<P, Mesh>> "
                  "(it hands the model its group)");
    }
    state_ = std::make_unique<core::ShardedModel>(
        model_.ptr(), dist::DeviceMesh<dist::AnyCommunicator>::build(world, shard, sequence), unit,
        Policies::model_setup(options));
    state_->set_activation_checkpointing(options.activation_checkpointing);
    if constexpr (takes_sequence_group) {
      if (sequence > 1) model_->set_sequence_group(state_->mesh().sequence_group());
    }
  }

  /// The root forward under the unit protocol.
  template <class... Args>
  auto forward(Args&&... args) {
    check_sequence_group();
    return state_->run_with(
        state_->root(),
        [impl = model_.get()](auto&&... inputs) { return impl->forward(std::forward<decltype(inputs)>(inputs)...); },
        std::forward<Args>(args)...);
  }
  template <class... Args>
  auto operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  /// Runs a member function of the model under the root's protocol, with floating tensor arguments
  /// cast to the compute dtype (FSDP2's register_fsdp_forward_method):
  ///   fsdp.call(&GptImpl::generate, prompt, 32)
  template <class Method, class... Args>
    requires std::is_member_function_pointer_v<Method>
  auto call(Method method, Args&&... args) {
    check_sequence_group();
    return state_->run_with(
        state_->root(),
        [impl = model_.get(), method](auto&&... inputs) {
          return (impl->*method)(std::forward<decltype(inputs)>(inputs)...);
        },
        std::forward<Args>(args)...);
  }
  /// The same for any callable taking the model; its arguments are used as they are.
  template <class Fn>
    requires(!std::is_member_function_pointer_v<std::decay_t<Fn>>)
  auto call(Fn&& fn) {
    check_sequence_group();
    return state_->run(state_->root(), [&] { return fn(model_); });
  }

  /// Turns activation checkpointing of the units the policy chose on or off (between steps), e.g. off
  /// for an evaluation pass with gradients or a step on short sequences.
  void set_activation_checkpointing(bool on) { state_->set_activation_checkpointing(on); }
  bool activation_checkpointing() const { return state_->activation_checkpointing(); }

  Model& module() { return model_; }
  typename Model::ContainedType* operator->() { return model_.get(); }

  /// The tensors the optimizer steps: views of every unit's float32 shard.
  std::vector<at::Tensor> parameters(std::optional<bool> decay = std::nullopt) const {
    FSDPX_CHECK(!inference_only(),
                "an inference-only Fsdp model has no parameters to optimize "
                "(FsdpOptions::inference_only is set)");
    std::vector<at::Tensor> out;
    for (size_t i = 0; i < state_->num_units(); ++i) {
      for (const auto& p : state_->unit(i).optim_params()) {
        if (!decay || p.decay == *decay) out.push_back(p.tensor);
      }
    }
    return out;
  }

  bool inference_only() const { return state_->options().inference_only; }

  GradNorm clip_grad_norm_(double max_norm) { return state_->clip_grad_norm_(max_norm); }
  void set_requires_gradient_sync(bool on) { state_->set_requires_gradient_sync(on); }
  /// Makes every rank's buffers equal now (collective): before saving or evaluating, so the last
  /// step's statistics are agreed too.
  void sync_buffers(BufferSync how) { state_->sync_buffers(how); }
  void unshard() { state_->unshard_all(); }
  /// RL trainers: move the shards and their gradients to host memory while a rollout engine uses the
  /// device, then back. Pair with move_optimizer_state(optimizer, ...) for the optimizer.
  void offload_model() { state_->offload_model(); }
  void reload_model() { state_->reload_model(); }
  void reshard() { state_->reshard_all(); }
  /// Waits for background checkpoint copies of the shards; needed only before changing the shards
  /// outside the usual backward-then-step order (the end of backward waits by itself).
  void wait_for_shard_readers() { state_->wait_for_shard_readers(); }

  /// Full parameters in the module for the scope's lifetime (inspection, evaluation, export).
  class FullParameters {
   public:
    explicit FullParameters(core::ShardedModel& s) : s_(&s) { s_->unshard_all(); }
    FullParameters(const FullParameters&) = delete;
    FullParameters& operator=(const FullParameters&) = delete;
    ~FullParameters() {
      s_->reshard_all();
      memory::HostBufferCache::instance().trim();  // the one-off peak of a whole model does not stay resident
    }

   private:
    core::ShardedModel* s_;
  };
  [[nodiscard]] FullParameters full_parameters() { return FullParameters(*state_); }

  const dist::DeviceMesh<dist::AnyCommunicator>& mesh() const { return state_->mesh(); }
  /// The ranks that hold slices of this rank's sequences (SequenceParallel meshes; nullopt otherwise):
  /// feed rank r of it tokens [r t, (r + 1) t) of the same rows (models::sequence_slice does).
  const std::optional<dist::AnyCommunicator>& sequence_group() const { return state_->mesh().sequence_group(); }
  core::ShardedModel& sharded() { return *state_; }
  const core::ShardedModel& sharded() const { return *state_; }
  ShardedBytes sharded_bytes() const { return state_->sharded_bytes(); }
  /// What the last step did: its forward order, when reductions were issued, peak unsharded bytes.
  const core::StepStats& last_step_stats() const { return state_->last_step_stats(); }

 private:
  /// Under a sequence mesh, a pass with gradients must run on slices: with the model's group turned off
  /// (for generation), its whole-row gradients would come out P times large from the reduction.
  void check_sequence_group() const {
    if constexpr (requires { model_->sequence_group(); }) {
      FSDPX_CHECK(state_->mesh().sequence_size() == 1 || !at::GradMode::is_enabled() || model_->sequence_group(),
                  "Fsdp: the mesh has sequence groups of ", state_->mesh().sequence_size(),
                  " ranks but the model's sequence group is off, and gradients are on: turn it back on "
                  "(set_sequence_group(*sequence_group())) or run without gradients (at::NoGradGuard)");
    }
  }

  c10::Device first_device() const {
    for (const auto& p : model_->parameters()) return p.device();  // a deferred model: the CPU
    return c10::Device(c10::kCPU);
  }

  Model model_;
  std::unique_ptr<core::ShardedModel> state_;
};

/// Calls `module`'s forward under its unit protocol when it is a sharded unit, plainly otherwise.
template <class Holder, class... Args>
auto forward(Holder& module, Args&&... args) {
  const auto [owner, unit] = core::detail::UnitRegistry::instance().find(module.ptr().get());
  if (owner == nullptr) return module->forward(std::forward<Args>(args)...);
  return owner->run_with(
      *unit,
      [impl = module.get()](auto&&... inputs) { return impl->forward(std::forward<decltype(inputs)>(inputs)...); },
      std::forward<Args>(args)...);
}

/// Runs `fn(module)` (any member function) under `module`'s unit protocol when it is a sharded unit.
/// Tensors `fn` captures are used as they are: not cast, not checkpointed (use the form below).
template <class Holder, class Fn>
auto call(Holder& module, Fn&& fn) {
  const auto [owner, unit] = core::detail::UnitRegistry::instance().find(module.ptr().get());
  if (owner == nullptr) return fn(module);
  return owner->run(*unit, [&] { return fn(module); });
}

/// Runs `fn(module, args...)` under `module`'s unit protocol, with `args` as fsdpx::forward passes
/// them (floating tensors cast to the compute dtype, those requiring grad ending the unit's backward;
/// checkpointed when the unit is). A checkpointed unit runs `fn` again in backward: `fn` is copied, so
/// it must capture by value.
///   auto loss = fsdpx::call(lm_head, [](LmHead& head, const at::Tensor& h, const at::Tensor& y) { ... }, hidden,
///   labels);
template <class Holder, class Fn, class Arg, class... Args>
auto call(Holder& module, Fn&& fn, Arg&& arg, Args&&... args) {
  const auto [owner, unit] = core::detail::UnitRegistry::instance().find(module.ptr().get());
  if (owner == nullptr) return fn(module, std::forward<Arg>(arg), std::forward<Args>(args)...);
  return owner->run_with(
      *unit,
      [holder = module, fn = std::decay_t<Fn>(fn)](auto&&... inputs) {
        Holder m = holder;  // the function takes the module as the unsharded call does, not const
        return fn(m, std::forward<decltype(inputs)>(inputs)...);
      },
      std::forward<Arg>(arg), std::forward<Args>(args)...);
}

/// Whether `value` holds on every rank of the Fsdp model `module` belongs to (its root or a unit): a
/// collective over that model's ranks, which must all call it, in the same order. For a module that
/// is not sharded, `value` itself. Lets a loop whose length depends on the data (generation stopping at
/// EOS) run as many unit calls on every rank.
inline bool on_every_rank(const torch::nn::Module& module, bool value) {
  const auto [owner, unit] = core::detail::UnitRegistry::instance().find(&module);
  if (owner == nullptr) return value;
  dist::AnyCommunicator world = owner->mesh().world();
  at::Tensor flag =
      at::full({1}, value ? 1.0 : 0.0, at::TensorOptions().dtype(at::kFloat).device(owner->options().device));
  world.all_reduce(flag, dist::ReduceOp::min);
  return flag.item<float>() > 0.5f;
}

}  // namespace fsdpx
