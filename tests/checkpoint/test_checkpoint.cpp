// Checkpoints under mpiexec at world sizes 1-4: state dict round trips of every kind, resharding on
// load (a job of 2 ranks reads what 3 or 4 wrote), the coordinator's commit protocol, rotation,
// failed saves (an injected full disk) and the errors loading names.
#include <catch2/catch.hpp>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <future>
#include <optional>
#include <set>
#include <cstdlib>
#include <thread>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../support/bn_block.hpp"
#include "checkpoint_common.hpp"
#include "fresh_dir.hpp"

#include <fsdpx/dcp.hpp>
#include <fsdpx/checkpoint/merge.hpp>
#include <fsdpx/detail/json.hpp>

using namespace fsdpx;
using namespace fsdpx::test;
namespace fs = std::filesystem;

namespace {

/// A test's set-up: the world, an emptied checkpoint root, a model seeded alike on every rank, its
/// optimizer and extra state. `auto& [world, root, model, opt, extra] = run;` names them.
struct CheckpointRun {
  CheckpointRun(const std::string& name, uint64_t seed)
      : world(any_world()),
        root(fresh_dir(name)),
        model(seeded(seed), world),
        opt(make_adamw(model, adamw_options())) {}
  dist::AnyCommunicator world;
  fs::path root;
  CkptModel<> model;
  torch::optim::AdamW opt;
  ExtraState extra;

 private:
  static ResMlp seeded(uint64_t seed) {
    torch::manual_seed(seed);
    return ResMlp();
  }
};

/// What the coordinator's wait() throws; empty when every save succeeded.
std::string wait_error(CheckpointCoordinator& coordinator) {
  try {
    coordinator.wait();
  } catch (const IoError& e) {
    return e.what();
  }
  return {};
}

template <class Model>
void load_files(Model& model, const fs::path& dir, const std::string& prefix, int world) {
  load_model_state_dict(model.sharded(), [&](const auto& fn) {
    for (int r = 0; r < world; ++r) fn(checkpoint::load_state_dict_file(dir / (prefix + std::to_string(r) + ".pt")));
  });
}

}  // namespace

TEST_CASE("sharded, local and full state dicts round trip bit for bit", "[checkpoint]") {
  auto world = any_world();
  const fs::path dir = fresh_dir("roundtrip");
  torch::manual_seed(1);
  CkptModel<> a(ResMlp(), world);
  auto opt_a = make_adamw(a, adamw_options());
  for (int i = 0; i < 2; ++i) train_step(a, opt_a, world);

  torch::manual_seed(2);  // different initial values
  CkptModel<> b(ResMlp(), world);
  REQUIRE_FALSE(same_shards(a, b));

  SECTION("sharded") {
    checkpoint::save_state_dict(dir / ("s" + std::to_string(world.rank()) + ".pt"), sharded_state_dict(a.sharded()));
    world.barrier();
    load_files(b, dir, "s", world.size());
    CHECK(same_shards(a, b));
  }
  SECTION("local") {
    checkpoint::save_state_dict(dir / ("l" + std::to_string(world.rank()) + ".pt"), local_state_dict(a.sharded()));
    world.barrier();
    load_files(b, dir, "l", world.size());
    CHECK(same_shards(a, b));
  }
  SECTION("full, on every rank") {
    const StateDict full = full_state_dict(a.sharded(), /*all_ranks=*/true);
    for (const auto& e : full.entries) CHECK(e.is_whole());
    load_model_state_dict(b.sharded(), full);
    CHECK(same_shards(a, b));
    // It is what the module holds when unsharded.
    auto scope = a.full_parameters();
    for (const auto& item : a.module()->named_parameters()) {
      const auto it =
          std::find_if(full.entries.begin(), full.entries.end(), [&](const auto& e) { return e.name == item.key(); });
      REQUIRE(it != full.entries.end());
      CHECK(at::equal(it->data(), item.value()));
    }
  }
  SECTION("full, on rank 0 only") {
    const StateDict full = full_state_dict(a.sharded());
    CHECK(full.entries.empty() == (world.rank() != 0));
  }
  SECTION("optimizer state: the next steps are identical") {
    auto opt_b = make_adamw(b, torch::optim::AdamWOptions(5.0));  // wrong lr: restored from the file
    checkpoint::save_state_dict(dir / ("s" + std::to_string(world.rank()) + ".pt"), sharded_state_dict(a.sharded()));
    checkpoint::save_state_dict(dir / ("o" + std::to_string(world.rank()) + ".pt"),
                                optimizer_state_dict(a.sharded(), opt_a));
    world.barrier();
    load_files(b, dir, "s", world.size());
    load_optimizer_state_dict(b, opt_b, [&](const auto& fn) {
      for (int r = 0; r < world.size(); ++r)
        fn(checkpoint::load_state_dict_file(dir / ("o" + std::to_string(r) + ".pt")));
    });
    CHECK(opt_b.param_groups()[0].options().get_lr() == 1e-2);  // the saved double, as it was
    torch::manual_seed(7);
    const double la = train_step(a, opt_a, world);
    torch::manual_seed(7);
    const double lb = train_step(b, opt_b, world);
    CHECK(la == lb);
    CHECK(same_shards(a, b));
  }
}

TEST_CASE("loading names what does not match", "[checkpoint][errors]") {
  auto world = any_world();
  torch::manual_seed(1);
  CkptModel<> a(ResMlp(), world);
  CkptModel<> wider(ResMlp(20, 28), world);
  const StateDict full = full_state_dict(a.sharded(), true);
  try {
    load_model_state_dict(wider.sharded(), full);
    FAIL("loading a narrower model's state dict succeeded");
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    CHECK_THAT(what, Catch::Contains("'r0.a.weight' has shape [48, 24] in the checkpoint but [56, 28] in the model"));
    CHECK_THAT(what, !Catch::Contains("missing:"));  // a mismatch is not also reported missing
  }
  StateDict partial = full;
  partial.entries.erase(std::remove_if(partial.entries.begin(), partial.entries.end(),
                                       [](const auto& e) { return e.name == "head.bias"; }),
                        partial.entries.end());
  partial.entries.push_back({"extra.weight", {2}, 0, 2, {{"data", at::zeros({2})}}});
  try {
    load_model_state_dict(a.sharded(), partial);
    FAIL("loading an incomplete state dict succeeded");
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    CHECK_THAT(what, Catch::Contains("missing: head.bias"));
    CHECK_THAT(what, Catch::Contains("not in the model: extra.weight"));
  }
}

TEST_CASE("a job of two ranks loads what 1-4 ranks saved, FullShard or HybridShard", "[checkpoint][reshard]") {
  auto world = any_world();
  const fs::path dir = fresh_dir("reshard");
  torch::manual_seed(3);
  const bool hybrid = world.size() == 4;  // 2 replicas x 2 shards
  std::optional<StateDict> reference;
  auto save = [&](auto& model) {
    auto opt = make_adamw(model, adamw_options());
    train_step(model, opt, world);
    checkpoint::save_state_dict(dir / ("s" + std::to_string(world.rank()) + ".pt"),
                                sharded_state_dict(model.sharded()));
    reference = full_state_dict(model.sharded(), true);
  };
  if (hybrid) {
    CkptModel<HybridShard<2>> model(ResMlp(), world);
    save(model);
  } else {
    CkptModel<> model(ResMlp(), world);
    save(model);
  }
  world.barrier();
  // Ranks 0 and 1 form the new job.
  auto pair = world.split(world.rank() < 2 ? 0 : dist::no_color, world.rank(), "pair");
  if (pair) {
    torch::manual_seed(4);
    CkptModel<> loaded(ResMlp(), *pair);
    load_files(loaded, dir, "s", world.size());
    const StateDict got = full_state_dict(loaded.sharded(), true);
    REQUIRE(got.entries.size() == reference->entries.size());
    for (size_t i = 0; i < got.entries.size(); ++i) {
      CHECK(got.entries[i].name == reference->entries[i].name);
      CHECK(at::equal(got.entries[i].data(), reference->entries[i].data()));
    }
  }
  world.barrier();
}

TEST_CASE("the coordinator commits, rotates, and survives a full disk", "[checkpoint][coordinator]") {
  CheckpointRun run("coordinator", 5);
  auto& [world, root, model, opt, extra] = run;
  extra.client.insert("data_position", int64_t{0});

  std::atomic<int> begun{0}, ended{0}, commits{0}, weight_commits{0}, failures{0};
  CheckpointCoordinator ckpt(root, model, {.max_to_keep = 2});
  ckpt.add_monitor({.before_save = [&](int64_t, checkpoint::Component) { ++begun; },
                    .after_save = [&](const SaveEvent& e) { ++ended; },
                    .on_commit = [&](int64_t, bool weights_only) { ++(weights_only ? weight_commits : commits); },
                    .on_failure = [&](int64_t, const std::string&) { ++failures; }});
  for (int64_t step = 1; step <= 3; ++step) {
    train_step(model, opt, world);
    extra.client.insert_or_assign("data_position", step * 12);
    ckpt.save(step, model, opt, extra);
  }
  // The copy runs in the background; the next step's backward waits for it before the optimizer
  // changes the shards, so step 3's files hold step 3's values.
  const StateDict at_step3 = local_state_dict(model.sharded());
  const at::Tensor rng_after_save = at::randn({4});
  CkptModel<> at3(ResMlp(), world);
  load_model_state_dict(at3.sharded(), at_step3);
  train_step(model, opt, world);
  ckpt.wait();
  world.barrier();
  CHECK(begun == 9);
  CHECK(ended == 9);
  if (world.rank() == 0) {
    CHECK(commits == 3);
    CHECK(weight_commits == 3);
    CHECK(ckpt.latest_committed() == 3);
  }
  CHECK(checkpoint::read_iteration_file(root / checkpoint::checkpointed_iteration_file) == 3);
  CHECK(checkpoint::read_iteration_file(root / checkpoint::state_dict_iteration_file) == 3);
  CHECK_FALSE(fs::exists(root / "global_step_1"));  // max_to_keep = 2
  CHECK(fs::exists(root / "global_step_2"));
  const auto record = checkpoint::read_commit_record(checkpoint::step_dir(root, 3));
  REQUIRE(record.has_value());
  CHECK(record->complete);
  CHECK(record->world_size == world.size());
  checkpoint::verify_step(checkpoint::step_dir(root, 3), *record, /*verify_checksums=*/true);

  // Resume into a fresh model: step 3's shards, client state and RNG.
  torch::manual_seed(99);
  CkptModel<> resumed(ResMlp(), world);
  auto opt2 = make_adamw(resumed, adamw_options());
  const auto info = load_checkpoint(resumed, root, opt2);
  REQUIRE(info.has_value());
  CHECK(info->step == 3);
  CHECK(info->extra.client.at("data_position").toInt() == 36);
  CHECK(same_shards(at3, resumed));
  CHECK_FALSE(same_shards(model, resumed));
  CHECK(at::equal(at::randn({4}), rng_after_save));

  // A full disk on the last rank at step 4: nothing commits, nothing older is lost, the cause is told.
  const bool victim = world.rank() == world.size() - 1;
  if (victim) fsdpx::detail::inject_write_error(ENOSPC, 1000);
  train_step(model, opt, world);
  ckpt.save(4, model, opt, extra);
  const std::string error = wait_error(ckpt);
  if (victim) {
    CHECK_THAT(error, Catch::Contains("No space left on device (ENOSPC: the disk is full)"));
    CHECK_THAT(error, Catch::Contains("checkpoint step 4: rank " + std::to_string(world.rank())));
    fsdpx::detail::inject_write_error(0);
  } else if (world.rank() == 0) {
    CHECK_THAT(error, Catch::Contains("checkpoint step 4 was not committed"));
  } else {
    CHECK(error.empty());
  }
  if (world.rank() == 0) CHECK(failures >= 1);
  world.barrier();
  CHECK(checkpoint::read_iteration_file(root / checkpoint::checkpointed_iteration_file) == 3);
  CHECK(checkpoint::find_latest_checkpoint(root) == 3);
  CHECK(fs::exists(root / "global_step_2"));
  CHECK(fs::exists(root / "global_step_3"));

  // The next save works again and rotation clears the failed step's debris.
  train_step(model, opt, world);
  ckpt.save(5, model, opt, extra);
  ckpt.wait();
  world.barrier();
  CHECK(checkpoint::find_latest_checkpoint(root) == 5);
  CHECK_FALSE(fs::exists(root / "global_step_4"));
  CHECK_FALSE(fs::exists(root / "global_step_2"));
  CHECK(fs::exists(root / "global_step_3"));

  // A truncated extra-state file is named as such, even when checksums are not verified.
  const fs::path extra_file =
      checkpoint::step_dir(root, 5) /
      checkpoint::shard_file_name(checkpoint::Component::extra_state, world.size(), world.rank());
  fs::resize_file(extra_file, fs::file_size(extra_file) - 1);
  CkptModel<> again(ResMlp(), world);
  auto opt3 = make_adamw(again, adamw_options());
  CHECK_THROWS_WITH(load_checkpoint(again, root, opt3, {.verify_checksums = false}),
                    Catch::Contains(extra_file.string()) && Catch::Contains("truncated"));
}

TEST_CASE("a run that resumes after a crash commits the steps it saves again from its own files only",
          "[checkpoint][coordinator]") {
  auto world = any_world();
  const fs::path root = fresh_dir("resave");
  const bool last_rank = world.rank() == world.size() - 1;
  // The interrupted run: steps 1-5 committed, but the crash came before latest_checkpointed_iteration
  // moved past 3; step 6 failed on the last rank. Its markers stay behind.
  {
    torch::manual_seed(7);
    CkptModel<> model(ResMlp(), world);
    auto opt = make_adamw(model, adamw_options());
    ExtraState extra;
    CheckpointCoordinator run(root, model);
    for (int64_t step = 1; step <= 5; ++step) {
      train_step(model, opt, world);
      run.save(step, model, opt, extra);
    }
    run.wait();
    if (last_rank) fsdpx::detail::inject_write_error(ENOSPC);
    train_step(model, opt, world);
    run.save(6, model, opt, extra);
    CHECK(wait_error(run).empty() == (world.rank() != 0 && !last_rank));
    fsdpx::detail::inject_write_error(0);
  }
  world.barrier();
  if (world.rank() == 0) fsdpx::detail::write_text_durably(root / checkpoint::checkpointed_iteration_file, "3\n");
  world.barrier();

  // The resumed run trains on other data, so its files differ from the interrupted run's. Its
  // writers are slow: rank 0 polls the markers many times before this run's appear.
  torch::manual_seed(8);
  CkptModel<> model(ResMlp(), world);
  auto opt = make_adamw(model, adamw_options());
  REQUIRE(load_checkpoint(model, root, opt, {.restore_rng = false})->step == 3);
  ExtraState extra;
  CheckpointCoordinator run(root, model, {.max_to_keep = 2});
  run.add_monitor({.before_save = [](int64_t, checkpoint::Component) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }});
  const auto committed_as_saved = [&](int64_t step) {
    const auto record = checkpoint::read_commit_record(checkpoint::step_dir(root, step));
    REQUIRE(record.has_value());
    CHECK(record->complete);
    checkpoint::verify_step(checkpoint::step_dir(root, step), *record, /*verify_checksums=*/true);
    CkptModel<> loaded(ResMlp(), world);
    auto loaded_opt = make_adamw(loaded, adamw_options());
    CHECK(load_checkpoint(loaded, root, loaded_opt, {.step = step})->step == step);
    CHECK(same_shards(loaded, model));
  };
  const auto iteration = [&](const char* file) { return checkpoint::read_iteration_file(root / file); };

  train_step(model, opt, world);
  run.save(4, model, opt, extra);
  run.wait();
  world.barrier();
  CHECK(iteration(checkpoint::checkpointed_iteration_file) == 4);
  CHECK(iteration(checkpoint::state_dict_iteration_file) == 5);  // the interrupted run's step 5 is still committed
  committed_as_saved(4);
  world.barrier();

  // Step 5 is written again: its old commit is withdrawn first, and the weights' iteration file,
  // which named it, falls back to step 4 meanwhile.
  train_step(model, opt, world);
  run.save(5, model, opt, extra);
  if (world.rank() == 0) {
    CHECK(iteration(checkpoint::state_dict_iteration_file) == 4);
    CHECK_FALSE(checkpoint::read_commit_record(checkpoint::step_dir(root, 5)).has_value());
  }
  run.wait();
  world.barrier();
  CHECK(iteration(checkpoint::checkpointed_iteration_file) == 5);
  CHECK(iteration(checkpoint::state_dict_iteration_file) == 5);
  committed_as_saved(5);
  world.barrier();

  // The interrupted run's failure marker of step 6 is not this run's failure.
  train_step(model, opt, world);
  run.save(6, model, opt, extra);
  CHECK_NOTHROW(run.wait());
  world.barrier();
  CHECK(iteration(checkpoint::checkpointed_iteration_file) == 6);
  committed_as_saved(6);
  CHECK_FALSE(fs::exists(root / "global_step_4"));  // max_to_keep = 2
  world.barrier();
}

TEST_CASE("rotation never deletes a step an iteration file names, nor counts or deletes the steps after the newest one",
          "[checkpoint][rotation]") {
  CheckpointRun run("rotation_named", 9);
  auto& [world, root, model, opt, extra] = run;
  {
    CheckpointCoordinator run(root, model);
    for (int64_t step = 1; step <= 5; ++step) run.save(step, model, opt, extra);
    run.wait();
  }
  world.barrier();
  if (world.rank() == 0) {
    // As after a crash: the iteration files lag behind the commit records of steps 4 and 5.
    fsdpx::detail::write_text_durably(root / checkpoint::checkpointed_iteration_file, "2\n");
    fsdpx::detail::write_text_durably(root / checkpoint::state_dict_iteration_file, "3\n");
    checkpoint::rotate_checkpoints(root, {.max_to_keep = 1});
    CHECK_FALSE(fs::exists(root / "global_step_1"));
    for (int step = 2; step <= 5; ++step) CHECK(fs::exists(root / ("global_step_" + std::to_string(step))));
    // A garbled iteration file: what is in use is unknown, so nothing is deleted.
    fsdpx::detail::write_text_durably(root / checkpoint::checkpointed_iteration_file, "two\n");
    checkpoint::rotate_checkpoints(root, {.max_to_keep = 1});
    CHECK(fs::exists(root / "global_step_2"));
  }
  world.barrier();
}

TEST_CASE("rotation keeps leased and newest steps, scans when the iteration file is gone", "[checkpoint][rotation]") {
  CheckpointRun run("rotation", 6);
  auto& [world, root, model, opt, extra] = run;
  {
    CheckpointCoordinator ckpt(root, model, {.max_to_keep = 1});
    ckpt.save(1, model);  // weights only: latest_state_dict_iteration moves, latest_checkpointed does not
    ckpt.wait();
    world.barrier();
    std::optional<checkpoint::CheckpointLease> lease;
    if (world.rank() == 0) lease.emplace(root, 1);
    world.barrier();
    ckpt.save(2, model);
    ckpt.wait();
    world.barrier();
    CHECK(fs::exists(root / "global_step_1"));  // leased
    lease.reset();
    world.barrier();
    ckpt.save(3, model);
    ckpt.wait();
    world.barrier();
  }
  CHECK_FALSE(fs::exists(root / "global_step_1"));
  CHECK_FALSE(fs::exists(root / "global_step_2"));
  CHECK(checkpoint::find_latest_checkpoint(root, /*weights_only=*/true) == 3);
  CHECK_FALSE(checkpoint::find_latest_checkpoint(root).has_value());
  world.barrier();
  if (world.rank() == 0) fs::remove(root / checkpoint::state_dict_iteration_file);
  world.barrier();
  CHECK(checkpoint::find_latest_checkpoint(root, true) == 3);  // found by scanning
  CHECK_THROWS_WITH(checkpoint::CheckpointLease(root, 2), Catch::Contains("not (or no longer) committed"));
  world.barrier();
}

namespace {
/// What `fn` writes to stderr (file descriptor 2), which it still shows.
template <class Fn>
std::string capture_stderr(const fs::path& file, Fn&& fn) {
  std::fflush(stderr);
  const int saved = ::dup(2);
  const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ::dup2(fd, 2);
  ::close(fd);
  try {
    fn();
  } catch (...) {
    std::fflush(stderr);
    ::dup2(saved, 2);
    ::close(saved);
    throw;
  }
  std::fflush(stderr);
  ::dup2(saved, 2);
  ::close(saved);
  const std::string text = fsdpx::detail::read_text(file);
  std::fputs(text.c_str(), stderr);
  return text;
}
}  // namespace

namespace {
/// Holds the last rank's saves until `release` exists (at most a minute), and gives the other ranks
/// a way to wait until their own file of a step is durable: the test orders events by files and
/// barriers, never by sleeps, so a loaded machine cannot reorder them.
struct LateLastRank {
  fs::path release;
  std::promise<void> own_written;
  std::future<void> own_written_future = own_written.get_future();

  void attach(CheckpointCoordinator& ckpt, int rank, int size) {
    CheckpointMonitor monitor;
    if (rank == size - 1) {
      monitor.before_save = [file = release](int64_t, checkpoint::Component) {
        const auto give_up = std::chrono::steady_clock::now() + std::chrono::minutes(1);
        while (!fs::exists(file) && std::chrono::steady_clock::now() < give_up) {
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
      };
    } else {
      monitor.after_save = [this](const SaveEvent&) { own_written.set_value(); };
    }
    ckpt.add_monitor(monitor);
  }
  /// Every rank but the last: returns once this rank's own file is durable.
  void wait_own(int rank, int size) {
    if (rank != size - 1) own_written_future.get();
  }
  void let_go() const { fsdpx::detail::write_text_durably(release, "go\n"); }
};
}  // namespace

TEST_CASE("a coordinator says what it waits for, and teardown after an error abandons commits at once",
          "[checkpoint][failfast]") {
  if (fsdpx::test::world().size() < 2) return;  // needs a rank that is late
  CheckpointRun run("teardown", 7);
  auto& [world, root, model, opt, extra] = run;

  // A wait longer than report_interval says which rank's file it waits for: every other rank's file
  // is durable (barrier) and the last rank's is held until rank 0 has waited several intervals.
  {
    LateLastRank late{root / "release_1"};
    CheckpointCoordinator ckpt(root, model, {.report_interval = std::chrono::milliseconds(100)});
    late.attach(ckpt, world.rank(), world.size());
    ckpt.save(1, model);
    late.wait_own(world.rank(), world.size());
    world.barrier();
    if (world.rank() == 0) {
      std::thread releaser([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(600));
        late.let_go();
      });
      std::string said;
      try {
        said = capture_stderr(root / "rank0_stderr.txt", [&] { ckpt.wait(); });
      } catch (...) {
        releaser.join();
        throw;
      }
      releaser.join();
      CHECK_THAT(said, Catch::Contains("fsdpx: checkpoint (rank 0): still waiting after"));
      CHECK_THAT(said, Catch::Contains(::fsdpx::detail::str("step 1 to commit: waiting for rank ", world.size() - 1,
                                                            "'s model file")));
    } else {
      ckpt.wait();
    }
    world.barrier();
  }
  CHECK(checkpoint::find_latest_checkpoint(root, /*weights_only=*/true) == 1);

  // Rank 0 fails while the last rank's file of step 2 is held: its coordinator, destroyed while the
  // exception propagates, abandons the commit at once instead of waiting up to commit_timeout (the
  // last rank is let go only after rank 0 has caught the exception).
  world.barrier();
  LateLastRank late{root / "release_2"};
  std::chrono::steady_clock::time_point thrown, caught;
  const auto fail_on_rank0 = [&] {
    try {
      CheckpointCoordinator ckpt(root, model, {.commit_timeout = std::chrono::minutes(30)});
      late.attach(ckpt, world.rank(), world.size());
      ckpt.save(2, model);
      late.wait_own(world.rank(), world.size());
      world.barrier();
      if (world.rank() == 0) {
        thrown = std::chrono::steady_clock::now();
        throw std::runtime_error("the trainer failed");
      }
    } catch (const std::runtime_error&) {
      caught = std::chrono::steady_clock::now();
    }
  };
  if (world.rank() == 0) {
    const std::string said = capture_stderr(root / "rank0_teardown.txt", fail_on_rank0);
    late.let_go();
    // Generous: a wait for the held rank would last the minute its hold lasts.
    CHECK(caught - thrown < std::chrono::seconds(20));
    CHECK_THAT(said, Catch::Contains(::fsdpx::detail::str(
                         "fsdpx: checkpoint step 2 was abandoned, not committed: this process is ending after an "
                         "error while it waited for rank ",
                         world.size() - 1, "'s model file")));
  } else {
    fail_on_rank0();
  }
  world.barrier();
  // The last rank's files landed after the teardown; nothing committed them, and step 1 still stands.
  CHECK(fs::exists(checkpoint::step_dir(root, 2) /
                   checkpoint::shard_file_name(checkpoint::Component::model, world.size(), world.size() - 1)));
  CHECK_FALSE(fs::exists(checkpoint::step_dir(root, 2) / checkpoint::config_file));
  CHECK(checkpoint::find_latest_checkpoint(root, /*weights_only=*/true) == 1);
  world.barrier();
}

TEST_CASE("a lease a crashed reader left unreadable or empty pins its step only briefly", "[checkpoint][rotation]") {
  auto world = any_world();
  const fs::path root = fresh_dir("stale_lease");
  if (world.rank() == 0) {
    const fs::path step = root / "global_step_1";
    const fs::path leases = step / ".leases";
    fs::create_directories(leases);
    CHECK_FALSE(checkpoint::is_leased(step));
    // Empty, as a crash between create and write leaves it (and as a temporary file looks mid-write).
    for (const char* name : {"vm-123-0", "vm-123-1.tmp"}) {
      const fs::path lease = leases / name;
      {
        std::ofstream touch(lease);
      }
      CHECK(checkpoint::is_leased(step));  // young: it may be being written
      fs::last_write_time(
          lease, fs::file_time_type::clock::now() - checkpoint::detail::lease_write_grace - std::chrono::seconds(1));
      CHECK_FALSE(checkpoint::is_leased(step));  // old: debris
      fs::remove(lease);
    }
    // A FIFO as a lease is not opened for a blocking read (rotation on rank 0's commit thread would
    // hang in open()): it is unreadable, so it pins only briefly too.
    const fs::path fifo = leases / "vm-123-2";
    REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
    CHECK(checkpoint::is_leased(step));
    fs::last_write_time(
        fifo, fs::file_time_type::clock::now() - checkpoint::detail::lease_write_grace - std::chrono::seconds(1));
    CHECK_FALSE(checkpoint::is_leased(step));
    fs::remove(fifo);
    // A readable lease of a live process of this host pins the step however old it is.
    const fs::path live = leases / "live";
    fsdpx::detail::write_text_durably(live,
                                      ::fsdpx::detail::str(checkpoint::detail::host_name(), " ", ::getpid(), "\n"));
    fs::last_write_time(live, fs::file_time_type::clock::now() - std::chrono::hours(24));
    CHECK(checkpoint::is_leased(step));
  }
  world.barrier();
}

TEST_CASE("a real commit record holds exactly the fields of docs/checkpoint.md", "[checkpoint][coordinator]") {
  CheckpointRun run("spec", 5);
  auto& [world, root, model, opt, extra] = run;
  {
    CheckpointCoordinator ckpt(root, model);
    train_step(model, opt, world);
    ckpt.save(1, model, opt, extra);
    ckpt.wait();
  }
  world.barrier();
  // The spec's example: the first ```json block of the "## Format" section.
  const char* source = std::getenv("FSDPX_SOURCE_DIR");
  REQUIRE(source != nullptr);
  const std::string doc = fsdpx::detail::read_text(fs::path(source) / "docs" / "checkpoint.md");
  const auto section = doc.find("\n## Format");
  REQUIRE(section != std::string::npos);
  const auto begin = doc.find("```json\n", section);
  const auto end = doc.find("```", begin + 8);
  REQUIRE((begin != std::string::npos && end != std::string::npos));
  const auto spec = fsdpx::detail::parse_json(doc.substr(begin + 8, end - begin - 8), "docs/checkpoint.md's example");
  const auto real = fsdpx::detail::parse_json(
      fsdpx::detail::read_text(checkpoint::step_dir(root, 1) / checkpoint::config_file), "the commit record");
  const auto keys = [](const fsdpx::detail::Json& j) {
    std::set<std::string> k;
    for (const auto& [key, v] : j.items()) k.insert(key);
    return k;
  };
  CHECK(keys(real) == keys(spec));
  CHECK(keys(real["mesh"]) == keys(spec["mesh"]));
  CHECK(keys(real["files"].begin().value()) == keys(spec["files"].begin().value()));
  for (const auto& [key, v] : spec.items()) {
    INFO(key);
    CHECK(real[key].type() == v.type());  // the same JSON types (numbers as integers)
  }
  CHECK(real["components"] == spec["components"]);
  CHECK(real["files"].size() == static_cast<size_t>(3 * world.size()));  // model, optim and extra_state of every rank
}

namespace {
/// Blocks with BatchNorm (running statistics and an int64 counter) and a root buffer (a router bias).
using fsdpx::test::BnBlock;
using fsdpx::test::BnBlockImpl;

struct BnNetImpl : torch::nn::Module {
  BnNetImpl() {
    stem = register_module("stem", torch::nn::Linear(20, 16));
    b0 = register_module("b0", BnBlock(16));
    b1 = register_module("b1", BnBlock(16));
    head = register_module("head", torch::nn::Linear(16, 5));
    router_bias = register_buffer("router_bias", at::zeros({16}));
  }
  at::Tensor forward(const at::Tensor& x, const at::Tensor& y) {
    auto h = stem(x) + router_bias;
    h = fsdpx::forward(b0, h);
    h = fsdpx::forward(b1, h);
    {
      at::NoGradGuard no_grad;
      router_bias.add_(0.25);  // a buffer the model updates itself (DeepSeek's e_score_correction_bias)
    }
    return torch::nn::functional::cross_entropy(head(h), y);
  }
  torch::nn::Linear stem{nullptr}, head{nullptr};
  BnBlock b0{nullptr}, b1{nullptr};
  at::Tensor router_bias;
};
TORCH_MODULE(BnNet);
using BnModel = Fsdp<BnNet, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<BnBlockImpl>>;

/// Every buffer of `b` equal to `a`'s, bit for bit, dtype included.
void require_same_buffers(BnModel& a, BnModel& b) {
  auto want = a.module()->named_buffers();
  const auto got = b.module()->named_buffers();
  REQUIRE(got.size() == 7);  // router_bias, and per block running_mean, running_var, num_batches_tracked
  for (const auto& item : got) {
    INFO(item.key());
    REQUIRE(item.value().scalar_type() == want[item.key()].scalar_type());
    REQUIRE(at::equal(item.value(), want[item.key()]));
  }
}
}  // namespace

TEST_CASE("buffers (BatchNorm statistics, a counter, a router bias) are in every state dict kind",
          "[checkpoint][buffers]") {
  auto world = any_world();
  const fs::path dir = fresh_dir("buffers");
  torch::manual_seed(1);
  BnModel a(BnNet(), world);
  auto opt_a = make_adamw(a, adamw_options());
  for (int i = 0; i < 2; ++i) train_step(a, opt_a, world);
  REQUIRE(a.module()->b0->bn->num_batches_tracked.item<int64_t>() == 2);
  // The statistics are each rank's own batch's (as with DDP without buffer broadcast); state dicts
  // take world rank 0's, so make every rank hold those, and check what comes back.
  for (auto& item : a.module()->named_buffers()) world.broadcast(item.value(), 0);

  torch::manual_seed(2);
  BnModel b(BnNet(), world);

  SECTION("sharded") {
    const StateDict sd = sharded_state_dict(a.sharded());
    const auto is_buffer = [](const TensorSlice& e) {
      for (const char* b : {"running_mean", "running_var", "num_batches_tracked", "router_bias"}) {
        if (e.name.ends_with(b)) return true;
      }
      return false;
    };
    const auto n = std::count_if(sd.entries.begin(), sd.entries.end(), is_buffer);
    CHECK(n == (world.rank() == 0 ? 7 : 0));  // buffers once, in world rank 0's file
    checkpoint::save_state_dict(dir / ("s" + std::to_string(world.rank()) + ".pt"), sd);
    // The same files under their checkpoint names, for fsdpx-merge's reader.
    checkpoint::save_state_dict(
        dir / checkpoint::shard_file_name(checkpoint::Component::model, world.size(), world.rank()), sd);
    world.barrier();
    load_files(b, dir, "s", world.size());
    CHECK(same_shards(a, b));
    require_same_buffers(a, b);
    if (world.rank() == 0) {  // the merge carries the buffers, integers kept integers
      checkpoint::MergeOptions options;
      options.warn = [](const std::string&) {};  // no commit record here: merge warns, as it should
      const auto merged = checkpoint::merge_checkpoint(dir, options);
      auto want = a.module()->named_buffers();
      int buffers = 0;
      for (const auto& [name, t] : merged) {
        if (want.find(name) == nullptr) continue;
        ++buffers;
        INFO(name);
        CHECK(t.scalar_type() == want[name].scalar_type());
        CHECK(at::equal(t, want[name]));
      }
      CHECK(buffers == 7);
    }
    world.barrier();
  }
  SECTION("local") {
    checkpoint::save_state_dict(dir / ("l" + std::to_string(world.rank()) + ".pt"), local_state_dict(a.sharded()));
    world.barrier();
    load_files(b, dir, "l", world.size());
    CHECK(same_shards(a, b));
    require_same_buffers(a, b);
  }
  SECTION("full") {
    load_model_state_dict(b.sharded(), full_state_dict(a.sharded(), /*all_ranks=*/true));
    CHECK(same_shards(a, b));
    require_same_buffers(a, b);
  }
  SECTION("a state dict without the buffers is refused, naming them") {
    StateDict sd = full_state_dict(a.sharded(), /*all_ranks=*/true);
    std::erase_if(sd.entries, [](const auto& e) { return e.name == "b1.bn.running_var"; });
    REQUIRE_THROWS_WITH(load_model_state_dict(b.sharded(), sd),
                        Catch::Matchers::Contains("missing: b1.bn.running_var"));
  }
}

namespace {

/// A ResMlp seeded alike everywhere, with the parameters whose names start with one of `frozen` frozen.
ResMlp frozen_mlp(uint64_t seed, const std::vector<std::string>& frozen) {
  torch::manual_seed(seed);
  ResMlp m;
  for (auto& p : m->named_parameters()) {
    for (const auto& prefix : frozen) {
      if (p.key().rfind(prefix, 0) == 0) p.value().set_requires_grad(false);
    }
  }
  return m;
}

/// `dir`'s model and optimizer files (saved by `saved_world` ranks) resumed into a model over `comm` with
/// `frozen` frozen, then one training step; and the gradients an unsharded copy of the resumed weights
/// computes on that step's batch (the scale that step's rounding is relative to).
struct ResumedStep {
  CkptModel<> model;
  torch::optim::AdamW opt;
  std::map<std::string, at::Tensor> reference_gradients;

  ResumedStep(const fs::path& dir, int saved_world, dist::AnyCommunicator& comm, const std::vector<std::string>& frozen)
      : model(frozen_mlp(5, frozen), comm), opt(make_adamw(model, adamw_options())) {
    load_files(model, dir, "m", saved_world);
    load_optimizer_state_dict(model, opt, [&](const auto& fn) {
      for (int r = 0; r < saved_world; ++r)
        fn(checkpoint::load_state_dict_file(dir / ("o" + std::to_string(r) + ".pt")));
    });
    ResMlp copy = frozen_mlp(5, frozen);
    {
      at::NoGradGuard no_grad;
      auto params = copy->named_parameters();
      for (const auto& e : full_state_dict(model.sharded(), true).entries) params[e.name].copy_(e.data());
    }
    torch::manual_seed(6);
    const auto batch = StepBatch::draw();
    copy->forward(batch.x, batch.y).backward();
    reference_gradients = named_gradients(*copy);
    torch::manual_seed(6);
    train_step(model, opt, comm);
  }

  /// This run's step against `other`'s (the same resumed state at another world size): every updated
  /// weight within AdamW's sensitivity to the two runs' gradients, each within the rounding bound of the
  /// unsharded copy's (so within twice it of each other); frozen ones unchanged.
  void check_against(const StateDict& other) {
    auto bounds = step_bounds(res_mlp_path(), StepBatch::rows);
    bounds.gradient *= 2;
    StepParity parity(bounds);
    parity.note_reference_gradients(model.sharded(), reference_gradients, false);
    std::map<std::string, at::Tensor> want;
    for (const auto& e : other.entries) want[e.name] = e.data();
    parity.check_step(opt, model.sharded(), want);
    INFO(parity.summary());
    CHECK(parity.holds());
  }
};

}  // namespace

TEST_CASE(
    "resuming with other parameters frozen restores the optimizer exactly at every world size, or says what changed",
    "[checkpoint][reshard][errors]") {
  auto world = any_world();
  // Saved with the block r1 and the head frozen; each resume trains one step.
  const fs::path dir = fresh_dir("refreeze");
  {
    CkptModel<> model(frozen_mlp(4, {"r1.", "head."}), world);
    auto opt = make_adamw(model, adamw_options());
    torch::manual_seed(5);
    for (int i = 0; i < 2; ++i) train_step(model, opt, world);
    checkpoint::save_state_dict(dir / ("m" + std::to_string(world.rank()) + ".pt"),
                                sharded_state_dict(model.sharded()));
    checkpoint::save_state_dict(dir / ("o" + std::to_string(world.rank()) + ".pt"),
                                optimizer_state_dict(model.sharded(), opt));
  }
  world.barrier();
  auto pair = world.split(world.rank() < 2 ? 0 : dist::no_color, world.rank(), "pair");
  SECTION("a whole unit trained now that was frozen: it starts afresh, alike at every world size") {
    // r1 trained now (its unit had no state); the head still frozen. A fresh Adam state's first step
    // (about lr times the gradient's sign) is where AdamW amplifies rounding most: the bound follows it.
    ResumedStep here(dir, world.size(), world, {"head."});
    const StateDict here_state = full_state_dict(here.model.sharded(), true);
    if (pair) {
      ResumedStep two(dir, world.size(), *pair, {"head."});
      REQUIRE(full_state_dict(two.model.sharded(), true).entries.size() == here_state.entries.size());
      two.check_against(here_state);
    }
  }
  SECTION("parameters frozen now that had state: their state is dropped, alike at every world size") {
    ResumedStep here(dir, world.size(), world, {"r1.", "head.", "r2."});
    const StateDict here_state = full_state_dict(here.model.sharded(), true);
    if (pair) {
      ResumedStep two(dir, world.size(), *pair, {"r1.", "head.", "r2."});
      two.check_against(here_state);
    }
  }
  SECTION("a parameter trained now beside others that had state (one optimizer state for both): refused, naming it") {
    // The head joins the root unit's trained parameters (the stem), whose state was saved without it.
    for (auto* comm : {&world, pair ? &*pair : nullptr}) {
      if (comm == nullptr) continue;
      try {
        ResumedStep(dir, world.size(), *comm, {"r1."});
        FAIL("the optimizer state loaded");
      } catch (const Error& e) {
        CHECK_THAT(e.what(), Catch::Contains("head.weight") && Catch::Contains("stem.weight") &&
                                 Catch::Contains("frozen when the optimizer state was saved"));
      }
    }
  }
  world.barrier();
}

TEST_CASE("resuming another model's checkpoint root names the model, not a part it happens to lack",
          "[checkpoint][errors]") {
  auto world = any_world();
  const fs::path root = fresh_dir("other_model");
  {  // saved by "another program": 3 blocks, no scheduler
    torch::manual_seed(9);
    CkptModel<> model(ResMlp(20, 24, 3), world);
    auto opt = make_adamw(model, adamw_options());
    train_step(model, opt, world);
    CheckpointCoordinator ckpt(root, model);
    ExtraState extra;
    ckpt.save(1, model, opt, extra);
    ckpt.wait();
  }
  world.barrier();
  CkptModel<> other(ResMlp(20, 24, 2), world);  // this program's model: 2 blocks, and a scheduler
  auto opt = make_adamw(other, adamw_options());
  LrScheduler scheduler(opt, LrSchedule::constant());
  CHECK_THROWS_WITH(load_checkpoint(other, root, opt, scheduler),
                    Catch::Contains("holds another model than this one") && Catch::Contains("r2.") &&
                        !Catch::Contains("has no scheduler"));
  world.barrier();
}

TEST_CASE("at the saving topology, a layout changed by freezing restores the optimizer from every file, never zeros",
          "[checkpoint][reshard]") {
  auto world = any_world();
  const fs::path root = fresh_dir("relayout");
  {  // saved with everything trained: the root unit's flat holds the stem and the head
    CkptModel<> model(frozen_mlp(4, {}), world);
    auto opt = make_adamw(model, adamw_options());
    torch::manual_seed(5);
    for (int i = 0; i < 2; ++i) train_step(model, opt, world);
    CheckpointCoordinator ckpt(root, model);
    ExtraState extra;
    ckpt.save(2, model, opt, extra);
    ckpt.wait();
  }
  world.barrier();
  // The head frozen now: the root's trained flat is the stem alone, so each rank's shard covers other
  // ranges than its saved file. load_checkpoint (its own file first) must equal reading every file.
  const auto next_step = [&](bool through_load_checkpoint) {
    CkptModel<> model(frozen_mlp(9, {"head."}), world);
    auto opt = make_adamw(model, adamw_options());
    if (through_load_checkpoint) {
      REQUIRE(load_checkpoint(model, root, opt, {.restore_rng = false})->step == 2);
    } else {
      const fs::path dir = checkpoint::step_dir(root, 2);
      const auto record = checkpoint::read_commit_record(dir);
      REQUIRE(record);
      const auto every_file = [&](checkpoint::Component c) {
        return [&, c](const std::function<void(const StateDict&)>& fn) {
          for (int r = 0; r < record->world_size; ++r) {
            const std::string name = checkpoint::shard_file_name(c, record->world_size, r);
            fn(checkpoint::load_shard_file(dir, name, record->file(dir, name, true)));
          }
        };
      };
      load_model_state_dict(model, every_file(checkpoint::Component::model));
      load_optimizer_state_dict(model, opt, every_file(checkpoint::Component::optim));
    }
    torch::manual_seed(6);
    train_step(model, opt, world);
    return full_state_dict(model.sharded(), true);
  };
  const StateDict own = next_step(true), every = next_step(false);
  REQUIRE(own.entries.size() == every.entries.size());
  for (size_t i = 0; i < own.entries.size(); ++i) {
    INFO(own.entries[i].name);
    CHECK(at::equal(own.entries[i].data(), every.entries[i].data()));
  }
  world.barrier();
}

TEST_CASE("dcp writer: what each rank wrote reaches rank 0 whole, and an entry saved twice is refused", "[dcp]") {
  namespace w = dcp::detail;
  using Step = dcp::PathStep;
  w::RankData r0;
  r0.relative_path = "__0_0.distcp";
  r0.tensors.push_back({"state.w.exp_avg", c10::kFloat, {2, 3}, {Step("state"), Step("w"), Step("exp_avg")}});
  r0.pieces.push_back({"state.w.exp_avg", dcp::Chunk{{0, 0}, {1, 3}}, 0, 100});
  r0.bytes.push_back({"param_groups.0.lr", {Step("param_groups"), Step(int64_t{0}), Step("lr")}, 100, 50});
  w::RankData r1;
  r1.relative_path = "__1_0.distcp";
  r1.tensors.push_back(r0.tensors.front());
  r1.pieces.push_back({"state.w.exp_avg", dcp::Chunk{{1, 0}, {1, 3}}, 0, 90});
  const w::RankData back = w::decode_rank_data(w::encode_rank_data(r0), 0);
  CHECK(back.relative_path == r0.relative_path);
  REQUIRE(back.tensors.size() == 1);
  CHECK((back.tensors[0].path == r0.tensors[0].path));
  REQUIRE(back.bytes.size() == 1);
  CHECK((back.bytes[0].path == r0.bytes[0].path));  // the group index stays an int, the keys strings
  CHECK(std::holds_alternative<int64_t>(back.bytes[0].path[1]));
  CHECK((back.bytes[0].offset == 100 && back.bytes[0].length == 50));

  const std::vector<w::RankData> ranks{back, w::decode_rank_data(w::encode_rank_data(r1), 1)};
  const dcp::Metadata md = w::make_metadata(ranks);
  const auto& t = std::get<dcp::TensorEntry>(md.entries.at("state.w.exp_avg"));
  CHECK(t.chunks.size() == 2);
  CHECK(std::holds_alternative<dcp::BytesEntry>(md.entries.at("param_groups.0.lr")));
  CHECK(md.storage.at({"param_groups.0.lr", std::nullopt}).offset == 100);
  CHECK((md.planner_data->at("state.w.exp_avg") == r0.tensors[0].path));
  CHECK((md.planner_data->at("param_groups.0.lr") == r0.bytes[0].path));
  CHECK((dcp::parse_metadata(dcp::serialize_metadata(md)) == md));

  std::vector<w::RankData> twice = ranks;
  twice[1].bytes = twice[0].bytes;
  CHECK_THROWS_WITH(w::make_metadata(twice), Catch::Contains("'param_groups.0.lr' is saved twice"));
  twice = ranks;
  twice[1].tensors[0].size = {3, 2};
  CHECK_THROWS_WITH(w::make_metadata(twice), Catch::Contains("the ranks disagree on 'state.w.exp_avg'"));
  CHECK_THROWS_WITH(w::decode_rank_data("{\"path\": 3}", 1), Catch::Contains("what rank 1 wrote cannot be read"));
}

TEST_CASE("an earlier run's commit of a step is gone before any rank replaces a file of the step",
          "[checkpoint][coordinator][dcp]") {
  auto world = any_world();
  // The earlier run's format and this one's: DCP's .metadata goes too when this run writes fsdpx's format.
  for (const auto& [earlier, format] : {std::pair{CheckpointFormat::fsdpx, CheckpointFormat::fsdpx},
                                        std::pair{CheckpointFormat::dcp, CheckpointFormat::dcp},
                                        std::pair{CheckpointFormat::dcp, CheckpointFormat::fsdpx}}) {
    const fs::path root =
        fresh_dir(std::string("rewrite_") + checkpoint::to_string(earlier) + "_" + checkpoint::to_string(format));
    const fs::path dir = checkpoint::step_dir(root, 2);
    torch::manual_seed(11);
    CkptModel<> model(ResMlp(), world);
    auto opt = make_adamw(model, adamw_options());
    ExtraState extra;
    {  // the earlier run: step 2 committed (and, in DCP, its .metadata written)
      CheckpointCoordinator run(root, model, {.format = earlier});
      for (int64_t step = 1; step <= 2; ++step) {
        train_step(model, opt, world);
        run.save(step, model, opt, extra);
      }
      run.wait();
    }
    world.barrier();
    REQUIRE(fs::exists(dir / checkpoint::config_file));
    CHECK(fs::exists(dir / dcp::metadata_file_name) == (earlier == CheckpointFormat::dcp));

    // This run saves step 2 again; rank 0, which withdraws the earlier commit, comes late. No rank may start a
    // file of the step while that commit is there: a reader would take the new files for the old commit's.
    // The earlier run's files are told from this run's (whose weights commit may be there before a rank's
    // later components start) by inode, held open so that no new file can reuse one.
    std::vector<std::pair<int, struct stat>> earlier_files;
    for (const fs::path& file : {dir / checkpoint::config_file, dir / dcp::metadata_file_name,
                                 dir / "optim_states" / dcp::metadata_file_name}) {
      const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
      struct stat st{};
      if (fd >= 0 && ::fstat(fd, &st) == 0) earlier_files.emplace_back(fd, st);
    }
    REQUIRE(!earlier_files.empty());
    CheckpointCoordinator run(root, model, {.format = format});
    std::atomic<int> stale_seen{0};
    run.add_monitor({.before_save = [&](int64_t, checkpoint::Component) {
      for (const fs::path& file : {dir / checkpoint::config_file, dir / dcp::metadata_file_name,
                                   dir / "optim_states" / dcp::metadata_file_name}) {
        struct stat st{};
        if (::stat(file.c_str(), &st) != 0) continue;
        for (const auto& [fd, earlier] : earlier_files) {
          if (st.st_dev == earlier.st_dev && st.st_ino == earlier.st_ino) ++stale_seen;
        }
      }
    }});
    train_step(model, opt, world);
    if (world.rank() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(400));
    run.save(2, model, opt, extra);
    run.wait();
    world.barrier();
    for (const auto& [fd, earlier] : earlier_files) ::close(fd);
    INFO(checkpoint::to_string(earlier) << " then " << checkpoint::to_string(format));
    CHECK(stale_seen.load() == 0);
    CHECK(fs::exists(dir / dcp::metadata_file_name) == (format == CheckpointFormat::dcp));
    CHECK(fs::exists(dir / "optim_states" / dcp::metadata_file_name) == (format == CheckpointFormat::dcp));
    const auto record = checkpoint::read_commit_record(dir);
    REQUIRE(record.has_value());
    CHECK(record->complete);
    CHECK(record->files_format == format);
    CkptModel<> loaded(ResMlp(), world);
    auto loaded_opt = make_adamw(loaded, adamw_options());
    CHECK(load_checkpoint(loaded, root, loaded_opt, {.step = 2, .restore_rng = false})->step == 2);
    CHECK(same_shards(loaded, model));
    world.barrier();
  }
}

TEST_CASE("a DCP root whose tensors are saved stacked resumes their optimizer state through load_checkpoint",
          "[checkpoint][dcp]") {
  auto world = any_world();
  const fs::path root = fresh_dir("dcp_stacked");
  // The blocks' first projections saved as one tensor, as transformers 5 stacks a mixture's experts.
  const auto stacked = [](const std::string& name) -> std::optional<Placement> {
    for (int64_t i = 0; i < 3; ++i) {
      if (name == "r" + std::to_string(i) + ".a.weight") return Placement{"stacked.a.weight", {3, 48, 24}, i * 48 * 24};
    }
    return std::nullopt;
  };
  torch::manual_seed(41);
  CkptModel<> model(ResMlp(), world);
  auto opt = make_adamw(model, adamw_options());
  for (int i = 0; i < 2; ++i) train_step(model, opt, world);
  {
    CheckpointCoordinator run(root, model, {.format = CheckpointFormat::dcp, .dcp_names = {.placed_in = stacked}});
    ExtraState extra;
    run.save(2, model, opt, extra);
    run.wait();
  }
  world.barrier();
  const dcp::Reader saved(checkpoint::step_dir(root, 2) / "optim_states");
  CHECK(saved.find_tensor("state.stacked.a.weight.exp_avg") != nullptr);
  CHECK(saved.find_tensor("state.r0.a.weight.exp_avg") == nullptr);

  torch::manual_seed(42);
  CkptModel<> resumed(ResMlp(), world);
  auto resumed_opt = make_adamw(resumed, adamw_options());
  REQUIRE(load_checkpoint(resumed, root, resumed_opt, {.restore_rng = false, .dcp = {.placed_in = stacked}})->step ==
          2);
  CHECK(same_shards(resumed, model));
  // The moments came back with the weights: the next step is the same, bit for bit.
  torch::manual_seed(43);
  train_step(model, opt, world);
  torch::manual_seed(43);
  train_step(resumed, resumed_opt, world);
  CHECK(same_shards(resumed, model));
  world.barrier();
}

TEST_CASE("a DCP-format root's files are checked against their commit record on resume and merge",
          "[checkpoint][dcp][security]") {
  auto world = any_world();
  const fs::path root = fresh_dir("dcp_checked");
  torch::manual_seed(47);
  CkptModel<> model(ResMlp(), world);
  auto opt = make_adamw(model, adamw_options());
  train_step(model, opt, world);
  {
    CheckpointCoordinator run(root, model, {.format = CheckpointFormat::dcp});
    ExtraState extra;
    run.save(2, model, opt, extra);
    run.wait();
  }
  world.barrier();
  const fs::path dir = checkpoint::step_dir(root, 2);
  // One bit of each rank's model data file flipped in the middle, where it still parses: each rank reads its own.
  const fs::path mine = dir / ("__" + std::to_string(world.rank()) + "_0.distcp");
  {
    std::fstream f(mine, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(0, std::ios::end);
    const auto middle = static_cast<std::streamoff>(f.tellg()) / 2;
    char byte = 0;
    f.seekg(middle);
    f.read(&byte, 1);
    byte = static_cast<char>(byte ^ 0x10);
    f.seekp(middle);
    f.write(&byte, 1);
  }
  world.barrier();
  CkptModel<> resumed(ResMlp(), world);
  auto resumed_opt = make_adamw(resumed, adamw_options());
  CHECK_THROWS_WITH(load_checkpoint(resumed, root, resumed_opt, {.restore_rng = false}),
                    Catch::Contains(mine.string()) && Catch::Contains("is corrupt: its CRC-32C is"));
  const fs::path copy = fresh_dir("dcp_checked_copy");
  if (world.rank() == 0) {
    CHECK_THROWS_WITH(checkpoint::merge_checkpoint(dir), Catch::Contains("is corrupt: its CRC-32C is"));
    // without the check, as a user may ask (MergeOptions::verify_checksums), the flipped bit is read as whatever
    // it makes: values that parse, or a refusal of what does not
    try {
      checkpoint::merge_checkpoint(dir, {.verify_checksums = false});
    } catch (const IoError& e) {
      CHECK(std::string(e.what()).find("CRC-32C") == std::string::npos);
    }
    // a data file that is a link out of the folder, and a file the record does not list
    fs::copy(dir, copy / "step", fs::copy_options::recursive);
    fs::rename(copy / "step" / "__0_0.distcp", copy / "outside.distcp");
    fs::create_symlink(copy / "outside.distcp", copy / "step" / "__0_0.distcp");
    CHECK_THROWS_WITH(dcp::Reader(copy / "step"), Catch::Contains("is a symbolic link"));
    CHECK_THROWS_WITH(checkpoint::merge_checkpoint(copy / "step"), Catch::Contains("is a symbolic link"));
  }
  world.barrier();
}

TEST_CASE("a resume says what it found and never silently starts over", "[checkpoint][resume][errors]") {
  auto world = any_world();
  const fs::path base = fresh_dir("what_resume_found");
  const bool rank0 = world.rank() == 0;
  torch::manual_seed(51);
  CkptModel<> model(ResMlp(), world);
  auto opt = make_adamw(model, adamw_options());
  const fs::path log = base / ("stderr_" + std::to_string(world.rank()) + ".txt");
  const auto resume_from = [&](const fs::path& root, std::optional<ResumeInfo>& info) {
    return capture_stderr(log, [&] { info = load_checkpoint(model, root, opt); });
  };
  std::optional<ResumeInfo> info;

  // No root yet, or an empty one: the first launch of an "always --resume" job. One line on rank 0.
  std::string said = resume_from(base / "not_there", info);
  CHECK_FALSE(info.has_value());
  CHECK((said.find("does not exist yet: starting from scratch") != std::string::npos) == rank0);
  if (rank0) fs::create_directories(base / "empty");
  world.barrier();
  said = resume_from(base / "empty", info);
  CHECK_FALSE(info.has_value());
  CHECK((said.find("is empty: starting from scratch") != std::string::npos) == rank0);

  // A folder of other files: the wrong path. An error naming what is there, on every rank.
  if (rank0) {
    fs::create_directories(base / "junk" / "logs");
    fsdpx::detail::write_text_durably(base / "junk" / "notes.txt", "not a checkpoint\n");
  }
  world.barrier();
  CHECK_THROWS_WITH(load_checkpoint(model, base / "junk", opt), Catch::Contains("holds no fsdpx checkpoint") &&
                                                                    Catch::Contains("logs, notes.txt") &&
                                                                    Catch::Contains("give the checkpoint root"));

  // A committed root, and its step folder (what fsdpx-merge takes): both resume the step.
  const fs::path root = base / "root";
  train_step(model, opt, world);
  {
    CheckpointCoordinator run(root, model);
    ExtraState extra;
    run.save(3, model, opt, extra);
    run.wait();
  }
  world.barrier();
  CkptModel<> other(ResMlp(), world);
  auto other_opt = make_adamw(other, adamw_options());
  REQUIRE(load_checkpoint(other, root, other_opt, {.restore_rng = false})->step == 3);
  CHECK(same_shards(other, model));
  for (const fs::path& step_folder : {root / "global_step_3", root / "global_step_3" / "actor"}) {
    INFO(step_folder.string());
    CkptModel<> again(ResMlp(), world);
    auto again_opt = make_adamw(again, adamw_options());
    said = capture_stderr(log, [&] { info = load_checkpoint(again, step_folder, again_opt, {.restore_rng = false}); });
    REQUIRE(info.has_value());
    CHECK(info->step == 3);
    CHECK(same_shards(again, model));
    CHECK((said.find("is step 3 of the checkpoint root") != std::string::npos) == rank0);
    CHECK_THROWS_WITH(load_checkpoint(again, step_folder, again_opt, {.step = 2}),
                      Catch::Contains("is the folder of step 3, but LoadOptions::step is 2"));
  }

  // A root whose only step is not committed (a crash in the first save): fresh, and said.
  if (rank0) fs::create_directories(base / "crashed" / "global_step_10" / "actor");
  world.barrier();
  said = resume_from(base / "crashed", info);
  CHECK_FALSE(info.has_value());
  CHECK((said.find("has no committed step yet (global_step_10): starting from scratch") != std::string::npos) == rank0);

  // A commit record that cannot be read: a damaged root, not an empty one.
  if (rank0) {
    fs::create_directories(base / "damaged" / "global_step_5" / "actor");
    fsdpx::detail::write_text_durably(base / "damaged" / "global_step_5" / "actor" / checkpoint::config_file, "{");
  }
  world.barrier();
  CHECK_THROWS_WITH(load_checkpoint(model, base / "damaged", opt),
                    Catch::Contains((base / "damaged" / "global_step_5" / "actor" / checkpoint::config_file).string()));
  world.barrier();
}
