// CheckpointCoordinator: background checkpoint saves that never cost a good checkpoint.
//
//   fsdpx::CheckpointCoordinator ckpt("/ckpt", model, {.max_to_keep = 3});
//   for (step...) { train(); if (step % 100 == 0) ckpt.save(step, model, &optimizer, extra); }
//   ckpt.wait();  // before exit: every save durable and committed (throws the first failure)
//
// save() copies the state to host memory (pinned on a GPU) on the calling thread and returns; a
// Boost.Asio thread pool (checkpoint/detail/worker_pool.hpp) serializes and writes the files durably
// (temporary file, fsync, rename, fsync of the directory). Each rank then drops a .done marker per
// file, named with this run's id.
// Rank 0 watches the markers and commits a step only when every rank's files of it are durable: it
// writes fsdp_config.json (the commit record, with every file's size and CRC-32C), then advances
// latest_state_dict_iteration.txt (weights complete) and latest_checkpointed_iteration.txt
// (everything complete), atomically and never backwards, then rotates old checkpoints. A failed save
// never advances them: it is reported to the monitors and thrown by the next call on the coordinator.
//
// After a crash the job resumes from an older step and saves the steps after it again, into
// directories the interrupted run left. Markers of that run carry its id, so they are never taken for
// this run's; its commit record of a step is withdrawn before the step is written again (an
// iteration file naming that step falls back to the newest step committed before it).
//
// Teardown after an error (the coordinator destroyed while an exception propagates, or after its
// world communicator failed) waits only for this rank's own writes: rank 0 takes one last look at
// each step it was committing, commits those whose files are all durable, and abandons the others,
// saying which, instead of waiting out commit_timeout for ranks that will never finish. Nothing
// committed is touched. Every wait reports what it waits for every CheckpointOptions::report_interval.
//
// The checkpoint root must be one file system that every rank sees (the commit reads other ranks' markers).
#pragma once

#include <fsdpx/detail/config.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <ATen/record_function.h>
#include <torch/optim/optimizer.h>

#include <fsdpx/detail/json_fwd.hpp>
#include <fsdpx/checkpoint/dcp_writer.hpp>
#include <fsdpx/checkpoint/detail/worker_pool.hpp>
#include <fsdpx/checkpoint/extra_state.hpp>
#include <fsdpx/checkpoint/format.hpp>
#include <fsdpx/checkpoint/layout.hpp>
#include <fsdpx/hf/model_folder.hpp>
#include <fsdpx/checkpoint/state_dict.hpp>
#include <fsdpx/core/lr_schedule.hpp>
#include <fsdpx/dist/communicator.hpp>

namespace fsdpx {

/// The files a step's state is written as. The commit record, the iteration files, rotation and resuming are
/// the same for both.
enum class CheckpointFormat {
  /// fsdpx's own: model_/optim_world_size_W_rank_r.pt, each CRC-32C checked on load.
  fsdpx,
  /// PyTorch Distributed Checkpoint in LightRFT's layout: the model's DCP in the step folder, the optimizer's
  /// in optim_states/ (get_optimizer_state_dict's layout), each `.metadata` written by rank 0 when every
  /// rank's data file is durable, before the commit record; FSDP2, LightRFT and torch's format_utils read the
  /// step folder as it is. The extra state (RNG, scheduler, client state) stays fsdpx's file beside them.
  /// The model's StateDict policy must be sharded or full.
  dcp,
};

struct CheckpointOptions {
  /// Keep at most this many committed checkpoints (0: all). The newest committed one is never deleted.
  int max_to_keep = 0;
  /// Keep at most this many bytes of committed checkpoints (0: no cap); the newest is kept even if larger.
  int64_t max_bytes = 0;
  /// Threads that serialize and write.
  int threads = 2;
  /// Rank 0 gives up on a step whose files have not all become durable within this time.
  std::chrono::milliseconds commit_timeout = std::chrono::minutes(30);
  std::chrono::milliseconds poll_interval = std::chrono::milliseconds(10);
  /// A wait that lasts longer than this says on stderr what it waits for (and again each interval). 0: never.
  std::chrono::milliseconds report_interval = std::chrono::minutes(1);
  /// A model folder whose files other than weights (config.json, tokenizer and generation files:
  /// fsdpx::hf::copy_model_files) rank 0 copies into every step's huggingface/ directory, so a merged
  /// checkpoint is a Hugging Face model directory. A pretrained model's own folder will do. Empty: none.
  std::filesystem::path huggingface_dir;
  CheckpointFormat format = CheckpointFormat::fsdpx;
  /// CheckpointFormat::dcp: how the model's tensors are named in it (models::dcp_save_options for the decoder).
  checkpoint::dcp::SaveOptions dcp_names;
};

/// What a monitor hears about one file of one save (rank-local).
struct SaveEvent {
  int64_t step = 0;
  checkpoint::Component component = checkpoint::Component::model;
  std::filesystem::path path;
  int64_t bytes = 0;
  double seconds = 0;
  std::string error;  // empty when the save succeeded
};

/// Callbacks; each may be empty. They run on the coordinator's threads: keep them short.
struct CheckpointMonitor {
  std::function<void(int64_t step, checkpoint::Component)> before_save;
  std::function<void(const SaveEvent&)> after_save;
  /// Rank 0: the step's weights (weights_only) or whole checkpoint are committed.
  std::function<void(int64_t step, bool weights_only)> on_commit;
  /// A save or commit of `step` failed; the iteration files did not move.
  std::function<void(int64_t step, const std::string& cause)> on_failure;
};

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
  /// CheckpointFormat::dcp, rank 0: the optimizer's param_groups entries (their parameter lists come from every
  /// rank's shards, so save() gathers them, collectively, on the calling thread).
  std::vector<checkpoint::dcp::SavedBytes> optim_param_groups;
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

class CheckpointCoordinator {
 public:
  using Component = checkpoint::Component;

  /// Collective over the model's world communicator: its ranks agree on an id for this run's saves.
  template <class Sharded>
    requires requires(const Sharded& m) { m.mesh().world(); }
  CheckpointCoordinator(std::filesystem::path root, const Sharded& model, CheckpointOptions options = {})
      : CheckpointCoordinator(std::move(root), model.mesh().world(), options) {}
  /// For requests made by hand (submit): `world` is the communicator of the ranks that save. Collective.
  template <dist::Communicator Comm>
  CheckpointCoordinator(std::filesystem::path root, Comm world, CheckpointOptions options = {})
      : CheckpointCoordinator(std::move(root), world.rank(), world.size(), agree_on_run_id(world), options) {
    if constexpr (requires {
                    { world.is_broken() } -> std::convertible_to<bool>;
                  }) {
      world_failed_ = [world] { return world.is_broken(); };
    }
  }

  CheckpointCoordinator(const CheckpointCoordinator&) = delete;
  CheckpointCoordinator& operator=(const CheckpointCoordinator&) = delete;
  /// Waits for the saves in flight (see the top of this file for teardown after an error).
  FSDPX_DECL ~CheckpointCoordinator();

  void add_monitor(CheckpointMonitor monitor) {
    std::lock_guard lock(mutex_);
    monitors_.push_back(std::move(monitor));
  }

  /// Snapshots the model (and the optimizer and extra state when given) and saves them in the
  /// background. Blocks only for the host copy, and for a previous save of the same component that
  /// is still writing. Throws the cause of an earlier failed save.
  template <class Sharded>
  void save(int64_t step, Sharded& model, torch::optim::Optimizer* optimizer = nullptr,
            const ExtraState* extra = nullptr) {
    rethrow_failure();
    if (options_.format == CheckpointFormat::dcp) {
      FSDPX_CHECK(Sharded::StateDictPolicyType::kind != StateDictKind::local,
                  "CheckpointFormat::dcp writes sharded or full state dicts; this model's StateDict policy is "
                  "LocalStateDict, whose entries are flat unit shards that name no tensor");
    }
    wait_for_components(optimizer != nullptr, extra != nullptr);
    SaveRequest req = make_save_request(step, model, optimizer, extra);
    if (options_.format == CheckpointFormat::dcp && optimizer != nullptr)
      req.optim_param_groups = checkpoint::dcp::param_group_entries(model.sharded(), *optimizer, options_.dcp_names);
    submit(std::move(req), &model.sharded());
  }
  template <class Sharded>
  void save(int64_t step, Sharded& model, torch::optim::Optimizer& optimizer, const ExtraState& extra) {
    save(step, model, &optimizer, &extra);
  }
  /// The same with the LR scheduler's state, stored in extra_state (load_checkpoint restores it).
  template <class Sharded>
  void save(int64_t step, Sharded& model, torch::optim::Optimizer& optimizer, const LrScheduler& scheduler,
            ExtraState extra = {}) {
    extra.scheduler = scheduler.state_dict();
    save(step, model, &optimizer, &extra);
  }

  /// Saves an already made request (see make_save_request). With `readers_of`, that model's next
  /// backward waits until the request's snapshot function has run (the shards it copies must not
  /// change before).
  FSDPX_DECL void submit(SaveRequest req, core::ShardedModel* readers_of = nullptr);

  /// Waits until this rank's saves are durable (and, on rank 0, committed or failed); throws the
  /// first failure since the last throw.
  void wait() {
    wait_idle();
    rethrow_failure();
  }

  /// The newest step whose weights (weights_only) or whole checkpoint this coordinator committed or
  /// found committed at start; -1 when none. Meaningful on rank 0.
  int64_t latest_committed(bool weights_only = false) const {
    std::lock_guard lock(mutex_);
    return iteration_.at(weights_only ? checkpoint::state_dict_iteration_file
                                      : checkpoint::checkpointed_iteration_file);
  }

  const std::filesystem::path& root() const { return root_; }

 private:
  /// Waits until nothing is outstanding, saying what it waits for every report_interval.
  FSDPX_DECL void wait_idle();

  FSDPX_DECL CheckpointCoordinator(std::filesystem::path root, int rank, int world_size, std::string run,
                                   CheckpointOptions options);

  /// A fresh random number (entropy and the clock).
  FSDPX_DECL static uint64_t random_run_id();

  /// Rank 0 draws a random id and broadcasts it: every rank names its markers with it.
  template <dist::Communicator Comm>
  static std::string agree_on_run_id(Comm world) {
    at::Tensor id = at::zeros({1}, at::TensorOptions().dtype(at::kLong).device(world.device_type()));
    if (world.rank() == 0) id.fill_(static_cast<int64_t>(random_run_id()));
    world.broadcast(id, 0);
    return ::fsdpx::detail::str(std::hex, static_cast<uint64_t>(id.item<int64_t>()));
  }

  struct InFlight {
    int64_t step = 0;
    std::mutex m;
    std::condition_variable cv;
    bool done = false;
  };
  struct Commit {
    int64_t step;
    std::filesystem::path dir;
    std::vector<Component> components;
    std::optional<SaveSetup> setup;
    std::chrono::steady_clock::time_point deadline;
    bool weights_committed = false;
    std::string waiting_for;  // the first file not yet durable, for reports
    /// CheckpointFormat::dcp: the components whose .metadata is written, and their files (JSON) for the record.
    std::map<Component, std::string> dcp_files;
  };

  /// Rank 0, tearing down after an error: the step cannot be committed any more (its ranks' files are
  /// not all durable, and they may never be).
  FSDPX_DECL void abandon(Commit& c);

  bool own_writes_done(int64_t step) const {
    std::lock_guard lock(mutex_);
    return own_writes_.count(step) == 0;
  }

  /// What wait() waits for, for its reports.
  FSDPX_DECL std::string describe_outstanding();

  void start_task() {
    std::lock_guard lock(mutex_);
    ++outstanding_;
  }
  void finish_task() {
    std::lock_guard lock(mutex_);
    if (--outstanding_ == 0) idle_.notify_all();
  }

  FSDPX_DECL void wait_for_components(bool optim, bool extra);

  template <class Fn>
  void notify(Fn&& fn) {
    std::vector<CheckpointMonitor> monitors;
    {
      std::lock_guard lock(mutex_);
      monitors = monitors_;
    }
    for (const auto& m : monitors) {
      try {
        fn(m);
      } catch (const std::exception& e) {
        TORCH_WARN("fsdpx: a checkpoint monitor threw: ", e.what());
      }
    }
  }

  /// `said`: the cause was printed already (the destructor does not print it again).
  FSDPX_DECL void record_failure(int64_t step, const std::string& cause, bool said = false);

  void rethrow_failure() {
    std::string cause;
    {
      std::lock_guard lock(mutex_);
      cause.swap(failure_);
    }
    if (!cause.empty()) throw IoError(cause);
  }

  FSDPX_DECL void write_component(const SaveRequest& req, const std::filesystem::path& dir, Component c, InFlight& slot,
                                  const std::string& snapshot_error);

  /// CheckpointFormat::dcp: this rank's data file of component `c` of the step in `dir` written, and its
  /// marker's text (the file, its size and CRC-32C, and what it holds where, for rank 0's .metadata).
  FSDPX_DECL std::pair<::fsdpx::detail::WrittenFile, std::string> write_dcp_component(const SaveRequest& req,
                                                                                      const std::filesystem::path& dir,
                                                                                      Component c);

  /// CheckpointFormat::dcp, rank 0: once every rank's data file of `comp` is durable (its markers, in
  /// `markers` by rank), the component's .metadata, written; the files for the commit record, as JSON.
  FSDPX_DECL std::string commit_dcp_component(const Commit& c, Component comp, const std::vector<std::string>& markers);

  // ---- rank 0: commit ----------------------------------------------------------------------------

  FSDPX_DECL void watch_commit(std::shared_ptr<Commit> commit);

  /// One look at the markers; true when the commit is finished (committed or failed).
  FSDPX_DECL bool advance_commit(Commit& c);

  static void release_reserves(const std::filesystem::path& dir) {
    for (const char* name : {".reserve_weights", ".reserve_complete"}) fsdpx::detail::release_space(dir / name);
  }

  FSDPX_DECL void rotate();

  FSDPX_DECL void write_config(const Commit& c, const std::vector<std::string>& done,
                               const ::fsdpx::detail::Json& files, bool complete);

  /// Iteration files only move forward, each write atomic and durable.
  FSDPX_DECL void advance(const char* file, int64_t step);

  /// Rank 0, before `step` is written: an interrupted run's commit record of it is withdrawn, so the
  /// step is never taken for committed while its files are replaced. An iteration file that names it
  /// first falls back to the newest step committed before it (or goes, when there is none): readers
  /// see it move back, never name a step that is not committed.
  FSDPX_DECL void withdraw_earlier_commit(int64_t step, const std::filesystem::path& dir);

  std::filesystem::path root_;
  int rank_;
  int world_size_;
  std::string run_;  // the id in this run's marker names, the same on every rank
  CheckpointOptions options_;
  mutable std::mutex mutex_;
  std::condition_variable idle_;
  int outstanding_ = 0;
  std::string failure_;
  bool failure_said_ = false;
  std::map<int64_t, int> own_writes_;  // this rank's files of each step still being written
  int64_t last_submitted_ = -1;
  std::set<int64_t> pending_commits_;            // rank 0: steps whose commit is being watched
  std::map<int64_t, std::string> commit_waits_;  // rank 0: what each of them still waits for
  std::atomic<bool> abandoning_{false};          // tearing down after an error
  std::function<bool()> world_failed_;           // the world communicator failed (empty: cannot tell)
  std::vector<CheckpointMonitor> monitors_;
  std::shared_ptr<InFlight> in_flight_[3];
  std::mutex iteration_mutex_;
  std::map<std::string, int64_t> iteration_;
  checkpoint::detail::WorkerPool pool_;  // last: joined (in the destructor) before the members above go
};

}  // namespace fsdpx

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/checkpoint/impl/coordinator.ipp>
#endif
