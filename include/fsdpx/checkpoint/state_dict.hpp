// State dicts of an Fsdp model and its optimizer, in one shape for all three kinds:
//
//   full     every parameter whole (on rank 0, or on every rank when asked), float32, on the CPU
//   sharded  each rank's slice of every parameter: elements [begin, end) of the flattened parameter,
//            with its global shape, so any world size or mesh can load it (resharding on load)
//   local    each unit's raw flat shard (padding included): the fastest save, same topology only
//
// A loader takes the state dicts of every rank of the saving job one at a time (a checkpoint's files)
// and copies what overlaps this rank's shards; it never builds the full model. Names, shapes,
// dtypes and coverage are checked, and every mismatch is named.
#pragma once

#include <fsdpx/detail/config.hpp>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>

#include <fsdpx/core/model_ref.hpp>
#include <fsdpx/core/optim.hpp>
#include <fsdpx/core/sharded_model.hpp>
#include <fsdpx/error.hpp>
#include <fsdpx/policies/state_dict.hpp>

namespace fsdpx {

/// One tensor of a state dict: elements [begin, end) of the flattened tensor `name` of global `shape`.
struct TensorSlice {
  std::string name;
  std::vector<int64_t> shape;
  int64_t begin = 0;
  int64_t end = 0;
  /// "data" for a model; the optimizer's state tensors ("exp_avg", "exp_avg_sq", ...) for an optimizer.
  std::map<std::string, at::Tensor> tensors;
  int64_t step = 0;  // optimizer entries: the optimizer's step count for this tensor

  int64_t global_numel() const {
    int64_t n = 1;
    for (const int64_t d : shape) n *= d;
    return n;
  }
  bool is_whole() const { return begin == 0 && end == global_numel(); }
  /// The model entry's tensor, shaped as the whole parameter when the slice is whole.
  at::Tensor data() const {
    const at::Tensor& t = tensors.at("data");
    return is_whole() ? t.view(shape) : t;
  }
};

/// A state dict of one rank: its kind, the saving job's world size and rank, and the slices.
struct StateDict {
  StateDictKind kind = StateDictKind::sharded;
  std::string component = "model";  // "model" or "optim"
  int world_size = 1;
  int rank = 0;
  std::vector<TensorSlice> entries;
  /// Optimizer: one entry per parameter group (its hyperparameters, e.g. "lr", "betas").
  std::vector<std::map<std::string, std::vector<double>>> param_groups;
  /// Optimizer: the names of every parameter the saving job trained, on all its ranks (each rank's file
  /// holds the whole list, so one file tells which parameters had state; empty in files of older fsdpx).
  std::vector<std::string> trained;
};

FSDPX_DECL const char* to_string(StateDictKind kind);

namespace detail {

/// Only replica 0 of each shard group writes slices: the other replicas hold the same values.
inline bool writes_slices(const core::ShardedModel& model) { return model.mesh().replicate_group().rank() == 0; }

FSDPX_DECL StateDict empty_state_dict(const core::ShardedModel& model, StateDictKind kind, const char* component);

/// A host snapshot of `t` (pinned when it lives on a GPU, so the copy is a fast DMA).
FSDPX_DECL at::Tensor host_copy(const at::Tensor& t);

class SliceLoader;  // detail/slice_loader.hpp

/// LibTorch keeps the step count inside the state object but exposes it by type.
FSDPX_DECL int64_t optimizer_step(torch::optim::OptimizerParamState& state);

/// A new state object of `optimizer`'s type with `tensors` and `step`.
FSDPX_DECL std::unique_ptr<torch::optim::OptimizerParamState> make_optimizer_state(
    torch::optim::Optimizer& optimizer, std::map<std::string, at::Tensor> tensors, int64_t step);

/// The hyperparameters of a param group, as numbers (what checkpoints keep and restore).
FSDPX_DECL std::map<std::string, std::vector<double>> group_hyperparameters(torch::optim::OptimizerOptions& o);

FSDPX_DECL void set_group_hyperparameters(torch::optim::OptimizerOptions& o,
                                          const std::map<std::string, std::vector<double>>& h);

}  // namespace detail

// ---- model ------------------------------------------------------------------------------------------

namespace detail {
/// Each buffer as one whole entry, in its own dtype, copied to host memory (every rank holds the same
/// copy, as the module keeps them; sharded state dicts take world rank 0's).
FSDPX_DECL void add_buffers(StateDict& sd, const core::ShardedModel& model);
/// Registers every buffer as a whole target of `loader` (those `wanted` admits, when given).
FSDPX_DECL void add_buffer_targets(SliceLoader& loader, const core::ShardedModel& model,
                                   const std::function<bool(const std::string&)>& wanted = {});
/// Registers this rank's slice of every parameter (those `wanted` admits, when given) as a target of `loader`;
/// a parameter it holds none of is registered empty, so that its name is still checked.
FSDPX_DECL void add_param_targets(SliceLoader& loader, core::ShardedModel& model,
                                  const std::function<bool(const std::string&)>& wanted = {});
}  // namespace detail

/// This rank's slices of every parameter (float32 master values), copied to host memory.
FSDPX_DECL StateDict sharded_state_dict(ConstShardedModelRef model);

/// Each unit's raw flat shard; loads only into the same model at the same world size and mesh.
FSDPX_DECL StateDict local_state_dict(ConstShardedModelRef model);

namespace detail {
/// Unit `u`'s whole flat buffer of master values. Collective over the shard group.
FSDPX_DECL at::Tensor gather_unit_shards(core::ShardedModel& model, const core::Unit& u);
}  // namespace detail

/// Every parameter whole, float32 on the CPU: on rank 0 only, or on every rank with `all_ranks`.
/// Collective: every rank calls it. One unit is gathered at a time.
FSDPX_DECL StateDict full_state_dict(ShardedModelRef model, bool all_ranks = false);

/// Loads state dicts saved by any world size (full or sharded), or by this very topology (local).
/// `for_each_saved(fn)` calls fn once per saved rank's state dict: a checkpoint streams its files.
/// Every rank calls it; it is not collective.
FSDPX_DECL void load_model_state_dict(
    ShardedModelRef model, const std::function<void(const std::function<void(const StateDict&)>&)>& for_each_saved,
    bool strict = true);

inline void load_model_state_dict(ShardedModelRef model, const StateDict& sd, bool strict = true) {
  load_model_state_dict(model, [&](const auto& fn) { fn(sd); }, strict);
}

// ---- optimizer --------------------------------------------------------------------------------------

/// This rank's slices of the optimizer's state for every parameter, in the sharded layout (so it
/// reshards on load like the model), plus each param group's hyperparameters.
FSDPX_DECL StateDict optimizer_state_dict(ConstShardedModelRef model, torch::optim::Optimizer& optimizer);

/// Restores optimizer state saved at any world size into this rank's shards (and the param groups'
/// hyperparameters when the group count matches). `for_each_saved(fn)` calls fn once per saved rank's state
/// dict. Every rank calls it; it is not collective.
FSDPX_DECL void load_optimizer_state_dict(
    ShardedModelRef model, torch::optim::Optimizer& optimizer,
    const std::function<void(const std::function<void(const StateDict&)>&)>& for_each_saved);
inline void load_optimizer_state_dict(ShardedModelRef model, torch::optim::Optimizer& optimizer, const StateDict& sd) {
  load_optimizer_state_dict(model, optimizer, [&](const auto& fn) { fn(sd); });
}
/// The order before the model came first (2026-12): one release, deprecated.
[[deprecated(
    "fsdpx::load_optimizer_state_dict(optimizer, model, saved) is now load_optimizer_state_dict(model, "
    "optimizer, saved): the model first, as in every load, save and sync call")]]
inline void load_optimizer_state_dict(
    torch::optim::Optimizer& optimizer, core::ShardedModel& model,
    const std::function<void(const std::function<void(const StateDict&)>&)>& for_each_saved) {
  load_optimizer_state_dict(ShardedModelRef(model), optimizer, for_each_saved);
}

}  // namespace fsdpx

namespace fsdpx {

/// The state dict of `model` in the kind its StateDict policy names (Fsdp<..., FullStateDict, ...>:
/// full tensors on rank 0). Collective for the full kind.
template <class Sharded>
  requires requires { Sharded::StateDictPolicyType::kind; }
StateDict state_dict(Sharded& model) {
  switch (Sharded::StateDictPolicyType::kind) {
    case StateDictKind::full: return full_state_dict(model.sharded());
    case StateDictKind::local: return local_state_dict(model.sharded());
    case StateDictKind::sharded: break;
  }
  return sharded_state_dict(model.sharded());
}

/// Loads a state dict of any kind into `model` (a full one on every rank; a sharded one of one
/// saving rank at a time through the streaming overload of load_model_state_dict).
template <class Sharded>
  requires requires { Sharded::StateDictPolicyType::kind; }
void load_state_dict(Sharded& model, const StateDict& sd, bool strict = true) {
  load_model_state_dict(model.sharded(), sd, strict);
}

}  // namespace fsdpx

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/checkpoint/impl/state_dict.ipp>
#endif
