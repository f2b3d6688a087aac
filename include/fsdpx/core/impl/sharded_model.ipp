// ShardedModel's member functions, out of line: included by fsdpx/core/sharded_model.hpp (header-only) or by
// fsdpx/impl/src.hpp (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <exception>

#include <fsdpx/core/sharded_model.hpp>

namespace fsdpx::core {

FSDPX_DECL ShardedModel::ShardedModel(std::shared_ptr<torch::nn::Module> root, Mesh mesh, UnitOptions options,
    const ModelSetup& setup)
    : root_module_(std::move(root)), mesh_(std::move(mesh)), options_(options), buffer_sync_(setup.buffer_sync) {
  // Names of every parameter (the first name of a shared one).
  std::unordered_map<const c10::TensorImpl*, std::string> names;
  for (const auto& item : root_module_->named_parameters(/*recurse=*/true)) {
    names.emplace(item.value().unsafeGetTensorImpl(), item.key());
  }
  const auto decays = [&](const std::string& name, const at::Tensor& p) {
    return setup.decay ? setup.decay(name, p) : p.dim() >= 2;
  };
  // Pick units top-down; parameters outside every unit belong to the root.
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> picked;
  pick_units(*root_module_, "", setup.is_unit, picked);
  if (setup.check_units) {
    std::vector<std::string> unit_names;
    for (const auto& item : picked) unit_names.push_back(item.first);
    setup.check_units(unit_names);
  }
  std::unordered_map<const c10::TensorImpl*, std::string> owner;
  const auto collect = [&](const std::string& unit_name, torch::nn::Module& m) {
    std::vector<ParamInfo> params;
    for (const at::Tensor& p : m.parameters(/*recurse=*/true)) {
      const auto* key = p.unsafeGetTensorImpl();
      if (const auto it = owner.find(key); it != owner.end()) {
        FSDPX_CHECK(it->second == unit_name, "parameter '", names[key], "' is shared by units '", it->second,
                    "' and '", unit_name, "'; shared (tied) parameters must live in one unit: wrap a common parent "
                    "or leave both users in the root");
        continue;
      }
      owner.emplace(key, unit_name);
      params.push_back({names[key], p, {}, decays(names[key], p)});
    }
    return params;
  };
  std::vector<std::pair<std::string, std::vector<ParamInfo>>> unit_params;
  std::vector<ParamInfo> root_params;
  for (auto& [name, m] : picked) unit_params.emplace_back(name, collect(name, *m));
  for (const auto& item : root_module_->named_parameters(true)) {
    const auto* key = item.value().unsafeGetTensorImpl();
    if (owner.emplace(key, "root").second) root_params.push_back({item.key(), item.value(), {}, decays(item.key(), item.value())});
  }
  unit_params.insert(unit_params.begin(), {"root", std::move(root_params)});
  std::vector<torch::nn::Module*> unit_modules{root_module_.get()};
  for (auto& item : picked) unit_modules.push_back(item.second.get());

  // A module with frozen and trainable parameters (LoRA adapters beside frozen base weights) gets two
  // units that always move together: the trainable one, and "<name>#frozen", sharded and gathered
  // like it but never reduced, with no gradient and no optimizer state.
  struct Planned {
    std::string name;
    std::vector<ParamInfo> params;
    size_t module;  // index into unit_modules
    bool companion;
  };
  std::vector<Planned> planned;
  for (size_t m = 0; m < unit_params.size(); ++m) {
    auto& [name, params] = unit_params[m];
    std::vector<ParamInfo> frozen;
    if (!params.empty() && std::any_of(params.begin(), params.end(), [](const ParamInfo& p) { return p.param.requires_grad(); })) {
      const auto split = std::stable_partition(params.begin(), params.end(),
                                               [](const ParamInfo& p) { return p.param.requires_grad(); });
      frozen.assign(std::make_move_iterator(split), std::make_move_iterator(params.end()));
      params.erase(split, params.end());
    }
    planned.push_back({name, std::move(params), m, false});
    if (!frozen.empty()) planned.push_back({name + "#frozen", std::move(frozen), m, true});
  }

  // ---- checks: nothing has changed yet ----
  for (const auto* m : unit_modules) {
    FSDPX_CHECK(detail::UnitRegistry::instance().find(m).first == nullptr, "module '", m->name(),
                "' is already a unit of another Fsdp model");
  }
  for (const auto& u : planned) Unit::check_params(u.name, u.params, options_);
  check_layouts_agree(planned);

  // Duplicates of the groups, so gathers and reductions have communicators of their own.
  auto gather = *mesh_.shard_group().split(0, mesh_.shard_group().rank(), "fsdpx/gather");
  auto reduce = *mesh_.shard_group().split(0, mesh_.shard_group().rank(), "fsdpx/reduce");
  const UnitComms comms{gather, reduce, mesh_.replicate_group()};

  // A deferred model is materialized one unit at a time, right before that unit takes its shard
  // and releases the rest: no rank ever holds the whole model.
  const bool deferred = detail::DeferredModels::instance().contains(root_module_.get());
  const auto* skip = setup.init_module.target<bool (*)(torch::nn::Module&)>();
  // Values that a strict load overwrites right after construction are not compared.
  const bool values_meaningful = !(deferred && skip != nullptr && *skip == &skip_init);
  for (auto& [name, m] : picked) {
    for (const auto& sub : m->modules(/*include_self=*/true)) in_units_.insert(sub.get());
  }
  const auto materialize = [&](torch::nn::Module& top, const std::string& prefix, bool root_only) {
    if (!deferred) return;
    for (const auto& item : top.named_modules(prefix, /*include_self=*/true)) {
      if (root_only && in_units_.count(item.value().get()) != 0) continue;
      detail::materialize_module(*item.value(), item.key(), setup.init_module);
    }
  };

  // ---- changes, undone if anything fails ----
  std::vector<std::pair<at::Tensor, at::Tensor>> originals;  // parameter, its data before
  for (const auto& u : planned) {
    for (const ParamInfo& p : u.params) originals.emplace_back(p.param, p.param.variable_data());
  }
  try {
    for (size_t k = 0; k < planned.size(); ++k) {
      Planned& u = planned[k];
      const bool is_root = u.module == 0;
      if (!u.companion) {
        if (is_root) {
          materialize(*root_module_, "", /*root_only=*/true);
        } else {
          materialize(*picked[u.module - 1].second, picked[u.module - 1].first, /*root_only=*/false);
        }
        std::vector<ParamInfo> all = u.params;  // the module's parameters, its companion's too
        if (k + 1 < planned.size() && planned[k + 1].companion) {
          all.insert(all.end(), planned[k + 1].params.begin(), planned[k + 1].params.end());
        }
        replicate_values(u.name, all, *unit_modules[u.module], is_root, values_meaningful, setup.replicas);
      }
      UnitOptions unit_options = options_;
      // The root's parameters are needed again first in backward.
      if (is_root) unit_options.reshard_after_forward = false;
      units_.push_back(std::make_unique<Unit>(u.name, static_cast<int>(k), std::move(u.params), comms, unit_options));
      modules_.push_back(unit_modules[u.module]);
      is_companion_.push_back(u.companion);
      companion_.push_back(0);
      if (u.companion) companion_[k - 1] = k;
    }
  } catch (...) {
    at::NoGradGuard no_grad;
    for (auto& [param, data] : originals) param.set_data(data);
    throw;
  }
  originals.clear();
  if (deferred) detail::DeferredModels::instance().remove(root_module_.get());  // frees the scratch
  for (size_t i = 0; i < units_.size(); ++i) {
    if (is_companion_[i]) continue;  // reached through the unit it moves with
    detail::UnitRegistry::instance().add(modules_[i], this, units_[i].get());
    install_gradient_hooks(*units_[i]);
  }
  pass_.resize(units_.size());
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

FSDPX_DECL std::vector<std::pair<std::string, at::Tensor>> ShardedModel::named_buffers() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& b : root_module_->named_buffers(/*recurse=*/true)) {
    if (b.value().defined()) out.emplace_back(b.key(), b.value());
  }
  return out;
}

FSDPX_DECL void ShardedModel::sync_buffers(BufferSync how) {
  if (how == BufferSync::none || mesh_.world().size() == 1) return;
  RECORD_USER_SCOPE("fsdpx::sync_buffers");
  at::NoGradGuard no_grad;
  // One flat tensor per dtype and treatment, so a model's buffers cost a few collectives, issued in
  // the same order on every rank (the layouts were checked to agree at construction).
  std::map<std::pair<at::ScalarType, bool>, std::vector<at::Tensor>> groups;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& [name, b] : named_buffers()) {
    if (!seen.insert(b.unsafeGetTensorImpl()).second) continue;  // a buffer registered twice
    // variable_data(): the same bytes under a version counter of its own, so the copy below does not
    // invalidate a graph that saved the buffer (two forwards before one backward), as DDP's
    // broadcast_buffers does.
    groups[{b.scalar_type(), how == BufferSync::average && b.is_floating_point()}].push_back(b.variable_data());
  }
  const auto comm_device = mesh_.world().device_type() == c10::kCPU ? at::Device(at::kCPU) : options_.device;
  for (auto& [key, tensors] : groups) {
    std::vector<at::Tensor> flat;
    for (const at::Tensor& t : tensors) flat.push_back(t.reshape({-1}).to(comm_device));
    at::Tensor packed = at::cat(flat);
    if (key.second) {
      mesh_.world().all_reduce(packed, dist::ReduceOp::avg);
    } else {
      mesh_.world().broadcast(packed, 0);
    }
    int64_t offset = 0;
    for (at::Tensor& t : tensors) {
      t.copy_(packed.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

FSDPX_DECL void ShardedModel::add_shard_reader(std::function<void()> wait_done) {
  FSDPX_CHECK(static_cast<bool>(wait_done), "add_shard_reader: the wait function is empty");
  std::lock_guard lock(readers_mutex_);
  readers_.push_back(std::move(wait_done));
}

FSDPX_DECL void ShardedModel::wait_for_shard_readers() {
  std::vector<std::function<void()>> readers;
  {
    std::lock_guard lock(readers_mutex_);
    readers.swap(readers_);
  }
  if (readers.empty()) return;
  RECORD_USER_SCOPE("fsdpx::wait_for_shard_readers");
  const auto start = std::chrono::steady_clock::now();
  // Every reader is waited for, even after one failed: the shards may change once this returns.
  std::exception_ptr first_error;
  for (auto& wait_done : readers) {
    try {
      wait_done();
    } catch (...) {
      if (!first_error) first_error = std::current_exception();
    }
  }
  reader_wait_ += std::chrono::steady_clock::now() - start;
  if (first_error) std::rethrow_exception(first_error);
}

FSDPX_DECL GradNorm ShardedModel::clip_grad_norm_(double max_norm) {
  RECORD_USER_SCOPE("fsdpx::clip_grad_norm");
  at::NoGradGuard no_grad;
  // Each shard gradient's norm in its own dtype on its own device (as torch's clip_grad_norm_), then
  // one scalar to the communicator's device: no copy of a gradient.
  std::vector<at::Tensor> norms;
  for (auto& u : units_) {
    for (const at::Tensor& g : u->shard_grads()) norms.push_back(at::linalg_vector_norm(g, 2));
  }
  const bool on_host = mesh_.shard_group().device_type() == c10::kCPU;
  const auto comm_device = on_host ? at::Device(at::kCPU) : options_.device;
  at::Tensor sq = norms.empty() ? at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(comm_device))
                                : at::stack(norms).to(at::kDouble).square().sum().reshape({1}).to(comm_device);
  // Shards of one group partition the model; replicas hold the same shard.
  mesh_.shard_group().all_reduce(sq, dist::ReduceOp::sum);
  GradNorm norm{std::sqrt(sq.item<double>())};
  if (!norm.is_finite()) {
    for (auto& u : units_) u->clear_shard_grads();
    TORCH_WARN("fsdpx: the global gradient norm is ", norm.value, "; the gradients were cleared, so this step "
               "changes no parameter");
    return norm;
  }
  const double coef = max_norm / (norm.value + 1e-6);
  if (coef < 1.0) {
    for (auto& u : units_) {
      for (at::Tensor g : u->shard_grads()) g.mul_(coef);
    }
  }
  return norm;
}

FSDPX_DECL void ShardedModel::offload_model() {
  wait_for_shard_readers();  // a background checkpoint copy may still read the shards
  reshard_all();
  for (auto& u : units_) u->move_shard(at::Device(at::kCPU));
  release_cached_device_memory();
  memory::release_cached_host_buffers();  // a CPU model's step buffers too
}

FSDPX_DECL ShardedBytes ShardedModel::sharded_bytes() const {
  ShardedBytes b;
  for (const auto& u : units_) {
    b.parameters += u->shard().nbytes();
    for (const at::Tensor& g : u->shard_grads()) b.gradients += g.nbytes();
    b.unsharded += u->unsharded_bytes();
  }
  return b;
}

FSDPX_DECL void ShardedModel::pick_units(torch::nn::Module& m, const std::string& prefix,
    const std::function<bool(const UnitQuery&)>& is_unit,
                         std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>& out) {
  const auto numel = [](torch::nn::Module& mod) {
    int64_t n = 0;
    for (const auto& p : mod.parameters(true)) n += p.numel();
    return n;
  };
  for (const auto& child : m.named_children()) {
    const std::string name = prefix.empty() ? child.key() : prefix + "." + child.key();
    int64_t largest = 0;
    for (const auto& grandchild : child.value()->children()) largest = std::max(largest, numel(*grandchild));
    if (is_unit(UnitQuery{*child.value(), numel(*child.value()), largest, name})) {
      out.emplace_back(name, child.value());
    } else {
      pick_units(*child.value(), name, is_unit, out);
    }
  }
}

FSDPX_DECL void ShardedModel::install_gradient_hooks(Unit& u) {
  if (!u.trainable()) return;
  for (const ParamInfo& p : u.layout().params()) {
    accumulators_.push_back(detail::add_post_accumulate_hook(p.param, [alive = alive_, this, &u] {
      if (*alive) on_grad_accumulated(u);
    }));
  }
}

FSDPX_DECL void ShardedModel::rethrow_if_resharded_access(const c10::Error& e) const {
  const std::string what = e.what_without_backtrace();
  if (what.find("storage of size 0") == std::string::npos && what.find("data is not allocated") == std::string::npos) {
    return;
  }
  std::string names;
  for (size_t i = 1; i < units_.size(); ++i) names += (i > 1 ? ", " : "") + units_[i]->name();
  throw ConfigError(::fsdpx::detail::str(
      "fsdpx: a sharded unit's parameters were used while resharded: a module called a sharded child directly. "
      "Call sharded modules through fsdpx::forward(child, args...) or fsdpx::call(child, fn), or choose units "
      "(wrap policy) that the model calls that way. Sharded units: ", names, ". (ATen: ", what.substr(0, 200), ")"));
}

FSDPX_DECL void ShardedModel::add_post_backward_node(Unit& u, const std::vector<at::Tensor*>& tracked) {
  if (tracked.empty() || !at::GradMode::is_enabled()) return;
  std::vector<at::Tensor> inputs;
  for (const at::Tensor* t : tracked) inputs.push_back(*t);
  auto hook = std::make_shared<detail::BackwardHook>([alive = alive_, this, &u] {
    if (*alive) post_backward(u);
  });
  auto outputs = detail::add_post_backward_hook(std::move(inputs), std::move(hook));
  for (size_t i = 0; i < tracked.size(); ++i) *tracked[i] = std::move(outputs[i]);
  ++pass_[index_of(u)].post_backward_expected;
}

FSDPX_DECL void ShardedModel::begin_step() {
  if (detail::current_backward_pass_id() != -1) return;  // a forward run inside backward (recomputation)
  if (in_backward_) abort_failed_pass();
  // Before the forward, as DDP does: after it, the graph may hold the buffers (an eval-mode
  // BatchNorm saves its running statistics), and changing them would break its backward.
  sync_buffers(buffer_sync_);
  recording_.clear();
  recorded_.assign(units_.size(), false);
  stats_ = StepStats{};
}

FSDPX_DECL void ShardedModel::pre_forward(Unit& u) {
  RECORD_USER_SCOPE("fsdpx::pre_forward");
  if (is_root(u)) begin_step();
  unshard_with(u);
  const size_t i = index_of(u);
  if (at::GradMode::is_enabled()) pass_[i].ran_forward = true;
  if (is_root(u)) {
    if (!forward_order_.empty()) unshard_async_with(*forward_order_.front());  // prefetch the first unit
  } else {
    if (i < recorded_.size() && !recorded_[i]) {
      recorded_[i] = true;
      recording_.push_back(&u);
    }
    // Prefetch what followed u in the previous step (the same on every rank).
    if (const auto pos = position_.find(&u); pos != position_.end() && pos->second + 1 < forward_order_.size()) {
      unshard_async_with(*forward_order_[pos->second + 1]);
    }
  }
  note_unsharded();
}

FSDPX_DECL void ShardedModel::commit_forward_order() {
  forward_order_ = recording_;
  position_.clear();
  for (size_t i = 0; i < forward_order_.size(); ++i) position_[forward_order_[i]] = i;
  stats_.forward_order.clear();
  for (const Unit* u : forward_order_) stats_.forward_order.push_back(u->name());
  for (size_t i = 1; i < units_.size(); ++i) {
    if (!recorded_[i] && !is_companion_[i] && units_[i]->options().reshard_after_forward) reshard_with(*units_[i]);
  }
}

FSDPX_DECL void ShardedModel::forward_failed(Unit& u) noexcept {
  if (!is_root(u) || detail::current_backward_pass_id() != -1) return;
  try {
    reshard_all();
  } catch (const std::exception& e) {
    TORCH_WARN("fsdpx: after a failed forward, freeing the gathered parameters failed too: ", e.what());
  }
  for (auto& s : pass_) s = PassState{};
  recording_.clear();
}

FSDPX_DECL void ShardedModel::begin_backward() {
  const int id = detail::current_backward_pass_id();
  if (in_backward_ && id == backward_pass_id_) return;
  if (in_backward_) abort_failed_pass();
  in_backward_ = true;
  backward_pass_id_ = id;
  detail::at_end_of_backward([alive = alive_, this] {
    if (*alive) end_of_backward();
  });
}

FSDPX_DECL void ShardedModel::pre_backward(Unit& u) {
  RECORD_USER_SCOPE("fsdpx::pre_backward");
  begin_backward();
  unshard_with(u);  // again after an earlier call of the same unit finished its backward
  PassState& s = pass_[index_of(u)];
  if (!s.pre_backward_done) {
    s.pre_backward_done = true;
    if (const auto pos = position_.find(&u); pos != position_.end() && pos->second > 0) {
      unshard_async_with(*forward_order_[pos->second - 1]);  // backward prefetch
    }
  }
  note_unsharded();
}

FSDPX_DECL void ShardedModel::on_grad_accumulated(Unit& u) {
  begin_backward();  // a pass that never met a hooked output still ends with its reductions
  PassState& s = pass_[index_of(u)];
  if (s.backward_done) {
    if (sync_ && u.trainable()) s.late_gradient = true;
    return;
  }
  // Every gradient in means the backward is over, unless frozen parameters (the companion's) are
  // still needed for the gradient of the unit's input: then only the post-backward node says so.
  if (++s.grads_ready == static_cast<int>(u.layout().params().size()) && companion(u) == nullptr) {
    unit_backward_done(u);
  }
}

FSDPX_DECL void ShardedModel::unit_backward_done(Unit& u) {
  PassState& s = pass_[index_of(u)];
  if (s.backward_done) return;
  s.backward_done = true;
  if (sync_ && u.trainable()) {
    u.reduce_gradients_async();
    issued_.push_back(&u);
    ++stats_.reductions_during_backward;
  }
  if (!is_root(u)) reshard_with(u);
  advance_replica_reductions();
}

FSDPX_DECL void ShardedModel::end_of_backward() {
  RECORD_USER_SCOPE("fsdpx::end_of_backward");
  in_backward_ = false;
  wait_for_shard_readers();  // the optimizer step that follows changes the shards
  if (sync_) {
    // Units whose backward never signalled (no input required grad, or it ended without them):
    // reduced now, in reverse unit order. A unit that did not run keeps no gradient at all, so
    // the optimizer leaves it as it is.
    for (size_t i = units_.size(); i-- > 0;) {
      Unit& u = *units_[i];
      if (pass_[i].backward_done || !pass_[i].ran_forward || !u.trainable()) continue;
      u.reduce_gradients_async();
      issued_.push_back(&u);
      ++stats_.reductions_at_end;
    }
    for (Unit* u : issued_) u->start_replica_reduction();
    for (Unit* u : issued_) u->start_gradient_copy_to_host();  // offloaded: all copies queued, one wait
    for (Unit* u : issued_) u->finish_gradient_reduction();
    // Gradients accumulated after their unit's reduction (autograd ran a branch late): reduced
    // again, in unit order.
    for (size_t i = 0; i < units_.size(); ++i) {
      if (!pass_[i].late_gradient) continue;
      units_[i]->reduce_gradients_async();
      units_[i]->finish_gradient_reduction();
      ++stats_.late_reductions;
    }
  }
  issued_.clear();
  replica_next_ = 0;
  reshard_all();  // the next forward gathers the updated shards
  memory::HostBufferCache::instance().end_step();  // the step buffers kept: no more than this step's peak
  for (const auto& s : pass_) stats_.units_run += s.ran_forward ? 1 : 0;
  last_stats_ = stats_;
  for (auto& s : pass_) s = PassState{};
}

FSDPX_DECL void ShardedModel::abort_failed_pass() {
  in_backward_ = false;
  std::string error;
  bool dropped = false;
  for (auto& u : units_) {
    try {
      dropped = u->discard_gradients() || dropped;
    } catch (const std::exception& e) {
      if (error.empty()) error = e.what();
    }
  }
  issued_.clear();
  replica_next_ = 0;
  try {
    reshard_all();
  } catch (const std::exception& e) {
    if (error.empty()) error = e.what();
  }
  for (auto& s : pass_) s = PassState{};
  TORCH_WARN("fsdpx: the previous backward pass ended with an exception; the gradients it computed",
             dropped && !sync_ ? " (and those accumulated without gradient sync before it)" : "",
             " were discarded and no shard changed. Zero the optimizer's gradients before the next step as "
             "usual.",
             error.empty() ? "" : " Waiting for its collectives failed too: ", error);
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
    torch::nn::Module& module,
                        bool root, bool values_meaningful, ReplicaInit how) {
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
          join_ranks(ranks), "; every rank takes its shard from its own copy, so the model would be a patchwork. "
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

FSDPX_DECL void ShardedModel::reload_model() {
  wait_for_shard_readers();
  const at::Device home = options_.offload_to_cpu ? at::Device(at::kCPU) : options_.device;
  for (auto& u : units_) u->move_shard(home);
}

FSDPX_DECL void ShardedModel::note_unsharded() {
  int64_t bytes = 0;
  for (const auto& u : units_) bytes += u->unsharded_bytes();
  stats_.peak_unsharded_bytes = std::max(stats_.peak_unsharded_bytes, bytes);
}

FSDPX_DECL void ShardedModel::post_backward(Unit& u) {
  RECORD_USER_SCOPE("fsdpx::post_backward");
  begin_backward();
  PassState& s = pass_[index_of(u)];
  if (++s.post_backward_seen >= s.post_backward_expected) unit_backward_done(u);
}

FSDPX_DECL void ShardedModel::advance_replica_reductions() {
  while (replica_next_ < issued_.size() && issued_[replica_next_]->reduce_scatter_completed()) {
    issued_[replica_next_++]->start_replica_reduction();
  }
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

}  // namespace fsdpx::core
