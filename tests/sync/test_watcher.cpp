// Single-process tests of checkpoint-based weight sync (CheckpointWatcher): fixtures are checkpoint
// roots written by hand with the checkpoint format's own functions (sharded model files of world
// size 2, fsdp_config.json with sizes and CRC-32C, the iteration file), then changed under the
// watcher's feet: uncommitted steps, files truncated, replaced or rotated away between the
// iteration file's read and the load, iteration files that go backwards, nothing new at all.
#include <catch2/catch.hpp>

#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include <unistd.h>

#include <ATen/ATen.h>
#include <torch/nn.h>

#include <fsdpx/detail/file_io.hpp>
#include <fsdpx/detail/json.hpp>
#include <fsdpx/checkpoint/format.hpp>
#include <fsdpx/checkpoint/layout.hpp>
#include <fsdpx/sync.hpp>

#include "../support/bit_equal.hpp"

using namespace fsdpx;
using namespace fsdpx::sync;
using namespace std::chrono_literals;
namespace fs = std::filesystem;
namespace ckpt = fsdpx::checkpoint;

namespace {

using fsdpx::test::bit_equal;

/// The module the fixtures' weights fit: fc.weight [4, 6], fc.bias [4], scale [5].
struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc = register_module("fc", torch::nn::Linear(6, 4));
    scale = register_parameter("scale", at::zeros({5}));
  }
  torch::nn::Linear fc{nullptr};
  at::Tensor scale;
};
TORCH_MODULE(Net);

/// The weights of `step`, in name order: every element tells the step (and is not a round number).
std::vector<NamedTensor> weights(int64_t step) {
  const auto f = [&](std::vector<int64_t> shape, double base) {
    int64_t n = 1;
    for (const int64_t d : shape) n *= d;
    return (at::arange(n, at::kFloat) * 0.37 + base + step * 1000.0 + 0.1).view(shape);
  };
  return {{"fc.bias", f({4}, 10)}, {"fc.weight", f({4, 6}, 20)}, {"scale", f({5}, 30)}};
}

/// A checkpoint root written by hand, as CheckpointCoordinator would for a trainer of 2 ranks.
struct Root {
  fs::path path;
  static constexpr int world = 2;

  explicit Root(const std::string& name)
      : path(fs::temp_directory_path() / ("fsdpx_watcher_" + std::to_string(::getpid()) + "_" + name)) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~Root() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  fs::path dir(int64_t step) const { return ckpt::step_dir(path, step); }
  fs::path model_file(int64_t step, int rank) const {
    return dir(step) / ckpt::shard_file_name(ckpt::Component::model, world, rank);
  }

  /// Each rank's file holds its half of every flattened tensor (of `values`' step by default).
  std::vector<fsdpx::detail::WrittenFile> write_shards(int64_t step,
                                                       std::optional<int64_t> values = std::nullopt) const {
    fs::create_directories(dir(step));
    std::vector<fsdpx::detail::WrittenFile> files;
    for (int r = 0; r < world; ++r) {
      StateDict sd;
      sd.kind = StateDictKind::sharded;
      sd.world_size = world;
      sd.rank = r;
      for (const auto& t : weights(values.value_or(step))) {
        const int64_t n = t.tensor.numel(), half = (n + 1) / 2;
        const int64_t lo = r == 0 ? 0 : half, hi = r == 0 ? half : n;
        TensorSlice s;
        s.name = t.name;
        s.shape = t.tensor.sizes().vec();
        s.begin = lo;
        s.end = hi;
        s.tensors["data"] = t.tensor.reshape({-1}).narrow(0, lo, hi - lo).clone();
        sd.entries.push_back(std::move(s));
      }
      files.push_back(ckpt::save_state_dict(model_file(step, r), sd));
    }
    return files;
  }
  void commit(int64_t step, const std::vector<fsdpx::detail::WrittenFile>& files,
              std::vector<std::string> components = {"model"}) const {
    using fsdpx::detail::Json;
    Json f = Json::object();
    for (const auto& w : files) f[w.path.filename().string()] = {{"bytes", w.bytes}, {"crc32c", w.crc32c}};
    const Json record = {{"format", "fsdpx"},
                         {"format_version", 1},
                         {"step", step},
                         {"world_size", world},
                         {"state_dict_kind", "sharded"},
                         {"complete", false},
                         {"components", components},
                         {"files", f}};
    fsdpx::detail::write_text_durably(dir(step) / ckpt::config_file, record.dump() + "\n");
  }
  void advance(int64_t step) const {
    fsdpx::detail::write_text_durably(path / ckpt::state_dict_iteration_file, std::to_string(step) + "\n");
  }
  /// A whole save of `step`: shards, then the commit record, then the iteration file.
  void save(int64_t step) const {
    commit(step, write_shards(step));
    advance(step);
  }
};

void require_weights(const WeightVersion& v, int64_t step, at::ScalarType dtype = at::kFloat) {
  REQUIRE(v.version == step);
  const auto expected = weights(step);
  REQUIRE(v.tensors.size() == expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    INFO("step " << step << ", " << expected[i].name);
    REQUIRE(v.tensors[i].name == expected[i].name);
    REQUIRE(bit_equal(v.tensors[i].tensor, expected[i].tensor.to(dtype)));
  }
}

WatcherOptions fast(std::function<void(std::string_view, int64_t)> on_stage = {}) {
  return {.poll_interval = 5ms, .timeout = 2s, .on_stage = std::move(on_stage)};
}

}  // namespace

TEST_CASE("watcher: returns the newest committed step, merged from the shards bit for bit, and loads it by name",
          "[watcher]") {
  Root root("newest");
  CheckpointWatcher watcher(root.path, fast());
  CHECK_FALSE(watcher.poll());  // nothing there yet
  root.save(1);
  root.save(2);
  root.save(3);
  auto v = watcher.poll();
  REQUIRE(v);
  require_weights(*v, 3);  // the newest; 1 and 2 are skipped
  CHECK(watcher.last_step() == 3);
  CHECK_FALSE(watcher.poll());                                // nothing newer
  CHECK_FALSE(ckpt::is_leased(root.path / "global_step_3"));  // the lease ended with the read

  Net net;
  v->load_into(*net);
  CHECK(bit_equal(net->fc->weight.detach(), weights(3)[1].tensor));
  CHECK(bit_equal(net->scale.detach(), weights(3)[2].tensor));

  root.save(4);
  const WeightVersion w = watcher.wait_newer(3, 2s);
  require_weights(w, 4);

  SECTION("a rollout dtype") {
    CheckpointWatcher bf16(root.path, {.poll_interval = 5ms, .dtype = at::kBFloat16});
    require_weights(bf16.wait_newer(no_version, 2s), 4, at::kBFloat16);
  }
  SECTION("the step is leased while it is read") {
    bool leased = false;
    CheckpointWatcher observed(root.path, fast([&](std::string_view stage, int64_t step) {
                                 if (stage == "leased")
                                   leased = ckpt::is_leased(root.path / ("global_step_" + std::to_string(step)));
                               }));
    REQUIRE(observed.poll());
    CHECK(leased);
    CHECK_FALSE(ckpt::is_leased(root.path / "global_step_4"));
  }
}

TEST_CASE("watcher: load_newer_into, the receivers' verb, loads the newest step and verifies the module against it",
          "[watcher]") {
  static_assert(Receiver<CheckpointWatcher>);
  Root root("verb");
  CheckpointWatcher watcher(root.path, fast());
  Net net;
  CHECK_THROWS_WITH(watcher.verify(*net), Catch::Contains("no step was loaded"));
  root.save(1);
  root.save(2);
  CHECK(watcher.load_newer_into(*net, 2s) == 2);
  CHECK(watcher.last_version() == 2);
  CHECK_FALSE(watcher.last_was_delta());
  CHECK(bit_equal(net->fc->weight.detach(), weights(2)[1].tensor));
  watcher.verify(*net);
  {
    at::NoGradGuard no_grad;
    net->scale[0] += 1;
  }
  CHECK_THROWS_WITH(watcher.verify(*net), Catch::Contains("'scale' differs"));
  CHECK_THROWS_WITH(watcher.load_newer_into(*net, 50ms), Catch::Contains("newer than step 2"));
  // A module the step does not fit is refused before anything is copied, and the step stays to be loaded.
  root.save(3);
  torch::nn::Linear other(6, 4);
  const at::Tensor before = other->weight.detach().clone();
  CHECK_THROWS_AS(watcher.load_newer_into(*other, 2s), SyncError);
  CHECK(bit_equal(other->weight.detach(), before));
  CHECK(watcher.load_newer_into(*net, 2s) == 3);
  watcher.verify(*net);
}

TEST_CASE("watcher: an uncommitted step is never read", "[watcher]") {
  Root root("uncommitted");
  root.save(1);
  CheckpointWatcher watcher(root.path, fast());
  require_weights(*watcher.poll(), 1);

  // Step 2's shards are all there, but no commit record and the iteration file did not move: a save
  // in flight (or one that crashed).
  const auto files = root.write_shards(2);
  CHECK_FALSE(watcher.poll());
  CHECK_THROWS_AS(watcher.wait_newer(1, 50ms), SyncError);

  // Even an iteration file that names it (written by hand) does not make it readable.
  root.advance(2);
  CHECK_FALSE(watcher.poll());
  CHECK_THAT(watcher.last_error(), Catch::Contains("not (or no longer) committed"));
  // A commit record without the model component does not commit the weights.
  root.commit(2, files, {"optim"});
  CHECK_FALSE(watcher.poll());
  CHECK(watcher.last_step() == 1);

  // Committed now: read.
  root.commit(2, files);
  require_weights(watcher.wait_newer(1, 2s), 2);
}

TEST_CASE("watcher: a file truncated or replaced between the iteration file's read and the load is never returned torn",
          "[watcher]") {
  Root root("replaced");
  root.save(1);
  root.save(2);
  int64_t damaged = -1;
  const auto damage_once = [&](std::function<void()> fn) {
    return [&, fn](std::string_view stage, int64_t step) {
      if (stage == "leased" && step == 2 && damaged < 0) {
        damaged = step;
        fn();
      }
    };
  };

  SECTION("truncated, and a newer step committed meanwhile: the newer step instead, no error") {
    CheckpointWatcher watcher(root.path, fast(damage_once([&] {
                                fs::resize_file(root.model_file(2, 1), fs::file_size(root.model_file(2, 1)) / 2);
                                root.save(3);
                              })));
    const auto v = watcher.poll();
    REQUIRE(damaged == 2);
    REQUIRE(v);
    require_weights(*v, 3);
  }
  SECTION("replaced by another valid file (of other weights), and a newer step committed meanwhile") {
    CheckpointWatcher watcher(root.path, fast(damage_once([&] {
                                Root scratch("scratch");
                                scratch.write_shards(2, /*values=*/77);
                                fs::rename(scratch.model_file(2, 1),
                                           root.model_file(2, 1));  // atomically, as a writer would
                                root.save(3);
                              })));
    const auto v = watcher.wait_newer(no_version, 2s);
    REQUIRE(damaged == 2);
    require_weights(v, 3);
  }
  SECTION("rotated away before the lease: the newer step instead") {
    CheckpointWatcher watcher(root.path, fast([&](std::string_view stage, int64_t step) {
                                if (stage == "chosen" && step == 2 && damaged < 0) {
                                  damaged = step;
                                  root.save(3);
                                  ckpt::delete_step(root.path, {2, root.path / "global_step_2"});
                                }
                              }));
    const auto v = watcher.poll();
    REQUIRE(damaged == 2);
    REQUIRE(v);
    require_weights(*v, 3);
  }
  SECTION("truncated with nothing newer: nothing is returned, the wait ends in an error that says why") {
    CheckpointWatcher watcher(
        root.path,
        fast(damage_once([&] { fs::resize_file(root.model_file(2, 1), fs::file_size(root.model_file(2, 1)) - 7); })));
    CHECK_FALSE(watcher.poll());
    CHECK(damaged == 2);
    CHECK(watcher.last_step() == no_version);
    CHECK_THAT(watcher.last_error(), Catch::Contains("model_world_size_2_rank_1.pt") && Catch::Contains("truncated"));
    try {
      watcher.wait_newer(no_version, 100ms);
      FAIL("no error");
    } catch (const SyncError& e) {
      CHECK_THAT(e.what(), Catch::Contains(root.path.string()) && Catch::Contains("the last attempt failed: step 2") &&
                               Catch::Contains("truncated"));
    }
    // The trainer moves on: the watcher too.
    root.save(3);
    require_weights(watcher.wait_newer(no_version, 2s), 3);
  }
  SECTION("the same step rewritten whole after a torn read is read again") {
    CheckpointWatcher watcher(root.path, fast(damage_once([&] { fs::resize_file(root.model_file(2, 0), 100); })));
    CHECK_FALSE(watcher.poll());
    CHECK_FALSE(watcher.poll());  // unchanged: not read again
    root.save(2);                 // e.g. a trainer restarted from step 1 saves step 2 again
    require_weights(*watcher.poll(), 2);
  }
}

TEST_CASE("watcher: nothing new within the timeout is a SyncError naming the root and the last step seen",
          "[watcher]") {
  Root root("timeout");
  const fs::path absent = root.path / "not_there";
  {
    CheckpointWatcher watcher(absent, fast());
    const auto t0 = std::chrono::steady_clock::now();
    try {
      watcher.wait_newer(no_version, 150ms);
      FAIL("no error");
    } catch (const SyncError& e) {
      const auto waited = std::chrono::steady_clock::now() - t0;
      CHECK(waited >= 150ms);
      CHECK(waited < 5s);
      CHECK_THAT(e.what(),
                 Catch::Contains("no committed weights newer than step -1 appeared under the checkpoint root '" +
                                 absent.string() + "' within 150 ms") &&
                     Catch::Contains("the root does not exist") && Catch::Contains("the last step seen: none"));
    }
  }
  root.save(4);
  CheckpointWatcher watcher(root.path, {.poll_interval = 5ms, .timeout = 100ms});
  require_weights(watcher.wait_newer(no_version), 4);
  try {
    watcher.wait_newer(4);  // the options' timeout
    FAIL("no error");
  } catch (const SyncError& e) {
    CHECK_THAT(e.what(), Catch::Contains("newer than step 4") && Catch::Contains("within 100 ms") &&
                             Catch::Contains("it names step 4") && Catch::Contains("the last step seen: 4") &&
                             Catch::Contains("the last step loaded: 4") &&
                             Catch::Contains("the trainer may be slow, stopped or dead"));
  }
}

TEST_CASE("watcher: versions never go backwards, even when the iteration file does", "[watcher]") {
  Root root("backwards");
  for (int64_t s = 1; s <= 3; ++s) root.save(s);
  CheckpointWatcher watcher(root.path, fast());
  require_weights(*watcher.poll(), 3);
  root.advance(2);  // rewritten with a smaller number (by hand, or a trainer restarted from step 2)
  CHECK_FALSE(watcher.poll());
  CHECK_THROWS_AS(watcher.wait_newer(no_version, 30ms), SyncError);  // step 2 is newer than -1, but older than 3
  CHECK(watcher.last_step() == 3);
  CHECK(watcher.newest_step_seen() == 3);
  root.advance(3);
  CHECK_FALSE(watcher.poll());
  require_weights(watcher.wait_newer(2, 2s), 3);  // newer than 2 and not older than 3: step 3 again
  root.save(5);
  require_weights(*watcher.poll(), 5);
  CHECK(watcher.last_step() == 5);
}
