// Fsdp<Model, MeshPolicy, OffloadPolicy, PrecisionPolicy, StateDictPolicy, WrapPolicy>: a LibTorch
// module trained with its parameters, gradients and optimizer state sharded across ranks.
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

#include <fsdpx/core/mesh.hpp>
#include <fsdpx/core/sharded_model.hpp>
#include <fsdpx/dist/any.hpp>
#include <fsdpx/dist/env.hpp>
#include <fsdpx/dist/mesh.hpp>
#include <fsdpx/policies.hpp>

namespace fsdpx {

using core::BufferSync;
using core::GradNorm;
using core::ReplicaInit;
using core::ShardedBytes;
using core::StepStats;

struct FsdpOptions {
  /// The device the model computes on; default: where its first parameter is.
  std::optional<c10::Device> device;
  /// HybridShard<runtime_shard_size>: the shard group size.
  std::optional<int> shard_size;
  /// Non-root units free their full parameters after forward (true) or keep them until after backward.
  bool reshard_after_forward = true;
  /// HybridShard<auto_shard_size>: bytes of model state (parameters, gradients, Adam moments: 16 bytes
  /// per parameter) one rank may hold; the smallest shard size that fits is used.
  std::optional<int64_t> auto_shard_budget_bytes;
  /// A frozen model for inference only (an RL reference or reward model): every parameter is frozen,
  /// shards stay in the precision policy's param_dtype (bfloat16 under BF16Mixed: 2 bytes per
  /// parameter), and no gradients or float32 masters exist. Forward and call(...) run as usual.
  bool inference_only = false;
  /// deferred_init models: initializes modules fsdpx does not know (returns false to decline).
  ModuleInit init_module;
  /// How the ranks' copies of the constructed values become one model: checked equal (default; an
  /// error names the first tensor that differs and the ranks), copied from rank 0, or trusted.
  ReplicaInit replicas = ReplicaInit::check;
  /// Which parameters make_adamw decays, by fully qualified name and tensor (default: dim() >= 2).
  /// E.g. [](const std::string& name, const at::Tensor& p) { return p.dim() >= 2 && name.find("embed") == npos; }
  std::function<bool(const std::string&, const at::Tensor&)> weight_decay;
  /// A wrap policy other than NoWrap that picks no module is an error (the model would train as one
  /// unit, with no overlap); set this when that is intended.
  bool allow_no_units = false;
  /// How the ranks' copies of the module's buffers are kept equal (default: not at all, as FSDP2):
  /// BufferSync::broadcast_from_rank0 as DDP, or BufferSync::average for running statistics of the
  /// global batch. Applied before every forward of the root.
  BufferSync buffer_sync = BufferSync::none;
};

/// HybridShard<auto_shard_size>'s choice (as LightRFT does): the smallest shard size that divides the
/// world, stays within one node when possible, and keeps 16 bytes per parameter under `budget`.
inline int choose_auto_shard_size(int64_t numel, int world_size, int local_world_size, int64_t budget_bytes) {
  const int64_t state_bytes = numel * 16;
  int fallback = world_size;
  for (int s = 1; s <= world_size; ++s) {
    if (world_size % s != 0 || state_bytes / s > budget_bytes) continue;
    if (s <= local_world_size) return s;
    fallback = std::min(fallback, s);
  }
  return fallback;
}

template <class Model, class Mesh = FullShard, class Offload = NoOffload, class Precision = FullPrecision,
          class StateDict = ShardedStateDict, class Wrap = NoWrap>
class Fsdp {
  static_assert(requires(Model m) { m.ptr(); } && std::is_base_of_v<torch::nn::Module, typename Model::ContainedType>,
                "Fsdp<Model, ...>: Model must be a LibTorch module holder (TORCH_MODULE(Name) over NameImpl)");
  static_assert(MeshPolicy<Mesh>, "Fsdp<Model, Mesh, ...>: Mesh must be FullShard, HybridShard<N> or NoShard");
  static_assert(OffloadPolicy<Offload>, "Fsdp<Model, Mesh, Offload, ...>: Offload must be NoOffload or CpuOffload<>");
  static_assert(PrecisionPolicy<Precision>,
                "Fsdp<..., Precision, ...>: Precision must be a MixedPrecision<...> (e.g. FullPrecision, BF16Mixed)");
  static_assert(StateDictPolicy<StateDict>,
                "Fsdp<..., StateDict, ...>: StateDict must be FullStateDict, ShardedStateDict or LocalStateDict");
  static_assert(WrapPolicy<Wrap>, "Fsdp<..., Wrap>: Wrap must be WrapModules<...>, WrapIf<...>, WrapBySize<N> or NoWrap");
  static_assert(!(Mesh::kind == MeshKind::no_shard && Offload::offload_to_cpu),
                "Fsdp: CpuOffload needs a sharding mesh (FullShard or HybridShard): with NoShard every rank keeps the "
                "whole model, and offloading it would copy every full parameter to the device at each unit");

 public:
  using ModelType = Model;
  using MeshPolicyType = Mesh;
  using OffloadPolicyType = Offload;
  using PrecisionPolicyType = Precision;
  using StateDictPolicyType = StateDict;
  using WrapPolicyType = Wrap;

  /// Shards `model` over `world` (collective: every rank constructs the same model and calls this).
  Fsdp(Model model, dist::AnyCommunicator world, FsdpOptions options = {}) : model_(std::move(model)) {
    const int shard = resolve_shard(world, options);
    core::UnitOptions unit;
    unit.param_dtype = Precision::param_dtype;
    unit.reduce_dtype = Precision::reduce_dtype;
    unit.output_dtype = Precision::output_dtype;
    unit.device = options.device.value_or(first_device());
    if (!unit.device.has_index() && !unit.device.is_cpu()) {
      // "cuda" means the current device now: fixed here, so every allocation lands on it whatever
      // device is current later (autograd's threads, a rollout engine's).
      unit.device = c10::Device(unit.device.type(), c10::impl::getDeviceGuardImpl(unit.device.type())->getDevice().index());
    }
    unit.offload_to_cpu = Offload::offload_to_cpu;
    unit.pin_memory = Offload::pin_memory;
    unit.reshard_after_forward = options.reshard_after_forward;
    unit.inference_only = options.inference_only;
    unit.shard_dtype = options.inference_only ? Precision::param_dtype : at::kFloat;
    if (options.inference_only) {
      for (auto& p : model_->parameters()) p.set_requires_grad(false);
    }
    FSDPX_CHECK(unit.device.type() == world.device_type(), "the model computes on ", unit.device, " but the communicator (", world.backend_name(), ") works on ",
                c10::DeviceTypeName(world.device_type(), true), " tensors");
    core::ModelSetup setup;
    setup.is_unit = [](const UnitQuery& q) { return Wrap::is_unit(q); };
    setup.init_module = options.init_module;
    setup.decay = options.weight_decay;
    setup.replicas = options.replicas;
    setup.buffer_sync = options.buffer_sync;
    setup.check_units = [allow_none = options.allow_no_units](const std::vector<std::string>& units) {
      check_wrap_matched(units, allow_none);
    };
    state_ = std::make_unique<core::ShardedModel>(model_.ptr(), dist::DeviceMesh<dist::AnyCommunicator>::build(world, shard),
                                                  unit, setup);
  }

  /// The root forward under the unit protocol.
  template <class... Args>
  auto forward(Args&&... args) {
    return state_->run_with(
        state_->root(), [&](auto&&... inputs) { return model_->forward(std::forward<decltype(inputs)>(inputs)...); },
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
    return state_->run_with(
        state_->root(), [&](auto&&... inputs) { return ((*model_).*method)(std::forward<decltype(inputs)>(inputs)...); },
        std::forward<Args>(args)...);
  }
  /// The same for any callable taking the model; its arguments are used as they are.
  template <class Fn>
    requires(!std::is_member_function_pointer_v<std::decay_t<Fn>>)
  auto call(Fn&& fn) {
    return state_->run(state_->root(), [&] { return fn(model_); });
  }

  Model& module() { return model_; }
  typename Model::ContainedType* operator->() { return model_.get(); }

  /// The tensors the optimizer steps: views of every unit's float32 shard.
  std::vector<at::Tensor> parameters(std::optional<bool> decay = std::nullopt) const {
    FSDPX_CHECK(!inference_only(), "an inference-only Fsdp model has no parameters to optimize "
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
  core::ShardedModel& sharded() { return *state_; }
  const core::ShardedModel& sharded() const { return *state_; }
  ShardedBytes sharded_bytes() const { return state_->sharded_bytes(); }
  /// What the last step did: its forward order, when reductions were issued, peak unsharded bytes.
  const core::StepStats& last_step_stats() const { return state_->last_step_stats(); }

 private:
  c10::Device first_device() const {
    for (const auto& p : model_->parameters()) return p.device();  // a deferred model: the CPU
    return c10::Device(c10::kCPU);
  }

  int resolve_shard(const dist::AnyCommunicator& world, const FsdpOptions& options) const {
    if constexpr (Mesh::shard_size == auto_shard_size) {
      int64_t numel = 0;  // each tensor once: a tied one is listed under every name it has
      std::unordered_set<const c10::TensorImpl*> seen;
      for (const auto& p : model_->parameters()) {
        if (seen.insert(p.unsafeGetTensorImpl()).second) numel += p.numel();
      }
      const auto env = dist::detect_launch_env();
      const int64_t budget = options.auto_shard_budget_bytes.value_or(int64_t{8} << 30);
      return core::resolve_shard_size<Mesh>(world.size(),
                                            choose_auto_shard_size(numel, world.size(), env.local_world_size, budget));
    } else {
      return core::resolve_shard_size<Mesh>(world.size(), options.shard_size);
    }
  }

  static void check_wrap_matched(const std::vector<std::string>& units, bool allow_none) {
    if constexpr (requires { Wrap::unmatched(units); }) {
      const auto missing = Wrap::unmatched(units);
      std::string list;
      for (const auto& m : missing) list += (list.empty() ? "'" : ", '") + m + "'";
      FSDPX_CHECK(missing.empty() || (allow_none && units.empty()), "the wrap policy's name pattern(s) ", list,
                  " match no module of the model (module names are dotted paths such as 'layers.0' or 'lm_head'; '*' "
                  "matches within one segment)");
    }
    if constexpr (!std::is_same_v<Wrap, NoWrap>) {
      FSDPX_CHECK(allow_none || !units.empty(), "the wrap policy picked no module of the model, so it would train as "
                  "one unit (no overlap of communication with computation, the whole model gathered at once); check "
                  "the policy, or set FsdpOptions::allow_no_units when that is intended");
    }
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
      *unit, [&](auto&&... inputs) { return module->forward(std::forward<decltype(inputs)>(inputs)...); },
      std::forward<Args>(args)...);
}

/// Runs `fn(module)` (any member function) under `module`'s unit protocol when it is a sharded unit.
template <class Holder, class Fn>
auto call(Holder& module, Fn&& fn) {
  const auto [owner, unit] = core::detail::UnitRegistry::instance().find(module.ptr().get());
  if (owner == nullptr) return fn(module);
  return owner->run(*unit, [&] { return fn(module); });
}

}  // namespace fsdpx
