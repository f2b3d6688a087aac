// bench_decoder: training steps of the Hugging Face decoder users train (models::CausalLM from a folder),
// sharded by fsdpx with BF16Mixed: tokens/s and peak memory. benchmarks/run_decoder_bench.sh runs it
// beside PyTorch FSDP2 + transformers (benchmarks/decoder_bench.py) on the same folder and batch, and
// prints the table of docs/gpu.md with MFU (computed there, once, for every contender).
//
//   torchrun --no-python bench_decoder cuda MODEL_DIR TOKENS STEPS WARMUP CONFIG...   NCCL, a GPU per rank
//   mpiexec -n 2 bench_decoder cpu MODEL_DIR TOKENS STEPS WARMUP CONFIG...            MPI, CPU ranks
//     CONFIG  plain    embedding, layers and head as units (DecoderUnits), whole logits
//             ckpt     the same with the layers checkpointed
//             chunked  checkpointed layers and the chunked loss (never the whole logits)
//             each with LibTorch's AdamW, or with fsdpx::FusedAdamW (ATen's fused kernel): plain-fused, ...
// The configurations run in turn on one loaded model (loading dominates a short run's time). One sample
// of TOKENS tokens per rank. FSDPX_SYNC_DEBUG=1 also reports the host synchronizations of one step of
// each (CUDA's sync debug mode); FSDPX_PROFILE=DIR writes a trace of one step of each (cuda_profile.hpp).
// One RESULT line per configuration (rank 0): the median step over the timed steps (slowest rank) and the
// peak memory (largest rank: allocated GPU memory since the configuration began, or the process's RSS).
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include <torch/optim.h>

#include <fsdpx/fsdp.hpp>
#include <fsdpx/models.hpp>

#if defined(FSDPX_WITH_NCCL)
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Backtrace.h>
#include <c10/util/Exception.h>

#include <fsdpx/dist/launch.hpp>
#endif

#include "../examples/common/memory.hpp"
#include "cuda_profile.hpp"
#include "timing.hpp"

namespace models = fsdpx::models;
using Sharded = fsdpx::Fsdp<models::CausalLM, fsdpx::FullShard, fsdpx::NoOffload, fsdpx::BF16Mixed,
                            fsdpx::ShardedStateDict, models::DecoderUnits, fsdpx::CheckpointNames<"model.layers.*">>;

namespace {

// One configuration: plain, ckpt or chunked, with LibTorch's AdamW or (suffix -fused) FusedAdamW.
struct Config {
  std::string name;
  bool checkpointing = false, chunked = false, fused = false;
};

Config parse_config(const std::string& name) {
  const std::string fused_suffix = "-fused";
  const bool fused = name.size() > fused_suffix.size() && name.ends_with(fused_suffix);
  const std::string base = fused ? name.substr(0, name.size() - fused_suffix.size()) : name;
  FSDPX_CHECK(base == "plain" || base == "ckpt" || base == "chunked",
              "bench_decoder: a CONFIG is plain, ckpt or chunked, optionally with -fused; not '", name, "'");
  return {.name = name, .checkpointing = base != "plain", .chunked = base == "chunked", .fused = fused};
}

struct Run {
  std::string dir;
  int64_t tokens = 4096;
  int steps = 10, warmup = 3;
  std::vector<Config> configs;
};

// Peak bytes this rank has held: the caching allocator's peak allocation on a GPU, RSS on the CPU.
double peak_gib(const c10::Device& device) {
#if defined(FSDPX_WITH_NCCL)
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    return static_cast<double>(
               stats.allocated_bytes[static_cast<size_t>(c10::CachingDeviceAllocator::StatType::AGGREGATE)].peak) /
           1073741824.0;
  }
#endif
  (void)device;
  return fsdpx::examples::peak_rss_mib() / 1024.0;
}

#if defined(FSDPX_WITH_NCCL)
// Records each warning of CUDA's sync debug mode raised on this thread, with the call stack that led
// to it (backward's device thread reports its own through the default handler, on stderr).
struct SyncRecorder : c10::WarningHandler {
  std::vector<std::string> stacks;
  void process(const c10::Warning& w) override {
    stacks.push_back(w.msg() + "\n" + c10::get_backtrace(/*frames_to_skip=*/1, /*maximum_number_of_frames=*/24));
  }
};
#endif

// FSDPX_SYNC_DEBUG=1: one training step under CUDA's sync debug mode (torch.cuda.set_sync_debug_mode
// "warn"): every host synchronization inside it, with where it came from. A step should have none.
template <class Step>
void report_host_syncs(const c10::Device& device, const Step& step) {
#if defined(FSDPX_WITH_NCCL)
  if (!device.is_cuda()) return;
  SyncRecorder recorder;
  {
    c10::WarningUtils::WarningHandlerGuard guard(&recorder);
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_WARN);
    step();
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
  }
  c10::cuda::device_synchronize();
  std::printf("SYNCS in one step on the main thread: %zu\n", recorder.stacks.size());
  for (size_t i = 0; i < recorder.stacks.size() && i < 8; ++i)
    std::printf("SYNC %zu: %s\n", i, recorder.stacks[i].c_str());
  std::fflush(stdout);
#else
  (void)device, (void)step;
#endif
}

void synchronize(const c10::Device& device) {
#if defined(FSDPX_WITH_NCCL)
  if (device.is_cuda()) c10::cuda::device_synchronize();
#endif
  (void)device;
}

void reset_peak(const c10::Device& device) {
#if defined(FSDPX_WITH_NCCL)
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
#endif
  (void)device;
}

// Each configuration in turn on one loaded model: its own optimizer (the last one's state freed), its
// warm-up steps, then the timed ones; one RESULT line each.
int run(fsdpx::dist::AnyCommunicator world, const c10::Device& device, const Run& r) {
  // The head stays gathered from its forward to its backward, as FSDP2 keeps its root's parameters.
  auto model = models::from_pretrained<Sharded>(
      r.dir, world, {.device = device, .reshard_after_forward_for = models::reshard_all_but_head});
  at::manual_seed(1 + world.rank());
  const at::Tensor ids =
      at::randint(model->config.vocab_size, {1, r.tokens}, at::TensorOptions().dtype(at::kLong).device(device));
  const auto options = torch::optim::AdamWOptions(1e-5).weight_decay(0.1);
  for (const Config& config : r.configs) {
    model.set_activation_checkpointing(config.checkpointing);
    model->chunk_logits = config.chunked ? models::default_chunk_logits : 0;
    std::unique_ptr<torch::optim::AdamW> optimizer;
    if (config.fused) {
      optimizer = std::make_unique<fsdpx::FusedAdamW>(fsdpx::make_adamw<fsdpx::FusedAdamW>(model, options));
    } else {
      optimizer = std::make_unique<torch::optim::AdamW>(fsdpx::make_adamw(model, options));
    }
    const auto unsynchronized_step = [&] {
      optimizer->zero_grad();
      model.call(&models::CausalLMImpl::loss, ids, ids, models::BatchLayout{}).backward();
      optimizer->step();
    };
    const auto step = [&] {
      unsynchronized_step();
      synchronize(device);
    };
    reset_peak(device);
    for (int i = 0; i < r.warmup; ++i) step();
    if (std::getenv("FSDPX_SYNC_DEBUG") != nullptr) report_host_syncs(device, unsynchronized_step);
    std::vector<double> times;
    for (int i = 0; i < r.steps; ++i) times.push_back(fsdpx::bench::time_once(world, step));
    fsdpx::bench::profile_step(fsdpx::bench::trace_name("fsdpx-" + config.name, world.rank(), world.size()), step);
    auto peak = at::tensor({peak_gib(device)}, at::kDouble).to(device);
    world.all_reduce(peak, fsdpx::dist::ReduceOp::max);
    const double seconds = fsdpx::bench::median(times);
    if (world.rank() == 0) {
      std::printf(
          "RESULT contender=fsdpx-%s device=%s world=%d seq=%lld step_ms=%.1f tokens_per_s_per_rank=%.0f "
          "peak_gib=%.2f\n",
          config.name.c_str(), device.is_cuda() ? "cuda" : "cpu", world.size(), static_cast<long long>(r.tokens),
          seconds * 1000, static_cast<double>(r.tokens) / seconds, peak.cpu().item<double>());
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  if (argc < 7) {
    std::fprintf(stderr, "usage: %s cuda|cpu MODEL_DIR TOKENS STEPS WARMUP CONFIG...\n", argv[0]);
    return 2;
  }
  const std::string where = argv[1];
  Run r{.dir = argv[2], .tokens = std::atoll(argv[3]), .steps = std::atoi(argv[4]), .warmup = std::atoi(argv[5])};
  FSDPX_CHECK(r.tokens >= 2 && r.steps >= 1 && r.warmup >= 0, "bench_decoder: tokens >= 2, steps >= 1, warmup >= 0");
  for (int i = 6; i < argc; ++i) r.configs.push_back(parse_config(argv[i]));
  if (where == "cuda") {
#if defined(FSDPX_WITH_NCCL)
    const auto env = fsdpx::dist::detect_launch_env();
    const auto index = static_cast<c10::DeviceIndex>(env.local_rank);
    c10::cuda::set_device(index);
    return run(fsdpx::dist::nccl_world(), c10::Device(c10::kCUDA, index), r);
#else
    FSDPX_CHECK(false, "bench_decoder: the cuda mode needs NCCL, and this build has none");
#endif
  }
  FSDPX_CHECK(where == "cpu", "bench_decoder: the first argument must be cuda or cpu, not '", where, "'");
#if defined(FSDPX_WITH_MPI)
  return run(fsdpx::dist::MpiCommunicator::world(), c10::Device(c10::kCPU), r);
#else
  FSDPX_CHECK(false, "bench_decoder: the cpu mode needs MPI, and this build has none");
#endif
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_decoder: %s\n", e.what());
  return 1;
}
