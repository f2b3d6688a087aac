// CheckpointCoordinator's member functions, out of line: included by fsdpx/checkpoint/coordinator.hpp (header-only) or
// by fsdpx/impl/src.hpp (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <future>
#include <random>

#include <fcntl.h>
#include <unistd.h>

#include <fsdpx/checkpoint/coordinator.hpp>
#include <fsdpx/detail/json.hpp>

namespace fsdpx {

FSDPX_DECL CheckpointCoordinator::~CheckpointCoordinator() {
  if (std::uncaught_exceptions() > 0) abandoning_.store(true);
  if (memory_ && abandoning_.load()) memory_->abandoning_.store(true);
  wait_idle();
  bool failed = false;
  {
    std::lock_guard lock(mutex_);
    failed = !failure_.empty();
    if (failed && !failure_said_) {
      std::fprintf(stderr, "%s (rank %d, at the coordinator's end)\n", failure_.c_str(), rank_);
    }
  }
  pool_.join();
  if (memory_) {
    if (failed) memory_->abandoning_.store(true);
    end_memory_tier();
  }
}

FSDPX_DECL void CheckpointCoordinator::end_memory_tier() {
  memory_->wait_idle();
  bool clean = !abandoning_.load() && !memory_->abandoning_.load() && !(world_failed_ && world_failed_());
  {
    std::lock_guard lock(memory_->mutex_);
    clean = clean && memory_->failure_.empty() && memory_->pending_commits_.empty();
  }
  const int64_t newest_in_memory = memory_->latest_committed();
  const std::filesystem::path folder = memory_->root();
  memory_.reset();
  // Every rank's memory files of every step are durable once rank 0 committed them all: nothing writes there now
  if (rank_ == 0 && clean && latest_committed() >= newest_in_memory) {
    std::error_code ec;
    std::filesystem::remove_all(folder, ec);
    if (ec) TORCH_WARN("fsdpx: the memory tier's folder '", folder.string(), "' could not be removed: ", ec.message());
  }
}

FSDPX_DECL uint64_t CheckpointCoordinator::memory_tier_id() {
  if (const auto id = checkpoint::read_memory_tier_id(root_)) return *id;
  uint64_t id = 0;
  while (id == 0) id = random_run_id();
  fsdpx::detail::write_text_durably(root_ / checkpoint::memory_tier_id_file, ::fsdpx::detail::str(std::hex, id, "\n"));
  return id;
}

FSDPX_DECL bool CheckpointCoordinator::memory_tier_warned(const std::function<void()>& fn) {
  try {
    fn();
    return true;
  } catch (const IoError& e) {
    if (memory_warned_ != e.what()) {
      memory_warned_ = e.what();
      TORCH_WARN("fsdpx: the memory tier failed a step (the disk tier is not affected): ", e.what());
    }
    return false;
  }
}

FSDPX_DECL uint64_t CheckpointCoordinator::random_run_id() {
  std::random_device entropy;
  const auto now = static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count());
  return ((uint64_t{entropy()} << 32) | entropy()) ^ now;
}

FSDPX_DECL void CheckpointCoordinator::submit(SaveRequest req, core::ShardedModel* readers_of) {
  const auto has = [&](Component c) {
    return std::find(req.components.begin(), req.components.end(), c) != req.components.end();
  };
  wait_for_components(has(Component::optim), has(Component::extra_state));
  submit_request(std::move(req), readers_of);
}

FSDPX_DECL void CheckpointCoordinator::submit_request(SaveRequest req, core::ShardedModel* readers_of) {
  FSDPX_CHECK(req.model.world_size == world_size_ && req.model.rank == rank_, "CheckpointCoordinator for rank ", rank_,
              " of ", world_size_, " was given the state of rank ", req.model.rank, " of ", req.model.world_size);
  {
    std::lock_guard lock(mutex_);
    FSDPX_CHECK(req.step > last_submitted_, "checkpoint steps must increase: step ", req.step, " after step ",
                last_submitted_);
    last_submitted_ = req.step;
  }
  const std::filesystem::path dir = checkpoint::step_dir(root_, req.step);
  std::error_code ec;
  std::filesystem::create_directories(dir / ".done", ec);
  FSDPX_CHECK_AS(IoError, !ec, "cannot create '", (dir / ".done").string(), "': ", ec.message());

  if (rank_ == 0) {
    withdraw_earlier_commit(req.step, dir);  // before any file of the step is replaced, on any rank
    if (!options_.huggingface_dir.empty()) fsdpx::hf::copy_model_files(options_.huggingface_dir, dir / "huggingface");
    // Room for the commit records and iteration files, taken before any shard is written, so a
    // disk that fills up during this save or the next cannot keep a finished step from committing.
    // (A record lists every rank's files, ~100 bytes each; an iteration file needs a block.)
    const int64_t record_bytes =
        (int64_t{8} << 10) + int64_t{256} * world_size_ * static_cast<int64_t>(req.components.size());
    for (const char* name : {".reserve_weights", ".reserve_complete"})
      fsdpx::detail::reserve_space(dir / name, record_bytes);
  }

  auto shared = std::make_shared<SaveRequest>(std::move(req));
  const std::vector<Component> components = shared->components;
  // The model's next backward waits until the copy is taken. Before the tasks are counted: should
  // this throw, nothing is left for wait_idle() to wait on (an unfulfilled promise that dies makes
  // the reader's wait return).
  auto fence = std::make_shared<std::optional<std::promise<void>>>();
  if (readers_of != nullptr && shared->snapshot) {
    fence->emplace();
    readers_of->add_shard_reader([copied = (*fence)->get_future().share()] { copied.wait(); });
  }
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
  const auto deadline = dist::deadline_after(options_.commit_timeout);
  pool_.post([this, shared, dir, components, slots, fence, deadline] {
    std::string snapshot_error;
    try {
      if (shared->snapshot) shared->snapshot(*shared);
    } catch (const std::exception& e) {
      snapshot_error = e.what();
    }
    if (*fence) (*fence)->set_value();  // the shards may change from here on
    const auto write = [this, shared, dir, components, slots](const std::string& refused) {
      for (size_t i = 0; i < components.size(); ++i) {
        pool_.post([this, shared, dir, c = components[i], slot = slots[i], refused] {
          write_component(*shared, dir, c, *slot, refused);
        });
      }
    };
    // Nothing to write after a failed copy: the step fails now, without waiting for rank 0's withdrawal
    if (!snapshot_error.empty()) return write("copying the state to host memory failed: " + snapshot_error);
    write_when_withdrawn(shared->step, dir, write, deadline);
  });
  if (rank_ == 0) {
    start_task();
    {
      std::lock_guard lock(mutex_);
      pending_commits_.insert(shared->step);
    }
    watch_commit(std::make_shared<Commit>(Commit{shared->step, dir, components, shared->setup, deadline}));
  }
}

FSDPX_DECL void CheckpointCoordinator::wait_idle() {
  const auto start = std::chrono::steady_clock::now();
  std::unique_lock lock(mutex_);
  while (
      !idle_.wait_until(lock, dist::next_report_after(options_.report_interval), [&] { return outstanding_ == 0; })) {
    const std::chrono::duration<double> waited = std::chrono::steady_clock::now() - start;
    std::fprintf(stderr, "fsdpx: checkpoint (rank %d): still waiting after %.1f s for %s\n", rank_, waited.count(),
                 describe_outstanding().c_str());
    std::fflush(stderr);
  }
}

FSDPX_DECL CheckpointCoordinator::CheckpointCoordinator(std::filesystem::path root, int rank, int world_size,
                                                        std::string run, CheckpointOptions options)
    : root_(std::move(root)),
      rank_(rank),
      world_size_(world_size),
      run_(std::move(run)),
      options_(options),
      format_(&checkpoint::step_format(options.format, "a CheckpointCoordinator (CheckpointOptions::format)")),
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

FSDPX_DECL void CheckpointCoordinator::abandon(Commit& c) {
  release_reserves(c.dir);
  const std::string cause = ::fsdpx::detail::str(
      "fsdpx: checkpoint step ", c.step,
      " was abandoned, not committed: this process is ending after an error "
      "while it waited for ",
      c.waiting_for.empty() ? std::string("the ranks' files") : c.waiting_for, " (",
      c.weights_committed ? "its weights were committed; " : "", "the committed steps are untouched)");
  std::fprintf(stderr, "%s\n", cause.c_str());
  std::fflush(stderr);
  record_failure(c.step, cause, /*said=*/true);
}

FSDPX_DECL std::string CheckpointCoordinator::describe_outstanding() {
  std::string out;
  const auto add = [&](const std::string& part) { out += (out.empty() ? "" : "; ") + part; };
  for (const Component c : checkpoint::all_components) {
    if (auto slot = in_flight_[static_cast<int>(c)]) {
      std::lock_guard lock(slot->m);
      if (!slot->done)
        add(::fsdpx::detail::str("this rank's ", to_string(c), " file of step ", slot->step, " to be written"));
    }
  }
  for (const auto& [step, what] : commit_waits_)
    add(::fsdpx::detail::str("step ", step, " to commit: waiting for ", what));
  return out.empty() ? std::string("background checkpoint tasks") : out;
}

FSDPX_DECL void CheckpointCoordinator::wait_for_components(bool optim, bool extra) {
  wait_for_slots(optim, extra);
  rethrow_failure();
}

FSDPX_DECL void CheckpointCoordinator::wait_for_slots(bool optim, bool extra) {
  for (const Component c : checkpoint::all_components) {
    if ((c == Component::optim && !optim) || (c == Component::extra_state && !extra)) continue;
    if (auto slot = in_flight_[static_cast<int>(c)]) {  // one save per component in flight
      std::unique_lock lock(slot->m);
      slot->cv.wait(lock, [&] { return slot->done; });
    }
  }
}

FSDPX_DECL void CheckpointCoordinator::record_failure(int64_t step, const std::string& cause, bool said) {
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

FSDPX_DECL void CheckpointCoordinator::write_component(const SaveRequest& req, const std::filesystem::path& dir,
                                                       Component c, InFlight& slot, const std::string& refused) {
  notify([&](const CheckpointMonitor& m) {
    if (m.before_save) m.before_save(req.step, c);
  });
  SaveEvent event{req.step, c, dir / checkpoint::shard_file_name(c, world_size_, rank_)};
  const auto start = std::chrono::steady_clock::now();
  try {
    FSDPX_CHECK_AS(IoError, refused.empty(), refused);
    const checkpoint::WrittenComponent written = format_->write(req, dir, c, rank_, world_size_, options_.dcp_names);
    if (!written.file.path.empty()) event.path = written.file.path;
    event.bytes = written.file.bytes;
    fsdpx::detail::write_text_durably(checkpoint::done_marker(dir, c, rank_, run_), written.marker);
  } catch (const std::exception& e) {
    event.error = ::fsdpx::detail::str("fsdpx: checkpoint step ", req.step, ": rank ", rank_, " could not save its ",
                                       to_string(c), ": ", e.what());
    // Tell rank 0 at once, so it stops waiting for this step. On a full disk the text may not fit;
    // an empty marker needs no data block.
    const auto marker = checkpoint::failed_marker(dir, rank_, run_);
    try {
      fsdpx::detail::write_text_durably(marker, event.error);
    } catch (...) {
      if (const int fd = ::open(marker.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | O_NONBLOCK, 0644); fd >= 0)
        ::close(fd);
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

FSDPX_DECL std::vector<std::filesystem::path> CheckpointCoordinator::earlier_commit_files(
    const std::filesystem::path& dir) const {
  std::vector<std::filesystem::path> out;
  std::error_code ec;
  if (std::filesystem::exists(dir / checkpoint::config_file, ec)) out.push_back(dir / checkpoint::config_file);
  std::set<std::string> names;  // this format's, and every other's: an earlier run may have written another
  for (const std::string& name : format_->commit_files()) names.insert(name);
  for (const auto& home : checkpoint::detail::format_homes) {
    for (const char* name : home.commit_files) {
      if (name != nullptr) names.insert(name);
    }
  }
  for (const std::string& name : names) {
    if (std::filesystem::exists(dir / name, ec)) out.push_back(dir / name);
  }
  return out;
}

FSDPX_DECL void CheckpointCoordinator::write_when_withdrawn(int64_t step, const std::filesystem::path& dir,
                                                            std::function<void(const std::string&)> write,
                                                            std::chrono::steady_clock::time_point deadline) {
  // Before this rank's first file of the step, none of this run's commit files of it can exist (rank 0
  // writes them only once every rank's markers are there): any there is an earlier run's.
  const std::vector<std::filesystem::path> left = earlier_commit_files(dir);
  if (left.empty()) {
    {
      std::lock_guard lock(mutex_);
      if (rank_ != 0) commit_waits_.erase(step);
    }
    return write({});
  }
  const char* gave_up = std::chrono::steady_clock::now() > deadline ? "commit_timeout passed"
                        : abandoning_.load()                        ? "this process is ending after an error"
                        : (world_failed_ && world_failed_())        ? "the world communicator failed"
                                                                    : nullptr;
  if (gave_up == nullptr) {
    {
      std::lock_guard lock(mutex_);
      commit_waits_[step] = ::fsdpx::detail::str("rank 0 to withdraw an earlier run's commit of the step ('",
                                                 left.front().string(), "')");
    }
    pool_.post_after(options_.poll_interval, [this, step, dir, write = std::move(write), deadline]() mutable {
      write_when_withdrawn(step, dir, std::move(write), deadline);
    });
    return;
  }
  {
    std::lock_guard lock(mutex_);
    commit_waits_.erase(step);
  }
  write(::fsdpx::detail::str("an earlier run's commit of the step ('", left.front().string(),
                             "') was not withdrawn by rank 0 before this rank stopped waiting (", gave_up,
                             "; commit_timeout is ", options_.commit_timeout.count(),
                             " ms): its files were left as they are"));
}

FSDPX_DECL void CheckpointCoordinator::watch_commit(std::shared_ptr<Commit> commit) {
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

FSDPX_DECL bool CheckpointCoordinator::advance_commit(Commit& c) {
  c.waiting_for.clear();
  for (int r = 0; r < world_size_; ++r) {
    const auto failed = checkpoint::failed_marker(c.dir, r, run_);
    if (std::filesystem::exists(failed)) {
      std::string cause = fsdpx::detail::read_text(failed, "checkpoint failure marker");
      if (cause.empty())
        cause = ::fsdpx::detail::str("rank ", r, " could not save its files (nor describe why: is the disk full?)");
      record_failure(c.step, ::fsdpx::detail::str("fsdpx: checkpoint step ", c.step, " was not committed: ", cause));
      release_reserves(c.dir);
      return true;
    }
  }
  // A component's files once every rank's are durable: committed by the format once (DCP writes its .metadata
  // there), before any commit record names them, so that a folder that has one is whole.
  const auto files_of = [&](Component comp) -> const std::map<std::string, checkpoint::CommittedFile>* {
    if (const auto it = c.committed.find(comp); it != c.committed.end()) return &it->second;
    std::vector<std::string> markers;
    for (int r = 0; r < world_size_; ++r) {
      const auto marker = checkpoint::done_marker(c.dir, comp, r, run_);
      if (!std::filesystem::exists(marker)) {
        c.waiting_for = ::fsdpx::detail::str("rank ", r, "'s ", to_string(comp), " file");
        return nullptr;
      }
      markers.push_back(fsdpx::detail::read_text(marker, "checkpoint marker"));
    }
    return &(c.committed[comp] = format_->commit(c.dir, c.step, comp, markers));
  };
  std::vector<std::string> done;
  ::fsdpx::detail::Json files = ::fsdpx::detail::Json::object();
  for (const Component comp : c.components) {
    const auto* f = files_of(comp);
    if (f == nullptr) break;
    done.push_back(to_string(comp));
    for (const auto& [name, file] : *f) files[name] = {{"bytes", file.bytes}, {"crc32c", file.crc32c.value_or(0)}};
  }
  const bool complete = done.size() == c.components.size();
  const bool weights = !done.empty();
  if (std::chrono::steady_clock::now() > c.deadline && !complete) {
    record_failure(c.step, ::fsdpx::detail::str("fsdpx: checkpoint step ", c.step,
                                                " was not committed: not every rank's ", "files became durable within ",
                                                options_.commit_timeout.count(), " ms (complete: ", done.size(), " of ",
                                                c.components.size(), " components); a rank may have died"));
    release_reserves(c.dir);
    return true;
  }
  if (weights && !c.weights_committed) {
    fsdpx::detail::release_space(c.dir / ".reserve_weights");
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
  fsdpx::detail::release_space(c.dir / ".reserve_complete");
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

FSDPX_DECL void CheckpointCoordinator::rotate() {
  std::set<int64_t> in_flight;
  {
    std::lock_guard lock(mutex_);
    in_flight = pending_commits_;
  }
  std::lock_guard lock(iteration_mutex_);  // the steps the iteration files name hold still meanwhile
  checkpoint::rotate_checkpoints(root_, {options_.max_to_keep, options_.max_bytes}, in_flight);
}

FSDPX_DECL void CheckpointCoordinator::write_config(const Commit& c, const std::vector<std::string>& done,
                                                    const ::fsdpx::detail::Json& files, bool complete) {
  ::fsdpx::detail::Json config = ::fsdpx::detail::Json::object();
  if (c.setup) {
    const SaveSetup& s = *c.setup;
    config["mesh"] = {{"shard", s.mesh_shard}, {"replicate", s.mesh_replicate}};
    config["state_dict_kind"] = to_string(s.kind);
    config["param_dtype"] = s.param_dtype;
    config["reduce_dtype"] = s.reduce_dtype;
    config["master_dtype"] = s.master_dtype;
    config["backend"] = s.backend;
  }
  config["format"] = checkpoint::format_name;
  config["format_version"] = checkpoint::format_version;
  // Absent for fsdpx's own files, as before the field existed: older readers take those records as they were
  if (options_.format != CheckpointFormat::fsdpx) config["files_format"] = checkpoint::to_string(options_.format);
  config["step"] = c.step;
  config["world_size"] = world_size_;
  config["complete"] = complete;
  config["components"] = done;
  config["files"] = files;
  fsdpx::detail::write_text_durably(c.dir / checkpoint::config_file, config.dump(2) + "\n");
}

FSDPX_DECL void CheckpointCoordinator::advance(const char* file, int64_t step) {
  std::lock_guard lock(iteration_mutex_);
  int64_t& current = iteration_[file];
  if (step <= current) return;
  fsdpx::detail::write_text_durably(root_ / file, std::to_string(step) + "\n");
  std::lock_guard state(mutex_);
  current = step;
}

FSDPX_DECL void CheckpointCoordinator::withdraw_earlier_commit(int64_t step, const std::filesystem::path& dir) {
  if (std::filesystem::exists(dir / checkpoint::config_file)) {
    std::lock_guard lock(iteration_mutex_);
    for (auto& [file, current] : iteration_) {
      if (current != step) continue;
      const auto fallback = checkpoint::find_committed_before(
          root_, step, /*weights_only=*/file == checkpoint::state_dict_iteration_file);
      if (fallback) {
        fsdpx::detail::write_text_durably(root_ / file, std::to_string(*fallback) + "\n");
      } else {
        fsdpx::detail::remove_durably(root_ / file);
      }
      std::lock_guard state(mutex_);
      current = fallback.value_or(-1);
    }
  }
  // The record first (the step is no longer committed), then what completed the commit (DCP's .metadata, which
  // may be there without a record: a run that died between the two); the other ranks write once all are gone.
  for (const std::filesystem::path& file : earlier_commit_files(dir)) fsdpx::detail::remove_durably(file);
}

}  // namespace fsdpx
