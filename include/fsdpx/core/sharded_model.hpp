// ShardedModel: the units of one model and the protocol that runs them. Not a template, so every
// Fsdp<...> shares one compiled implementation; Fsdp maps its policies onto UnitOptions and ModelSetup
// (core/policy_map.hpp).
//
// The protocol is a state machine (core/detail/pass.hpp; docs/core.md has the table). The model's
// stage: idle -> forward (the root's forward) -> after_forward -> backward (autograd's first unit event)
// -> idle (end of backward). Each unit's phase: idle -> forward (gathered, prefetching the unit that
// followed it last step) -> after_forward (resharded unless it keeps its parameters; its outputs
// hooked) -> backward (gathered again when its outputs' gradients arrive, prefetching the unit before
// it; a checkpointed unit recomputes its forward here) -> reduced (its post-backward node ran, or
// every parameter has a gradient: the reduce-scatter starts at once and it reshards; parameters
// without a gradient count as zero). At the end of backward, units whose backward never signalled
// (no input required grad) are reduced in reverse unit order, every result is added to the shards'
// gradients at once, and every unit reshards.
//
// Failure: every way out of a pass resets it (Pass::reset). A forward that throws reshards what it
// gathered. A backward that throws leaves a pass whose end never came: the next forward or backward
// sees it (autograd gives every pass its own id), waits for the collectives it issued, discards its
// gradients and starts clean. An end of backward that throws while reducing does the same at once;
// nothing of that pass reaches the shards.
#pragma once

#include <fsdpx/detail/config.hpp>

#include <chrono>
#include <cmath>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <fsdpx/core/detail/autograd.hpp>
#include <fsdpx/core/detail/model_plan.hpp>
#include <fsdpx/core/detail/pass.hpp>
#include <fsdpx/core/detail/unit_registry.hpp>
#include <fsdpx/core/memory.hpp>
#include <fsdpx/core/setup.hpp>
#include <fsdpx/core/unit.hpp>
#include <fsdpx/dist/mesh.hpp>

namespace fsdpx::core {

/// Result of clip_grad_norm_: the global norm before clipping.
struct GradNorm {
  double value = 0;
  bool is_finite() const { return std::isfinite(value); }
};

/// What one rank holds, in bytes (for memory accounting and tests).
struct ShardedBytes {
  int64_t parameters = 0;  // shards (float32 masters; the compute dtype when inference-only)
  int64_t gradients = 0;   // float32 shard gradients
  int64_t unsharded = 0;   // full parameter buffers allocated right now
};

class ShardedModel {
 public:
  using Mesh = dist::DeviceMesh<dist::AnyCommunicator>;

  /// Collective over the mesh's world, in three steps: plan (this rank chooses the units; nothing
  /// changes), check (every rank built the same model and values; one small collective), commit (each
  /// unit takes its shard). Nothing in the module changes until every check has passed on every rank;
  /// a failure after that (out of memory, a collective error) puts the module's parameters back as
  /// they were before rethrowing.
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
      // Named while the pass still says which units ran through the protocol (never instead of the clean-up)
      std::optional<ConfigError> named;
      try {
        named = resharded_access_error(u, e);
        if (!named) named = dtype_clash_error(u, e);
      } catch (...) {
      }
      forward_failed(u);
      if (named) throw *named;
      throw;
    } catch (...) {
      forward_failed(u);
      throw;
    }
  }

  /// Runs `body(inputs...)` under unit `u`'s protocol, with `args` as the unit computes them: floating
  /// tensors cast to the compute dtype, and those that require grad routed through the node that ends
  /// the unit's backward. A checkpointed unit runs `body` without keeping its activations and again
  /// inside backward: `body` must hold what it refers to by value (a module pointer, not a reference
  /// to a caller's local), and `args` are copied until then.
  template <class Body, class... Args>
  auto run_with(Unit& u, const Body& body, Args&&... args) {
    return run(u, [&] {
      std::tuple<decltype(cast_input(u, std::forward<Args>(args)))...> inputs(
          cast_input(u, std::forward<Args>(args))...);
      std::vector<at::Tensor*> tracked;
      std::apply([&](auto&... a) { (track_input(a, tracked), ...); }, inputs);
      add_post_backward_node(u, tracked);
      using Result = std::decay_t<decltype(std::apply(body, inputs))>;
      if (checkpoints(u)) return Result(checkpointed_call(u, body, inputs));
      return Result(std::apply([&](auto&&... a) { return body(std::forward<decltype(a)>(a)...); }, std::move(inputs)));
    });
  }

  /// A unit's forward argument as the unit computes it: floating tensors cast to the compute dtype
  /// (FSDP2's cast_forward_inputs), everything else unchanged.
  template <class Arg>
  static decltype(auto) cast_input(const Unit& u, Arg&& arg) {
    if constexpr (std::is_same_v<std::decay_t<Arg>, at::Tensor>) {
      const auto dtype = u.options().input_dtype.value_or(u.options().param_dtype);
      return arg.defined() && arg.is_floating_point() && arg.scalar_type() != dtype ? arg.to(dtype) : at::Tensor(arg);
    } else {
      return std::forward<Arg>(arg);
    }
  }

  // ---- activation checkpointing -----------------------------------------------------------------------

  /// Whether the units the policy chose recompute their forward in backward (on by default when the
  /// policy chose any). Takes effect at the next unit call; a pass already running keeps its choice
  /// for the calls it made.
  void set_activation_checkpointing(bool on) { checkpointing_ = on; }
  bool activation_checkpointing() const { return checkpointing_; }

  // ---- background readers of the shards ---------------------------------------------------------------

  /// Something reads the shards (and optimizer state) in the background: a checkpoint's copy, a
  /// weight export. `wait_done` blocks until that read has finished; it must return also when the
  /// reader failed (an error it throws reaches the caller of wait_for_shard_readers, after every
  /// other reader was waited for). The shards must not change until then: the end of the next
  /// backward (before any optimizer step) calls it, so the read overlaps a forward and backward
  /// instead of blocking the loop.
  FSDPX_DECL void add_shard_reader(std::function<void()> wait_done);
  /// Waits for every background reader of the shards (call before changing shards outside a step).
  FSDPX_DECL void wait_for_shard_readers();
  /// Total time training waited for background readers of the shards (what an async save blocked).
  std::chrono::duration<double> shard_reader_wait() const { return reader_wait_; }

  // ---- training helpers -----------------------------------------------------------------------------

  /// What the last completed step did (updated at the end of each backward).
  const StepStats& last_step_stats() const { return last_stats_; }
  /// Where the model is now in the protocol (idle between steps).
  PassStage stage() const { return pass_.stage; }

  /// Off: skip gradient reduction and keep unsharded gradients until a step with it on (accumulation).
  void set_requires_gradient_sync(bool on) { sync_ = on; }
  bool requires_gradient_sync() const { return sync_; }

  /// Clips the gradients of every shard to a global L2 norm of `max_norm` (torch's formula) and
  /// returns the norm before clipping. A non-finite norm clears the gradients, so a following
  /// optimizer step changes nothing, and warns.
  FSDPX_DECL GradNorm clip_grad_norm_(double max_norm);

  /// Gathers every unit's full parameters (e.g. for evaluation or export).
  FSDPX_DECL void unshard_all();
  FSDPX_DECL void reshard_all();

  /// Sharded parameters and gradients to host memory (pinned on a GPU machine) and back. Between the
  /// two the model cannot run; the device holds none of its memory.
  /// Offloading returns the freed blocks to the device's driver (the caching allocator would keep
  /// them), so a rollout engine in another process can use that memory.
  FSDPX_DECL void offload_model();
  FSDPX_DECL void reload_model();

  FSDPX_DECL ShardedBytes sharded_bytes() const;

 private:
  // ---- construction (core/impl/model_plan.ipp) ----------------------------------------------------------

  /// Every rank must build the same units (names, shapes, dtypes, trainability and weight-decay
  /// classes) and the same buffers: checked with one small collective (two when they differ, to name
  /// the tensor) before any collective sizes a buffer from them. No module changes.
  FSDPX_DECL void check_plan(const detail::ModelPlan& plan);
  /// Makes the units (materializing a deferred model one unit at a time, checking or copying each
  /// unit's values across ranks); on failure every parameter is put back as it was.
  FSDPX_DECL void commit_plan(detail::ModelPlan& plan, const ModelSetup& setup);

  /// Every int64 of every rank's `mine` (all the same length), in rank order, over the world.
  FSDPX_DECL std::vector<int64_t> all_gather_world(const std::vector<int64_t>& mine);
  /// The ranks (other than this one) whose entry `i` differs from rank 0's; `all` holds n per rank.
  FSDPX_DECL static std::vector<int> ranks_differing(const std::vector<int64_t>& all, size_t n, size_t i);
  FSDPX_DECL static std::string join_ranks(const std::vector<int>& ranks);
  /// An exact fingerprint of a tensor's bytes (the same bits give the same value on every rank).
  FSDPX_DECL static int64_t fingerprint(const at::Tensor& tensor);
  /// The values one unit takes its shard from must be the same on every rank: checked with one
  /// collective of fingerprints (parameters and buffers), or copied from rank 0 (ReplicaInit).
  FSDPX_DECL void replicate_values(const std::string& unit, const std::vector<ParamInfo>& params,
                                   torch::nn::Module& module, bool root, bool values_meaningful, ReplicaInit how);
  /// The buffers of `module` that a unit holds: all of its own for a unit, those outside every
  /// other unit for the root.
  FSDPX_DECL std::vector<std::pair<std::string, at::Tensor>> unit_buffers(torch::nn::Module& module, bool root) const;
  FSDPX_DECL void install_gradient_hooks(Unit& u);

  // ---- the protocol's transitions (core/impl/sharded_model.ipp) ------------------------------------------

  /// The root's forward starts a step: a backward pass that an exception ended is cleaned up first.
  FSDPX_DECL void begin_forward();
  /// unit: idle | after_forward | backward | reduced -> forward (detail::check_phase refuses the rest,
  /// before anything is gathered). Gathers u and prefetches what followed it.
  FSDPX_DECL void pre_forward(Unit& u);

  /// unit: forward | idle -> after_forward (with gradients on) or idle; the root's also ends the forward.
  template <class Out>
  Out post_forward(Unit& u, Out out) {
    end_unit_forward(u);
    auto hook = std::make_shared<detail::BackwardHook>([alive = alive_, this, &u] {
      if (*alive) pre_backward(u);
    });
    const auto output_dtype = u.options().output_dtype;
    return detail::map_tensors(std::move(out), [&](at::Tensor t) {
      if (!t.defined()) return t;
      if (output_dtype && t.is_floating_point()) t = t.to(*output_dtype);
      if (t.requires_grad()) detail::add_pre_backward_hook(t, hook);
      return t;
    });
  }
  FSDPX_DECL void end_unit_forward(Unit& u);

  /// The root's forward threw: every unit reshards and the pass resets, so the next step starts clean.
  /// (Inside backward a failed recomputation ends that pass instead.) Another unit's forward threw: it
  /// is back in the phase its forward started from, for a caller that catches the error and goes on.
  FSDPX_DECL void forward_failed(Unit& u) noexcept;

  /// stage: forward | after_forward -> backward, at the first unit event of a backward pass: arranges
  /// for its end. A pass that began and never ended (an exception left it) is cleaned up first.
  FSDPX_DECL void begin_backward();
  /// unit: idle | after_forward | backward -> backward (reduced stays reduced), when its outputs'
  /// gradients arrive. Gathers it again.
  FSDPX_DECL void pre_backward(Unit& u);
  /// The post-backward node of one call of `u` ran; the last of u's calls ends its backward.
  FSDPX_DECL void post_backward(Unit& u);
  FSDPX_DECL void on_grad_accumulated(Unit& u);
  /// unit: idle | after_forward | backward -> reduced. Its reduction starts now (missing gradients count
  /// as zero), it reshards.
  FSDPX_DECL void unit_backward_done(Unit& u);
  /// Starts the replica all-reduce of every issued unit whose reduce-scatter is done, in issue order
  /// (the same on every rank), without waiting for any.
  FSDPX_DECL void advance_replica_reductions();
  /// stage: backward -> idle. Reduces what is left, then adds every unit's result to its shard's
  /// gradients at once; throwing on the way (a collective fails) aborts the pass instead.
  FSDPX_DECL void end_of_backward();
  /// stage: any -> idle, for a pass that ended with an exception: waits for the collectives it issued
  /// (every rank issued the same ones, for the same failure), drops the gradients it computed and
  /// everything it had not yet added to the shards, reshards every unit. Never throws; says what it
  /// dropped in a warning.
  FSDPX_DECL void abort_pass(const char* why) noexcept;

  // ---- activation checkpointing ---------------------------------------------------------------------------

  bool checkpoints(const Unit& u) const {
    return checkpointing_ && u.options().checkpoint_activations && at::GradMode::is_enabled();
  }

  /// A checkpointed unit call: `body` runs on copies of the inputs without keeping activations; its
  /// backward recomputes it on the same inputs (with the unit gathered by pre_backward) and hands the
  /// parameters' gradients to the protocol as autograd's accumulation would.
  template <class Body, class Inputs>
  auto checkpointed_call(Unit& u, const Body& body, Inputs& inputs) {
    using Stored =
        decltype(std::apply([](auto&... a) { return std::tuple<std::decay_t<decltype(a)>...>(a...); }, inputs));
    using Out = std::decay_t<decltype(std::apply(body, std::declval<Stored&>()))>;
    if constexpr (!std::is_copy_constructible_v<Stored> || !std::is_copy_constructible_v<Body> ||
                  !std::is_copy_constructible_v<Out>) {
      FSDPX_FAIL(
          ConfigError, "unit '", u.name(),
          "' is checkpointed, but its call's arguments, result or function "
          "cannot be copied, so it cannot run again in backward; leave this unit out of the checkpointing policy");
      return std::apply(body, inputs);
    } else {
      struct Call final : detail::Recomputation {
        Call(ShardedModel* model, Unit* unit, Body body, Stored args)
            : model(model),
              unit(unit),
              alive(model->alive_),
              device_(unit->options().device),
              body(std::move(body)),
              args(std::move(args)) {}
        std::vector<at::Tensor> run(const std::vector<at::Tensor>& tensors) override {
          Stored call_args = args;
          size_t next = 0;
          call_args = detail::map_tensors(std::move(call_args), [&](at::Tensor) { return tensors.at(next++); });
          Out out = std::apply(body, call_args);
          std::vector<at::Tensor> flat;
          detail::collect_tensors(out, flat);
          if (!ran) {
            ran = true;
            first_out.emplace(std::move(out));
          } else if (*alive) {
            ++model->pass_.stats.recomputations;
          }
          return flat;
        }
        at::Device device() const override { return device_; }
        std::vector<at::Tensor> parameters() const override {
          return *alive ? model->trainable_parameters(*unit) : std::vector<at::Tensor>{};
        }
        void accept_parameter_gradients(std::vector<at::Tensor> grads) override {
          if (*alive) model->recomputed_gradients(*unit, std::move(grads));
        }
        std::vector<at::Tensor> buffers() const override {
          return *alive ? model->unit_module_buffers(*unit) : std::vector<at::Tensor>{};
        }
        ShardedModel* model;
        Unit* unit;
        std::shared_ptr<bool> alive;
        at::Device device_;
        Body body;
        Stored args;       // the call's arguments; its tensors are placeholders after forward (run() gets them)
        bool ran = false;  // the forward ran: the next run is the recomputation
        std::optional<Out> first_out;  // the forward's result: its structure, and its non-tensor parts
      };
      auto call = std::make_shared<Call>(this, &u, body, std::apply([](auto&... a) { return Stored(a...); }, inputs));
      std::vector<at::Tensor> flat;
      detail::collect_tensors(call->args, flat);
      const std::vector<at::Tensor> outputs = detail::run_checkpointed(flat, call, u.trainable());
      // The node saved the inputs it needs; the copies here would outlive backward with the graph.
      call->args = detail::map_tensors(std::move(call->args), [](at::Tensor) { return at::Tensor(); });
      Out out = std::move(*call->first_out);
      call->first_out.reset();
      size_t next = 0;
      return detail::map_tensors(std::move(out), [&](at::Tensor) { return outputs.at(next++); });
    }
  }

  /// The parameters of `u` and of its kept companions that get gradients (none when u is frozen), in unit order.
  FSDPX_DECL std::vector<at::Tensor> trainable_parameters(const Unit& u) const;
  /// The buffers of unit `u`'s module, all of them (what a call of it may change).
  FSDPX_DECL std::vector<at::Tensor> unit_module_buffers(const Unit& u) const;
  /// A recomputation's parameter gradients, accumulated as autograd would, each counted toward the end
  /// of u's backward.
  FSDPX_DECL void recomputed_gradients(Unit& u, std::vector<at::Tensor> grads);

  // ---- helpers ----------------------------------------------------------------------------------------------

  /// A module that runs a sharded child without fsdpx::forward reads parameters whose bytes are
  /// released; ATen notices the empty storage. Say what happened instead of ATen's words.
  /// When ATen's error `e`, inside unit `running`'s call, says a resharded parameter was read: the ConfigError
  /// that says so, naming the units inside `running` that this pass has not called through the protocol
  /// (the one its module called directly is among them). nullopt for any other error.
  FSDPX_DECL std::optional<ConfigError> resharded_access_error(const Unit& running, const c10::Error& e) const;
  /// When ATen's error `e`, inside unit `running`'s call, is a dtype mismatch: the ConfigError that names the
  /// unit, its dtypes and the modules in it that hold parameters and buffers of different dtypes (BatchNorm's
  /// bfloat16 weights beside float32 running statistics), and how to keep them in float32. nullopt otherwise.
  FSDPX_DECL std::optional<ConfigError> dtype_clash_error(const Unit& running, const c10::Error& e) const;

  size_t index_of(const Unit& u) const { return static_cast<size_t>(u.index()); }
  detail::UnitRecord& record(const Unit& u) { return pass_.units[index_of(u)]; }
  bool is_root(const Unit& u) const { return &u == units_.front().get(); }

  template <class T>
  static void track_input(T& arg, std::vector<at::Tensor*>& tracked) {
    if constexpr (std::is_same_v<std::remove_cvref_t<T>, at::Tensor> && !std::is_const_v<std::remove_reference_t<T>>) {
      if (arg.defined() && arg.requires_grad()) tracked.push_back(&arg);
    }
  }
  FSDPX_DECL void add_post_backward_node(Unit& u, const std::vector<at::Tensor*>& tracked);

  /// A unit and its companions (frozen parameters, float32-kept ones) are gathered and freed together.
  const std::vector<size_t>& companions(const Unit& u) const { return companions_[index_of(u)]; }
  /// Whether one of u's companions is frozen: its parameters may still be needed for the gradient of
  /// u's input after every trainable one has its gradient.
  bool has_frozen_companion(const Unit& u) const {
    for (const size_t c : companions(u)) {
      if (!units_[c]->trainable()) return true;
    }
    return false;
  }
  /// The units whose gradients a backward of u produces: u and its kept companions, when trainable.
  template <class F>
  void for_each_trainable_member(Unit& u, F&& f) {
    if (!u.trainable()) return;
    f(u);
    for (const size_t c : companions(u)) {
      if (units_[c]->trainable()) f(*units_[c]);
    }
  }
  FSDPX_DECL void unshard_async_with(Unit& u);
  FSDPX_DECL void unshard_with(Unit& u);
  FSDPX_DECL void reshard_with(Unit& u);
  FSDPX_DECL void note_unsharded();

  std::shared_ptr<torch::nn::Module> root_module_;
  Mesh mesh_;
  UnitOptions options_;
  BufferSync buffer_sync_;
  std::vector<std::unique_ptr<Unit>> units_;  // [0] is the root
  std::vector<const torch::nn::Module*> modules_;
  std::vector<detail::NodePtr> accumulators_;              // keep the hooks' nodes alive
  std::unordered_set<const torch::nn::Module*> in_units_;  // every module inside a non-root unit
  std::vector<bool> is_companion_;                         // moves with the last unit before it that is not one
  std::vector<std::vector<size_t>> companions_;            // a unit's companions' indices (none for a companion)
  std::vector<Unit*> forward_order_;  // the last completed forward's units (prefetching follows it)
  std::unordered_map<const Unit*, size_t> position_;
  detail::Pass pass_;  // everything the current pass changed
  StepStats last_stats_;
  bool sync_ = true;
  bool checkpointing_ = true;
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);
  std::mutex readers_mutex_;
  std::vector<std::function<void()>> readers_;  // add_shard_reader's waits
  std::chrono::duration<double> reader_wait_{0};
};

}  // namespace fsdpx::core

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/core/impl/model_plan.ipp>
#include <fsdpx/core/impl/sharded_model.ipp>
#endif
