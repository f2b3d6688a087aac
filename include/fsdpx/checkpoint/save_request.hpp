// What one checkpoint save writes: a host snapshot of the state (or a function that takes it on the
// coordinator's threads) and the step's description. CheckpointCoordinator::save makes one (make_save_request)
// and submits it; checkpoint::StepFormat writes its files in the coordinator's format.
#pragma once

#include <any>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>
#include <ATen/record_function.h>
#include <torch/optim/optimizer.h>

#include <fsdpx/checkpoint/extra_state.hpp>
#include <fsdpx/checkpoint/format.hpp>
#include <fsdpx/checkpoint/state_dict.hpp>
#include <fsdpx/core/sharded_model.hpp>

namespace fsdpx {

/// How the saving job is set up, as a step's commit record (fsdp_config.json) records it.
struct SaveSetup {
  int64_t mesh_shard = 1;
  int64_t mesh_replicate = 1;
  StateDictKind kind = StateDictKind::sharded;
  std::string param_dtype, reduce_dtype, master_dtype;  // c10::toString of each
  std::string backend;                                  // the world communicator's backend_name()
};

/// What one save writes: host snapshots of the state plus the step's description.
struct SaveRequest {
  int64_t step = 0;
  std::vector<checkpoint::Component> components;
  StateDict model;
  std::optional<StateDict> optim;
  std::optional<c10::IValue> extra;
  std::optional<SaveSetup> setup;  // recorded in the commit record when set
  /// When set, fills `model` and `optim` on the coordinator's threads, before the writes.
  std::function<void(SaveRequest&)> snapshot;
  /// What the format took on save()'s calling thread besides the snapshot (StepFormat::prepare; with
  /// CheckpointFormat::dcp, the param groups' parameter lists, which come from every rank's shards). A request
  /// made by hand for such a format gets it from checkpoint::step_format(format).prepare(req, model, optimizer,
  /// names).
  std::any format_data;
};

/// Describes a save of `model` (by its StateDict policy), the optimizer's state and the extra state.
/// Sharded and local state dicts are copied to host memory in the background (the model's next
/// backward waits for the copy, so it overlaps that step's forward and backward); a full state dict
/// is gathered here (collective). The RNG states in extra_state are taken now.
template <class Sharded>
SaveRequest make_save_request(int64_t step, Sharded& model, torch::optim::Optimizer* optimizer,
                              const ExtraState* extra) {
  using checkpoint::Component;
  SaveRequest req;
  req.step = step;
  req.components.push_back(Component::model);
  if (optimizer != nullptr) req.components.push_back(Component::optim);
  if (extra != nullptr) req.components.push_back(Component::extra_state);
  const auto& world = model.mesh().world();
  constexpr StateDictKind kind = Sharded::StateDictPolicyType::kind;
  req.model.kind = kind;
  req.model.world_size = world.size();
  req.model.rank = world.rank();
  if constexpr (kind == StateDictKind::full) {
    req.model = full_state_dict(model.sharded());
    if (optimizer != nullptr) req.optim = optimizer_state_dict(model.sharded(), *optimizer);
  } else {
    core::ShardedModel* sharded = &model.sharded();
    req.snapshot = [sharded, optimizer](SaveRequest& r) {
      RECORD_USER_SCOPE("fsdpx::checkpoint_snapshot");
      r.model = kind == StateDictKind::local ? local_state_dict(*sharded) : sharded_state_dict(*sharded);
      if (optimizer != nullptr) r.optim = optimizer_state_dict(*sharded, *optimizer);
    };
  }
  if (extra != nullptr) {
    ExtraState e = *extra;
    e.step = step;
    req.extra = checkpoint::extra_state_to_ivalue(e, world.size(), world.rank());
  }
  const auto& unit = model.sharded().unit(0).options();
  req.setup = SaveSetup{model.mesh().shard_size(),
                        model.mesh().replicate_size(),
                        kind,
                        std::string(c10::toString(unit.param_dtype)),
                        std::string(c10::toString(unit.reduce_dtype)),
                        std::string(c10::toString(unit.shard_dtype)),
                        std::string(world.backend_name())};
  return req;
}

}  // namespace fsdpx
