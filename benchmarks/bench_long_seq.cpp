// bench_long_seq: one training step of a Hugging Face decoder on long sequences, fsdpx with and without
// activation checkpointing and the chunked loss: step time, tokens/s and peak RSS per rank.
// benchmarks/run_long_seq.sh runs it beside PyTorch FSDP2 + transformers (benchmarks/long_seq.py) on the
// same folder, batch and sequence, and prints the table of docs/benchmarks.md ("Long sequences").
//
//   mpiexec -n 2 bench_long_seq MODEL_DIR SEQ CONFIG [steps=2 warmup=1]
//     CONFIG  plain   layers as units, embedding and head in the root, whole logits (no checkpointing)
//             units   embedding, layers and head as units (models::DecoderUnits), whole logits
//             ckpt    units, layers checkpointed, whole logits
//             chunked units, layers checkpointed, chunked loss (2^26 logits per chunk)
//             ulysses chunked, with every rank in one sequence group (SequenceParallel): the ranks share
//                     one sample of SEQ tokens, SEQ / world each
// One sample of SEQ tokens per rank (ulysses: per world), float32 (FullPrecision), AdamW. Prints one
// RESULT line (rank 0):
// the median step over the timed steps (slowest rank), peak RSS (the largest rank's VmHWM) and the RSS
// after the warm-up steps (model, gradients, optimizer state: what the activations come on top of).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <torch/optim.h>

#include <fsdpx/fsdp.hpp>
#include <fsdpx/models.hpp>

#include "../examples/common/memory.hpp"
#include "timing.hpp"

namespace models = fsdpx::models;
using Layers = fsdpx::Fsdp<models::CausalLM, fsdpx::FullShard, fsdpx::NoOffload, fsdpx::FullPrecision,
                           fsdpx::ShardedStateDict, fsdpx::WrapModules<models::DecoderLayerImpl>>;
using Units = fsdpx::Fsdp<models::CausalLM, fsdpx::FullShard, fsdpx::NoOffload, fsdpx::FullPrecision,
                          fsdpx::ShardedStateDict, models::DecoderUnits, fsdpx::CheckpointNames<"model.layers.*">>;
using Ulysses = fsdpx::Fsdp<models::CausalLM, fsdpx::SequenceParallel<fsdpx::runtime_sequence_size>, fsdpx::NoOffload,
                            fsdpx::FullPrecision, fsdpx::ShardedStateDict, models::DecoderUnits,
                            fsdpx::CheckpointNames<"model.layers.*">>;

namespace {

double rss_mib() {
  return static_cast<double>(fsdpx::memory_report(c10::Device(c10::kCPU)).host_rss_bytes) / 1048576.0;
}

template <class Sharded>
int run(fsdpx::dist::MpiCommunicator& world, const std::string& dir, int64_t seq, const std::string& config, int steps,
        int warmup) {
  const bool ulysses = config == "ulysses", checkpointing = config == "ckpt" || config == "chunked" || ulysses;
  const int sequence = ulysses ? world.size() : 1;
  // With units, the head stays gathered from its forward to its backward (docs/models.md).
  fsdpx::FsdpOptions options{.reshard_after_forward_for = models::reshard_all_but_head,
                             .activation_checkpointing = checkpointing};
  if (ulysses) options.sequence_size = sequence;
  auto model = models::from_pretrained<Sharded>(dir, fsdpx::dist::AnyCommunicator(world), options);
  model->chunk_logits = config == "chunked" || ulysses ? models::default_chunk_logits : 0;
  auto optimizer = fsdpx::make_adamw(model, torch::optim::AdamWOptions(1e-5).weight_decay(0.1));
  at::manual_seed(ulysses ? 1 : 1 + world.rank());  // the sequence group shares its sample
  at::Tensor ids = at::randint(model->config.vocab_size, {1, seq}, at::kLong);
  if (ulysses) ids = models::sequence_slice(ids, *model.sequence_group());
  const auto step = [&] {
    optimizer.zero_grad();
    model.call(&models::CausalLMImpl::loss, ids, ids, at::Tensor()).backward();
    optimizer.step();
  };
  for (int i = 0; i < warmup; ++i) fsdpx::bench::time_once(world, step);
  const double base = rss_mib();
  std::vector<double> times;
  for (int i = 0; i < steps; ++i) times.push_back(fsdpx::bench::time_once(world, step));
  auto mem = at::tensor({fsdpx::examples::peak_rss_mib(), base}, at::kDouble);
  world.all_reduce(mem, fsdpx::dist::ReduceOp::max);
  const double seconds = fsdpx::bench::median(times);
  int64_t params = 0;
  for (const auto& t : models::hf_tensors(model->config)) params += c10::multiply_integers(t.shape);
  if (world.rank() == 0) {
    std::printf(
        "RESULT contender=fsdpx-%s world=%d params=%lld seq=%lld per_rank=%lld sequence_parallel=%d step_ms=%.0f "
        "tokens_per_s=%.0f peak_rss_mib=%.0f base_rss_mib=%.0f recomputations=%d\n",
        config.c_str(), world.size(), static_cast<long long>(params), static_cast<long long>(seq),
        static_cast<long long>(ids.size(1)), sequence, seconds * 1000,
        static_cast<double>(ids.size(1) * world.size()) / seconds, mem[0].item<double>(), mem[1].item<double>(),
        model.last_step_stats().recomputations);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s MODEL_DIR SEQ plain|units|ckpt|chunked|ulysses [steps warmup]\n", argv[0]);
    return 2;
  }
  auto world = fsdpx::dist::MpiCommunicator::world();
  const std::string dir = argv[1], config = argv[3];
  const int64_t seq = std::atoll(argv[2]);
  const int steps = argc > 4 ? std::atoi(argv[4]) : 2, warmup = argc > 5 ? std::atoi(argv[5]) : 1;
  if (config == "plain") return run<Layers>(world, dir, seq, config, steps, warmup);
  if (config == "units" || config == "ckpt" || config == "chunked")
    return run<Units>(world, dir, seq, config, steps, warmup);
  if (config == "ulysses") return run<Ulysses>(world, dir, seq, config, steps, warmup);
  std::fprintf(stderr, "bench_long_seq: CONFIG must be plain, units, ckpt, chunked or ulysses, not '%s'\n",
               config.c_str());
  return 2;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_long_seq: %s\n", e.what());
  return 1;
}
