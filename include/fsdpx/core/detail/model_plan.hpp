// Construction's first step: the units a model is cut into, chosen on one rank with no collective and
// nothing in the module changed. ShardedModel's constructor then checks the plan across the ranks and
// commits it (core/impl/model_plan.ipp).
#pragma once

#include <fsdpx/detail/config.hpp>

#include <cstddef>
#include <memory>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include <torch/nn/module.h>

#include <fsdpx/core/flat_param.hpp>
#include <fsdpx/core/setup.hpp>
#include <fsdpx/core/unit.hpp>

namespace fsdpx::core::detail {

/// One unit to make.
struct PlannedUnit {
  std::string name;
  std::vector<ParamInfo> params;
  size_t module = 0;       // index into ModelPlan::modules
  bool companion = false;  // moves with the unit before it: its frozen ("<name>#frozen") or float32-kept parameters
  UnitOptions options;
};

struct ModelPlan {
  /// [0] the root module, then each non-root unit's module, in the model's registration order.
  std::vector<torch::nn::Module*> modules;
  std::vector<std::string> module_names;  // [0] "" (the root)
  /// [0] the root unit; companions right after the unit they move with.
  std::vector<PlannedUnit> units;
  /// Every module inside a non-root unit (the root's own modules are the others).
  std::unordered_set<const torch::nn::Module*> in_units;
  bool deferred = false;          // a deferred_init model: each unit materialized right before it shards
  bool values_meaningful = true;  // compared across ranks (not a deferred model a load overwrites)
};

/// Chooses the units of `root` (top-down: a module the setup picks is not descended into; parameters
/// outside every unit belong to the root), splits modules with frozen and trainable parameters, and
/// gives each unit its options. Throws ConfigError for a model that cannot be cut (a parameter shared
/// by two units).
FSDPX_DECL ModelPlan plan_model(torch::nn::Module& root, const UnitOptions& options, const ModelSetup& setup);

}  // namespace fsdpx::core::detail
