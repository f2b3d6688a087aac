// Unit: one sharding unit's parameters as a flat buffer sharded over the shard group.
//
//   sharded    only this rank's slice exists (shard(): float32 masters, or the compute dtype when
//              inference-only); the full buffer has no bytes
//   gathering  the full buffer is allocated and an all-gather fills it (a prefetch in flight)
//   unsharded  the module's parameters are valid views of the full buffer, in the compute dtype
//
// Gradients: once autograd has accumulated a step's parameter gradients, they are packed into one
// flat buffer (reduce dtype), reduce-scattered (average) over the shard group, all-reduced across
// replicas (HSDP / NoShard) and added to the float32 gradient of the shard.
#pragma once

#include <fsdpx/detail/config.hpp>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <fsdpx/core/detail/storage.hpp>
#include <fsdpx/core/flat_param.hpp>
#include <fsdpx/dist/any.hpp>
#include <fsdpx/error.hpp>
#include <fsdpx/memory/host.hpp>

namespace fsdpx::core {

struct UnitOptions {
  at::ScalarType param_dtype = at::kFloat;
  at::ScalarType reduce_dtype = at::kFloat;
  std::optional<at::ScalarType> output_dtype;
  /// What the unit's floating inputs are cast to; default param_dtype. A unit whose own parameters are
  /// kept in float32 while its companion's compute in the policy's dtype takes inputs in the latter.
  std::optional<at::ScalarType> input_dtype;
  c10::Device device = c10::Device(c10::kCPU);  // where the module computes
  bool offload_to_cpu = false;                  // shard, its gradient and optimizer state on the host
  bool pin_memory = false;
  bool reshard_after_forward = true;
  /// The dtype of this rank's shard: float32 masters for training; an inference-only model keeps its
  /// shards in the compute dtype and never has gradients (FsdpOptions::inference_only).
  at::ScalarType shard_dtype = at::kFloat;
  bool inference_only = false;
  /// Its forward keeps only its inputs and runs again inside backward (activation checkpointing).
  bool checkpoint_activations = false;
  /// How many ranks' gradients make one sample's: a sequence group's size, whose ranks each hold their
  /// slice's share. The reduction averages over ranks; the reduced shard is multiplied by this, which
  /// puts the shares' sum back into the average.
  int gradient_factor = 1;
};

/// The communicators a unit uses. Gathers and reductions run on separate duplicates of the shard
/// group, so their interleaving never has to agree across ranks.
struct UnitComms {
  dist::AnyCommunicator gather;
  dist::AnyCommunicator reduce;
  dist::AnyCommunicator replicate;
};

class Unit {
 public:
  FSDPX_DECL Unit(std::string name, int index, std::vector<ParamInfo> params, UnitComms comms,
                  const UnitOptions& options);

  /// Throws what the constructor would refuse, before anything is changed.
  FSDPX_DECL static void check_params(const std::string& name, const std::vector<ParamInfo>& params,
                                      const UnitOptions& options);

  Unit(const Unit&) = delete;
  Unit& operator=(const Unit&) = delete;

  const std::string& name() const { return name_; }
  int index() const { return index_; }
  const FlatParamLayout& layout() const { return layout_; }
  const UnitOptions& options() const { return options_; }
  bool trainable() const { return trainable_; }
  /// This rank's position in the shard group: it holds layout().shard_range(shard_rank()).
  int shard_rank() const { return shard_rank_; }
  bool is_unsharded() const { return state_ == State::unsharded; }
  /// Bytes of the full (unsharded) buffer while allocated, else 0.
  int64_t unsharded_bytes() const { return detail::storage_allocated(full_) ? full_.nbytes() : 0; }

  /// This rank's slice of the flat layout (float32 masters; options().shard_dtype).
  const at::Tensor& shard() const { return shard_; }
  /// The buffers of a gather of this unit's master values (the shards' dtype, not the compute-dtype
  /// copy unshard() fills): the whole flat buffer and this rank's input, on the compute device
  /// (offloaded shards go through it for the collective). For saving and exporting.
  struct MasterGather {
    at::Tensor full, input;
  };
  FSDPX_DECL MasterGather master_gather_buffers() const;
  /// What this rank holds of parameter `p`: [lo, hi) of the flat layout, empty (lo >= hi) when nothing.
  FlatRange held_range(const ParamInfo& p) const {
    const FlatRange mine = layout_.shard_range(shard_rank_);
    return {std::max(p.offset, mine.begin), std::min(p.offset + p.numel, mine.end)};
  }

  /// What the optimizer steps: contiguous views of shard() with their weight-decay class.
  struct OptimParam {
    at::Tensor tensor;
    FlatRange range;  // within shard()
    bool decay;
  };
  const std::vector<OptimParam>& optim_params() const { return optim_params_; }

  // ---- parameters ---------------------------------------------------------------------------------

  /// Starts gathering the full parameters (a prefetch); no-op unless sharded.
  FSDPX_DECL void unshard_async();

  /// Makes the module's parameters valid (waits for a prefetch in flight).
  FSDPX_DECL void unshard();

  /// Frees the full parameters' bytes; views stay, their data is gone until the next unshard().
  FSDPX_DECL void reshard();

  /// Moves the shard and its gradients to `device` (RL trainers free the GPU for a rollout
  /// engine between steps). Tensor identity is kept, so optimizer state stays attached.
  FSDPX_DECL void move_shard(at::Device device);
  at::Device shard_device() const { return shard_.device(); }

  // ---- gradients ----------------------------------------------------------------------------------

  /// Packs this step's parameter gradients (missing ones count as zero) and starts their reduction.
  FSDPX_DECL void reduce_gradients_async();

  bool reducing() const { return reducing_; }
  /// True once the reduce-scatter started by reduce_gradients_async() has completed (or none runs).
  bool reduce_scatter_completed() const { return !reducing_ || replicating_ || reduce_.is_completed(); }

  /// HSDP / NoShard: once the reduce-scatter is done, starts averaging its result across replicas,
  /// so the all-reduce runs behind the rest of backward. No-op when it already started.
  FSDPX_DECL void start_replica_reduction();

  /// Offloaded shards on a GPU machine: once the reduction is done (in stream order), starts copying
  /// its result to pinned host memory without blocking, and records an event the host waits on in
  /// wait_gradient_reduction(), so the copies of all units queue back to back and the host waits
  /// once instead of once per unit. No-op otherwise.
  FSDPX_DECL void start_gradient_copy_to_host();

  /// Waits for the reduction (and the replicas' average) and keeps its result, in float32 where the
  /// shard lives, as this pass's pending gradient (a second reduction in the same pass adds to it).
  /// Nothing of the shard changes yet.
  FSDPX_DECL void wait_gradient_reduction();

  /// Adds the pending gradient to the gradients of the optimizer tensors (each its own tensor:
  /// LibTorch's zero_grad() detaches gradients in place, which views would refuse). A gradient that
  /// zero_grad() reset is set instead of added to.
  FSDPX_DECL void apply_gradient_reduction();

  /// After a backward pass that ended with an exception: waits for the collectives it issued (every
  /// rank issued the same ones), then drops their results, the pending gradient and the unsharded
  /// gradients, so none of the failed pass reaches the shards. Returns whether unsharded gradients
  /// were dropped.
  FSDPX_DECL bool discard_gradients();

  /// The float32 gradients of the optimizer tensors that have one.
  FSDPX_DECL std::vector<at::Tensor> shard_grads() const;

  /// Drops the shard's gradients (after a skipped step).
  void clear_shard_grads() {
    for (auto& p : optim_params_) p.tensor.mutable_grad().reset();
  }

 private:
  enum class State { sharded, gathering, unsharded };

  std::string name_;
  int index_;
  UnitComms comms_;
  UnitOptions options_;
  int shard_rank_ = 0;
  FlatParamLayout layout_;
  bool trainable_ = true;
  State state_ = State::sharded;
  at::Tensor shard_;  // this rank's slice, options_.shard_dtype
  at::Tensor full_;   // compute dtype, padded; the module's parameters are views of it
  std::vector<OptimParam> optim_params_;
  dist::Work gather_;
  dist::Work reduce_;
  dist::Work replica_;
  bool reducing_ = false;     // a reduce-scatter was started and its result is not yet in the shards
  bool replicating_ = false;  // the reduce-scatter is done; the replicas' all-reduce (if any) started
  at::Tensor flat_grad_;
  at::Tensor reduced_;
  at::Tensor host_grad_;                 // offloaded shards: the reduction's result, pinned, being copied in
  at::Tensor pending_;                   // this pass's reduced gradient (float32, the shard's device), not yet applied
  std::optional<c10::Event> copy_done_;  // set while that copy runs
};

}  // namespace fsdpx::core

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/core/impl/unit.ipp>
#endif
