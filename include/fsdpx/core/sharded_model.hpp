// ShardedModel: the units of one model and the protocol that runs them. Not a template, so every
// Fsdp<...> shares one compiled implementation; Fsdp maps its policies onto UnitOptions.
//
// Forward:  pre_forward(u) unshards u and prefetches the next unit in forward order (recorded on the
//           first forward); post_forward(u) reshards u (unless it is the root or reshard_after_forward
//           is off) and hooks u's outputs so that u is unsharded again before its backward.
// Backward: the output hook unshards u and prefetches the unit before it; autograd's post-accumulate
//           hooks count u's gradients, and when all are in, u's reduce-scatter starts. Reductions
//           start in one fixed order (reverse unit index, root last) on every rank. At the end of
//           backward, missing reductions start (unused parameters count as zero), all are finished
//           into the shards' gradients, and every unit is resharded.
#pragma once

#include <chrono>
#include <cmath>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <fsdpx/core/deferred_init.hpp>
#include <fsdpx/core/detail/autograd.hpp>
#include <fsdpx/core/memory.hpp>
#include <fsdpx/core/unit.hpp>
#include <fsdpx/dist/mesh.hpp>
#include <fsdpx/policies/wrap.hpp>

namespace fsdpx::core {

class ShardedModel;

namespace detail {

/// Which sharded unit a module is, for fsdpx::forward.
class UnitRegistry {
 public:
  static UnitRegistry& instance() {
    static UnitRegistry registry;
    return registry;
  }
  void add(const torch::nn::Module* m, ShardedModel* owner, Unit* unit) {
    std::lock_guard lock(mutex_);
    FSDPX_CHECK(units_.find(m) == units_.end(), "module '", m->name(), "' is already a unit of another Fsdp model");
    units_[m] = {owner, unit};
  }
  void remove(const torch::nn::Module* m) {
    std::lock_guard lock(mutex_);
    units_.erase(m);
  }
  std::pair<ShardedModel*, Unit*> find(const torch::nn::Module* m) const {
    std::lock_guard lock(mutex_);
    const auto it = units_.find(m);
    return it == units_.end() ? std::pair<ShardedModel*, Unit*>{nullptr, nullptr} : it->second;
  }

 private:
  mutable std::mutex mutex_;
  std::unordered_map<const torch::nn::Module*, std::pair<ShardedModel*, Unit*>> units_;
};

/// Applies `fn` to every tensor in a module's output (a tensor, or a tuple / vector of them).
template <class T, class Fn>
T map_tensors(T value, Fn&& fn) {
  if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor>) {
    return fn(std::move(value));
  } else if constexpr (requires { std::tuple_size<std::decay_t<T>>::value; }) {
    std::apply([&](auto&... elems) { ((elems = map_tensors(std::move(elems), fn)), ...); }, value);
    return value;
  } else if constexpr (requires { value.begin(); typename std::decay_t<T>::value_type; }) {
    for (auto& v : value) v = map_tensors(std::move(v), fn);
    return value;
  } else {
    return value;  // no tensors inside (e.g. a scalar)
  }
}

}  // namespace detail

/// Result of clip_grad_norm_: the global norm before clipping.
struct GradNorm {
  double value = 0;
  bool is_finite() const { return std::isfinite(value); }
};

/// What one rank holds, in bytes (for memory accounting and tests).
struct ShardedBytes {
  int64_t parameters = 0;   // shards (float32 masters; the compute dtype when inference-only)
  int64_t gradients = 0;    // float32 shard gradients
  int64_t unsharded = 0;    // full parameter buffers allocated right now
};

class ShardedModel {
 public:
  using Mesh = dist::DeviceMesh<dist::AnyCommunicator>;
  using UnitSelector = std::function<bool(const UnitQuery&)>;

  /// `init_module` initializes modules of a deferred_init model that fsdpx does not know.
  ShardedModel(std::shared_ptr<torch::nn::Module> root, Mesh mesh, UnitOptions options, const UnitSelector& is_unit,
               const ModuleInit& init_module = {})
      : root_module_(std::move(root)), mesh_(std::move(mesh)), options_(options) {
    // Duplicates of the groups, so gathers and reductions have communicators of their own.
    auto gather = *mesh_.shard_group().split(0, mesh_.shard_group().rank(), "fsdpx/gather");
    auto reduce = *mesh_.shard_group().split(0, mesh_.shard_group().rank(), "fsdpx/reduce");
    const UnitComms comms{gather, reduce, mesh_.replicate_group()};

    // Names of every parameter (the first name of a shared one).
    std::unordered_map<const c10::TensorImpl*, std::string> names;
    for (const auto& item : root_module_->named_parameters(/*recurse=*/true)) {
      names.emplace(item.value().unsafeGetTensorImpl(), item.key());
    }
    // Pick units top-down; parameters outside every unit belong to the root.
    std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> picked;
    pick_units(*root_module_, "", is_unit, picked);
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
        params.push_back({names[key], p, {}, p.dim() >= 2});
      }
      return params;
    };
    std::vector<std::pair<std::string, std::vector<ParamInfo>>> unit_params;
    for (auto& [name, m] : picked) unit_params.emplace_back(name, collect(name, *m));
    std::vector<ParamInfo> root_params;
    for (const auto& item : root_module_->named_parameters(true)) {
      const auto* key = item.value().unsafeGetTensorImpl();
      if (owner.emplace(key, "root").second) root_params.push_back({item.key(), item.value(), {}, item.value().dim() >= 2});
    }

    // A deferred model is materialized one unit at a time, right before that unit takes its shard
    // and releases the rest: no rank ever holds the whole model.
    const bool deferred = detail::DeferredModels::instance().contains(root_module_.get());
    std::unordered_set<const torch::nn::Module*> in_units;
    for (auto& [name, m] : picked) {
      for (const auto& sub : m->modules(/*include_self=*/true)) in_units.insert(sub.get());
    }
    const auto materialize = [&](torch::nn::Module& top, const std::string& prefix, bool root_only) {
      if (!deferred) return;
      for (const auto& item : top.named_modules(prefix, /*include_self=*/true)) {
        if (root_only && in_units.count(item.value().get()) != 0) continue;
        detail::materialize_module(*item.value(), item.key(), init_module);
      }
    };

    UnitOptions root_options = options_;
    root_options.reshard_after_forward = false;  // the root's parameters are needed again first in backward
    materialize(*root_module_, "", /*root_only=*/true);
    units_.push_back(std::make_unique<Unit>("root", 0, std::move(root_params), comms, root_options));
    modules_.push_back(root_module_.get());
    for (size_t i = 0; i < picked.size(); ++i) {
      materialize(*picked[i].second, picked[i].first, /*root_only=*/false);
      units_.push_back(std::make_unique<Unit>(unit_params[i].first, static_cast<int>(i + 1),
                                              std::move(unit_params[i].second), comms, options_));
      modules_.push_back(picked[i].second.get());
    }
    if (deferred) detail::DeferredModels::instance().remove(root_module_.get());  // frees the scratch
    for (size_t i = 0; i < units_.size(); ++i) {
      detail::UnitRegistry::instance().add(modules_[i], this, units_[i].get());
      install_gradient_hooks(*units_[i]);
    }
    pass_.resize(units_.size());
  }

  ShardedModel(const ShardedModel&) = delete;
  ShardedModel& operator=(const ShardedModel&) = delete;
  ~ShardedModel() {
    wait_for_snapshots();     // a background checkpoint copy may still read the shards
    *alive_ = false;  // autograd may still hold hooks that point here
    for (const auto* m : modules_) detail::UnitRegistry::instance().remove(m);
  }

  const Mesh& mesh() const { return mesh_; }
  Mesh& mesh() { return mesh_; }
  /// The module being trained (its parameters are views into the units' buffers; its buffers are
  /// replicated on every rank, as the module holds them).
  torch::nn::Module& root_module() const { return *root_module_; }
  size_t num_units() const { return units_.size(); }
  const UnitOptions& options() const { return options_; }
  Unit& unit(size_t i) { return *units_.at(i); }
  const Unit& unit(size_t i) const { return *units_.at(i); }
  Unit& root() { return *units_.front(); }

  // ---- the unit protocol ----------------------------------------------------------------------------

  /// Runs `call` (a forward, or any member function) under unit `u`'s protocol.
  template <class Call>
  auto run(Unit& u, Call&& call) {
    pre_forward(u);
    try {
      auto out = call();
      return post_forward(u, std::move(out));
    } catch (const c10::Error& e) {
      rethrow_if_resharded_access(e);
      throw;
    }
  }

  /// A unit's forward argument as the unit computes it: floating tensors cast to the compute dtype
  /// (FSDP2's cast_forward_inputs), everything else unchanged.
  template <class Arg>
  static decltype(auto) cast_input(const Unit& u, Arg&& arg) {
    if constexpr (std::is_same_v<std::decay_t<Arg>, at::Tensor>) {
      const auto dtype = u.options().param_dtype;
      return arg.defined() && arg.is_floating_point() && arg.scalar_type() != dtype ? arg.to(dtype)
                                                                                    : at::Tensor(arg);
    } else {
      return std::forward<Arg>(arg);
    }
  }

  // ---- snapshots: background copies of the shards (checkpoints) --------------------------------------

  /// A background copy of the shards and optimizer state is in progress until `done` is ready. The
  /// shards must not change until then: the end of the next backward (before any optimizer step)
  /// waits for it, so the copy overlaps a forward and backward instead of blocking the loop.
  void add_snapshot_fence(std::shared_future<void> done) {
    std::lock_guard lock(fence_mutex_);
    fences_.push_back(std::move(done));
  }
  /// Waits for every background copy of the shards (call before changing shards outside a step).
  void wait_for_snapshots() {
    std::vector<std::shared_future<void>> fences;
    {
      std::lock_guard lock(fence_mutex_);
      fences.swap(fences_);
    }
    if (fences.empty()) return;
    const auto start = std::chrono::steady_clock::now();
    for (auto& f : fences) f.wait();
    snapshot_wait_ += std::chrono::steady_clock::now() - start;
  }
  /// Total time training waited for background checkpoint copies (what an async save blocked).
  std::chrono::duration<double> snapshot_wait() const { return snapshot_wait_; }

  // ---- training helpers -----------------------------------------------------------------------------

  /// Off: skip gradient reduction and keep unsharded gradients until a step with it on (accumulation).
  void set_requires_gradient_sync(bool on) { sync_ = on; }
  bool requires_gradient_sync() const { return sync_; }

  /// Clips the gradients of every shard to a global L2 norm of `max_norm` (torch's formula) and
  /// returns the norm before clipping. A non-finite norm clears the gradients, so a following
  /// optimizer step changes nothing, and warns.
  GradNorm clip_grad_norm_(double max_norm) {
    at::NoGradGuard no_grad;
    auto sq = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(mesh_.shard_group().device_type()));
    for (auto& u : units_) {
      for (const at::Tensor& g : u->shard_grads()) sq += g.to(sq.device(), at::kDouble).pow(2).sum();
    }
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

  /// Gathers every unit's full parameters (e.g. for evaluation or export).
  void unshard_all() {
    for (auto& u : units_) u->unshard_async();
    for (auto& u : units_) u->unshard();
  }
  void reshard_all() {
    for (auto& u : units_) u->reshard();
  }

  /// Sharded parameters and gradients to host memory (pinned on a GPU machine) and back. Between the
  /// two the model cannot run; the device holds none of its memory.
  /// Offloading returns the freed blocks to the device's driver (the caching allocator would keep
  /// them), so a rollout engine in another process can use that memory.
  void offload_model() {
    wait_for_snapshots();  // a background checkpoint copy may still read the shards
    reshard_all();
    for (auto& u : units_) u->move_shard(at::Device(at::kCPU));
    release_cached_device_memory();
  }
  void reload_model() {
    wait_for_snapshots();
    const at::Device home = options_.offload_to_cpu ? at::Device(at::kCPU) : options_.device;
    for (auto& u : units_) u->move_shard(home);
  }

  ShardedBytes sharded_bytes() const {
    ShardedBytes b;
    for (const auto& u : units_) {
      b.parameters += u->shard().nbytes();
      for (const at::Tensor& g : u->shard_grads()) b.gradients += g.nbytes();
      b.unsharded += u->unsharded_bytes();
    }
    return b;
  }

 private:
  struct PassState {  // per unit, per backward pass
    bool pre_backward_done = false;
    int grads_ready = 0;
    bool reduction_ready = false;
  };

  static void pick_units(torch::nn::Module& m, const std::string& prefix, const UnitSelector& is_unit,
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
      if (is_unit(UnitQuery{*child.value(), numel(*child.value()), largest})) {
        out.emplace_back(name, child.value());
      } else {
        pick_units(*child.value(), name, is_unit, out);
      }
    }
  }

  void install_gradient_hooks(Unit& u) {
    if (!u.trainable()) return;
    for (const ParamInfo& p : u.layout().params()) {
      accumulators_.push_back(detail::add_post_accumulate_hook(p.param, [alive = alive_, this, &u] {
        if (*alive) on_grad_accumulated(u);
      }));
    }
  }

  /// A module that runs a sharded child without fsdpx::forward reads parameters whose bytes are
  /// released; ATen notices the empty storage. Say what happened instead of ATen's words.
  void rethrow_if_resharded_access(const c10::Error& e) const {
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

  size_t index_of(const Unit& u) const { return static_cast<size_t>(u.index()); }

  void pre_forward(Unit& u) {
    u.unshard();
    if (!order_frozen_) {
      if (&u == units_.front().get()) {
        forward_order_.clear();
      } else {
        forward_order_.push_back(&u);
      }
    } else if (&u == units_.front().get()) {
      if (!forward_order_.empty()) forward_order_.front()->unshard_async();  // prefetch the first unit
    } else if (const auto pos = position_.find(&u); pos != position_.end() && pos->second + 1 < forward_order_.size()) {
      forward_order_[pos->second + 1]->unshard_async();
    }
  }

  template <class Out>
  Out post_forward(Unit& u, Out out) {
    const bool is_root = &u == units_.front().get();
    if (is_root && !order_frozen_) {
      order_frozen_ = true;
      for (size_t i = 0; i < forward_order_.size(); ++i) position_[forward_order_[i]] = i;
    }
    // An inference-only root has no backward to free it after: it is freed here like the others.
    if ((!is_root || u.options().inference_only) && u.options().reshard_after_forward) u.reshard();
    auto hook = std::make_shared<detail::BackwardHook>([alive = alive_, this, &u] {
      if (*alive) pre_backward(u);
    });
    const auto output_dtype = u.options().output_dtype;
    return detail::map_tensors(std::move(out), [&](at::Tensor t) {
      if (output_dtype && t.is_floating_point()) t = t.to(*output_dtype);
      if (t.requires_grad()) detail::add_pre_backward_hook(t, hook);
      return t;
    });
  }

  /// First unit event of a backward pass: arrange for its end.
  void begin_backward() {
    if (in_backward_) return;
    in_backward_ = true;
    next_reduction_ = 0;
    detail::at_end_of_backward([this] { end_of_backward(); });
  }

  void pre_backward(Unit& u) {
    begin_backward();
    PassState& s = pass_[index_of(u)];
    if (s.pre_backward_done) return;
    s.pre_backward_done = true;
    u.unshard();
    if (const auto pos = position_.find(&u); pos != position_.end() && pos->second > 0) {
      forward_order_[pos->second - 1]->unshard_async();  // backward prefetch
    }
  }

  void on_grad_accumulated(Unit& u) {
    if (!sync_) return;
    begin_backward();  // a pass that never met a hooked output still ends with its reductions
    PassState& s = pass_[index_of(u)];
    if (++s.grads_ready == static_cast<int>(u.layout().params().size())) {
      s.reduction_ready = true;
      start_ready_reductions();
    }
  }

  /// Reductions start in reverse unit index on every rank, so collectives match across ranks even
  /// when gradients become ready in another order.
  void start_ready_reductions() {
    while (next_reduction_ < units_.size()) {
      Unit& u = *units_[units_.size() - 1 - next_reduction_];
      if (u.trainable() && !pass_[index_of(u)].reduction_ready) return;
      u.reduce_gradients_async();
      if (&u != units_.front().get() && u.options().reshard_after_forward) u.reshard();
      ++next_reduction_;
    }
  }

  void end_of_backward() {
    in_backward_ = false;
    wait_for_snapshots();  // the optimizer step that follows changes the shards
    if (sync_) {
      for (auto& s : pass_) s.reduction_ready = true;  // unused parameters: their gradient is zero
      start_ready_reductions();
      for (size_t i = units_.size(); i-- > 0;) units_[i]->finish_gradient_reduction();
    }
    reshard_all();  // the next forward gathers the updated shards
    for (auto& s : pass_) s = PassState{};
  }

  std::shared_ptr<torch::nn::Module> root_module_;
  Mesh mesh_;
  UnitOptions options_;
  std::vector<std::unique_ptr<Unit>> units_;  // [0] is the root
  std::vector<const torch::nn::Module*> modules_;
  std::vector<c10::intrusive_ptr<torch::autograd::Node>> accumulators_;  // keep the hooks' nodes alive
  std::vector<Unit*> forward_order_;
  std::unordered_map<const Unit*, size_t> position_;
  bool order_frozen_ = false;
  std::vector<PassState> pass_;
  bool in_backward_ = false;
  size_t next_reduction_ = 0;
  bool sync_ = true;
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);
  std::mutex fence_mutex_;
  std::vector<std::shared_future<void>> fences_;
  std::chrono::duration<double> snapshot_wait_{0};
};

}  // namespace fsdpx::core
