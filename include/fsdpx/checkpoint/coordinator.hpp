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

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <unistd.h>


#include <ATen/record_function.h>
#include <torch/optim/optimizer.h>

#include <fsdpx/detail/json.hpp>
#include <fsdpx/checkpoint/detail/worker_pool.hpp>
#include <fsdpx/checkpoint/extra_state.hpp>
#include <fsdpx/checkpoint/format.hpp>
#include <fsdpx/checkpoint/layout.hpp>
#include <fsdpx/checkpoint/model_folder.hpp>
#include <fsdpx/checkpoint/state_dict.hpp>
#include <fsdpx/core/lr_schedule.hpp>
#include <fsdpx/dist/communicator.hpp>

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
  /// checkpoint::copy_model_files) rank 0 copies into every step's huggingface/ directory, so a merged
  /// checkpoint is a Hugging Face model directory. A pretrained model's own folder will do. Empty: none.
  std::filesystem::path huggingface_dir;
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

/// What one save writes: host snapshots of the state plus the step's description.
struct SaveRequest {
  int64_t step = 0;
  std::vector<checkpoint::Component> components;
  StateDict model;
  std::optional<StateDict> optim;
  std::optional<c10::IValue> extra;
  ::fsdpx::detail::Json config = ::fsdpx::detail::Json::object();  // mesh, dtypes, kind: goes into fsdp_config.json
  /// When set, fills `model` and `optim` on the coordinator's threads, before the writes.
  std::function<void(SaveRequest&)> snapshot;
};

/// Describes a save of `model` (by its StateDict policy), the optimizer's state and the extra state.
/// Sharded and local state dicts are copied to host memory in the background (the model's next
/// backward waits for the copy, so it overlaps that step's forward and backward); a full state dict
/// is gathered here (collective). The RNG states in extra_state are taken now.
template <class Sharded>
SaveRequest make_save_request(int64_t step, Sharded& model, torch::optim::Optimizer* optimizer, const ExtraState* extra) {
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
  req.config = {{"mesh", {{"shard", model.mesh().shard_size()}, {"replicate", model.mesh().replicate_size()}}},
                {"state_dict_kind", to_string(kind)},
                {"param_dtype", std::string(c10::toString(unit.param_dtype))},
                {"reduce_dtype", std::string(c10::toString(unit.reduce_dtype))},
                {"master_dtype", std::string(c10::toString(unit.shard_dtype))},
                {"backend", std::string(world.backend_name())}};
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
    if constexpr (requires { { world.is_broken() } -> std::convertible_to<bool>; }) {
      world_failed_ = [world] { return world.is_broken(); };
    }
  }

  CheckpointCoordinator(const CheckpointCoordinator&) = delete;
  CheckpointCoordinator& operator=(const CheckpointCoordinator&) = delete;
  /// Waits for the saves in flight (see the top of this file for teardown after an error).
  ~CheckpointCoordinator() {
    if (std::uncaught_exceptions() > 0) abandoning_.store(true);
    wait_idle();
    {
      std::lock_guard lock(mutex_);
      if (!failure_.empty() && !failure_said_) {
        std::fprintf(stderr, "%s (rank %d, at the coordinator's end)\n", failure_.c_str(), rank_);
      }
    }
    pool_.join();
  }

  void add_monitor(CheckpointMonitor monitor) {
    std::lock_guard lock(mutex_);
    monitors_.push_back(std::move(monitor));
  }

  /// Snapshots the model (and the optimizer and extra state when given) and saves them in the
  /// background. Blocks only for the host copy, and for a previous save of the same component that
  /// is still writing. Throws the cause of an earlier failed save.
  template <class Sharded>
  void save(int64_t step, Sharded& model, torch::optim::Optimizer* optimizer = nullptr, const ExtraState* extra = nullptr) {
    rethrow_failure();
    wait_for_components(optimizer != nullptr, extra != nullptr);
    SaveRequest req = make_save_request(step, model, optimizer, extra);
    std::optional<std::promise<void>> copied;
    if (req.snapshot) {  // the model's next backward waits until the copy is taken
      copied.emplace();
      model.sharded().add_shard_reader(copied->get_future().share());
    }
    submit(std::move(req), std::move(copied));
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

  /// Saves an already made request (see make_save_request); `copied` is fulfilled once its snapshot
  /// function has run.
  void submit(SaveRequest req, std::optional<std::promise<void>> copied = std::nullopt) {
    const auto has = [&](Component c) { return std::find(req.components.begin(), req.components.end(), c) != req.components.end(); };
    wait_for_components(has(Component::optim), has(Component::extra_state));
    FSDPX_CHECK(req.model.world_size == world_size_ && req.model.rank == rank_, "CheckpointCoordinator for rank ", rank_,
                " of ", world_size_, " was given the state of rank ", req.model.rank, " of ", req.model.world_size);
    {
      std::lock_guard lock(mutex_);
      FSDPX_CHECK(req.step > last_submitted_, "checkpoint steps must increase: step ", req.step, " after step ", last_submitted_);
      last_submitted_ = req.step;
    }
    const std::filesystem::path dir = checkpoint::step_dir(root_, req.step);
    std::error_code ec;
    std::filesystem::create_directories(dir / ".done", ec);
    FSDPX_CHECK_AS(IoError, !ec, "cannot create '", (dir / ".done").string(), "': ", ec.message());

    if (rank_ == 0) {
      withdraw_earlier_commit(req.step, dir);
      if (!options_.huggingface_dir.empty()) checkpoint::copy_model_files(options_.huggingface_dir, dir / "huggingface");
      // Room for the commit records and iteration files, taken before any shard is written, so a
      // disk that fills up during this save or the next cannot keep a finished step from committing.
      // (A record lists every rank's files, ~100 bytes each; an iteration file needs a block.)
      const int64_t record_bytes = (int64_t{8} << 10) + int64_t{256} * world_size_ * static_cast<int64_t>(req.components.size());
      for (const char* name : {".reserve_weights", ".reserve_complete"}) checkpoint::detail::reserve_space(dir / name, record_bytes);
    }

    auto shared = std::make_shared<SaveRequest>(std::move(req));
    const std::vector<Component> components = shared->components;
    std::vector<std::shared_ptr<InFlight>> slots;
    for (const Component c : components) {
      auto& slot = in_flight_[static_cast<int>(c)];
      slot = std::make_shared<InFlight>();
      slot->step = shared->step;
      slots.push_back(slot);
      {
        std::lock_guard lock(mutex_);
        ++own_writes_[shared->step];
      }
      start_task();
    }
    auto fence = std::make_shared<std::optional<std::promise<void>>>(std::move(copied));
    pool_.post([this, shared, dir, components, slots, fence] {
      std::string snapshot_error;
      try {
        if (shared->snapshot) shared->snapshot(*shared);
      } catch (const std::exception& e) {
        snapshot_error = e.what();
      }
      if (*fence) (*fence)->set_value();  // the shards may change from here on
      for (size_t i = 0; i < components.size(); ++i) {
        pool_.post([this, shared, dir, c = components[i], slot = slots[i], snapshot_error] {
          write_component(*shared, dir, c, *slot, snapshot_error);
        });
      }
    });
    if (rank_ == 0) {
      start_task();
      {
        std::lock_guard lock(mutex_);
        pending_commits_.insert(shared->step);
      }
      watch_commit(std::make_shared<Commit>(Commit{shared->step, dir, components, shared->config,
                                                   dist::deadline_after(options_.commit_timeout)}));
    }
  }

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
    return iteration_.at(weights_only ? checkpoint::state_dict_iteration_file : checkpoint::checkpointed_iteration_file);
  }

  const std::filesystem::path& root() const { return root_; }

 private:
  /// Waits until nothing is outstanding, saying what it waits for every report_interval.
  void wait_idle() {
    const auto start = std::chrono::steady_clock::now();
    std::unique_lock lock(mutex_);
    while (!idle_.wait_until(lock, dist::next_report_after(options_.report_interval), [&] { return outstanding_ == 0; })) {
      const std::chrono::duration<double> waited = std::chrono::steady_clock::now() - start;
      std::fprintf(stderr, "fsdpx: checkpoint (rank %d): still waiting after %.1f s for %s\n", rank_, waited.count(),
                   describe_outstanding().c_str());
      std::fflush(stderr);
    }
  }

  CheckpointCoordinator(std::filesystem::path root, int rank, int world_size, std::string run, CheckpointOptions options)
      : root_(std::move(root)), rank_(rank), world_size_(world_size), run_(std::move(run)), options_(options),
        pool_(options.threads) {
    FSDPX_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "CheckpointCoordinator: rank ", rank,
                " is outside the world of ", world_size);
    std::error_code ec;
    std::filesystem::create_directories(root_, ec);
    FSDPX_CHECK_AS(IoError, !ec, "cannot create the checkpoint root '", root_.string(), "': ", ec.message());
    for (const char* f : {checkpoint::state_dict_iteration_file, checkpoint::checkpointed_iteration_file}) {
      iteration_[f] = checkpoint::read_iteration_file(root_ / f).value_or(-1);
    }
  }

  /// Rank 0 draws a random id and broadcasts it: every rank names its markers with it.
  template <dist::Communicator Comm>
  static std::string agree_on_run_id(Comm world) {
    at::Tensor id = at::zeros({1}, at::TensorOptions().dtype(at::kLong).device(world.device_type()));
    if (world.rank() == 0) {
      std::random_device entropy;
      const auto now = static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count());
      id.fill_(static_cast<int64_t>(((uint64_t{entropy()} << 32) | entropy()) ^ now));
    }
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
    ::fsdpx::detail::Json config;
    std::chrono::steady_clock::time_point deadline;
    bool weights_committed = false;
    std::string waiting_for;  // the first file not yet durable, for reports
  };

  /// Rank 0, tearing down after an error: the step cannot be committed any more (its ranks' files are
  /// not all durable, and they may never be).
  void abandon(Commit& c) {
    release_reserves(c.dir);
    const std::string cause = ::fsdpx::detail::str(
        "fsdpx: checkpoint step ", c.step, " was abandoned, not committed: this process is ending after an error "
        "while it waited for ", c.waiting_for.empty() ? std::string("the ranks' files") : c.waiting_for,
        " (", c.weights_committed ? "its weights were committed; " : "", "the committed steps are untouched)");
    std::fprintf(stderr, "%s\n", cause.c_str());
    std::fflush(stderr);
    record_failure(c.step, cause, /*said=*/true);
  }

  bool own_writes_done(int64_t step) const {
    std::lock_guard lock(mutex_);
    return own_writes_.count(step) == 0;
  }

  /// What wait() waits for, for its reports.
  std::string describe_outstanding() {
    std::string out;
    const auto add = [&](const std::string& part) { out += (out.empty() ? "" : "; ") + part; };
    for (const Component c : checkpoint::all_components) {
      if (auto slot = in_flight_[static_cast<int>(c)]) {
        std::lock_guard lock(slot->m);
        if (!slot->done) add(::fsdpx::detail::str("this rank's ", to_string(c), " file of step ", slot->step, " to be written"));
      }
    }
    for (const auto& [step, what] : commit_waits_) add(::fsdpx::detail::str("step ", step, " to commit: waiting for ", what));
    return out.empty() ? std::string("background checkpoint tasks") : out;
  }

  void start_task() {
    std::lock_guard lock(mutex_);
    ++outstanding_;
  }
  void finish_task() {
    std::lock_guard lock(mutex_);
    if (--outstanding_ == 0) idle_.notify_all();
  }

  void wait_for_components(bool optim, bool extra) {
    for (const Component c : checkpoint::all_components) {
      if ((c == Component::optim && !optim) || (c == Component::extra_state && !extra)) continue;
      if (auto slot = in_flight_[static_cast<int>(c)]) {  // one save per component in flight
        std::unique_lock lock(slot->m);
        slot->cv.wait(lock, [&] { return slot->done; });
      }
    }
    rethrow_failure();
  }

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
  void record_failure(int64_t step, const std::string& cause, bool said = false) {
    {
      std::lock_guard lock(mutex_);
      if (failure_.empty()) {
        failure_ = cause;
        failure_said_ = said;
      }
    }
    notify([&](const CheckpointMonitor& m) {
      if (m.on_failure) m.on_failure(step, cause);
    });
  }

  void rethrow_failure() {
    std::string cause;
    {
      std::lock_guard lock(mutex_);
      cause.swap(failure_);
    }
    if (!cause.empty()) throw IoError(cause);
  }

  void write_component(const SaveRequest& req, const std::filesystem::path& dir, Component c, InFlight& slot,
                       const std::string& snapshot_error) {
    notify([&](const CheckpointMonitor& m) {
      if (m.before_save) m.before_save(req.step, c);
    });
    SaveEvent event{req.step, c, dir / checkpoint::shard_file_name(c, world_size_, rank_)};
    const auto start = std::chrono::steady_clock::now();
    try {
      FSDPX_CHECK_AS(IoError, snapshot_error.empty(), "copying the state to host memory failed: ", snapshot_error);
      const auto written = c == Component::model   ? checkpoint::save_state_dict(event.path, req.model)
                           : c == Component::optim ? checkpoint::save_state_dict(event.path, *req.optim)
                                                   : checkpoint::detail::save_ivalue(event.path, *req.extra);
      event.bytes = written.bytes;
      checkpoint::detail::write_text_durably(checkpoint::done_marker(dir, c, rank_, run_),
                                             ::fsdpx::detail::str(event.path.filename().string(), " ", written.bytes, " ",
                                                                  written.crc32c, "\n"));
    } catch (const std::exception& e) {
      event.error = ::fsdpx::detail::str("fsdpx: checkpoint step ", req.step, ": rank ", rank_, " could not save its ",
                                         to_string(c), ": ", e.what());
      // Tell rank 0 at once, so it stops waiting for this step. On a full disk the text may not fit;
      // an empty marker needs no data block.
      const auto marker = checkpoint::failed_marker(dir, rank_, run_);
      try {
        checkpoint::detail::write_text_durably(marker, event.error);
      } catch (...) {
        if (const int fd = ::open(marker.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644); fd >= 0) ::close(fd);
      }
      record_failure(req.step, event.error);
    }
    event.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    notify([&](const CheckpointMonitor& m) {
      if (m.after_save) m.after_save(event);
    });
    {
      std::lock_guard lock(slot.m);
      slot.done = true;
    }
    slot.cv.notify_all();
    {
      std::lock_guard lock(mutex_);
      if (--own_writes_[req.step] == 0) own_writes_.erase(req.step);
    }
    finish_task();
  }

  // ---- rank 0: commit ----------------------------------------------------------------------------

  void watch_commit(std::shared_ptr<Commit> commit) {
    pool_.post_after(options_.poll_interval, [this, commit] {
      bool again = false;
      try {
        again = !advance_commit(*commit);
        // After an error, once this rank's own files of the step are done (the last look above has
        // seen them), a commit that still waits for other ranks is given up.
        if (again && (abandoning_.load() || (world_failed_ && world_failed_())) && own_writes_done(commit->step)) {
          abandon(*commit);
          again = false;
        }
      } catch (const std::exception& e) {
        record_failure(commit->step, e.what());
      }
      if (again) {
        watch_commit(commit);
      } else {
        {
          std::lock_guard lock(mutex_);
          pending_commits_.erase(commit->step);
          commit_waits_.erase(commit->step);
        }
        finish_task();
      }
    });
  }

  /// One look at the markers; true when the commit is finished (committed or failed).
  bool advance_commit(Commit& c) {
    c.waiting_for.clear();
    for (int r = 0; r < world_size_; ++r) {
      const auto failed = checkpoint::failed_marker(c.dir, r, run_);
      if (std::filesystem::exists(failed)) {
        std::string cause = checkpoint::detail::read_text(failed);
        if (cause.empty()) cause = ::fsdpx::detail::str("rank ", r, " could not save its files (nor describe why: is the disk full?)");
        record_failure(c.step, ::fsdpx::detail::str("fsdpx: checkpoint step ", c.step, " was not committed: ", cause));
        release_reserves(c.dir);
        return true;
      }
    }
    const auto files_of = [&](Component comp) -> std::optional<::fsdpx::detail::Json> {
      ::fsdpx::detail::Json files = ::fsdpx::detail::Json::object();
      for (int r = 0; r < world_size_; ++r) {
        const auto marker = checkpoint::done_marker(c.dir, comp, r, run_);
        if (!std::filesystem::exists(marker)) {
          c.waiting_for = ::fsdpx::detail::str("rank ", r, "'s ", to_string(comp), " file");
          return std::nullopt;
        }
        char name[256] = {};
        long long bytes = 0;
        unsigned long crc = 0;
        const std::string text = checkpoint::detail::read_text(marker);
        FSDPX_CHECK_AS(IoError, std::sscanf(text.c_str(), "%255s %lld %lu", name, &bytes, &crc) == 3,
                       "checkpoint marker '", marker.string(), "' is corrupt");
        files[name] = {{"bytes", int64_t{bytes}}, {"crc32c", static_cast<uint32_t>(crc)}};
      }
      return files;
    };
    std::vector<std::string> done;
    ::fsdpx::detail::Json files = ::fsdpx::detail::Json::object();
    for (const Component comp : c.components) {
      auto f = files_of(comp);
      if (!f) break;
      done.push_back(to_string(comp));
      files.update(*f);
    }
    const bool complete = done.size() == c.components.size();
    const bool weights = !done.empty();
    if (std::chrono::steady_clock::now() > c.deadline && !complete) {
      record_failure(c.step, ::fsdpx::detail::str("fsdpx: checkpoint step ", c.step, " was not committed: not every rank's ",
                                                  "files became durable within ", options_.commit_timeout.count(),
                                                  " ms (complete: ", done.size(), " of ", c.components.size(),
                                                  " components); a rank may have died"));
      release_reserves(c.dir);
      return true;
    }
    if (weights && !c.weights_committed) {
      checkpoint::detail::release_space(c.dir / ".reserve_weights");
      write_config(c, done, files, false);
      advance(checkpoint::state_dict_iteration_file, c.step);
      c.weights_committed = true;
      notify([&](const CheckpointMonitor& m) {
        if (m.on_commit) m.on_commit(c.step, true);
      });
    }
    if (!complete) {
      std::lock_guard lock(mutex_);
      commit_waits_[c.step] = c.waiting_for;
      return false;
    }
    const bool full = c.components.size() == std::size(checkpoint::all_components);
    checkpoint::detail::release_space(c.dir / ".reserve_complete");
    if (c.components.size() > 1) write_config(c, done, files, full);
    if (full) {
      advance(checkpoint::checkpointed_iteration_file, c.step);
      notify([&](const CheckpointMonitor& m) {
        if (m.on_commit) m.on_commit(c.step, false);
      });
    }
    rotate();
    return true;
  }

  static void release_reserves(const std::filesystem::path& dir) {
    for (const char* name : {".reserve_weights", ".reserve_complete"}) checkpoint::detail::release_space(dir / name);
  }

  void rotate() {
    std::set<int64_t> in_flight;
    {
      std::lock_guard lock(mutex_);
      in_flight = pending_commits_;
    }
    std::lock_guard lock(iteration_mutex_);  // the steps the iteration files name hold still meanwhile
    checkpoint::rotate_checkpoints(root_, {options_.max_to_keep, options_.max_bytes}, in_flight);
  }

  void write_config(const Commit& c, const std::vector<std::string>& done, const ::fsdpx::detail::Json& files,
                    bool complete) {
    ::fsdpx::detail::Json config = c.config;
    config["format"] = checkpoint::format_name;
    config["format_version"] = checkpoint::format_version;
    config["step"] = c.step;
    config["world_size"] = world_size_;
    config["complete"] = complete;
    config["components"] = done;
    config["files"] = files;
    checkpoint::detail::write_text_durably(c.dir / checkpoint::config_file, config.dump(2) + "\n");
  }

  /// Iteration files only move forward, each write atomic and durable.
  void advance(const char* file, int64_t step) {
    std::lock_guard lock(iteration_mutex_);
    int64_t& current = iteration_[file];
    if (step <= current) return;
    checkpoint::detail::write_text_durably(root_ / file, std::to_string(step) + "\n");
    std::lock_guard state(mutex_);
    current = step;
  }

  /// Rank 0, before `step` is written: an interrupted run's commit record of it is withdrawn, so the
  /// step is never taken for committed while its files are replaced. An iteration file that names it
  /// first falls back to the newest step committed before it (or goes, when there is none): readers
  /// see it move back, never name a step that is not committed.
  void withdraw_earlier_commit(int64_t step, const std::filesystem::path& dir) {
    if (!std::filesystem::exists(dir / checkpoint::config_file)) return;
    std::lock_guard lock(iteration_mutex_);
    for (auto& [file, current] : iteration_) {
      if (current != step) continue;
      const auto fallback =
          checkpoint::find_committed_before(root_, step, /*weights_only=*/file == checkpoint::state_dict_iteration_file);
      if (fallback) {
        checkpoint::detail::write_text_durably(root_ / file, std::to_string(*fallback) + "\n");
      } else {
        checkpoint::detail::remove_durably(root_ / file);
      }
      std::lock_guard state(mutex_);
      current = fallback.value_or(-1);
    }
    checkpoint::detail::remove_durably(dir / checkpoint::config_file);
  }

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
  std::set<int64_t> pending_commits_;  // rank 0: steps whose commit is being watched
  std::map<int64_t, std::string> commit_waits_;  // rank 0: what each of them still waits for
  std::atomic<bool> abandoning_{false};           // tearing down after an error
  std::function<bool()> world_failed_;            // the world communicator failed (empty: cannot tell)
  std::vector<CheckpointMonitor> monitors_;
  std::shared_ptr<InFlight> in_flight_[3];
  std::mutex iteration_mutex_;
  std::map<std::string, int64_t> iteration_;
  checkpoint::detail::WorkerPool pool_;  // last: joined (in the destructor) before the members above go
};

}  // namespace fsdpx
