// Out-of-line functions of fsdpx/checkpoint/state_dict.hpp: included by it (header-only) or by fsdpx/impl/src.hpp
// (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <fsdpx/checkpoint/state_dict.hpp>
#include <fsdpx/checkpoint/detail/slice_loader.hpp>

namespace fsdpx::detail {

FSDPX_DECL std::unique_ptr<torch::optim::OptimizerParamState> make_optimizer_state(
    torch::optim::Optimizer& optimizer, std::map<std::string, at::Tensor> tensors, int64_t step) {
  const auto get = [&](const char* key) {
    const auto it = tensors.find(key);
    return it == tensors.end() ? at::Tensor() : it->second;
  };
  std::unique_ptr<torch::optim::OptimizerParamState> out;
  visit_optimizer_row<AsOptimizer>(optimizer, [&](auto row, auto&) {
    auto state = std::make_unique<typename decltype(row)::State>();
    if constexpr (decltype(row)::adam_like) {
      state->step(step);
      state->exp_avg(get("exp_avg"));
      state->exp_avg_sq(get("exp_avg_sq"));
      if (const at::Tensor m = get("max_exp_avg_sq"); m.defined()) state->max_exp_avg_sq(m);
    } else {
      state->momentum_buffer(get("momentum_buffer"));
    }
    out = std::move(state);
  });
  FSDPX_CHECK(out != nullptr, "loading optimizer state: this optimizer type is not known to fsdpx (", known_optimizers,
              " are)");
  return out;
}

FSDPX_DECL std::map<std::string, std::vector<double>> group_hyperparameters(torch::optim::OptimizerOptions& o) {
  std::map<std::string, std::vector<double>> h{{"lr", {o.get_lr()}}};
  visit_optimizer_row<AsOptions>(o, [&](auto row, auto& a) {
    if constexpr (decltype(row)::adam_like) {
      h = {{"lr", {a.lr()}},
           {"betas", {std::get<0>(a.betas()), std::get<1>(a.betas())}},
           {"eps", {a.eps()}},
           {"weight_decay", {a.weight_decay()}},
           {"amsgrad", {a.amsgrad() ? 1.0 : 0.0}}};
    } else {
      h = {{"lr", {a.lr()}},
           {"momentum", {a.momentum()}},
           {"dampening", {a.dampening()}},
           {"weight_decay", {a.weight_decay()}},
           {"nesterov", {a.nesterov() ? 1.0 : 0.0}}};
    }
  });
  return h;
}

FSDPX_DECL void set_group_hyperparameters(torch::optim::OptimizerOptions& o,
                                          const std::map<std::string, std::vector<double>>& h) {
  const auto one = [&](const char* k) { return h.at(k).at(0); };
  o.set_lr(one("lr"));
  visit_optimizer_row<AsOptions>(o, [&](auto row, auto& a) {
    if constexpr (decltype(row)::adam_like) {
      a.betas({h.at("betas").at(0), h.at("betas").at(1)})
          .eps(one("eps"))
          .weight_decay(one("weight_decay"))
          .amsgrad(one("amsgrad") != 0);
    } else {
      a.momentum(one("momentum"))
          .dampening(one("dampening"))
          .weight_decay(one("weight_decay"))
          .nesterov(one("nesterov") != 0);
    }
  });
}

FSDPX_DECL void add_buffer_targets(SliceLoader& loader, const core::ShardedModel& model,
                                   const std::function<bool(const std::string&)>& wanted) {
  for (const auto& [name, b] : model.named_buffers()) {
    if (wanted && !wanted(name)) continue;
    FSDPX_CHECK(b.is_contiguous(), "buffer '", name, "' is not contiguous; state dicts load buffers in place");
    loader.add_target(name, b.sizes().vec(), 0, b.numel(), b.detach().view({-1}));
  }
}

FSDPX_DECL void add_param_targets(SliceLoader& loader, core::ShardedModel& model,
                                  const std::function<bool(const std::string&)>& wanted) {
  for (size_t i = 0; i < model.num_units(); ++i) {
    core::Unit& u = model.unit(i);
    const int64_t base = u.layout().shard_range(u.shard_rank()).begin;
    for (const core::ParamInfo& p : u.layout().params()) {
      if (wanted && !wanted(p.name)) continue;
      const core::FlatRange r = u.held_range(p);
      if (r.begin < r.end) {
        loader.add_target(p.name, p.shape, r.begin - p.offset, r.end - p.offset,
                          u.shard().narrow(0, r.begin - base, r.size()));
      } else {
        loader.add_target(p.name, p.shape, 0, 0, u.shard().narrow(0, 0, 0));  // known name, nothing to copy
      }
    }
  }
}

}  // namespace fsdpx::detail

namespace fsdpx {

FSDPX_DECL StateDict sharded_state_dict(ConstShardedModelRef model_ref) {
  const core::ShardedModel& model = *model_ref;
  StateDict sd = detail::empty_state_dict(model, StateDictKind::sharded, "model");
  if (!detail::writes_slices(model)) return sd;
  for (size_t i = 0; i < model.num_units(); ++i) {
    const core::Unit& u = model.unit(i);
    const int64_t base = u.layout().shard_range(u.shard_rank()).begin;
    for (const core::ParamInfo& p : u.layout().params()) {
      const core::FlatRange r = u.held_range(p);
      if (r.begin >= r.end) continue;
      sd.entries.push_back({p.name,
                            p.shape,
                            r.begin - p.offset,
                            r.end - p.offset,
                            {{"data", detail::host_copy(u.shard().narrow(0, r.begin - base, r.size()))}}});
    }
  }
  if (model.mesh().world().rank() == 0) detail::add_buffers(sd, model);
  return sd;
}

FSDPX_DECL StateDict local_state_dict(ConstShardedModelRef model_ref) {
  const core::ShardedModel& model = *model_ref;
  StateDict sd = detail::empty_state_dict(model, StateDictKind::local, "model");
  for (size_t i = 0; i < model.num_units(); ++i) {
    const core::Unit& u = model.unit(i);
    const core::FlatRange r = u.layout().shard_range(u.shard_rank());
    sd.entries.push_back(
        {u.name(), {u.layout().padded_numel()}, r.begin, r.end, {{"data", detail::host_copy(u.shard())}}});
  }
  detail::add_buffers(sd, model);  // a local state dict is loaded by the rank that saved it only
  return sd;
}

}  // namespace fsdpx

namespace fsdpx {

FSDPX_DECL StateDict full_state_dict(ShardedModelRef model_ref, bool all_ranks) {
  core::ShardedModel& model = *model_ref;
  StateDict sd = detail::empty_state_dict(model, StateDictKind::full, "model");
  const bool keep = all_ranks || model.mesh().world().rank() == 0;
  for (size_t i = 0; i < model.num_units(); ++i) {
    core::Unit& u = model.unit(i);
    if (u.layout().params().empty()) continue;
    const at::Tensor full = detail::gather_unit_shards(model, u);
    if (!keep) continue;
    const auto& layout = u.layout();
    const at::Tensor host = full.to(at::kCPU);  // (a GPU model gathers on the device, then copies once)
    for (const core::ParamInfo& p : layout.params()) {
      sd.entries.push_back({p.name, p.shape, 0, p.numel, {{"data", host.narrow(0, p.offset, p.numel).clone()}}});
    }
  }
  if (keep) detail::add_buffers(sd, model);
  return sd;
}

FSDPX_DECL void load_model_state_dict(
    ShardedModelRef model_ref, const std::function<void(const std::function<void(const StateDict&)>&)>& for_each_saved,
    bool strict) {
  core::ShardedModel& model = *model_ref;
  model.wait_for_shard_readers();  // a background checkpoint copy may still read the shards
  model.reshard_all();             // the next forward gathers the loaded shards
  detail::SliceLoader loader("model", model.options().inference_only);
  std::optional<StateDictKind> kind;
  detail::add_param_targets(loader, model);
  detail::SliceLoader local("model (local)", model.options().inference_only);
  for (size_t i = 0; i < model.num_units(); ++i) {
    core::Unit& u = model.unit(i);
    const core::FlatRange r = u.layout().shard_range(u.shard_rank());
    local.add_target(u.name(), {u.layout().padded_numel()}, r.begin, r.end, u.shard());
  }
  detail::add_buffer_targets(loader, model);
  detail::add_buffer_targets(local, model);
  for_each_saved([&](const StateDict& sd) {
    FSDPX_CHECK(sd.component == "model", "loading a model state dict from a '", sd.component, "' state dict");
    FSDPX_CHECK(!kind || *kind == sd.kind, "the saved state dicts mix kinds (", to_string(*kind), " and ",
                to_string(sd.kind), ")");
    kind = sd.kind;
    if (sd.kind == StateDictKind::local) {
      FSDPX_CHECK(sd.world_size == model.mesh().world().size(),
                  "a local state dict loads only at the world size "
                  "that saved it: it was saved by ",
                  sd.world_size, " ranks, this job has ", model.mesh().world().size(),
                  "; save a sharded or full state dict to change the world size");
      if (sd.rank != model.mesh().world().rank()) return;  // a local state dict is this rank's only
      local.load(sd, "data");
    } else {
      loader.load(sd, "data");
    }
  });
  FSDPX_CHECK(kind.has_value(), "loading a model state dict: no saved state dict was given");
  (*kind == StateDictKind::local ? local : loader).finish(strict);
}

FSDPX_DECL StateDict optimizer_state_dict(ConstShardedModelRef model_ref, torch::optim::Optimizer& optimizer) {
  const core::ShardedModel& model = *model_ref;
  StateDict sd = detail::empty_state_dict(model, StateDictKind::sharded, "optim");
  for (auto& group : optimizer.param_groups())
    sd.param_groups.push_back(detail::group_hyperparameters(group.options()));
  if (!optimizer.state().empty()) {  // every rank steps together: the trained units' parameters all have state
    for (size_t i = 0; i < model.num_units(); ++i) {
      const core::Unit& u = model.unit(i);
      if (!u.trainable()) continue;
      for (const core::ParamInfo& p : u.layout().params()) sd.trained.push_back(p.name);
    }
  }
  if (!detail::writes_slices(model)) return sd;
  for (size_t i = 0; i < model.num_units(); ++i) {
    const core::Unit& u = model.unit(i);
    const int64_t base = u.layout().shard_range(u.shard_rank()).begin;
    for (const auto& op : u.optim_params()) {
      const auto it = optimizer.state().find(op.tensor.unsafeGetTensorImpl());
      if (it == optimizer.state().end()) continue;  // not stepped yet
      const auto state = detail::optimizer_state_tensors(*it->second);
      const int64_t step = detail::optimizer_step(*it->second);
      const int64_t op_begin = base + op.range.begin, op_end = base + op.range.end;
      for (const core::ParamInfo& p : u.layout().params()) {
        const int64_t lo = std::max(p.offset, op_begin), hi = std::min(p.offset + p.numel, op_end);
        if (lo >= hi) continue;
        TensorSlice s{p.name, p.shape, lo - p.offset, hi - p.offset, {}, step};
        for (const auto& [key, t] : state) s.tensors[key] = detail::host_copy(t->narrow(0, lo - op_begin, hi - lo));
        sd.entries.push_back(std::move(s));
      }
    }
  }
  return sd;
}

FSDPX_DECL void load_optimizer_state_dict(
    ShardedModelRef model_ref, torch::optim::Optimizer& optimizer,
    const std::function<void(const std::function<void(const StateDict&)>&)>& for_each_saved) {
  core::ShardedModel& model = *model_ref;
  struct Pending {
    const core::Unit* unit;
    const core::Unit::OptimParam* op;
    std::map<std::string, at::Tensor> tensors;
    std::vector<std::string> targets;  // its entries in the loader
  };
  std::vector<Pending> pending;
  detail::SliceLoader loader("optimizer");
  int64_t step = 0;
  bool first = true;
  std::vector<std::string> keys;
  std::optional<std::set<std::string>> trained;  // the saving job's trained parameters, from its files
  model.wait_for_shard_readers();
  for_each_saved([&](const StateDict& sd) {
    FSDPX_CHECK(sd.component == "optim", "loading optimizer state from a '", sd.component, "' state dict");
    if (!trained && !sd.trained.empty()) trained.emplace(sd.trained.begin(), sd.trained.end());
    if (first) {
      first = false;
      if (sd.param_groups.size() == optimizer.param_groups().size()) {
        for (size_t g = 0; g < sd.param_groups.size(); ++g) {
          detail::set_group_hyperparameters(optimizer.param_groups()[g].options(), sd.param_groups[g]);
        }
      }
    }
    for (const TensorSlice& s : sd.entries) {
      step = std::max(step, s.step);
      if (!keys.empty() || s.tensors.empty()) continue;
      for (const auto& [key, t] : s.tensors) keys.push_back(key);
    }
    if (pending.empty() && !keys.empty()) {  // the state tensors' names are known now: make the targets
      for (size_t i = 0; i < model.num_units(); ++i) {
        core::Unit& u = model.unit(i);
        const int64_t base = u.layout().shard_range(u.shard_rank()).begin;
        for (const auto& op : u.optim_params()) {
          Pending pend{&u, &op, {}, {}};
          for (const auto& key : keys) pend.tensors[key] = at::zeros_like(op.tensor);
          const int64_t op_begin = base + op.range.begin, op_end = base + op.range.end;
          for (const core::ParamInfo& p : u.layout().params()) {
            const int64_t lo = std::max(p.offset, op_begin), hi = std::min(p.offset + p.numel, op_end);
            if (lo < hi) {
              for (const auto& key : keys) {
                pend.targets.push_back(p.name + " [" + key + "]");
                loader.add_target(pend.targets.back(), p.shape, lo - p.offset, hi - p.offset,
                                  pend.tensors[key].narrow(0, lo - op_begin, hi - lo));
              }
            }
          }
          pending.push_back(std::move(pend));
        }
      }
    }
    // One loader keyed by (name, state key): each saved slice contributes each of its tensors.
    StateDict split;
    split.component = "optim";
    split.kind = sd.kind;
    split.world_size = sd.world_size;  // so the loader knows when every saving rank's file was read
    split.rank = sd.rank;
    for (const TensorSlice& s : sd.entries) {
      for (const auto& [key, t] : s.tensors)
        split.entries.push_back({s.name + " [" + key + "]", s.shape, s.begin, s.end, {{"v", t}}, s.step});
    }
    loader.load(split, "v");
  });
  if (keys.empty()) return;  // saved before the first step: nothing to restore
  // One optimizer state, with one step count, covers each group of a unit's trained parameters (its
  // decayed ones, its others). It is restored when the checkpoint has state for every parameter of
  // the group, and left to start afresh when it has none (a unit frozen when saved, trained now);
  // decided from the saving job's list of trained parameters (or, in older files, from the names in
  // every rank's file), not from this rank's shard, so alike at every world size. A group with state
  // for some parameters only (the frozen parameters changed within it) cannot be restored.
  const bool global = trained.has_value() || loader.complete();
  const auto had_state = [&](const std::string& name) {
    return trained ? trained->count(name) != 0 : loader.seen(name + " [" + keys.front() + "]");
  };
  const auto saved = [&](const core::Unit& u, bool decay, std::vector<std::string>* with,
                         std::vector<std::string>* without) {
    bool any = false;
    for (const core::ParamInfo& p : u.layout().params()) {
      if (p.decay != decay) continue;
      const bool has = had_state(p.name);
      any = any || has;
      if (with != nullptr) (has ? *with : *without).push_back(p.name);
    }
    return any;
  };
  std::string changed;
  for (size_t i = 0; i < model.num_units() && global; ++i) {
    const core::Unit& u = model.unit(i);
    if (!u.trainable()) continue;
    for (const bool decay : {true, false}) {
      std::vector<std::string> with, without;
      saved(u, decay, &with, &without);
      if (with.empty() || without.empty()) continue;
      changed += ::fsdpx::detail::str("\n  unit '", u.name(), "': ", ::fsdpx::detail::join_names(without),
                                      " (frozen when the optimizer state was saved) would share one state with ",
                                      ::fsdpx::detail::join_names(with));
    }
  }
  FSDPX_CHECK(changed.empty(),
              "loading the optimizer state dict: the parameters frozen when it was saved differ from those "
              "frozen now, within one optimizer state:",
              changed,
              "\n  Resume with the same parameters frozen, or load the "
              "model only and start a new optimizer.");
  // Parameters the model lacks were named by the model load already; a state saved for a parameter
  // frozen now is left out.
  loader.finish(/*strict=*/false, /*absent_is_missing=*/false);
  // Older files read at the saving topology (this rank's file only): what this rank's shard got.
  const auto filled_here = [&](const Pending& pend) {
    return std::any_of(pend.targets.begin(), pend.targets.end(), [&](const std::string& t) {
      for (const auto& target : loader.targets()[t]) {
        if (!target.filled.empty()) return true;
      }
      return false;
    });
  };
  // A state restored must be in the files read, whole: this rank's own file holds other ranges once
  // the units' layout changed (then the caller reads every file), and zeros in its place would be wrong.
  const auto whole = [&](const Pending& pend) {
    for (const std::string& t : pend.targets) {
      for (auto& target : loader.targets()[t]) {
        std::sort(target.filled.begin(), target.filled.end());
        int64_t to = target.begin;
        for (const auto& [lo, hi] : target.filled) {
          if (lo > to) break;
          to = std::max(to, hi);
        }
        FSDPX_CHECK(to >= target.end, "loading the optimizer state dict: the state of '", t, "' elements [", to, ", ",
                    target.end,
                    ") is not in the files read (this rank's shard is not the saving rank's: the units' "
                    "layout differs)");
      }
    }
  };
  std::vector<bool> restore(pending.size());
  for (size_t i = 0; i < pending.size(); ++i) {  // every check before the optimizer is changed
    restore[i] = global ? saved(*pending[i].unit, pending[i].op->decay, nullptr, nullptr) : filled_here(pending[i]);
    if (restore[i] && global) whole(pending[i]);
  }
  for (size_t i = 0; i < pending.size(); ++i) {
    auto& pend = pending[i];
    if (!restore[i]) continue;
    optimizer.state()[pend.op->tensor.unsafeGetTensorImpl()] =
        detail::make_optimizer_state(optimizer, std::move(pend.tensors), step);
  }
}

FSDPX_DECL void detail::SliceLoader::load(const StateDict& sd, const std::string& key) {
  ranks_seen_.insert(sd.rank);
  complete_ = complete_ || sd.kind == StateDictKind::full || static_cast<int>(ranks_seen_.size()) == sd.world_size;
  for (const TensorSlice& s : sd.entries) {
    seen_.insert(s.name);
    const auto it = targets_.find(s.name);
    if (it == targets_.end()) {
      unexpected_.push_back(s.name);
      continue;
    }
    const auto t = s.tensors.find(key);
    if (t == s.tensors.end()) {
      problems_.push_back(::fsdpx::detail::str("'", s.name, "' has no '", key, "' tensor"));
      continue;
    }
    for (Target& target : it->second) {
      if (s.shape != target.shape) {
        mismatched_.insert(s.name);
        problems_.push_back(::fsdpx::detail::str("'", s.name, "' has shape ", shape_text(s.shape),
                                                 " in the checkpoint but ", shape_text(target.shape), " in the model"));
        break;
      }
      const bool castable = cast_floating_ && t->second.is_floating_point() && target.dst.is_floating_point();
      if (t->second.scalar_type() != target.dst.scalar_type() && !castable) {
        mismatched_.insert(s.name);
        problems_.push_back(::fsdpx::detail::str("'", s.name, "' has dtype ", t->second.scalar_type(),
                                                 " in the checkpoint but ", target.dst.scalar_type(), " in the model"));
        break;
      }
      FSDPX_CHECK_AS(IoError, t->second.numel() == s.end - s.begin, "'", s.name, "' in rank ", sd.rank, "'s ", what_,
                     " state dict holds ", t->second.numel(), " elements for the range [", s.begin, ", ", s.end, ")");
      const int64_t lo = std::max(s.begin, target.begin), hi = std::min(s.end, target.end);
      if (lo >= hi) continue;
      at::NoGradGuard no_grad;
      target.dst.narrow(0, lo - target.begin, hi - lo).copy_(t->second.reshape({-1}).narrow(0, lo - s.begin, hi - lo));
      target.filled.emplace_back(lo, hi);
    }
  }
}

FSDPX_DECL void detail::SliceLoader::finish(bool strict, bool absent_is_missing) {
  std::vector<std::string> missing;
  for (auto& [name, targets] : targets_) {
    if (mismatched_.count(name) != 0) continue;  // named below, with the reason
    if (!absent_is_missing && seen_.count(name) == 0) continue;
    if (complete_ && seen_.count(name) == 0) {  // no saved rank has any of it (even where this rank holds none)
      missing.push_back(name);
      continue;
    }
    for (Target& t : targets) {
      std::sort(t.filled.begin(), t.filled.end());
      int64_t covered_to = t.begin;
      for (const auto& [lo, hi] : t.filled) {
        if (lo > covered_to) break;
        covered_to = std::max(covered_to, hi);
      }
      if (covered_to < t.end) {
        missing.push_back(
            ::fsdpx::detail::str(name, (t.filled.empty() ? "" : " (partly)"), " [", covered_to, ", ", t.end, ")"));
      }
    }
  }
  std::string msg;
  if (!missing.empty()) msg += ::fsdpx::detail::str("\n  missing: ", join(missing));
  if (strict && !unexpected_.empty()) msg += ::fsdpx::detail::str("\n  not in the model: ", join(unexpected_));
  if (!problems_.empty()) msg += ::fsdpx::detail::str("\n  mismatched: ", join(problems_));
  FSDPX_CHECK(msg.empty(), "loading the ", what_, " state dict: it does not match this model:", msg);
}

}  // namespace fsdpx

namespace fsdpx {

FSDPX_DECL const char* to_string(StateDictKind kind) {
  switch (kind) {
    case StateDictKind::full: return "full";
    case StateDictKind::sharded: return "sharded";
    case StateDictKind::local: return "local";
  }
  return "?";
}

}  // namespace fsdpx

namespace fsdpx::detail {

FSDPX_DECL StateDict empty_state_dict(const core::ShardedModel& model, StateDictKind kind, const char* component) {
  StateDict sd;
  sd.kind = kind;
  sd.component = component;
  sd.world_size = model.mesh().world().size();
  sd.rank = model.mesh().world().rank();
  return sd;
}

FSDPX_DECL at::Tensor host_copy(const at::Tensor& t) {
  if (t.is_cpu()) return t.clone();
  at::Tensor out = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(true));
  out.copy_(t);
  return out;
}

FSDPX_DECL int64_t optimizer_step(torch::optim::OptimizerParamState& state) {
  int64_t step = 0;
  visit_optimizer_row<AsState>(state, [&](auto row, auto& s) {
    if constexpr (decltype(row)::adam_like) step = s.step();
  });
  return step;
}

FSDPX_DECL void add_buffers(StateDict& sd, const core::ShardedModel& model) {
  for (const auto& [name, b] : model.named_buffers()) {
    sd.entries.push_back(
        {name, b.sizes().vec(), 0, b.numel(), {{"data", host_copy(b.detach().contiguous().reshape({-1}))}}});
  }
}

FSDPX_DECL at::Tensor gather_unit_shards(core::ShardedModel& model, const core::Unit& u) {
  core::Unit::MasterGather g = u.master_gather_buffers();
  model.mesh().shard_group().all_gather(g.full, g.input);
  return g.full;
}

}  // namespace fsdpx::detail
