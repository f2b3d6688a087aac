// The policy seam: the one place where Fsdp's compile-time policies and its run-time FsdpOptions
// (core/options.hpp) become what the non-template unit protocol runs on (UnitOptions for every unit,
// ModelSetup for construction, the mesh's shard size). docs/policies.md ("What a policy is") says what a tag may
// select: values here, never a second implementation of the protocol.
//
//   Mesh        -> the shard and sequence sizes (core/mesh.hpp) and so the mesh; UnitOptions::gradient_factor
//   Offload     -> UnitOptions::offload_to_cpu, pin_memory
//   Precision   -> UnitOptions::param_dtype, reduce_dtype, output_dtype (and the shard dtype when
//                  inference-only)
//   Wrap        -> ModelSetup::is_unit, and the check that a policy other than NoWrap matched
//   Checkpoint  -> ModelSetup::checkpoint (which units recompute in backward)
//   StateDict   -> nothing here: the checkpoint layer reads it from Fsdp::StateDictPolicyType
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <type_traits>
#include <unordered_set>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/nn/module.h>

#include <fsdpx/core/deferred_init.hpp>
#include <fsdpx/core/mesh.hpp>
#include <fsdpx/core/module_precision.hpp>
#include <fsdpx/core/options.hpp>
#include <fsdpx/core/setup.hpp>
#include <fsdpx/core/unit.hpp>
#include <fsdpx/dist/env.hpp>
#include <fsdpx/policies.hpp>

namespace fsdpx {

/// HybridShard<auto_shard_size>'s choice (as LightRFT does): the smallest shard size that divides the
/// world, stays within one node when possible, and keeps each rank's part of `state_bytes` (the model state
/// the ranks of a shard group share) under `budget`.
inline int choose_auto_shard_size(int64_t state_bytes, int world_size, int local_world_size, int64_t budget_bytes) {
  int fallback = world_size;
  for (int s = 1; s <= world_size; ++s) {
    if (world_size % s != 0 || state_bytes / s > budget_bytes) continue;
    if (s <= local_world_size) return s;
    fallback = std::min(fallback, s);
  }
  return fallback;
}

namespace core {

/// Fsdp's policies, checked, and what each means at run time.
template <class Mesh, class Offload, class Precision, class StateDict, class Wrap, class Checkpoint>
struct PolicyMap {
  static_assert(MeshPolicy<Mesh>,
                "Fsdp<Model, Mesh, ...>: Mesh must be FullShard, HybridShard<N>, NoShard or SequenceParallel<P, Mesh>");
  static_assert(OffloadPolicy<Offload>, "Fsdp<Model, Mesh, Offload, ...>: Offload must be NoOffload or CpuOffload<>");
  static_assert(PrecisionPolicy<Precision>,
                "Fsdp<..., Precision, ...>: Precision must be a MixedPrecision<...> (e.g. FullPrecision, BF16Mixed)");
  static_assert(StateDictPolicy<StateDict>,
                "Fsdp<..., StateDict, ...>: StateDict must be FullStateDict, ShardedStateDict or LocalStateDict");
  static_assert(WrapPolicy<Wrap>,
                "Fsdp<..., Wrap, ...>: Wrap must be WrapModules<...>, WrapIf<...>, WrapBySize<N>, "
                "WrapNames<...> or NoWrap");
  static_assert(CheckpointPolicy<Checkpoint>,
                "Fsdp<..., Checkpoint>: Checkpoint must be NoActivationCheckpointing, CheckpointAll, "
                "CheckpointEvery<N>, CheckpointNames<...> or CheckpointIf<...>");
  static_assert(!(Mesh::kind == MeshKind::no_shard && Offload::offload_to_cpu),
                "Fsdp: CpuOffload needs a sharding mesh (FullShard or HybridShard): with NoShard every rank keeps the "
                "whole model, and offloading it would copy every full parameter to the device at each unit");
  static_assert(!(std::is_same_v<Wrap, NoWrap> && !std::is_same_v<Checkpoint, NoActivationCheckpointing>),
                "Fsdp: activation checkpointing recomputes units, and NoWrap makes none (the root is never "
                "checkpointed): choose a wrap policy that picks the model's blocks");
  /// Read by Fsdp's class body, so that naming a wrong Fsdp<...> type (not only constructing one)
  /// instantiates this class and its checks.
  static constexpr bool checked = true;

  /// Every unit's options (the plan then sets each unit's own checkpointing and resharding).
  static UnitOptions unit_options(const FsdpOptions& o, c10::Device device) {
    UnitOptions unit;
    unit.param_dtype = Precision::param_dtype;
    unit.reduce_dtype = Precision::reduce_dtype;
    unit.output_dtype = Precision::output_dtype;
    unit.device = device;
    if (!unit.device.has_index() && !unit.device.is_cpu()) {
      // "cuda" means the current device now: fixed here, so every allocation lands on it whatever
      // device is current later (autograd's threads, a rollout engine's).
      unit.device =
          c10::Device(unit.device.type(), c10::impl::getDeviceGuardImpl(unit.device.type())->getDevice().index());
    }
    unit.offload_to_cpu = Offload::offload_to_cpu;
    unit.pin_memory = Offload::pin_memory;
    unit.reshard_after_forward = o.reshard_after_forward;
    unit.inference_only = o.inference_only;
    unit.shard_dtype = o.inference_only ? Precision::param_dtype : at::kFloat;
    unit.gradient_factor = sequence_size(o);
    return unit;
  }

  /// How construction chooses and starts the units.
  static ModelSetup model_setup(const FsdpOptions& o) {
    ModelSetup setup;
    setup.is_unit = [](const UnitQuery& q) { return Wrap::is_unit(q); };
    if constexpr (!std::is_same_v<Checkpoint, NoActivationCheckpointing>) {
      setup.checkpoint = [](const CheckpointQuery& q) { return static_cast<bool>(Checkpoint::checkpoints(q)); };
    }
    setup.reshard_after_forward = o.reshard_after_forward_for;
    setup.init_module = o.init_module;
    setup.decay = o.weight_decay;
    setup.keep_full_precision = o.keep_full_precision;
    setup.replicas = o.replicas;
    setup.buffer_sync = o.buffer_sync;
    setup.check_units = [allow_none = o.allow_no_units](const std::vector<std::string>& units) {
      check_wrap_matched(units, allow_none);
    };
    return setup;
  }

  /// The shard size of the mesh, at this world size (HybridShard<auto_shard_size> from the model's size).
  static int shard_size(int world_size, torch::nn::Module& model, const FsdpOptions& o) {
    if constexpr (Mesh::shard_size == auto_shard_size) {
      int64_t numel = 0;  // each tensor once: a tied one is listed under every name it has
      std::unordered_set<const c10::TensorImpl*> seen;
      for (const auto& p : model.parameters()) {
        if (seen.insert(p.unsafeGetTensorImpl()).second) numel += p.numel();
      }
      // A trained parameter's state is 16 bytes (float32 master and gradient, Adam's two moments); a frozen
      // inference-only model holds its parameters in param_dtype alone (LightRFT sizes its reference so).
      const int64_t per_param =
          o.inference_only ? static_cast<int64_t>(c10::elementSize(Precision::param_dtype)) : int64_t{16};
      const auto env = dist::detect_launch_env();
      const int64_t budget = o.auto_shard_budget_bytes.value_or(int64_t{8} << 30);
      return resolve_shard_size<Mesh>(
          world_size, choose_auto_shard_size(numel * per_param, world_size, env.local_world_size, budget));
    } else {
      return resolve_shard_size<Mesh>(world_size, o.shard_size);
    }
  }

  /// The sequence group size of the mesh (1 without sequence parallelism).
  static int sequence_size(const FsdpOptions& o) { return resolve_sequence_size<Mesh>(o.sequence_size); }

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
      FSDPX_CHECK(allow_none || !units.empty(),
                  "the wrap policy picked no module of the model, so it would train as "
                  "one unit (no overlap of communication with computation, the whole model gathered at once); check "
                  "the policy, or set FsdpOptions::allow_no_units when that is intended");
    }
  }
};

}  // namespace core
}  // namespace fsdpx
