// Construction of a ShardedModel, out of line: plan (detail::plan_model, this rank alone), check
// (ShardedModel::check_plan, collective, nothing changed), commit (ShardedModel::commit_plan). Included
// by fsdpx/core/sharded_model.hpp (header-only) or by fsdpx/impl/src.hpp (FSDPX_SEPARATE_COMPILATION).
#pragma once

#include <algorithm>
#include <array>
#include <iterator>
#include <unordered_map>

#include <fsdpx/core/deferred_init.hpp>
#include <fsdpx/core/detail/model_plan.hpp>
#include <fsdpx/core/sharded_model.hpp>
#include <fsdpx/core/sync_batch_norm.hpp>
#include <fsdpx/detail/crc32c.hpp>

namespace fsdpx::core {

namespace detail {

namespace {

int64_t numel_of(torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters(/*recurse=*/true)) n += p.numel();
  return n;
}

/// Top-down: a module the policy picks becomes a unit and is not descended into.
void pick_units(torch::nn::Module& m, const std::string& prefix, const std::function<bool(const UnitQuery&)>& is_unit,
                std::vector<std::pair<std::string, torch::nn::Module*>>& out) {
  for (const auto& child : m.named_children()) {
    const std::string name = prefix.empty() ? child.key() : prefix + "." + child.key();
    int64_t largest = 0;
    for (const auto& grandchild : child.value()->children()) largest = std::max(largest, numel_of(*grandchild));
    if (is_unit(UnitQuery{*child.value(), numel_of(*child.value()), largest, name})) {
      out.emplace_back(name, child.value().get());
    } else {
      pick_units(*child.value(), name, is_unit, out);
    }
  }
}

}  // namespace

FSDPX_DECL ModelPlan plan_model(torch::nn::Module& root, const UnitOptions& options, const ModelSetup& setup) {
  ModelPlan plan;
  // Names of every parameter (the first name of a shared one).
  std::unordered_map<const c10::TensorImpl*, std::string> names;
  for (const auto& item : root.named_parameters(/*recurse=*/true))
    names.emplace(item.value().unsafeGetTensorImpl(), item.key());
  const auto decays = [&](const std::string& name, const at::Tensor& p) {
    return setup.decay ? setup.decay(name, p) : p.dim() >= 2;
  };
  std::vector<std::pair<std::string, torch::nn::Module*>> picked;
  pick_units(root, "", setup.is_unit, picked);
  if (setup.check_units) {
    std::vector<std::string> unit_names;
    for (const auto& item : picked) unit_names.push_back(item.first);
    setup.check_units(unit_names);
  }
  plan.modules.push_back(&root);
  plan.module_names.emplace_back();
  for (const auto& [name, m] : picked) {
    plan.modules.push_back(m);
    plan.module_names.push_back(name);
    for (const auto& sub : m->modules(/*include_self=*/true)) plan.in_units.insert(sub.get());
  }

  // Each parameter belongs to the first unit that holds it; the root takes the rest.
  std::unordered_map<const c10::TensorImpl*, std::string> owner;
  std::vector<std::vector<ParamInfo>> params(plan.modules.size());
  for (size_t m = 1; m < plan.modules.size(); ++m) {
    const std::string& unit_name = plan.module_names[m];
    for (const at::Tensor& p : plan.modules[m]->parameters(/*recurse=*/true)) {
      const auto* key = p.unsafeGetTensorImpl();
      if (const auto it = owner.find(key); it != owner.end()) {
        FSDPX_CHECK(it->second == unit_name, "parameter '", names[key], "' is shared by units '", it->second, "' and '",
                    unit_name,
                    "'; shared (tied) parameters must live in one unit: wrap a common parent "
                    "or leave both users in the root");
        continue;
      }
      owner.emplace(key, unit_name);
      params[m].push_back({names[key], p, {}, decays(names[key], p)});
    }
  }
  for (const auto& item : root.named_parameters(/*recurse=*/true)) {
    const auto* key = item.value().unsafeGetTensorImpl();
    if (owner.emplace(key, "root").second)
      params[0].push_back({item.key(), item.value(), {}, decays(item.key(), item.value())});
  }

  // Parameters that a kept module registers itself stay float32 when the units compute in another dtype.
  std::unordered_set<const c10::TensorImpl*> kept;
  const bool low_precision =
      options.param_dtype != at::kFloat || options.reduce_dtype != at::kFloat || options.shard_dtype != at::kFloat;
  if (setup.keep_full_precision && low_precision) {
    for (const auto& item : root.named_modules("", /*include_self=*/true)) {
      if (!setup.keep_full_precision(item.key(), *item.value())) continue;
      for (const at::Tensor& p : item.value()->parameters(/*recurse=*/false)) kept.insert(p.unsafeGetTensorImpl());
    }
  }

  // A module's parameters fall into up to four members: trainable in the compute dtype, trainable kept
  // in float32, then the frozen ones alike. The first that holds any is the unit (named as the module);
  // the others are its companions, sharded and gathered with it: a frozen one (LoRA adapters beside
  // frozen base weights: "<name>#frozen") is never reduced and has no gradient or optimizer state; a
  // kept one ("<name>#float32") is gathered and reduced in float32, and its gradients count toward the
  // unit's.
  struct Member {
    bool frozen, kept;
    std::vector<ParamInfo> params;
  };
  const int checkpointable = static_cast<int>(plan.modules.size()) - 1;
  for (size_t m = 0; m < plan.modules.size(); ++m) {
    const bool is_root = m == 0;
    const std::string name = is_root ? "root" : plan.module_names[m];
    std::array<Member, 4> members{{{false, false, {}}, {false, true, {}}, {true, false, {}}, {true, true, {}}}};
    for (ParamInfo& p : params[m]) {
      const size_t which = (p.param.requires_grad() ? 0 : 2) + (kept.count(p.param.unsafeGetTensorImpl()) ? 1 : 0);
      members[which].params.push_back(std::move(p));
    }
    UnitOptions unit_options = options;
    if (is_root) {
      unit_options.reshard_after_forward = false;  // backward needs the root's parameters first
    } else {
      if (setup.reshard_after_forward) unit_options.reshard_after_forward = setup.reshard_after_forward(name);
      unit_options.checkpoint_activations =
          !options.inference_only && setup.checkpoint &&
          setup.checkpoint(CheckpointQuery{name, static_cast<int>(m) - 1, checkpointable});
    }
    const auto member_options = [&](const Member& member) {
      UnitOptions o = unit_options;
      if (member.kept) {
        o.param_dtype = o.reduce_dtype = o.shard_dtype = at::kFloat;
        o.input_dtype = options.param_dtype;  // the unit's inputs stay in the policy's dtype
      }
      return o;
    };
    const auto first = std::find_if(members.begin(), members.end(), [](const Member& g) { return !g.params.empty(); });
    const Member& unit = first == members.end() ? members.front() : *first;
    plan.units.push_back({name, unit.params, m, false, member_options(unit)});
    for (const Member& member : members) {
      if (&member == &unit || member.params.empty()) continue;
      // Named by how it differs from the unit, so every member's name is its own.
      const std::string suffix =
          std::string(member.frozen && !unit.frozen ? "#frozen" : "") + (member.kept && !unit.kept ? "#float32" : "") +
          (!member.kept && unit.kept ? "#" + std::string(c10::toString(options.param_dtype)) : "");
      plan.units.push_back({name + suffix, member.params, m, true, member_options(member)});
    }
  }

  // A deferred model is materialized one unit at a time, right before that unit takes its shard.
  plan.deferred = DeferredModels::instance().contains(&root);
  const auto* skip = setup.init_module.target<bool (*)(torch::nn::Module&)>();
  // Values that a strict load overwrites right after construction are not compared.
  plan.values_meaningful = !(plan.deferred && skip != nullptr && *skip == &skip_init);
  return plan;
}

}  // namespace detail

FSDPX_DECL ShardedModel::ShardedModel(std::shared_ptr<torch::nn::Module> root, Mesh mesh, UnitOptions options,
                                      const ModelSetup& setup)
    : root_module_(std::move(root)), mesh_(std::move(mesh)), options_(options), buffer_sync_(setup.buffer_sync) {
  detail::ModelPlan plan = detail::plan_model(*root_module_, options_, setup);
  check_plan(plan);
  commit_plan(plan, setup);
  pass_.reset(units_.size());
  // Every rank holds the same modules (check_plan), so all of them split or none does.
  bool sync_batch_norm = false;
  for (const auto& m : root_module_->modules(/*include_self=*/true))
    sync_batch_norm = sync_batch_norm || dynamic_cast<const SyncBatchNormImpl*>(m.get()) != nullptr;
  if (sync_batch_norm) {
    set_sync_batch_norm_group(*root_module_, *mesh_.world().split(0, mesh_.world().rank(), "fsdpx/sync_batch_norm"));
  }
}

FSDPX_DECL ShardedModel::~ShardedModel() {
  try {
    wait_for_shard_readers();  // a background checkpoint copy may still read the shards
  } catch (...) {
    // A reader's wait failed after every reader was waited for: nothing reads the shards any more.
  }
  *alive_ = false;  // autograd may still hold hooks that point here
  for (size_t i = 0; i < modules_.size(); ++i) {
    if (!is_companion_[i]) detail::UnitRegistry::instance().remove(modules_[i]);
  }
}

FSDPX_DECL void ShardedModel::check_plan(const detail::ModelPlan& plan) {
  for (const auto* m : plan.modules) {
    FSDPX_CHECK(detail::UnitRegistry::instance().find(m).first == nullptr, "module '", m->name(),
                "' is already a unit of another Fsdp model");
  }
  for (const auto& u : plan.units) Unit::check_params(u.name, u.params, u.options);

  // Every rank must build the same units: one hash per parameter and buffer description, compared
  // through their count and a combined hash, then one by one only when they differ.
  std::vector<std::string> described;
  std::vector<int64_t> hashes;
  uint32_t total = 0;
  const auto add = [&](std::string description) {
    described.push_back(std::move(description));
    const uint32_t h = ::fsdpx::detail::Crc32c::of(described.back().data(), described.back().size());
    hashes.push_back(h);
    total = ::fsdpx::detail::Crc32c::of(&h, sizeof h) ^ (total * 31u);
  };
  for (const auto& u : plan.units) {
    for (const ParamInfo& p : u.params) {
      add(::fsdpx::detail::str("parameter '", p.name, "' (unit '", u.name, "', shape ", p.param.sizes(), ", ",
                               p.param.scalar_type(), p.param.requires_grad() ? ", trainable" : ", frozen",
                               p.decay ? ", decayed)" : ")"));
    }
  }
  // Buffers too: every rank synchronizes and saves them as one list (BufferSync, state dicts).
  for (const auto& [name, b] : named_buffers()) {
    add(::fsdpx::detail::str("buffer '", name, "' (shape ", b.sizes(), ", ", b.scalar_type(), ")"));
  }
  const auto all = all_gather_world({static_cast<int64_t>(hashes.size()), static_cast<int64_t>(total)});
  const auto count_differs = ranks_differing(all, 2, 0), layout_differs = ranks_differing(all, 2, 1);
  if (count_differs.empty() && layout_differs.empty()) return;
  const int me = mesh_.world().rank();
  if (!count_differs.empty()) {
    std::string counts;
    for (size_t r = 0; r * 2 < all.size(); ++r)
      counts += ::fsdpx::detail::str(r ? ", " : "", "rank ", r, ": ", all[r * 2]);
    throw ConfigError(::fsdpx::detail::str("fsdpx: the ranks built different models (rank ", me,
                                           "): they hold different numbers of parameters and buffers (", counts,
                                           "); ranks differing from rank 0: ", join_ranks(count_differs),
                                           ". Every rank must construct the "
                                           "same model with the same configuration."));
  }
  const auto per_tensor = all_gather_world(hashes);
  for (size_t i = 0; i < hashes.size(); ++i) {
    if (const auto ranks = ranks_differing(per_tensor, hashes.size(), i); !ranks.empty()) {
      throw ConfigError(::fsdpx::detail::str(
          "fsdpx: the ranks built different models: ", described[i], " on rank ", me,
          " is not the same on rank 0 and rank(s) ", join_ranks(ranks),
          " (name, shape, dtype, requires_grad or "
          "weight-decay class). Every rank must construct the same model with the same configuration."));
    }
  }
  FSDPX_INTERNAL_ASSERT(false, "the ranks' combined model hashes differ, but no single tensor's does");
}

FSDPX_DECL void ShardedModel::commit_plan(detail::ModelPlan& plan, const ModelSetup& setup) {
  // Duplicates of the groups, so gathers and reductions have communicators of their own.
  auto gather = *mesh_.shard_group().split(0, mesh_.shard_group().rank(), "fsdpx/gather");
  auto reduce = *mesh_.shard_group().split(0, mesh_.shard_group().rank(), "fsdpx/reduce");
  const UnitComms comms{gather, reduce, mesh_.replicate_group()};
  in_units_ = plan.in_units;
  const auto materialize = [&](size_t module) {
    if (!plan.deferred) return;
    const bool root_only = module == 0;
    for (const auto& item : plan.modules[module]->named_modules(plan.module_names[module], /*include_self=*/true)) {
      if (root_only && in_units_.count(item.value().get()) != 0) continue;
      detail::materialize_module(*item.value(), item.key(), setup.init_module);
    }
  };

  std::vector<std::pair<at::Tensor, at::Tensor>> originals;  // parameter, its data before
  size_t unit_of_module = 0;                                 // the unit the companions that follow move with
  for (const auto& u : plan.units) {
    for (const ParamInfo& p : u.params) originals.emplace_back(p.param, p.param.variable_data());
  }
  try {
    for (size_t k = 0; k < plan.units.size(); ++k) {
      detail::PlannedUnit& u = plan.units[k];
      const bool is_root = u.module == 0;
      if (!u.companion) {
        materialize(u.module);
        std::vector<ParamInfo> all = u.params;  // the module's parameters, its companions' too
        for (size_t c = k + 1; c < plan.units.size() && plan.units[c].companion; ++c) {
          all.insert(all.end(), plan.units[c].params.begin(), plan.units[c].params.end());
        }
        replicate_values(u.name, all, *plan.modules[u.module], is_root, plan.values_meaningful, setup.replicas);
      }
      units_.push_back(std::make_unique<Unit>(u.name, static_cast<int>(k), std::move(u.params), comms, u.options));
      modules_.push_back(plan.modules[u.module]);
      is_companion_.push_back(u.companion);
      companions_.emplace_back();
      if (!u.companion) {
        unit_of_module = k;
      } else {
        companions_[unit_of_module].push_back(k);
      }
    }
  } catch (...) {
    at::NoGradGuard no_grad;
    for (auto& [param, data] : originals) param.set_data(data);
    throw;
  }
  originals.clear();
  if (plan.deferred) detail::DeferredModels::instance().remove(root_module_.get());  // frees the scratch
  for (size_t i = 0; i < units_.size(); ++i) {
    if (is_companion_[i]) continue;  // reached through the unit it moves with
    detail::UnitRegistry::instance().add(modules_[i], this, units_[i].get());
    install_gradient_hooks(*units_[i]);
  }
}

FSDPX_DECL void ShardedModel::install_gradient_hooks(Unit& u) {
  for (const at::Tensor& p : trainable_parameters(u)) {  // a kept companion's count toward u's backward
    accumulators_.push_back(detail::add_post_accumulate_hook(p, [alive = alive_, this, &u] {
      if (*alive) on_grad_accumulated(u);
    }));
  }
}

FSDPX_DECL std::vector<int64_t> ShardedModel::all_gather_world(const std::vector<int64_t>& mine) {
  auto& world = mesh_.world();
  const auto device = world.device_type() == c10::kCPU ? at::Device(at::kCPU) : options_.device;
  const at::Tensor in = at::tensor(mine, at::kLong).to(device);
  at::Tensor out = at::empty({static_cast<int64_t>(mine.size()) * world.size()}, in.options());
  world.all_gather(out, in);
  const at::Tensor host = out.cpu();
  return {host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + host.numel()};
}

FSDPX_DECL std::vector<int> ShardedModel::ranks_differing(const std::vector<int64_t>& all, size_t n, size_t i) {
  std::vector<int> out;
  for (size_t r = 1; r * n < all.size(); ++r) {
    if (all[r * n + i] != all[i]) out.push_back(static_cast<int>(r));
  }
  return out;
}

FSDPX_DECL std::string ShardedModel::join_ranks(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

FSDPX_DECL int64_t ShardedModel::fingerprint(const at::Tensor& tensor) {
  at::NoGradGuard no_grad;
  const at::Tensor t = tensor.detach().contiguous().reshape({-1});
  if (t.numel() == 0) return 0;
  const auto as = [&]() -> at::ScalarType {
    switch (t.element_size()) {
      case 1: return at::kByte;
      case 2: return at::kShort;
      case 4: return at::kInt;
      default: return at::kLong;
    }
  }();
  const at::Tensor bits = (t.scalar_type() == at::kBool ? t.to(at::kByte) : t).view(as).reshape({-1});
  constexpr int64_t chunk = int64_t{1} << 20;  // bounds the temporaries, whatever the tensor's size
  int64_t h = bits.numel();
  for (int64_t begin = 0; begin < bits.numel(); begin += chunk) {
    const int64_t n = std::min(chunk, bits.numel() - begin);
    const at::Tensor weights = at::arange(begin, begin + n, bits.options().dtype(at::kLong)).remainder(65521).add_(1);
    h = h * 1000003 + (bits.narrow(0, begin, n).to(at::kLong) * weights).sum().item<int64_t>();
  }
  return h;
}

FSDPX_DECL void ShardedModel::replicate_values(const std::string& unit, const std::vector<ParamInfo>& params,
                                               torch::nn::Module& module, bool root, bool values_meaningful,
                                               ReplicaInit how) {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const ParamInfo& p : params) tensors.emplace_back(p.name, p.param);
  for (auto& [name, buffer] : unit_buffers(module, root)) tensors.emplace_back(name, buffer);
  if (how == ReplicaInit::as_constructed || mesh_.world().size() == 1) return;
  at::NoGradGuard no_grad;
  if (how == ReplicaInit::broadcast_from_rank0) {
    for (auto& [name, t] : tensors) {
      at::Tensor data = t.detach();
      if (data.is_contiguous()) {
        mesh_.world().broadcast(data, 0);
      } else {
        at::Tensor copy = data.contiguous();
        mesh_.world().broadcast(copy, 0);
        data.copy_(copy);
      }
    }
    return;
  }
  if (!values_meaningful || tensors.empty()) return;
  std::vector<int64_t> prints;
  for (const auto& [name, t] : tensors) prints.push_back(fingerprint(t));
  const auto all = all_gather_world(prints);
  for (size_t i = 0; i < prints.size(); ++i) {
    if (const auto ranks = ranks_differing(all, prints.size(), i); !ranks.empty()) {
      throw ConfigError(::fsdpx::detail::str(
          "fsdpx: '", tensors[i].first, "' (unit '", unit, "') does not hold the same values on rank 0 and rank(s) ",
          join_ranks(ranks),
          "; every rank takes its shard from its own copy, so the model would be a patchwork. "
          "Seed every rank's random generator alike before constructing the model, or set "
          "FsdpOptions::replicas = fsdpx::ReplicaInit::broadcast_from_rank0 to copy rank 0's values (as DDP does)."));
    }
  }
}

FSDPX_DECL std::vector<std::pair<std::string, at::Tensor>> ShardedModel::unit_buffers(torch::nn::Module& module,
                                                                                      bool root) const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  if (!root) {
    for (const auto& b : module.named_buffers(/*recurse=*/true)) out.emplace_back(b.key(), b.value());
    return out;
  }
  for (const auto& item : module.named_modules("", /*include_self=*/true)) {
    if (in_units_.count(item.value().get()) != 0) continue;
    for (const auto& b : item.value()->named_buffers(/*recurse=*/false)) {
      out.emplace_back(item.key().empty() ? b.key() : item.key() + "." + b.key(), b.value());
    }
  }
  return out;
}

}  // namespace fsdpx::core
