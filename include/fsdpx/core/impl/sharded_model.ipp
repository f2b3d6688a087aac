// ShardedModel's protocol, out of line, in the order a step runs it: forward, backward, end of
// backward, failure; then the helpers around it (buffers, shard readers, clipping, offload). Included
// by fsdpx/core/sharded_model.hpp (header-only) or by fsdpx/impl/src.hpp (FSDPX_SEPARATE_COMPILATION;
// fsdpx/detail/config.hpp). Construction is in model_plan.ipp.
#pragma once

#include <exception>
#include <map>
#include <set>
#include <utility>

#include <fsdpx/core/sharded_model.hpp>

namespace fsdpx::core {

// ---- forward ----------------------------------------------------------------------------------------------

FSDPX_DECL void ShardedModel::begin_forward() {
  if (detail::current_backward_pass_id() != -1) return;  // a root forward run inside backward (recomputation)
  if (pass_.stage == detail::PassStage::backward) abort_pass("the previous backward pass ended with an exception");
  // Before the forward, as DDP does: after it, the graph may hold the buffers (an eval-mode
  // BatchNorm saves its running statistics), and changing them would break its backward.
  sync_buffers(buffer_sync_);
  // A second forward before one backward keeps the units' records (its backward ends both graphs),
  // unless the first one's graph is gone.
  pass_.forget_dropped_graphs();
  pass_.stage = detail::PassStage::forward;
  pass_.recording.clear();
  pass_.recorded.assign(units_.size(), false);
  pass_.stats = StepStats{};
  memory::HostBufferCache::instance().begin_forward();  // step buffers only backward uses stay out of its peak
}

FSDPX_DECL void ShardedModel::pre_forward(Unit& u) {
  RECORD_USER_SCOPE("fsdpx::pre_forward");
  if (is_root(u)) begin_forward();
  // Checked before anything is gathered. Backward is a legal start: a forward inside backward
  // (a checkpointed caller's recomputation, or the root's) runs a unit whose own backward began.
  detail::check_phase(record(u), u.name(), "pre_forward",
                      {detail::UnitPhase::idle, detail::UnitPhase::after_forward, detail::UnitPhase::backward,
                       detail::UnitPhase::reduced},
                      detail::UnitPhase::forward, "; a unit cannot be called inside its own forward");
  unshard_with(u);
  detail::UnitRecord& r = record(u);
  r.before_forward = std::exchange(r.phase, detail::UnitPhase::forward);
  if (at::GradMode::is_enabled()) r.ran_with_grad = true;
  const size_t i = index_of(u);
  if (is_root(u)) {
    if (!forward_order_.empty()) unshard_async_with(*forward_order_.front());  // prefetch the first unit
  } else {
    if (i < pass_.recorded.size() && !pass_.recorded[i]) {
      pass_.recorded[i] = true;
      pass_.recording.push_back(&u);
    }
    // Prefetch what followed u in the previous step (the same on every rank).
    if (const auto pos = position_.find(&u); pos != position_.end() && pos->second + 1 < forward_order_.size()) {
      unshard_async_with(*forward_order_[pos->second + 1]);
    }
  }
  note_unsharded();
}

FSDPX_DECL void ShardedModel::end_unit_forward(Unit& u) {
  // Idle is a legal start: a whole backward ran inside this call, and its end reset the pass.
  detail::move_phase(record(u), u.name(), "the end of forward", {detail::UnitPhase::forward, detail::UnitPhase::idle},
                     at::GradMode::is_enabled() ? detail::UnitPhase::after_forward : detail::UnitPhase::idle);
  if (is_root(u) && detail::current_backward_pass_id() == -1) {
    // This step's forward order becomes the one prefetching follows. Every unit that frees its
    // parameters after forward is freed now: one prefetched but not run (the model skipped it), or
    // prefetched by a unit's second call after its last one ran.
    forward_order_ = pass_.recording;
    position_.clear();
    for (size_t i = 0; i < forward_order_.size(); ++i) position_[forward_order_[i]] = i;
    pass_.stats.forward_order.clear();
    for (const Unit* v : forward_order_) pass_.stats.forward_order.push_back(v->name());
    for (size_t i = 1; i < units_.size(); ++i) {
      if (!is_companion_[i] && units_[i]->options().reshard_after_forward) reshard_with(*units_[i]);
    }
    pass_.stage = detail::PassStage::after_forward;
    memory::HostBufferCache::instance().end_forward();
  }
  // An inference-only root has no backward to free it after: it is freed here like the others.
  if ((!is_root(u) || u.options().inference_only) && u.options().reshard_after_forward) reshard_with(u);
}

FSDPX_DECL void ShardedModel::forward_failed(Unit& u) noexcept {
  if (!is_root(u) || detail::current_backward_pass_id() != -1) {
    // The caller may catch it and go on: the unit is back where its forward started.
    if (detail::UnitRecord& r = record(u); r.phase == detail::UnitPhase::forward) r.phase = r.before_forward;
    return;
  }
  try {
    reshard_all();
  } catch (const std::exception& e) {
    TORCH_WARN("fsdpx: after a failed forward, freeing the gathered parameters failed too: ", e.what());
  }
  // Nothing was issued in a forward: the records are dropped, the gradients of earlier passes stay.
  pass_.reset(units_.size());
}

// ---- backward ---------------------------------------------------------------------------------------------

FSDPX_DECL void ShardedModel::begin_backward() {
  const int id = detail::current_backward_pass_id();
  if (pass_.stage == detail::PassStage::backward && id == pass_.backward_id) return;
  if (pass_.stage == detail::PassStage::backward) abort_pass("the previous backward pass ended with an exception");
  pass_.forget_dropped_graphs();  // a forward whose graph was dropped before this one's backward
  pass_.stage = detail::PassStage::backward;
  pass_.backward_id = id;
  detail::at_end_of_backward([alive = alive_, this] {
    if (*alive) end_of_backward();
  });
}

FSDPX_DECL void ShardedModel::pre_backward(Unit& u) {
  RECORD_USER_SCOPE("fsdpx::pre_backward");
  begin_backward();
  detail::UnitRecord& r = record(u);
  // Idle is a legal start: a unit called with gradients, then again without in the same forward.
  // A reduced unit stays reduced (a later call's gradients arrive as late gradients).
  detail::move_phase(r, u.name(), "pre_backward",
                     {detail::UnitPhase::idle, detail::UnitPhase::after_forward, detail::UnitPhase::backward,
                      detail::UnitPhase::reduced},
                     r.phase == detail::UnitPhase::reduced ? detail::UnitPhase::reduced : detail::UnitPhase::backward,
                     "; a backward ran inside the unit's own forward");
  unshard_with(u);  // again after an earlier call of the same unit finished its backward
  if (!r.prefetched_backward) {
    r.prefetched_backward = true;
    if (const auto pos = position_.find(&u); pos != position_.end() && pos->second > 0) {
      unshard_async_with(*forward_order_[pos->second - 1]);  // backward prefetch
    }
  }
  note_unsharded();
}

FSDPX_DECL void ShardedModel::post_backward(Unit& u) {
  RECORD_USER_SCOPE("fsdpx::post_backward");
  begin_backward();
  detail::UnitRecord& r = record(u);
  if (++r.finished_calls >= r.tracked_calls) unit_backward_done(u);
}

FSDPX_DECL void ShardedModel::on_grad_accumulated(Unit& u) {
  begin_backward();  // a pass that never met a hooked output still ends with its reductions
  detail::UnitRecord& r = record(u);
  if (r.phase == detail::UnitPhase::reduced) {
    if (sync_ && u.trainable()) r.late_gradient = true;
    return;
  }
  // Every gradient in (the kept companions' too) means the backward is over, unless frozen parameters
  // (a frozen companion's) are still needed for the gradient of the unit's input: then only the
  // post-backward node says so.
  size_t expected = 0;
  for_each_trainable_member(u, [&](const Unit& member) { expected += member.layout().params().size(); });
  if (++r.grads_ready == static_cast<int>(expected) && !has_frozen_companion(u)) {
    unit_backward_done(u);
  }
}

FSDPX_DECL void ShardedModel::unit_backward_done(Unit& u) {
  detail::UnitRecord& r = record(u);
  if (r.phase == detail::UnitPhase::reduced) return;
  // After forward or idle: every parameter's gradient accumulated (on_grad_accumulated) before any
  // of the unit's hooked outputs signalled, e.g. when none of its outputs was hooked.
  detail::move_phase(r, u.name(), "the end of the unit's backward",
                     {detail::UnitPhase::idle, detail::UnitPhase::after_forward, detail::UnitPhase::backward},
                     detail::UnitPhase::reduced, "; a backward ran inside the unit's own forward");
  if (sync_) {
    for_each_trainable_member(u, [&](Unit& member) {
      member.reduce_gradients_async();
      pass_.issued.push_back(&member);
      ++pass_.stats.reductions_during_backward;
    });
  }
  if (!is_root(u)) reshard_with(u);
  advance_replica_reductions();
}

FSDPX_DECL void ShardedModel::advance_replica_reductions() {
  while (pass_.replica_next < pass_.issued.size() && pass_.issued[pass_.replica_next]->reduce_scatter_completed()) {
    pass_.issued[pass_.replica_next++]->start_replica_reduction();
  }
}

FSDPX_DECL void ShardedModel::add_post_backward_node(Unit& u, const std::vector<at::Tensor*>& tracked) {
  if (tracked.empty() || !at::GradMode::is_enabled()) return;
  std::vector<at::Tensor> inputs;
  for (const at::Tensor* t : tracked) inputs.push_back(*t);
  auto hook = std::make_shared<detail::BackwardHook>([alive = alive_, this, &u] {
    if (*alive) post_backward(u);
  });
  record(u).post_backward_nodes.emplace_back(hook);  // alive as long as the node's graph
  auto outputs = detail::add_post_backward_hook(std::move(inputs), std::move(hook));
  for (size_t i = 0; i < tracked.size(); ++i) *tracked[i] = std::move(outputs[i]);
  ++record(u).tracked_calls;
}

// ---- activation checkpointing -------------------------------------------------------------------------------

FSDPX_DECL std::vector<at::Tensor> ShardedModel::trainable_parameters(const Unit& u) const {
  std::vector<at::Tensor> out;
  const auto add = [&](const Unit& member) {
    if (!member.trainable()) return;
    for (const ParamInfo& p : member.layout().params()) out.push_back(p.param);
  };
  add(u);
  if (u.trainable()) {
    for (const size_t c : companions(u)) add(*units_[c]);
  }
  return out;
}

FSDPX_DECL std::vector<at::Tensor> ShardedModel::unit_module_buffers(const Unit& u) const {
  const auto index = static_cast<size_t>(u.index());
  FSDPX_INTERNAL_ASSERT(index < modules_.size() && units_[index].get() == &u, "unit '", u.name(),
                        "' is not this model's unit ", index);
  return modules_[index]->buffers(/*recurse=*/true);
}

FSDPX_DECL void ShardedModel::recomputed_gradients(Unit& u, std::vector<at::Tensor> grads) {
  const std::vector<at::Tensor> params = trainable_parameters(u);
  FSDPX_INTERNAL_ASSERT(grads.empty() || grads.size() == params.size(), "unit '", u.name(), "' recomputed ",
                        grads.size(), " gradients for ", params.size(), " parameters");
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!grads[i].defined()) continue;  // unused in this call: as autograd, no accumulation
    detail::accumulate_grad(params[i], std::move(grads[i]));
    on_grad_accumulated(u);
  }
}

// ---- end of backward ------------------------------------------------------------------------------------------

FSDPX_DECL void ShardedModel::end_of_backward() {
  RECORD_USER_SCOPE("fsdpx::end_of_backward");
  // The optimizer step that follows changes the shards. A reader's failure is its own (a background
  // save): this rank still takes part in every collective below, and reports it once the pass is done.
  std::exception_ptr reader_error;
  try {
    wait_for_shard_readers();
  } catch (...) {
    reader_error = std::current_exception();
  }
  // Every way out below ends the pass: either it completes, or abort_pass drops what it issued.
  struct AbortUnlessDone {
    ShardedModel* model;
    bool done = false;
    ~AbortUnlessDone() {
      if (!done) model->abort_pass("the end of a backward pass failed while reducing gradients");
    }
  } abort_unless_done{this};
  if (sync_) {
    // Units whose backward never signalled (no input required grad, or it ended without them):
    // reduced now, in reverse unit order. A unit that did not run keeps no gradient at all, so
    // the optimizer leaves it as it is.
    for (size_t i = units_.size(); i-- > 0;) {
      const detail::UnitRecord& r = pass_.units[i];  // a companion's stays idle: it moves with its unit
      if (r.phase == detail::UnitPhase::reduced || !r.ran_with_grad) continue;
      for_each_trainable_member(*units_[i], [&](Unit& member) {
        member.reduce_gradients_async();
        pass_.issued.push_back(&member);
        ++pass_.stats.reductions_at_end;
      });
    }
    for (Unit* u : pass_.issued) u->start_replica_reduction();
    for (Unit* u : pass_.issued) u->start_gradient_copy_to_host();  // offloaded: all copies queued, one wait
    for (Unit* u : pass_.issued) u->wait_gradient_reduction();
    // Gradients accumulated after their unit's reduction (autograd ran a branch late): reduced
    // again, in unit order, into the same pending result.
    for (size_t i = 0; i < units_.size(); ++i) {
      if (!pass_.units[i].late_gradient) continue;
      for_each_trainable_member(*units_[i], [&](Unit& member) {
        member.reduce_gradients_async();
        member.wait_gradient_reduction();
        ++pass_.stats.late_reductions;
      });
    }
    // Only now, with every collective of the pass complete, do the shards' gradients change.
    for (Unit* u : pass_.issued) u->apply_gradient_reduction();
  }
  abort_unless_done.done = true;
  reshard_all();                                   // the next forward gathers the updated shards
  memory::HostBufferCache::instance().end_step();  // the step buffers kept: no more than this step's peak
  for (const auto& r : pass_.units) pass_.stats.units_run += r.ran_with_grad ? 1 : 0;
  last_stats_ = pass_.stats;
  pass_.reset(units_.size());
  if (reader_error) std::rethrow_exception(reader_error);
}

FSDPX_DECL void ShardedModel::abort_pass(const char* why) noexcept {
  std::string error;
  bool dropped = false;
  for (auto& u : units_) {
    try {
      dropped = u->discard_gradients() || dropped;
    } catch (const std::exception& e) {
      if (error.empty()) error = e.what();
    }
  }
  try {
    reshard_all();
  } catch (const std::exception& e) {
    if (error.empty()) error = e.what();
  }
  pass_.reset(units_.size());
  try {
    TORCH_WARN("fsdpx: ", why, "; the gradients it computed",
               dropped && !sync_ ? " (and those accumulated without gradient sync before it)" : "",
               " were discarded and no shard changed. Zero the optimizer's gradients before the next step as usual.",
               error.empty() ? "" : " Waiting for its collectives failed too: ", error);
  } catch (...) {
    // A warning handler that throws must not turn a cleanup into a second failure.
  }
}

// ---- unsharding ---------------------------------------------------------------------------------------------

FSDPX_DECL void ShardedModel::unshard_async_with(Unit& u) {
  u.unshard_async();
  for (const size_t c : companions(u)) units_[c]->unshard_async();
}

FSDPX_DECL void ShardedModel::unshard_with(Unit& u) {
  unshard_async_with(u);
  u.unshard();
  for (const size_t c : companions(u)) units_[c]->unshard();
}

FSDPX_DECL void ShardedModel::reshard_with(Unit& u) {
  u.reshard();
  for (const size_t c : companions(u)) units_[c]->reshard();
}

FSDPX_DECL void ShardedModel::unshard_all() {
  for (auto& u : units_) u->unshard_async();
  for (auto& u : units_) u->unshard();
}

FSDPX_DECL void ShardedModel::reshard_all() {
  for (auto& u : units_) u->reshard();
}

FSDPX_DECL void ShardedModel::note_unsharded() {
  int64_t bytes = 0;
  for (const auto& u : units_) bytes += u->unsharded_bytes();
  pass_.stats.peak_unsharded_bytes = std::max(pass_.stats.peak_unsharded_bytes, bytes);
}

FSDPX_DECL std::optional<ConfigError> ShardedModel::resharded_access_error(const Unit& running,
                                                                           const c10::Error& e) const {
  const std::string what = e.what_without_backtrace();
  if (what.find("storage of size 0") == std::string::npos && what.find("data is not allocated") == std::string::npos) {
    return std::nullopt;
  }
  // The units whose modules lie inside the running unit's and that this pass has not called: the module
  // called one of them directly (a unit it called through fsdpx::forward has left "idle").
  std::unordered_set<const torch::nn::Module*> inside;
  const size_t self = index_of(running);
  for (const auto& m : const_cast<torch::nn::Module*>(modules_[self])->modules(/*include_self=*/false))
    inside.insert(m.get());
  std::vector<std::string> uncalled, all;
  for (size_t i = 1; i < units_.size(); ++i) {
    if (is_companion_[i]) continue;
    all.push_back(units_[i]->name());
    if (i != self && i < pass_.units.size() && inside.count(modules_[i]) != 0 && !units_[i]->is_unsharded() &&
        pass_.units[i].phase == UnitPhase::idle)
      uncalled.push_back(units_[i]->name());
  }
  const std::string called = uncalled.size() == 1 ? ::fsdpx::detail::str("'", uncalled.front(), "'")
                             : uncalled.empty()
                                 ? std::string("one of the sharded units")
                                 : ::fsdpx::detail::str("one of ", ::fsdpx::detail::join_names(uncalled, 8));
  return ConfigError(::fsdpx::detail::str(
      "fsdpx: a sharded unit's parameters were used while resharded: a module called a sharded child directly (",
      running.index() == 0 ? std::string("the root module") : "unit '" + running.name() + "'", " called ", called,
      "). Call sharded modules through fsdpx::forward(child, args...) or fsdpx::call(child, fn), or choose units "
      "(wrap policy) that the model calls that way. Sharded units: ",
      ::fsdpx::detail::join_names(all, 20), ". (ATen: ", what.substr(0, 200), ")"));
}

FSDPX_DECL std::optional<ConfigError> ShardedModel::dtype_clash_error(const Unit& running, const c10::Error& e) const {
  const std::string what = e.what_without_backtrace();
  const bool clash = what.find("scalar type") != std::string::npos || what.find("dtype") != std::string::npos ||
                     (what.find("type") != std::string::npos && what.find("should be the same") != std::string::npos);
  if (!clash) return std::nullopt;
  const size_t self = index_of(running);
  const bool root = self == 0;
  // The modules of the unit whose own floating parameters and buffers are not all of one dtype.
  std::vector<std::string> suspects;
  const auto dtypes_of = [](const auto& tensors) {
    std::set<std::string> out;
    for (const auto& t : tensors) {
      if (t.defined() && t.is_floating_point()) out.insert(c10::toString(t.scalar_type()));
    }
    return out;
  };
  const auto join = [](const std::set<std::string>& names) {
    std::string s;
    for (const auto& n : names) s += (s.empty() ? "" : "/") + n;
    return s;
  };
  auto* module = const_cast<torch::nn::Module*>(modules_[self]);
  for (const auto& item : module->named_modules(root ? "" : running.name(), /*include_self=*/true)) {
    if (root && in_units_.count(item.value().get()) != 0) continue;
    const auto params = dtypes_of(item.value()->parameters(/*recurse=*/false));
    const auto buffers = dtypes_of(item.value()->buffers(/*recurse=*/false));
    std::set<std::string> all = params;
    all.insert(buffers.begin(), buffers.end());
    if (all.size() < 2) continue;
    suspects.push_back(::fsdpx::detail::str("'", item.key(), "' (parameters ", join(params), ", buffers ",
                                            buffers.empty() ? std::string("none") : join(buffers), ")"));
  }
  std::string kept;
  for (const size_t c : companions(running)) {
    if (units_[c]->options().param_dtype != running.options().param_dtype)
      kept += ::fsdpx::detail::str("; unit '", units_[c]->name(), "' in ", units_[c]->options().param_dtype);
  }
  const c10::ScalarType computes = running.options().input_dtype.value_or(running.options().param_dtype);
  return ConfigError(::fsdpx::detail::str(
      "fsdpx: a dtype mismatch inside unit '", running.name(), "' (it computes in ", computes, kept, "): ",
      suspects.empty()
          ? std::string("no module of the unit holds tensors of two dtypes; look at the unit's inputs "
                        "and at the tensors its forward makes")
          : ::fsdpx::detail::str("module ", ::fsdpx::detail::join_names(suspects, 8), " holds tensors of two dtypes"),
      ". A module whose parameters must match its float32 buffers or inputs (BatchNorm's running statistics) can "
      "keep its parameters in float32 under mixed precision: FsdpOptions::keep_full_precision (default "
      "fsdpx::is_batch_norm; fsdpx::is_norm_layer keeps every normalization layer). (ATen: ",
      what.substr(0, 200), ")"));
}

// ---- buffers ------------------------------------------------------------------------------------------------

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

// ---- background readers of the shards -------------------------------------------------------------------------

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

// ---- clipping, offload, accounting ----------------------------------------------------------------------------

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
    TORCH_WARN("fsdpx: the global gradient norm is ", norm.value,
               "; the gradients were cleared, so this step "
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

FSDPX_DECL void ShardedModel::reload_model() {
  wait_for_shard_readers();
  const at::Device home = options_.offload_to_cpu ? at::Device(at::kCPU) : options_.device;
  for (auto& u : units_) u->move_shard(home);
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

}  // namespace fsdpx::core
