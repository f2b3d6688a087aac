// How much an async checkpoint save costs the training loop, and how fast it writes.
//
//   OMP_NUM_THREADS=1 mpiexec -n 2 bench_checkpoint [--dim 768] [--layers 8] [--steps 6] [--threads 2] [--dir DIR]
//
// In one run, on each rank, with the same state (float32 shards + AdamW moments of a GPT):
//   disk     write()+fsync of the same number of bytes per rank: the disk's sequential speed
//   sync     torch::save of the same tensors plus fsync: what a synchronous save blocks
//   async    CheckpointCoordinator::save() inside a training loop: the time save() takes plus the
//            time the next backward waits for the background copy (ShardedModel::shard_reader_wait),
//            and the write throughput (bytes / time from save() to the last durable file), alone
//            (save then wait) and while training runs on the same cores
// The async measurements run for both CheckpointFormat::fsdpx and CheckpointFormat::dcp, taking turns. It
// prints the ratios the targets are about: blocked / sync (target <= 5%), write throughput / disk (target
// >= 80%), and DCP's blocked time against fsdpx's format's (target <= 1).
//
//   OMP_NUM_THREADS=1 mpiexec -n 2 bench_checkpoint --memory-tier 1 [--steps 6] [...]
//
// measures the memory tier instead (CheckpointCoordinator::save_to_memory every step, into $FSDPX_MEMORY_DIR or
// /dev/shm): blocks of steps with it and without it take turns (--steps blocks each), and it prints the time a
// step is blocked by it (the save_to_memory() call plus the next backward's wait for its copy) against the
// step's time (target <= 2%), and the step's time with the tier against without (its background copies share
// the cores), beside the memory folder's own write speed.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

#include <torch/nn.h>
#include <torch/optim.h>
#include <torch/serialize.h>

#include <fsdpx/dcp.hpp>
#include <fsdpx/fsdp.hpp>

#include "../examples/common/gpt.hpp"

using namespace fsdpx;
using examples::BlockImpl;
using examples::Gpt;
using examples::GptConfig;
using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

namespace {

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

/// Sequential write of `bytes` with fsync: the disk's speed for this job's pattern.
double disk_write_seconds(const fs::path& path, int64_t bytes) {
  std::vector<char> buf(size_t{16} << 20, 'x');
  const auto t = Clock::now();
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  for (int64_t done = 0; done < bytes;) {
    const auto n = static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(buf.size()), bytes - done));
    if (::write(fd, buf.data(), n) != static_cast<ssize_t>(n)) std::abort();
    done += static_cast<int64_t>(n);
  }
  ::fsync(fd);
  ::close(fd);
  return seconds_since(t);
}

/// Median of `v` (taken by value: sorted here).
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/// The --memory-tier measurement (see the top of the file).
template <class Model>
void bench_memory_tier(Model& model, torch::optim::Optimizer& opt, const std::function<void()>& step,
                       dist::AnyCommunicator& world, const fs::path& root, int blocks, int threads, int64_t bytes) {
  constexpr int steps_per_block = 4;
  auto owned = std::make_unique<CheckpointCoordinator>(root / "ckpt", model,
                                                       CheckpointOptions{.max_to_keep = 2, .threads = threads});
  CheckpointCoordinator& ckpt = *owned;
  const fs::path memory_dir = checkpoint::memory_tier_dir({});
  // the memory folder's own speed for this many bytes (fsync of a tmpfs file is nothing)
  std::vector<double> raw_runs;
  for (int rep = 0; rep < 3; ++rep) {
    const fs::path probe = memory_dir / ("fsdpx_bench_probe_" + std::to_string(world.rank()));
    raw_runs.push_back(disk_write_seconds(probe, bytes));
    fs::remove(probe);
  }
  const ExtraState extra;  // with it, a memory step is a whole resume point (the RNG states are added)
  std::vector<double> plain_step, tier_step, blocked;  // one value per block: the mean of its steps
  int64_t saved_step = 0;
  for (int b = 0; b < 2 * blocks; ++b) {
    const bool with_tier = (b % 2) == 1;
    ckpt.wait();  // a block starts with nothing in flight, so that the one before does not leak into it
    world.barrier();
    double step_s = 0, blocked_s = 0;
    for (int i = 0; i < steps_per_block; ++i) {
      const double fence_before = model.sharded().shard_reader_wait().count();
      auto t0 = Clock::now();
      step();
      step_s += seconds_since(t0);
      if (with_tier) {
        blocked_s += model.sharded().shard_reader_wait().count() - fence_before;
        t0 = Clock::now();
        ckpt.save_to_memory(++saved_step, model, &opt, &extra);
        const double call_s = seconds_since(t0);
        blocked_s += call_s;
        step_s += call_s;
      }
    }
    (with_tier ? tier_step : plain_step).push_back(step_s / steps_per_block);
    if (with_tier) blocked.push_back(blocked_s / steps_per_block);
  }
  ckpt.wait();
  const int64_t committed = ckpt.memory_tier_latest_committed();
  // its steps are newer than the disk tier's (none): a clean end keeps them, for a resume; the benchmark does not
  const fs::path memory_root = ckpt.memory_tier_root();
  owned.reset();
  world.barrier();
  if (world.rank() == 0 && !memory_root.empty()) fs::remove_all(memory_root);
  // worst rank decides; min and max of the blocks beside the medians (the spread)
  const auto stats = [](const std::vector<double>& v) {
    return std::vector<double>{median(v), *std::min_element(v.begin(), v.end()), *std::max_element(v.begin(), v.end())};
  };
  std::vector<double> values;
  for (const auto* v : {&plain_step, &tier_step, &blocked}) {
    const auto s = stats(*v);
    values.insert(values.end(), s.begin(), s.end());
  }
  values.push_back(median(raw_runs));
  auto v = at::tensor(values, at::kDouble);
  world.all_reduce(v, dist::ReduceOp::max);
  const auto r = v.accessor<double, 1>();
  if (world.rank() == 0) {
    const double mib = static_cast<double>(bytes) / (1 << 20);
    std::printf(
        "  memory tier (%s, %.1f MiB of shards + AdamW state per rank and step; newest committed step %lld "
        "of %lld):\n",
        memory_dir.string().c_str(), mib, static_cast<long long>(committed), static_cast<long long>(saved_step));
    std::printf("    the folder's write speed (write of the same bytes)   %8.3f s  %7.0f MiB/s per rank\n", r[9],
                mib / r[9]);
    std::printf("    step without the tier  %.4f s (blocks %.4f-%.4f)\n", r[0], r[1], r[2]);
    std::printf("    step with the tier     %.4f s (blocks %.4f-%.4f)\n", r[3], r[4], r[5]);
    std::printf("    blocked by the tier    %.4f s per step (blocks %.4f-%.4f)\n", r[6], r[7], r[8]);
    std::printf("RATIO memory tier: blocked/step = %.4f (target <= 0.02; blocks %.4f-%.4f); step with/without = %.3f\n",
                r[6] / r[0], r[7] / r[0], r[8] / r[0], r[3] / r[0]);
  }
}

}  // namespace

int main(int argc, char** argv) {
  GptConfig cfg{.vocab = 256, .seq = 128, .dim = 768, .heads = 12, .layers = 8, .tied = false};
  int steps = 6;
  int threads = 2;
  std::string dir = "bench_checkpoint_dir";
  bool memory_tier = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--dim") cfg.dim = std::stoll(argv[i + 1]);
    else if (k == "--layers") cfg.layers = std::stoll(argv[i + 1]);
    else if (k == "--steps") steps = std::stoi(argv[i + 1]);
    else if (k == "--threads") threads = std::stoi(argv[i + 1]);
    else if (k == "--dir") dir = argv[i + 1];
    else if (k == "--memory-tier") memory_tier = std::stoi(argv[i + 1]) != 0;
  }
  auto mpi = dist::MpiCommunicator::world();
  dist::AnyCommunicator world(mpi);
  const fs::path root = fs::absolute(dir);
  if (world.rank() == 0) {
    fs::remove_all(root);
    fs::create_directories(root);
  }
  world.barrier();

  torch::manual_seed(0);
  Fsdp<Gpt, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<BlockImpl>> model(Gpt(cfg), world);
  auto opt = make_adamw(model, torch::optim::AdamWOptions(1e-4));
  const int64_t batch = 4;
  auto step = [&] {
    const at::Tensor x = at::randint(0, cfg.vocab, {batch, cfg.seq});
    opt.zero_grad();
    model(x, x).backward();
    opt.step();
  };
  for (int i = 0; i < 2; ++i) step();  // optimizer state exists, warm caches

  // The state one save writes, as plain tensors (what torch::save gets).
  std::vector<at::Tensor> state;
  for (const auto& p : model.parameters()) {
    state.push_back(p);
    for (auto& [name, t] : fsdpx::detail::optimizer_state_tensors(*opt.state().at(p.unsafeGetTensorImpl())))
      state.push_back(*t);
  }
  int64_t bytes = 0;
  for (const auto& t : state) bytes += t.nbytes();
  if (memory_tier) {
    if (world.rank() == 0) {
      std::printf(
          "bench_checkpoint --memory-tier: %d ranks, GPT dim %lld x %lld layers, %d blocks of 4 steps each way\n",
          world.size(), static_cast<long long>(cfg.dim), static_cast<long long>(cfg.layers), steps);
    }
    bench_memory_tier(model, opt, step, world, root, steps, threads, bytes);
    world.barrier();
    if (world.rank() == 0) fs::remove_all(root);
    return 0;
  }

  // Side by side, three rounds, medians (this VM's disk speed drifts within a run): the disk, a
  // synchronous torch::save (+ fsync, so its bytes are on disk as the coordinator's are), and an
  // async save alone (save() then wait(), nothing else running) in each format, timed until both of its
  // components are durable (the commit and rotation that follow write nothing large but DCP's .metadata).
  struct Async {
    CheckpointFormat format;
    const char* name;
    std::unique_ptr<CheckpointCoordinator> ckpt;
    std::vector<double> alone_s, write_s;
    int64_t written = 0;
    double save_call_s = 0, fence_s = 0, step_s = 0;
  };
  std::vector<Async> formats;
  formats.push_back({CheckpointFormat::fsdpx, "fsdpx", nullptr});
  formats.push_back({CheckpointFormat::dcp, "dcp", nullptr});
  std::mutex m;
  Clock::time_point save_start;
  int files_done = 0;
  std::vector<double>* timing = nullptr;  // where the running save's write time goes
  for (Async& a : formats) {
    a.ckpt = std::make_unique<CheckpointCoordinator>(
        root / (std::string("ckpt_") + a.name), model,
        CheckpointOptions{.max_to_keep = 2, .threads = threads, .format = a.format});
    a.ckpt->add_monitor({.after_save = [&, w = &a.written](const SaveEvent& e) {
      std::lock_guard lock(m);
      *w += e.bytes;
      if (++files_done == 2 && timing != nullptr) timing->push_back(seconds_since(save_start));  // model + optim
    }});
  }
  const auto start_timing = [&](std::vector<double>& into) {
    std::lock_guard lock(m);
    files_done = 0;
    timing = &into;
    save_start = Clock::now();
  };
  std::vector<double> disk_runs, sync_runs;
  int64_t sync_bytes = 0;
  const fs::path sync_file = root / ("sync_" + std::to_string(world.rank()) + ".pt");
  Clock::time_point t0;
  // Each timed write starts from a settled disk: nothing dirty in the page cache, no deletes pending.
  const auto settle = [&] {
    ::sync();
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    world.barrier();
  };
  for (int rep = 0; rep < 3; ++rep) {
    settle();
    const fs::path probe = root / ("disk_probe_" + std::to_string(world.rank()));
    disk_runs.push_back(disk_write_seconds(probe, bytes));
    fs::remove(probe);
    settle();
    t0 = Clock::now();
    torch::save(state, sync_file.string());
    const int fd = ::open(sync_file.c_str(), O_RDONLY);
    ::fsync(fd);
    ::close(fd);
    sync_runs.push_back(seconds_since(t0));
    sync_bytes = static_cast<int64_t>(fs::file_size(sync_file));
    fs::remove(sync_file);
    for (Async& a : formats) {
      settle();
      start_timing(a.alone_s);
      a.ckpt->save(10 + rep, model, &opt);
      a.ckpt->wait();
    }
  }
  const double disk_s = median(disk_runs), sync_s = median(sync_runs);
  double plain_step_s = 0;
  for (int i = 0; i < steps; ++i) {  // steps without saves: the baseline step time
    world.barrier();
    t0 = Clock::now();
    step();
    plain_step_s += seconds_since(t0);
  }
  // The formats take turns, a save each step, so both see the same drift of the disk and the cores.
  for (Async& a : formats) a.written = 0;
  for (int i = 0; i < 2 * steps; ++i) {
    Async& a = formats[static_cast<size_t>(i % 2)];
    for (Async& b : formats) b.ckpt->wait();  // one save at a time, so each write is timed alone
    settle();
    const double wait_before = model.sharded().shard_reader_wait().count();
    start_timing(a.write_s);
    t0 = Clock::now();
    a.ckpt->save(100 + i, model, &opt);
    a.save_call_s += seconds_since(t0);
    t0 = Clock::now();
    step();
    a.step_s += seconds_since(t0);
    a.fence_s += model.sharded().shard_reader_wait().count() - wait_before;
  }
  for (Async& a : formats) a.ckpt->wait();

  // Worst rank decides (a step waits for the slowest).
  std::vector<double> values{disk_s, sync_s, plain_step_s / steps};
  for (const Async& a : formats) {
    values.insert(values.end(), {(a.save_call_s + a.fence_s) / steps, median(a.write_s), a.save_call_s / steps,
                                 a.fence_s / steps, a.step_s / steps, median(a.alone_s)});
  }
  auto v = at::tensor(values, at::kDouble);
  world.all_reduce(v, dist::ReduceOp::max);
  const auto r = v.accessor<double, 1>();
  if (world.rank() == 0) {
    const double mib = static_cast<double>(bytes) / (1 << 20);
    const double disk_bps = static_cast<double>(bytes) / r[0];
    std::printf(
        "bench_checkpoint: %d ranks, GPT dim %lld x %lld layers, %.1f MiB of shards + AdamW state per rank "
        "(torch::save file %.1f MiB)\n",
        world.size(), static_cast<long long>(cfg.dim), static_cast<long long>(cfg.layers), mib,
        static_cast<double>(sync_bytes) / (1 << 20));
    std::printf("  disk: write+fsync of %.1f MiB per rank            %8.3f s  %7.0f MiB/s per rank\n", mib, r[0],
                mib / r[0]);
    std::printf("  sync: torch::save + fsync                         %8.3f s  (the loop is blocked all along)\n", r[1]);
    std::printf("  step time without saves: %.3f s\n", r[2]);
    for (size_t f = 0; f < formats.size(); ++f) {
      const Async& a = formats[f];
      const size_t o = 3 + 6 * f;
      const double save_bytes = static_cast<double>(a.written) / steps;
      std::printf(
          "  async %-5s (%.1f MiB per save): save() call %.4f s + wait in next backward %.4f s = blocked "
          "%.4f s per save\n",
          a.name, save_bytes / (1 << 20), r[o + 2], r[o + 3], r[o]);
      std::printf("    alone: save() to durable, nothing else running %5.3f s  %7.0f MiB/s per rank\n", r[o + 5],
                  save_bytes / (1 << 20) / r[o + 5]);
      std::printf("    during training: background write %8.3f s  %7.0f MiB/s per rank; step time %.3f s with a save\n",
                  r[o + 1], save_bytes / (1 << 20) / r[o + 1], r[o + 4]);
      std::printf(
          "RATIO %s: blocked/sync = %.3f (target <= 0.05); write throughput/disk = %.2f alone (target >= "
          "0.80), %.2f during training\n",
          a.name, r[o] / r[1], (save_bytes / r[o + 5]) / disk_bps, (save_bytes / r[o + 1]) / disk_bps);
    }
    std::printf("RATIO dcp/fsdpx: blocked %.2f, write time alone %.2f (target: blocked <= 1, within the spread)\n",
                r[3 + 6] / r[3], r[3 + 6 + 5] / r[3 + 5]);
  }
  world.barrier();
  if (world.rank() == 0) fs::remove_all(root);
  return 0;
}
