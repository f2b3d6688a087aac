// Checkpoint-based weight sync under mpiexec: world ranks [0, N-1) train a sharded model and save its
// weights at every step with CheckpointCoordinator (weights only, every fourth step with the
// optimizer state too, so the commit record is rewritten; at most 2 steps kept, so old steps are
// rotated away while the watcher may be reading them). The last rank is a rollout that only follows
// the checkpoint root with a CheckpointWatcher: it shares no communicator with the trainers (it took
// part only in the world's split and in the barriers around the run).
//
// Trainer rank 0 writes the full parameters of every step (gathered with the sync's own
// gather_full_state_dict, not through the checkpoint) to a side file before saving the step. Every
// version the watcher returns must equal the side file of its step bit for bit, also once loaded into
// a module, and versions must increase; the watcher ends once it has the trainer's last step.
#include <catch2/catch.hpp>

#include <chrono>
#include <filesystem>
#include <optional>
#include <string>
#include <thread>

#include <ATen/ATen.h>

#include <fsdpx/checkpoint.hpp>
#include <fsdpx/fsdp.hpp>
#include <fsdpx/sync.hpp>

#include "../checkpoint/checkpoint_common.hpp"
#include "../support/mpi_world.hpp"
#include "../support/bit_equal.hpp"

using namespace fsdpx;
using namespace fsdpx::sync;
using namespace std::chrono_literals;
namespace fs = std::filesystem;
namespace ckpt = fsdpx::checkpoint;

namespace {

using fsdpx::test::bit_equal;

struct Job {
  dist::AnyCommunicator world;
  std::optional<dist::AnyCommunicator> trainer;  // on trainer ranks only
  fs::path root, side;
};

/// Collective over the world: the split, and a fresh scratch directory.
Job start(const std::string& name) {
  dist::AnyCommunicator world(test::world());
  REQUIRE(world.size() >= 2);
  const bool is_trainer = world.rank() < world.size() - 1;
  auto role = world.split(is_trainer ? 0 : 1, world.rank(), is_trainer ? "trainer" : "watcher");
  Job job{world, std::nullopt, test::scratch_dir(name) / "ckpt", test::scratch_dir(name) / "side"};
  if (is_trainer) job.trainer = std::move(role);  // the watcher drops its own at once
  if (world.rank() == 0) {
    fs::remove_all(test::scratch_dir(name));
    fs::create_directories(job.side);
  }
  world.barrier();
  return job;
}

fs::path side_file(const fs::path& side, int64_t step) { return side / ("step_" + std::to_string(step) + ".pt"); }
const fs::path done_file = "trainer_done.txt";

/// Trains `steps` steps, saving each; rank 0 writes the side file of a step before saving it.
void train(Job& job, int steps, bool announce_end) {
  auto& comm = *job.trainer;
  at::manual_seed(1);  // the same model and data on every trainer rank
  test::CkptModel<> model(test::ResMlp(), comm);
  auto optimizer = make_adamw(model, test::adamw_options());
  CheckpointCoordinator coordinator(job.root, model, {.max_to_keep = 2, .poll_interval = 2ms});
  for (int step = 1; step <= steps; ++step) {
    test::train_step(model, optimizer, comm);
    const auto full = gather_full_state_dict(model, comm.rank() == 0, {.dtype = at::kFloat});
    if (comm.rank() == 0) {
      auto dict = ckpt::detail::new_dict();
      for (const auto& t : full) dict.insert(t.name, t.tensor);
      ckpt::detail::save_ivalue(side_file(job.side, step), dict);
    }
    if (step % 4 == 0) {
      coordinator.save(step, model, &optimizer);
    } else {
      coordinator.save(step, model);
    }
    // The first steps take some time, so the watcher sees them one by one; the later ones come faster
    // than the watcher reads (it dawdles holding its lease), so it skips steps and rotation meets leases.
    if (step <= 8) std::this_thread::sleep_for(15ms);
  }
  coordinator.wait();
  if (comm.rank() == 0 && announce_end) {
    fsdpx::detail::write_text_durably(job.root / done_file, std::to_string(steps) + "\n");
  }
}

}  // namespace

TEST_CASE(
    "a watcher follows a training job's checkpoints: every version is a state the trainer had, bit for bit, "
    "in order",
    "[watcher]") {
  Job job = start("sync_watcher_follow");
  const int steps = 24;
  if (job.trainer) {
    train(job, steps, /*announce_end=*/true);
  } else {
    CheckpointWatcher watcher(job.root,
                              {.poll_interval = 2ms, .timeout = 120s, .on_stage = [](std::string_view stage, int64_t) {
                                 if (stage == "leased") std::this_thread::sleep_for(10ms);
                               }});
    test::ResMlp module;  // different values from the trainer's: every parameter must be overwritten
    int64_t last = no_version;
    std::vector<int64_t> seen;
    const auto check = [&](const WeightVersion& v) {
      INFO("step " << v.version);
      CHECK(v.version > last);
      const auto side = ckpt::detail::load_ivalue(side_file(job.side, v.version)).toGenericDict();
      REQUIRE(static_cast<size_t>(side.size()) == v.tensors.size());
      for (const auto& t : v.tensors) {
        INFO(t.name);
        REQUIRE(side.contains(t.name));
        CHECK(bit_equal(t.tensor, side.at(t.name).toTensor()));
      }
      v.load_into(*module);
      for (const auto& p : module->named_parameters()) {
        INFO("loaded " << p.key());
        CHECK(bit_equal(p.value().detach(), side.at(p.key()).toTensor()));
      }
      last = v.version;
      seen.push_back(v.version);
    };
    check(watcher.wait_newer(no_version));
    std::optional<int64_t> final_step;
    const auto deadline = std::chrono::steady_clock::now() + 180s;
    while (!final_step || last < *final_step) {
      if (!final_step && fs::exists(job.root / done_file)) {
        final_step = ckpt::read_iteration_file(job.root / done_file);
      }
      if (auto v = watcher.poll()) {
        check(*v);
        continue;
      }
      REQUIRE(std::chrono::steady_clock::now() < deadline);
      std::this_thread::sleep_for(2ms);
    }
    CHECK(last == steps);
    CHECK(seen.size() >= 2);
    std::string list;
    for (const int64_t s : seen) list += " " + std::to_string(s);
    std::printf("watcher: %zu versions of %d:%s\n", seen.size(), steps, list.c_str());
    if (!watcher.last_error().empty()) std::printf("watcher: last failed attempt: %s\n", watcher.last_error().c_str());
  }
  job.world.barrier();
}

TEST_CASE("a watcher whose trainer stopped ends in a SyncError naming the root and the last step, not a hang",
          "[watcher]") {
  Job job = start("sync_watcher_lost");
  if (job.trainer) {
    train(job, 2, /*announce_end=*/false);  // then the trainer is gone (as far as the watcher can tell)
  } else {
    CheckpointWatcher watcher(job.root, {.poll_interval = 5ms, .timeout = 60s});
    int64_t have = no_version;
    while (have < 2) have = watcher.wait_newer(have).version;
    const auto t0 = std::chrono::steady_clock::now();
    try {
      watcher.wait_newer(have, 1500ms);
      FAIL("no error");
    } catch (const SyncError& e) {
      std::printf("EXPECTED-ERROR: %s\n", e.what());
      CHECK(std::chrono::steady_clock::now() - t0 < 10s);
      CHECK_THAT(e.what(),
                 Catch::Contains("no committed weights newer than step 2 appeared under the checkpoint root '" +
                                 job.root.string() + "' within 1500 ms") &&
                     Catch::Contains("the last step loaded: 2"));
    }
  }
  job.world.barrier();
}
