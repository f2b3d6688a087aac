// What ShardedModel's constructor is told: which modules are units, how the ranks' copies become one
// model, and each unit's run-time choices. Fsdp<...> fills it from its policies and FsdpOptions in one
// place (core/policy_map.hpp).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <fsdpx/core/deferred_init.hpp>
#include <fsdpx/policies/checkpoint.hpp>
#include <fsdpx/policies/wrap.hpp>

namespace fsdpx::core {

/// How the ranks' copies of the values a model was constructed with become one model.
enum class ReplicaInit {
  check,                 // every rank must have constructed the same values (checked: an error names the tensor)
  broadcast_from_rank0,  // rank 0's values are copied to every rank (as DDP and FSDP's sync_module_states)
  as_constructed,        // trusted as they are (e.g. a checkpoint is loaded right after)
};

/// How the ranks' copies of the module's buffers (BatchNorm running statistics, counters, router
/// biases) are kept equal. Each rank's forward updates its own copy from its own batch, so without
/// this they drift apart, and state dicts save world rank 0's.
enum class BufferSync {
  none,                  // each rank keeps its own (FSDP2's behaviour)
  broadcast_from_rank0,  // rank 0's copied to every rank before each forward (DDP's broadcast_buffers)
  average,               // floating buffers averaged over the ranks before each forward, others copied
                         // from rank 0: running means become those of the global batch
};

/// What the units are and how they start, for ShardedModel's constructor.
struct ModelSetup {
  std::function<bool(const UnitQuery&)> is_unit;
  /// Which units recompute their forward inside backward (activation checkpointing); none when empty.
  std::function<bool(const CheckpointQuery&)> checkpoint;
  /// Per unit, by name: whether it frees its full parameters after forward. Empty: UnitOptions'
  /// reshard_after_forward for every unit. The root never does (backward needs it first).
  std::function<bool(const std::string&)> reshard_after_forward;
  /// deferred_init models: initializes modules fsdpx does not know.
  ModuleInit init_module;
  /// Whether a parameter gets weight decay, by its fully qualified name and tensor; default dim() >= 2.
  std::function<bool(const std::string&, const at::Tensor&)> decay;
  /// Modules (by dotted name and module) whose own parameters stay float32 when the units compute in
  /// another dtype: each unit's such parameters are a companion unit of float32 (FsdpOptions). Empty: none.
  std::function<bool(const std::string&, const torch::nn::Module&)> keep_full_precision;
  /// Sees the chosen units' names before anything changes (e.g. the wrap policy matched nothing).
  std::function<void(const std::vector<std::string>&)> check_units;
  ReplicaInit replicas = ReplicaInit::check;
  BufferSync buffer_sync = BufferSync::none;
};

}  // namespace fsdpx::core
