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
// this run's; rank 0 withdraws its commit of a step (the commit record and the files that complete it,
// DCP's .metadata) before the step is written again (an iteration file naming that step falls back to the
// newest step committed before it), and every other rank waits until they are gone before it replaces a
// file of the step: no reader meets an old commit that describes new files.
//
// The files are written in CheckpointOptions::format, through its checkpoint::StepFormat
// (checkpoint/step_format.hpp): the coordinator itself is the same for every format.
//
// Teardown after an error (the coordinator destroyed while an exception propagates, or after its
// world communicator failed) waits only for this rank's own writes: rank 0 takes one last look at
// each step it was committing, commits those whose files are all durable, and abandons the others,
// saying which, instead of waiting out commit_timeout for ranks that will never finish. Nothing
// committed is touched. Every wait reports what it waits for every CheckpointOptions::report_interval.
//
// save_to_memory() keeps steps in the memory tier as well (checkpoint/memory_tier.hpp): a second coordinator on a
// node-local root, whose failures are warnings, never a failure of the disk tier. At the job's clean end (no
// error, every memory step committed, the disk tier's newest step at least as new) rank 0 removes it.
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
#include <fsdpx/checkpoint/detail/worker_pool.hpp>
#include <fsdpx/checkpoint/extra_state.hpp>
#include <fsdpx/checkpoint/format.hpp>
#include <fsdpx/checkpoint/layout.hpp>
#include <fsdpx/checkpoint/memory_tier.hpp>
#include <fsdpx/checkpoint/names.hpp>
#include <fsdpx/checkpoint/save_request.hpp>
#include <fsdpx/checkpoint/state_dict.hpp>
#include <fsdpx/checkpoint/step_format.hpp>
#include <fsdpx/core/lr_schedule.hpp>
#include <fsdpx/dist/communicator.hpp>
#include <fsdpx/hf/model_folder.hpp>

namespace fsdpx {

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
  /// The files each step is written as (CheckpointFormat::dcp needs <fsdpx/dcp.hpp> in the program).
  CheckpointFormat format = CheckpointFormat::fsdpx;
  /// CheckpointFormat::dcp: how the model's tensors are named in it (models::dcp_save_options for the decoder).
  SaveNames dcp_names;
  /// Where and how many steps save_to_memory() keeps (the memory tier; off until it is first called).
  MemoryTierOptions memory_tier{};
};

/// What a monitor hears about one file of one save (rank-local).
struct SaveEvent {
  int64_t step = 0;
  checkpoint::Component component = checkpoint::Component::model;
  std::filesystem::path path;
  int64_t bytes = 0;
  double seconds = 0;
  std::string error{};  // empty when the save succeeded
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
    wait_for_components(optimizer != nullptr, extra != nullptr);
    SaveRequest req = make_save_request(step, model, optimizer, extra);
    format_->prepare(req, model.sharded(), optimizer, options_.dcp_names);  // collective for DCP's groups
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

  /// Keeps the step in the memory tier (checkpoint/memory_tier.hpp), as save() keeps it on disk: the same state,
  /// copied in the background into a node-local memory folder and committed when every rank's copy is whole.
  /// Collective the first time (the ranks agree on the tier's folder). Every rank calls it for the same steps.
  /// Blocks only for the host copy and for this rank's previous memory step still being written. A failed
  /// memory step (a full memory folder) is a warning: it never throws, and never touches the disk tier.
  template <class Sharded>
  void save_to_memory(int64_t step, Sharded& model, torch::optim::Optimizer* optimizer = nullptr,
                      const ExtraState* extra = nullptr) {
    static_assert(Sharded::StateDictPolicyType::kind != StateDictKind::full,
                  "save_to_memory keeps each rank's shards: it needs a sharded or local state dict policy (a full "
                  "state dict would gather the whole model on every step)");
    if (!memory_started_) start_memory_tier(model.mesh().world(), step);
    if (!memory_) return;  // off: said when it started
    memory_->wait_for_slots(optimizer != nullptr, extra != nullptr);
    // An earlier memory step's failure is said here, and this step is still saved: every rank saves the
    // same memory steps, so that none waits for another's copy of a step it skipped
    if (!memory_tier_warned([&] { memory_->rethrow_failure(); })) return;
    SaveRequest req = make_save_request(step, model, optimizer, extra);
    memory_tier_warned([&] { memory_->submit_request(std::move(req), &model.sharded()); });
  }
  template <class Sharded>
  void save_to_memory(int64_t step, Sharded& model, torch::optim::Optimizer& optimizer, const ExtraState& extra) {
    save_to_memory(step, model, &optimizer, &extra);
  }
  template <class Sharded>
  void save_to_memory(int64_t step, Sharded& model, torch::optim::Optimizer& optimizer, const LrScheduler& scheduler,
                      ExtraState extra = {}) {
    extra.scheduler = scheduler.state_dict();
    save_to_memory(step, model, &optimizer, &extra);
  }

  /// The memory tier's own checkpoint root; empty while it is off.
  std::filesystem::path memory_tier_root() const { return memory_ ? memory_->root() : std::filesystem::path(); }

  /// Saves an already made request (see make_save_request). With `readers_of`, that model's next
  /// backward waits until the request's snapshot function has run (the shards it copies must not
  /// change before).
  FSDPX_DECL void submit(SaveRequest req, core::ShardedModel* readers_of = nullptr);

  /// Waits until this rank's saves are durable (and, on rank 0, committed or failed), the memory tier's too;
  /// throws the first failure since the last throw (the memory tier's are warnings, as in save_to_memory).
  void wait() {
    wait_idle();
    if (memory_) {
      memory_->wait_idle();
      memory_tier_warned([&] { memory_->rethrow_failure(); });
    }
    rethrow_failure();
  }

  /// The memory tier's newest committed step (rank 0; -1 while it is off or has none).
  int64_t memory_tier_latest_committed() const { return memory_ ? memory_->latest_committed() : -1; }

  /// The newest step whose weights (weights_only) or whole checkpoint this coordinator committed or
  /// found committed at start; -1 when none. Meaningful on rank 0.
  int64_t latest_committed(bool weights_only = false) const {
    std::lock_guard lock(mutex_);
    return iteration_.at(weights_only ? checkpoint::state_dict_iteration_file
                                      : checkpoint::checkpointed_iteration_file);
  }

  const std::filesystem::path& root() const { return root_; }
  /// The format the steps are written in, and its seam (CheckpointOptions::format).
  const checkpoint::StepFormat& format() const { return *format_; }

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
    std::string waiting_for{};  // the first file not yet durable, for reports
    /// The components committed so far (StepFormat::commit ran: DCP's .metadata is written), and their files.
    std::map<Component, std::map<std::string, checkpoint::CommittedFile>> committed{};
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

  /// Waits until no save of the components is writing (one save per component in flight), then throws the
  /// first failure since the last throw.
  FSDPX_DECL void wait_for_components(bool optim, bool extra);
  FSDPX_DECL void wait_for_slots(bool optim, bool extra);

  /// submit() after wait_for_components().
  FSDPX_DECL void submit_request(SaveRequest req, core::ShardedModel* readers_of);

  // ---- the memory tier -----------------------------------------------------------------------------

  /// Collective: rank 0 reads or makes the root's memory tier id and gives it to every rank; the tier starts when
  /// every rank sees its folder (the ranks of one node), and stays off, saying why, otherwise. Steps there from
  /// `first_step` on belong to another history (this job resumed an older step, or started over): they go first.
  template <dist::Communicator Comm>
  void start_memory_tier(Comm world, int64_t first_step) {
    memory_started_ = true;
    const auto device = at::TensorOptions().dtype(at::kLong).device(world.device_type());
    at::Tensor id = at::zeros({1}, device);
    std::string cause;
    std::filesystem::path folder;
    if (rank_ == 0) {
      try {
        const uint64_t mine = memory_tier_id();
        folder = checkpoint::memory_tier_root(checkpoint::memory_tier_dir(options_.memory_tier.dir), mine);
        if (const auto steps = checkpoint::list_steps(folder); !steps.empty() && steps.back().step >= first_step) {
          std::fprintf(stderr,
                       "fsdpx: the memory tier's steps up to %lld are not this run's (it starts at step %lld): "
                       "removed\n",
                       static_cast<long long>(steps.back().step), static_cast<long long>(first_step));
          std::filesystem::remove_all(folder);
        }
        // a mark for the other ranks to look for, after the broadcast below
        std::filesystem::create_directories(folder);
        fsdpx::detail::write_text_durably(folder / (".seen." + run_), "");
        checkpoint::claim_memory_tier(folder, root_);
        for (const auto& [stale, why] :
             checkpoint::remove_stale_memory_tiers(folder.parent_path(), folder, options_.memory_tier.stale_after)) {
          std::fprintf(stderr, "fsdpx: removed the stale memory tier '%s': %s\n", stale.string().c_str(), why.c_str());
        }
        id.fill_(static_cast<int64_t>(mine));
      } catch (const std::exception& e) {
        cause = e.what();
      }
    }
    world.broadcast(id, 0);
    const auto got = static_cast<uint64_t>(id.item<int64_t>());
    if (got == 0) {
      if (rank_ == 0) std::fprintf(stderr, "fsdpx: the memory tier is off, the disk tier goes on: %s\n", cause.c_str());
      return;
    }
    folder = checkpoint::memory_tier_root(checkpoint::memory_tier_dir(options_.memory_tier.dir), got);
    std::error_code ec;
    at::Tensor seen = at::full({1}, std::filesystem::exists(folder / (".seen." + run_), ec) ? 1 : 0, device);
    at::Tensor first_blind = at::full({1}, seen.item<int64_t>() != 0 ? world_size_ : rank_, device);
    world.all_reduce(seen, dist::ReduceOp::min);
    world.all_reduce(first_blind, dist::ReduceOp::min);
    if (rank_ == 0) std::filesystem::remove(folder / (".seen." + run_), ec);
    if (seen.item<int64_t>() == 0) {
      if (rank_ == 0) {
        std::fprintf(stderr,
                     "fsdpx: the memory tier is off, the disk tier goes on: rank %lld does not see rank 0's memory "
                     "folder '%s' (another node, or another FSDPX_MEMORY_DIR); copies to a buddy node are not built "
                     "yet, so the tier needs every rank on one node\n",
                     static_cast<long long>(first_blind.item<int64_t>()), folder.string().c_str());
      }
      return;
    }
    CheckpointOptions memory_options = options_;
    memory_options.max_to_keep = std::max(1, options_.memory_tier.keep);
    memory_options.max_bytes = 0;
    memory_options.format = CheckpointFormat::fsdpx;
    memory_options.huggingface_dir.clear();
    // a memory copy is a memcpy: one that does not commit in minutes will not
    memory_options.commit_timeout =
        std::min<std::chrono::milliseconds>(options_.commit_timeout, std::chrono::minutes(2));
    memory_ = std::make_unique<CheckpointCoordinator>(folder, world, memory_options);
  }

  /// Rank 0: the root's memory tier id, made (random, durable) when it has none.
  FSDPX_DECL uint64_t memory_tier_id();

  /// Runs `fn`; an IoError it throws is a warning about the memory tier (said once per cause). False when it threw.
  FSDPX_DECL bool memory_tier_warned(const std::function<void()>& fn);

  /// The destructor's part for the memory tier: waits for it, and at a clean end removes it (rank 0).
  FSDPX_DECL void end_memory_tier();

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

  /// Writes this rank's file of component `c` and its marker; `refused`: why it must not be written (the
  /// snapshot failed, an earlier commit was not withdrawn), a failure of the step.
  FSDPX_DECL void write_component(const SaveRequest& req, const std::filesystem::path& dir, Component c, InFlight& slot,
                                  const std::string& refused);

  /// The files of an earlier commit of the step in `dir` (its commit record and the format's commit_files)
  /// that are still there.
  FSDPX_DECL std::vector<std::filesystem::path> earlier_commit_files(const std::filesystem::path& dir) const;

  /// A rank's thread, before it writes any file of the step in `dir`: once no earlier commit of the step is
  /// left (rank 0 withdraws it in submit(), before its own writes), calls write({}); until then it looks again
  /// every poll_interval, and after commit_timeout, or once the world failed or the coordinator tears down after
  /// an error, calls write(why), which fails the step's writes with that cause.
  FSDPX_DECL void write_when_withdrawn(int64_t step, const std::filesystem::path& dir,
                                       std::function<void(const std::string&)> write,
                                       std::chrono::steady_clock::time_point deadline);

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

  /// Rank 0, before `step` is written: an interrupted run's commit of it (the record, and the format's
  /// commit_files) is withdrawn, so the step is never taken for committed while its files are replaced. An
  /// iteration file that names it first falls back to the newest step committed before it (or goes, when
  /// there is none): readers see it move back, never name a step that is not committed.
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
  const checkpoint::StepFormat* format_;         // options_.format's seam
  std::vector<CheckpointMonitor> monitors_;
  std::shared_ptr<InFlight> in_flight_[3];
  std::mutex iteration_mutex_;
  std::map<std::string, int64_t> iteration_;
  bool memory_started_ = false;
  std::string memory_warned_;                      // the last memory tier failure said
  std::unique_ptr<CheckpointCoordinator> memory_;  // the memory tier, once started (null: off)
  checkpoint::detail::WorkerPool pool_;            // last: joined (in the destructor) before the members above go
};

}  // namespace fsdpx

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/checkpoint/impl/coordinator.ipp>
#endif
