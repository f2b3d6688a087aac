// Out-of-line functions of fsdpx/dcp/state_dict_saver.hpp: included by it (header-only) or by
// fsdpx/impl/src.hpp (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <fsdpx/dcp/state_dict_saver.hpp>

#include <map>
#include <set>
#include <type_traits>
#include <utility>

#include <ATen/ATen.h>

#include <fsdpx/checkpoint/state_dict.hpp>
#include <fsdpx/core/optim.hpp>
#include <fsdpx/detail/json.hpp>

namespace fsdpx::dcp::detail {

/// The names `name` is saved under (none: left out).
inline std::vector<std::string> saved_names(const SaveOptions& options, const std::string& name) {
  std::string saved = options.saved_name ? options.saved_name(name) : name;
  if (saved.empty()) return {};
  std::vector<std::string> out{saved};
  if (options.also_saved_as) {
    for (std::string& also : options.also_saved_as(saved)) out.push_back(std::move(also));
  }
  return out;
}

/// Where tensor `name` of `shape` is saved: itself, or a run of a larger tensor (SaveOptions::placed_in).
inline Placement placement(const SaveOptions& options, const std::string& name, const std::vector<int64_t>& shape) {
  if (options.placed_in) {
    if (auto at = options.placed_in(name)) return std::move(*at);
  }
  return {name, shape, 0};
}

/// The param group of each trained unit's decayed and other parameters, as (unit, decay) -> group, from
/// every rank's shards (a rank may hold none of a unit's decayed or other elements). Collective.
inline std::map<std::pair<size_t, bool>, size_t> param_group_of_units(core::ShardedModel& model,
                                                                      torch::optim::Optimizer& optimizer) {
  std::map<const c10::TensorImpl*, size_t> group_of_tensor;
  for (size_t g = 0; g < optimizer.param_groups().size(); ++g) {
    for (const at::Tensor& t : optimizer.param_groups()[g].params()) group_of_tensor[t.unsafeGetTensorImpl()] = g;
  }
  auto mine = ::fsdpx::detail::Json::array();
  for (size_t i = 0; i < model.num_units(); ++i) {
    for (const auto& op : model.unit(i).optim_params()) {
      const auto it = group_of_tensor.find(op.tensor.unsafeGetTensorImpl());
      if (it != group_of_tensor.end()) mine.push_back({i, op.decay, it->second});
    }
  }
  std::map<std::pair<size_t, bool>, size_t> out;
  for (const std::string& rank : all_gather_bytes(model.mesh().world(), mine.dump())) {
    for (const auto& e : ::fsdpx::detail::Json::parse(rank))
      out[{e.at(0).get<size_t>(), e.at(1).get<bool>()}] = e.at(2).get<size_t>();
  }
  return out;
}

/// Param group `g`'s entries as torch.optim's class of the same name holds them: LibTorch's
/// hyperparameters, Python's flags at their defaults (LibTorch has none of them), and `params`.
inline void add_param_group(RankState& state, torch::optim::OptimizerOptions& options, size_t g,
                            std::vector<std::string> params) {
  const auto add = [&](const char* key, c10::IValue value) {
    state.bytes.push_back({::fsdpx::detail::str("param_groups.", g, ".", key),
                           std::move(value),
                           {PathStep("param_groups"), PathStep(static_cast<int64_t>(g)), PathStep(key)}});
  };
  const bool known = ::fsdpx::detail::visit_optimizer_row<::fsdpx::detail::AsOptions>(options, [&](auto row, auto& o) {
    add("lr", o.lr());
    if constexpr (decltype(row)::adam_like) {
      add("betas", c10::ivalue::Tuple::create({std::get<0>(o.betas()), std::get<1>(o.betas())}));
      add("eps", o.eps());
      add("weight_decay", o.weight_decay());
      add("amsgrad", o.amsgrad());
      add("capturable", false);
      add("decoupled_weight_decay", std::is_same_v<decltype(row), ::fsdpx::detail::AdamWRow>);
    } else {
      add("momentum", o.momentum());
      add("dampening", o.dampening());
      add("weight_decay", o.weight_decay());
      add("nesterov", o.nesterov());
    }
    add("maximize", false);
    add("foreach", c10::IValue());
    add("differentiable", false);
    add("fused", c10::IValue());
  });
  FSDPX_CHECK(known, "DCP save: this optimizer's type is not known to fsdpx (", ::fsdpx::detail::known_optimizers,
              " are)");
  c10::List<std::string> names;
  for (std::string& n : params) names.push_back(std::move(n));
  add("params", names);
}

}  // namespace fsdpx::dcp::detail

namespace fsdpx::dcp {

FSDPX_DECL std::vector<SavedTensor> model_tensors(const StateDict& sd, const SaveOptions& options) {
  FSDPX_CHECK(sd.kind != StateDictKind::local, "a DCP checkpoint holds sharded or full state dicts; a local one ",
              "holds flat unit shards, which name no tensor");
  std::vector<SavedTensor> out;
  for (const TensorSlice& slice : sd.entries) {
    for (const std::string& name : detail::saved_names(options, slice.name)) {
      const Placement at = detail::placement(options, name, slice.shape);
      out.push_back({at.fqn, at.shape, at.offset + slice.begin, at.offset + slice.end, slice.tensors.at("data"), {}});
    }
  }
  return out;
}

FSDPX_DECL std::vector<SavedTensor> optimizer_tensors(const StateDict& sd, const SaveOptions& options) {
  std::vector<SavedTensor> out;
  const auto at_path = [](const std::string& name, const std::string& key) {
    return std::vector<PathStep>{PathStep("state"), PathStep(name), PathStep(key)};
  };
  for (const TensorSlice& slice : sd.entries) {
    const std::vector<std::string> names = detail::saved_names(options, slice.name);
    if (names.empty()) continue;
    // A tied weight's state is saved once, as torch saves it; a placed one's as part of the larger tensor's
    const Placement at = detail::placement(options, names.front(), slice.shape);
    for (const auto& [key, values] : slice.tensors) {
      out.push_back({"state." + at.fqn + "." + key, at.shape, at.offset + slice.begin, at.offset + slice.end, values,
                     at_path(at.fqn, key)});
    }
    // The step count, a float32 scalar as torch.optim keeps it, from the rank holding the first element
    if (at.offset + slice.begin == 0) {
      out.push_back({"state." + at.fqn + ".step",
                     {},
                     0,
                     1,
                     at::full({1}, static_cast<double>(slice.step), at::kFloat),
                     at_path(at.fqn, "step")});
    }
  }
  return out;
}

FSDPX_DECL std::vector<SavedBytes> param_group_entries(ShardedModelRef model_ref, torch::optim::Optimizer& optimizer,
                                                       const SaveOptions& options) {
  core::ShardedModel& model = *model_ref;
  const auto group_of = detail::param_group_of_units(model, optimizer);  // collective
  RankState state;
  if (model.mesh().world().rank() != 0) return {};
  for (size_t g = 0; g < optimizer.param_groups().size(); ++g) {
    std::vector<std::string> params;
    std::set<std::string> listed;  // a larger tensor that several are placed in is listed once
    for (size_t i = 0; i < model.num_units(); ++i) {
      for (const core::ParamInfo& p : model.unit(i).layout().params()) {
        const auto it = group_of.find({i, p.decay});
        if (it == group_of.end() || it->second != g) continue;
        const auto names = detail::saved_names(options, p.name);
        if (names.empty()) continue;
        std::string name = detail::placement(options, names.front(), p.shape).fqn;
        if (listed.insert(name).second) params.push_back(std::move(name));
      }
    }
    detail::add_param_group(state, optimizer.param_groups()[g].options(), g, std::move(params));
  }
  return std::move(state.bytes);
}

FSDPX_DECL ::fsdpx::detail::WrittenFile save_model(ShardedModelRef model, const fs::path& dir,
                                                   const SaveOptions& options) {
  return detail::save_made_state(dir, model->mesh().world(),
                                 [&] { return RankState{model_tensors(sharded_state_dict(model), options), {}}; });
}

FSDPX_DECL ::fsdpx::detail::WrittenFile save_optimizer(ShardedModelRef model, torch::optim::Optimizer& optimizer,
                                                       const fs::path& dir, const SaveOptions& options) {
  std::vector<SavedBytes> groups = param_group_entries(model, optimizer, options);  // collective: before the rest
  return detail::save_made_state(dir, model->mesh().world(), [&] {
    return RankState{optimizer_tensors(optimizer_state_dict(model, optimizer), options), std::move(groups)};
  });
}

}  // namespace fsdpx::dcp
