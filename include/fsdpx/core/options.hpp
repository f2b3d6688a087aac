// FsdpOptions: Fsdp's run-time knobs, what depends on the machine or the run rather than on the program
// (the compile-time choices are its policies, fsdpx/policies.hpp). core/policy_map.hpp turns both into
// what the unit protocol runs on.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/nn/module.h>

#include <fsdpx/core/deferred_init.hpp>
#include <fsdpx/core/module_precision.hpp>
#include <fsdpx/core/setup.hpp>

namespace fsdpx {

/// Fsdp's run-time knobs: what depends on the machine or the run rather than on the program.
struct FsdpOptions {
  /// The device the model computes on; default: where its first parameter is.
  std::optional<c10::Device> device;
  /// HybridShard<runtime_shard_size>: the shard group size.
  std::optional<int> shard_size;
  /// SequenceParallel<runtime_sequence_size, ...>: the sequence group size.
  std::optional<int> sequence_size;
  /// Non-root units free their full parameters after forward (true) or keep them until after backward.
  bool reshard_after_forward = true;
  /// Per unit, by its dotted name, overriding reshard_after_forward: e.g. keep the LM head (the last
  /// unit of the forward, the first of the backward) gathered between the two, as FSDP2 does with its
  /// last block: [](const std::string& unit) { return unit != "lm_head"; }.
  std::function<bool(const std::string&)> reshard_after_forward_for;
  /// HybridShard<auto_shard_size>: bytes of model state one rank may hold (a trained parameter: 16 bytes,
  /// master, gradient and Adam's two moments; an inference_only one: its bytes in param_dtype); the smallest
  /// shard size that fits is used.
  std::optional<int64_t> auto_shard_budget_bytes;
  /// A frozen model for inference only (an RL reference or reward model): every parameter is frozen,
  /// shards stay in the precision policy's param_dtype (bfloat16 under BF16Mixed: 2 bytes per
  /// parameter), and no gradients or float32 masters exist. Forward and call(...) run as usual.
  bool inference_only = false;
  /// The units the checkpointing policy chose recompute their forward in backward (default); false
  /// starts with it off (Fsdp::set_activation_checkpointing turns it on and off between steps).
  bool activation_checkpointing = true;
  /// deferred_init models: initializes modules fsdpx does not know (returns false to decline).
  ModuleInit init_module;
  /// How the ranks' copies of the constructed values become one model: checked equal (default; an
  /// error names the first tensor that differs and the ranks), copied from rank 0, or trusted.
  core::ReplicaInit replicas = core::ReplicaInit::check;
  /// Which parameters make_adamw decays, by fully qualified name and tensor (default: dim() >= 2).
  /// E.g. [](const std::string& name, const at::Tensor& p) { return p.dim() >= 2 && name.find("embed") == npos; }
  std::function<bool(const std::string&, const at::Tensor&)> weight_decay;
  /// Under a mixed precision policy (param_dtype other than float32), the modules whose own parameters
  /// stay in float32, by dotted module name and module: they are gathered, computed and reduced in float32
  /// (a second flat buffer of their unit, gathered with it), as FSDP2 gives a module its own
  /// MixedPrecisionPolicy. Default: every BatchNorm (FSDP1's choice; its running statistics are float32,
  /// which ATen refuses beside bfloat16 weights). fsdpx::is_norm_layer keeps every normalization layer;
  /// an empty function keeps none. A kept module must accept inputs in the policy's dtype (ATen's norms do;
  /// a Linear does not).
  std::function<bool(const std::string&, const torch::nn::Module&)> keep_full_precision = is_batch_norm;
  /// A wrap policy other than NoWrap that picks no module is an error (the model would train as one
  /// unit, with no overlap); set this when that is intended.
  bool allow_no_units = false;
  /// How the ranks' copies of the module's buffers are kept equal (default: not at all, as FSDP2):
  /// BufferSync::broadcast_from_rank0 as DDP, or BufferSync::average for running statistics of the
  /// global batch. Applied before every forward of the root.
  core::BufferSync buffer_sync = core::BufferSync::none;
};

}  // namespace fsdpx
