// ShardedModel: the units of one model and the protocol that runs them. Not a template, so every
// Fsdp<...> shares one compiled implementation; Fsdp maps its policies onto UnitOptions.
//
// Forward:  pre_forward(u) unshards u and prefetches the unit that followed u in the previous step's
//           forward (the order is recorded again at every step, so a unit skipped on some steps is
//           followed); the call's inputs that require grad pass through one post-backward node;
//           post_forward(u) reshards u (unless it is the root or reshard_after_forward is off) and
//           hooks u's outputs so that u is unsharded again before its backward.
// Backward: the output hook unshards u and prefetches the unit before it in this step's forward.
//           A unit's backward is over when its post-backward node runs (its inputs' gradients are
//           complete) or when every one of its parameters has accumulated a gradient, whichever comes
//           first: then its reduce-scatter starts at once and it reshards. Parameters without a
//           gradient count as zero; nothing waits for them. Autograd runs the same graph in the same
//           order on every rank, so reductions are issued in the same order everywhere. HSDP / NoShard
//           start each unit's replica all-reduce as soon as its reduce-scatter is done. At the end of
//           backward, units whose backward never signalled (no input requiring grad) are reduced in
//           reverse unit order, every result is added to the shards' gradients, and all reshard.
// Failure:  a forward that throws reshards what it gathered; a backward that throws leaves a pass
//           whose end never came. The next forward or backward sees it (autograd gives every pass its
//           own id), waits for the collectives it issued, discards its gradients and starts clean.
#pragma once

#include <algorithm>
#include <chrono>
#include <iterator>
#include <cmath>
#include <functional>
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
#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <fsdpx/core/deferred_init.hpp>
#include <fsdpx/detail/config.hpp>
#include <fsdpx/core/detail/autograd.hpp>
#include <fsdpx/core/memory.hpp>
#include <fsdpx/core/unit.hpp>
#include <fsdpx/detail/crc32c.hpp>
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

/// How the ranks' copies of the values a model was constructed with become one model.
enum class ReplicaInit {
  check,                 // every rank must have constructed the same values (checked: an error names the tensor)
  broadcast_from_rank0,  // rank 0's values are copied to every rank (as DDP and FSDP's sync_module_states)
  as_constructed,        // trusted as they are (e.g. a checkpoint is loaded right after)
};

/// How the ranks' copies of the module's buffers (BatchNorm running statistics, counters, router
/// biases) are kept equal. Each rank's forward updates its own copy from its own batch, so without
/// this they drift apart, and state dicts save world rank 0's.
enum class BufferSync {
  none,                  // each rank keeps its own (FSDP2's behaviour)
  broadcast_from_rank0,  // rank 0's copied to every rank before each forward (DDP's broadcast_buffers)
  average,               // floating buffers averaged over the ranks before each forward, others copied
                         // from rank 0: running means become those of the global batch
};

/// What the units are and how they start, for ShardedModel's constructor.
struct ModelSetup {
  std::function<bool(const UnitQuery&)> is_unit;
  /// deferred_init models: initializes modules fsdpx does not know.
  ModuleInit init_module;
  /// Whether a parameter gets weight decay, by its fully qualified name and tensor; default dim() >= 2.
  std::function<bool(const std::string&, const at::Tensor&)> decay;
  /// Sees the chosen units' names before anything changes (e.g. the wrap policy matched nothing).
  std::function<void(const std::vector<std::string>&)> check_units;
  ReplicaInit replicas = ReplicaInit::check;
  BufferSync buffer_sync = BufferSync::none;
};

/// What the last step did (a forward and its backward): for tests, benchmarks and profiles.
struct StepStats {
  std::vector<std::string> forward_order;  // the units the forward ran, in order (the root left out)
  int units_run = 0;                       // units whose forward ran with gradients on, the root included
  int reductions_during_backward = 0;      // reduce-scatters issued as soon as their unit's backward ended
  int reductions_at_end = 0;               // issued only when backward had finished
  int late_reductions = 0;                 // issued again for gradients that arrived after their unit's
  int64_t peak_unsharded_bytes = 0;        // the most full-parameter bytes allocated at once
};

class ShardedModel {
 public:
  using Mesh = dist::DeviceMesh<dist::AnyCommunicator>;

  /// Collective over the mesh's world. Nothing in the module changes until every check has passed on
  /// every rank; a failure after that (out of memory, a collective error) puts the module's parameters
  /// back as they were before rethrowing.
  FSDPX_DECL ShardedModel(std::shared_ptr<torch::nn::Module> root, Mesh mesh, UnitOptions options,
      const ModelSetup& setup);

  ShardedModel(const ShardedModel&) = delete;
  ShardedModel& operator=(const ShardedModel&) = delete;
  FSDPX_DECL ~ShardedModel();

  const Mesh& mesh() const { return mesh_; }
  Mesh& mesh() { return mesh_; }
  /// The module being trained (its parameters are views into the units' buffers; its buffers are
  /// replicated on every rank, as the module holds them).
  torch::nn::Module& root_module() const { return *root_module_; }
  size_t num_units() const { return units_.size(); }
  /// The module's buffers by name (running statistics, counters, router biases). They are not
  /// sharded: every rank holds the same copy, as the module keeps them.
  FSDPX_DECL std::vector<std::pair<std::string, at::Tensor>> named_buffers() const;
  /// Makes every rank's buffers equal (collective over the world): rank 0's, or the floating ones
  /// averaged. The forward does this by itself under FsdpOptions::buffer_sync; call it before saving
  /// or evaluating to agree on the last step's statistics too.
  FSDPX_DECL void sync_buffers(BufferSync how);

  const UnitOptions& options() const { return options_; }
  Unit& unit(size_t i) { return *units_.at(i); }
  const Unit& unit(size_t i) const { return *units_.at(i); }
  Unit& root() { return *units_.front(); }

  // ---- the unit protocol ----------------------------------------------------------------------------

  /// Runs `call` (a forward, or any member function) under unit `u`'s protocol.
  template <class Call>
  auto run(Unit& u, Call&& call) {
    try {
      pre_forward(u);
      auto out = call();
      return post_forward(u, std::move(out));
    } catch (const c10::Error& e) {
      forward_failed(u);
      rethrow_if_resharded_access(e);
      throw;
    } catch (...) {
      forward_failed(u);
      throw;
    }
  }

  /// Runs `body(inputs...)` under unit `u`'s protocol, with `args` as the unit computes them: floating
  /// tensors cast to the compute dtype, and those that require grad routed through the node that ends
  /// the unit's backward.
  template <class Body, class... Args>
  auto run_with(Unit& u, Body&& body, Args&&... args) {
    return run(u, [&] {
      std::tuple<decltype(cast_input(u, std::forward<Args>(args)))...> inputs(cast_input(u, std::forward<Args>(args))...);
      std::vector<at::Tensor*> tracked;
      std::apply([&](auto&... a) { (track_input(a, tracked), ...); }, inputs);
      add_post_backward_node(u, tracked);
      return std::apply([&](auto&&... a) { return body(std::forward<decltype(a)>(a)...); }, std::move(inputs));
    });
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

  // ---- background readers of the shards ---------------------------------------------------------------

  /// Something reads the shards (and optimizer state) in the background: a checkpoint's copy, a
  /// weight export. `wait_done` blocks until that read has finished; it must return also when the
  /// reader failed (an error it throws reaches the caller of wait_for_shard_readers, after every
  /// other reader was waited for). The shards must not change until then: the end of the next backward (before any
  /// optimizer step) calls it, so the read overlaps a forward and backward instead of blocking the loop.
  FSDPX_DECL void add_shard_reader(std::function<void()> wait_done);
  /// Waits for every background reader of the shards (call before changing shards outside a step).
  FSDPX_DECL void wait_for_shard_readers();
  /// Total time training waited for background readers of the shards (what an async save blocked).
  std::chrono::duration<double> shard_reader_wait() const { return reader_wait_; }

  // ---- training helpers -----------------------------------------------------------------------------

  /// What the last completed step did (updated at the end of each backward).
  const StepStats& last_step_stats() const { return last_stats_; }

  /// Off: skip gradient reduction and keep unsharded gradients until a step with it on (accumulation).
  void set_requires_gradient_sync(bool on) { sync_ = on; }
  bool requires_gradient_sync() const { return sync_; }

  /// Clips the gradients of every shard to a global L2 norm of `max_norm` (torch's formula) and
  /// returns the norm before clipping. A non-finite norm clears the gradients, so a following
  /// optimizer step changes nothing, and warns.
  FSDPX_DECL GradNorm clip_grad_norm_(double max_norm);

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
  FSDPX_DECL void offload_model();
  FSDPX_DECL void reload_model();

  FSDPX_DECL ShardedBytes sharded_bytes() const;

 private:
  struct PassState {  // per unit, per backward pass
    bool ran_forward = false;       // its forward ran with gradients on (the same on every rank)
    int post_backward_expected = 0;  // calls whose inputs went through a post-backward node
    int post_backward_seen = 0;
    int grads_ready = 0;
    bool pre_backward_done = false;
    bool backward_done = false;     // reduction issued (when syncing) and resharded
    bool late_gradient = false;     // a gradient accumulated after that: reduced again at the end
  };

  FSDPX_DECL static void pick_units(torch::nn::Module& m, const std::string& prefix,
      const std::function<bool(const UnitQuery&)>& is_unit, std::vector<std::pair<std::string,
          std::shared_ptr<torch::nn::Module>>>& out);

  FSDPX_DECL void install_gradient_hooks(Unit& u);

  /// A module that runs a sharded child without fsdpx::forward reads parameters whose bytes are
  /// released; ATen notices the empty storage. Say what happened instead of ATen's words.
  FSDPX_DECL void rethrow_if_resharded_access(const c10::Error& e) const;

  size_t index_of(const Unit& u) const { return static_cast<size_t>(u.index()); }

  template <class T>
  static void track_input(T& arg, std::vector<at::Tensor*>& tracked) {
    if constexpr (std::is_same_v<std::remove_cvref_t<T>, at::Tensor> && !std::is_const_v<std::remove_reference_t<T>>) {
      if (arg.defined() && arg.requires_grad()) tracked.push_back(&arg);
    }
  }

  FSDPX_DECL void add_post_backward_node(Unit& u, const std::vector<at::Tensor*>& tracked);

  bool is_root(const Unit& u) const { return &u == units_.front().get(); }

  /// A unit and its frozen companion (if any) are gathered and freed together.
  Unit* companion(const Unit& u) const {
    const size_t c = companion_[index_of(u)];
    return c == 0 ? nullptr : units_[c].get();
  }
  void unshard_async_with(Unit& u) {
    u.unshard_async();
    if (Unit* c = companion(u)) c->unshard_async();
  }
  void unshard_with(Unit& u) {
    unshard_async_with(u);
    u.unshard();
    if (Unit* c = companion(u)) c->unshard();
  }
  void reshard_with(Unit& u) {
    u.reshard();
    if (Unit* c = companion(u)) c->reshard();
  }

  FSDPX_DECL void note_unsharded();

  /// The root's forward starts a step: a pass that an exception ended is cleaned up first.
  FSDPX_DECL void begin_step();

  FSDPX_DECL void pre_forward(Unit& u);

  template <class Out>
  Out post_forward(Unit& u, Out out) {
    if (is_root(u) && detail::current_backward_pass_id() == -1) commit_forward_order();
    // An inference-only root has no backward to free it after: it is freed here like the others.
    if ((!is_root(u) || u.options().inference_only) && u.options().reshard_after_forward) reshard_with(u);
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

  /// This step's forward order becomes the one prefetching follows; a unit prefetched for this step
  /// but not run (the model skipped it) is freed.
  FSDPX_DECL void commit_forward_order();

  /// The root's forward threw: free what it gathered and forget its half-recorded order and counts,
  /// so the next step starts clean. (Inside backward, a recomputation's failure ends that pass.)
  FSDPX_DECL void forward_failed(Unit& u) noexcept;

  /// First unit event of a backward pass: arrange for its end. A pass that began and never ended
  /// (an exception left it) is cleaned up first.
  FSDPX_DECL void begin_backward();

  FSDPX_DECL void pre_backward(Unit& u);

  /// The post-backward node of one call of `u` ran; the last of u's calls ends its backward.
  FSDPX_DECL void post_backward(Unit& u);

  FSDPX_DECL void on_grad_accumulated(Unit& u);

  /// u's backward is over: its reduction starts now (missing gradients count as zero) and it reshards.
  FSDPX_DECL void unit_backward_done(Unit& u);

  /// Starts the replica all-reduce of every issued unit whose reduce-scatter is done, in issue order
  /// (the same on every rank), without waiting for any.
  FSDPX_DECL void advance_replica_reductions();

  FSDPX_DECL void end_of_backward();

  /// A backward pass ended with an exception (its end-of-backward callback never ran). Every rank
  /// issued the same collectives before it (the same graph, the same failure), so they complete;
  /// then the gradients of that pass are dropped and every unit reshards.
  FSDPX_DECL void abort_failed_pass();

  // ---- construction: every rank builds the same model ------------------------------------------------

  /// Every int64 of every rank's `mine` (all the same length), in rank order, over the world.
  FSDPX_DECL std::vector<int64_t> all_gather_world(const std::vector<int64_t>& mine);

  /// The ranks (other than this one) whose entry `i` differs from rank 0's; `all` holds n per rank.
  FSDPX_DECL static std::vector<int> ranks_differing(const std::vector<int64_t>& all, size_t n, size_t i);

  FSDPX_DECL static std::string join_ranks(const std::vector<int>& ranks);

  /// Every rank must build the same units: names, shapes, dtypes, trainability and weight-decay
  /// classes. Checked with one small collective (two when they differ, to name the tensor) before any
  /// collective sizes a buffer from them.
  template <class Planned>
  void check_layouts_agree(const std::vector<Planned>& planned) {
    std::vector<std::string> described;
    std::vector<int64_t> hashes;
    uint32_t total = 0;
    const auto add = [&](std::string description) {
      described.push_back(std::move(description));
      const uint32_t h = ::fsdpx::detail::Crc32c::of(described.back().data(), described.back().size());
      hashes.push_back(h);
      total = ::fsdpx::detail::Crc32c::of(&h, sizeof h) ^ (total * 31u);
    };
    for (const auto& [unit, params, module, companion] : planned) {
      for (const ParamInfo& p : params) {
        add(::fsdpx::detail::str("parameter '", p.name, "' (unit '", unit, "', shape ", p.param.sizes(), ", ",
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
      for (size_t r = 0; r * 2 < all.size(); ++r) counts += ::fsdpx::detail::str(r ? ", " : "", "rank ", r, ": ", all[r * 2]);
      throw ConfigError(::fsdpx::detail::str(
          "fsdpx: the ranks built different models (rank ", me, "): they hold different numbers of parameters and buffers (",
          counts, "); ranks differing from rank 0: ", join_ranks(count_differs), ". Every rank must construct the "
          "same model with the same configuration."));
    }
    const auto per_tensor = all_gather_world(hashes);
    for (size_t i = 0; i < hashes.size(); ++i) {
      if (const auto ranks = ranks_differing(per_tensor, hashes.size(), i); !ranks.empty()) {
        throw ConfigError(::fsdpx::detail::str(
            "fsdpx: the ranks built different models: ", described[i], " on rank ", me,
            " is not the same on rank 0 and rank(s) ", join_ranks(ranks), " (name, shape, dtype, requires_grad or "
            "weight-decay class). Every rank must construct the same model with the same configuration."));
      }
    }
  }

  /// An exact fingerprint of a tensor's bytes (the same bits give the same value on every rank).
  FSDPX_DECL static int64_t fingerprint(const at::Tensor& tensor);

  /// The values one unit takes its shard from must be the same on every rank: checked with one
  /// collective of fingerprints (parameters and buffers), or copied from rank 0 (ReplicaInit).
  FSDPX_DECL void replicate_values(const std::string& unit, const std::vector<ParamInfo>& params,
      torch::nn::Module& module, bool root, bool values_meaningful, ReplicaInit how);

  /// The buffers of `module` that a unit holds: all of its own for a unit, those outside every
  /// other unit for the root.
  FSDPX_DECL std::vector<std::pair<std::string, at::Tensor>> unit_buffers(torch::nn::Module& module, bool root) const;

  std::shared_ptr<torch::nn::Module> root_module_;
  Mesh mesh_;
  UnitOptions options_;
  BufferSync buffer_sync_;
  std::vector<std::unique_ptr<Unit>> units_;  // [0] is the root
  std::vector<const torch::nn::Module*> modules_;
  std::vector<c10::intrusive_ptr<torch::autograd::Node>> accumulators_;  // keep the hooks' nodes alive
  std::unordered_set<const torch::nn::Module*> in_units_;  // every module inside a non-root unit
  std::vector<bool> is_companion_;  // a module's frozen parameters, moving with the unit before it
  std::vector<size_t> companion_;   // the index of a unit's frozen companion, or 0 (none)
  std::vector<Unit*> forward_order_;     // the last completed forward's units (prefetching follows it)
  std::unordered_map<const Unit*, size_t> position_;
  std::vector<Unit*> recording_;         // this forward's units so far
  std::vector<bool> recorded_;
  std::vector<PassState> pass_;
  bool in_backward_ = false;
  int backward_pass_id_ = -1;
  std::vector<Unit*> issued_;            // reductions of this pass, in the order they were issued
  size_t replica_next_ = 0;              // issued_[replica_next_...] have not started their replica all-reduce
  StepStats stats_;
  StepStats last_stats_;
  bool sync_ = true;
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);
  std::mutex readers_mutex_;
  std::vector<std::function<void()>> readers_;  // add_shard_reader's waits
  std::chrono::duration<double> reader_wait_{0};
};

}  // namespace fsdpx::core

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/core/impl/sharded_model.ipp>
#endif
