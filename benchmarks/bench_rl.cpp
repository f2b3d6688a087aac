// bench_rl: what an RL trainer does with fsdpx's decoder besides a plain step. benchmarks/run_rl_bench.sh
// runs both modes beside transformers (benchmarks/rl_bench.py) and prints the tables of
// docs/benchmarks.md ("Packed rollouts", "Generation").
//
//   mpiexec -n 2 bench_rl MODEL_DIR packed [samples=16 steps=2 seed=1]
//     Training on rollouts whose lengths are lognormal (median 160 tokens, sigma 1.1, clipped to
//     32..2048), each rank its own: padded (micro-batches of 4 rollouts, each padded to its longest)
//     against packed (pack_sequences into rows of up to 4096 tokens, one row per micro-batch without
//     its tail padding), the same
//     rollouts, alternating, one AdamW step over all micro-batches. Prints RESULT lines per mode with
//     the real (not padding) tokens per second over both ranks, and the ratio.
//   [mpiexec -n N] bench_rl MODEL_DIR generate [batch=4 prompt=64 new=64 repeats=3]
//     Greedy generation with the KV cache of left-padded prompts (lengths 16..prompt), float32: the
//     plain model (one process), or at N ranks sharded (each step gathers every layer) and sharded with
//     the full parameters held for the whole call (FullParameters: no gathers). New tokens per second
//     of one rank, the median over repeats.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include <torch/optim.h>

#include <fsdpx/fsdp.hpp>
#include <fsdpx/models.hpp>

#include "timing.hpp"

namespace models = fsdpx::models;
using Sharded = fsdpx::Fsdp<models::CausalLM, fsdpx::FullShard, fsdpx::NoOffload, fsdpx::FullPrecision,
                            fsdpx::ShardedStateDict, models::DecoderUnits>;

namespace {

std::vector<at::Tensor> rollouts(int64_t count, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::lognormal_distribution<double> length(std::log(160.0), 1.1);
  std::vector<at::Tensor> out;
  at::manual_seed(static_cast<uint64_t>(seed));
  for (int64_t i = 0; i < count; ++i) {
    const auto n = static_cast<int64_t>(std::clamp(length(rng), 32.0, 2048.0));
    out.push_back(at::randint(1, vocab, {n}, at::kLong));
  }
  return out;
}

struct MicroBatch {
  at::Tensor ids, labels, mask;  // mask undefined when packed
  models::PackedSamples samples;
};

int packed(fsdpx::dist::MpiCommunicator& world, const std::string& dir, int64_t samples, int steps, uint64_t seed) {
  auto model = models::from_pretrained<Sharded>(dir, fsdpx::dist::AnyCommunicator(world),
                                                {.reshard_after_forward_for = models::reshard_all_but_head});
  auto optimizer = fsdpx::make_adamw(model, torch::optim::AdamWOptions(1e-6).weight_decay(0.0));
  const auto mine = rollouts(samples, model->config.vocab_size, seed + static_cast<uint64_t>(world.rank()) * 7919);
  int64_t tokens = 0;
  for (const auto& r : mine) tokens += r.size(0);

  std::vector<MicroBatch> padded_batches, packed_batches;
  int64_t padded_tokens = 0;
  for (size_t i = 0; i < mine.size(); i += 4) {
    const size_t end = std::min(mine.size(), i + 4);
    int64_t longest = 0;
    for (size_t j = i; j < end; ++j) longest = std::max(longest, mine[j].size(0));
    MicroBatch b{at::zeros({static_cast<int64_t>(end - i), longest}, at::kLong),
                 {},
                 at::zeros({static_cast<int64_t>(end - i), longest}, at::kLong),
                 {}};
    for (size_t j = i; j < end; ++j) {
      b.ids[static_cast<int64_t>(j - i)].narrow(0, 0, mine[j].size(0)).copy_(mine[j]);
      b.mask[static_cast<int64_t>(j - i)].narrow(0, 0, mine[j].size(0)).fill_(1);
    }
    b.labels = b.ids.masked_fill(b.mask == 0, -100);
    padded_tokens += b.ids.numel();
    padded_batches.push_back(std::move(b));
  }
  const auto pack = models::pack_sequences(mine, {.token_budget = 4096});
  int64_t packed_tokens = 0;
  for (int64_t r = 0; r < pack.input_ids.size(0); ++r) {
    const auto row = pack.row(r);  // one row per micro-batch, without its tail padding
    packed_tokens += row.input_ids.numel();
    packed_batches.push_back({row.input_ids, row.labels, {}, row.samples});
  }
  // Every rank runs as many micro-batches (each gathers every unit): the ranks with fewer repeat their
  // last one with its loss times 0 (counted in their time, as a trainer balancing ranks would pay it).
  const auto agreed = [&](size_t n) {
    at::Tensor t = at::full({1}, static_cast<double>(n), at::kDouble);
    world.all_reduce(t, fsdpx::dist::ReduceOp::max);
    return static_cast<size_t>(t.item<double>());
  };
  const size_t padded_steps = agreed(padded_batches.size()), packed_steps = agreed(packed_batches.size());
  const auto train = [&](const std::vector<MicroBatch>& batches, size_t count, bool is_packed) {
    optimizer.zero_grad();
    for (size_t i = 0; i < count; ++i) {
      const MicroBatch& b = batches[std::min(i, batches.size() - 1)];
      model.set_requires_gradient_sync(i + 1 == count);
      const models::BatchLayout layout = is_packed ? models::BatchLayout(b.samples) : models::BatchLayout(b.mask);
      at::Tensor loss = model.call(&models::CausalLMImpl::loss, b.ids, b.labels, layout);
      if (i >= batches.size()) loss = loss * 0;
      loss.backward();
    }
    optimizer.step();
  };
  const auto [padded_s, packed_s] = fsdpx::bench::time_side_by_side(
      world, steps, [&] { train(padded_batches, padded_steps, false); },
      [&] { train(packed_batches, packed_steps, true); });
  auto total =
      at::tensor({static_cast<double>(tokens), static_cast<double>(padded_tokens), static_cast<double>(packed_tokens)},
                 at::kDouble);
  world.all_reduce(total, fsdpx::dist::ReduceOp::sum);
  if (world.rank() == 0) {
    const double real = total[0].item<double>();
    for (size_t i = 0; i < padded_s.size(); ++i) {
      std::printf(
          "RESULT mode=packed world=%d rollouts=%lld tokens=%.0f padded_tokens=%.0f packed_tokens=%.0f "
          "padded_s=%.2f packed_s=%.2f padded_tokens_per_s=%.0f packed_tokens_per_s=%.0f speedup=%.2f\n",
          world.size(), static_cast<long long>(samples * world.size()), real, total[1].item<double>(),
          total[2].item<double>(), padded_s[i], packed_s[i], real / padded_s[i], real / packed_s[i],
          padded_s[i] / packed_s[i]);
    }
    std::fflush(stdout);
  }
  return 0;
}

struct Prompts {
  at::Tensor ids, mask;
};

Prompts prompts(int64_t batch, int64_t length, int64_t vocab) {
  at::manual_seed(5);
  Prompts p{at::randint(1, vocab, {batch, length}, at::kLong), at::ones({batch, length}, at::kLong)};
  for (int64_t r = 0; r < batch; ++r) {  // lengths 16..length, left-padded
    const int64_t pad = batch > 1 ? (length - 16) * (batch - 1 - r) / (batch - 1) : 0;
    p.mask[r].narrow(0, 0, pad).fill_(0);
    p.ids[r].narrow(0, 0, pad).fill_(0);
  }
  return p;
}

double seconds(const std::function<void()>& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int generate(const std::string& dir, int64_t batch, int64_t prompt, int64_t fresh, int repeats) {
  const models::GenerateOptions greedy{.max_new_tokens = fresh};
  const char* size = std::getenv("OMPI_COMM_WORLD_SIZE");
  if (size == nullptr || std::atoi(size) == 1) {
    models::CausalLM model(models::read_decoder_config(dir));
    models::load_pretrained(model, dir);
    const Prompts p = prompts(batch, prompt, model->config.vocab_size);
    std::vector<double> times;
    at::Tensor out;
    model->generate(p.ids, p.mask, greedy);  // warm-up
    for (int i = 0; i < repeats; ++i)
      times.push_back(seconds([&] { out = model->generate(p.ids, p.mask, greedy).sequences; }));
    const double s = fsdpx::bench::median(times);
    std::printf(
        "RESULT mode=generate contender=fsdpx-plain world=1 batch=%lld prompt=%lld new=%lld seconds=%.3f "
        "tokens_per_s=%.1f checksum=%lld\n",
        static_cast<long long>(batch), static_cast<long long>(prompt), static_cast<long long>(fresh), s,
        static_cast<double>(batch * fresh) / s, static_cast<long long>(out.sum().item<int64_t>()));
    return 0;
  }
  auto world = fsdpx::dist::MpiCommunicator::world();
  auto model = models::from_pretrained<Sharded>(dir, fsdpx::dist::AnyCommunicator(world), {.inference_only = true});
  const Prompts p = prompts(batch, prompt, model->config.vocab_size);
  at::NoGradGuard no_grad;
  for (bool held : {false, true}) {
    std::vector<double> times;
    const auto run = [&] {
      if (held) {
        auto full = model.full_parameters();
        model.call(&models::CausalLMImpl::generate, p.ids, p.mask, greedy);
      } else {
        model.call(&models::CausalLMImpl::generate, p.ids, p.mask, greedy);
      }
    };
    run();
    for (int i = 0; i < repeats; ++i) times.push_back(fsdpx::bench::time_once(world, run));
    const double s = fsdpx::bench::median(times);
    if (world.rank() == 0) {
      std::printf(
          "RESULT mode=generate contender=fsdpx-sharded%s world=%d batch=%lld prompt=%lld new=%lld seconds=%.3f "
          "tokens_per_s=%.1f\n",
          held ? "-full-parameters" : "", world.size(), static_cast<long long>(batch), static_cast<long long>(prompt),
          static_cast<long long>(fresh), s, static_cast<double>(batch * fresh) / s);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s MODEL_DIR packed|generate [...]\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1], mode = argv[2];
  const auto arg = [&](int i, long long fallback) { return argc > i ? std::atoll(argv[i]) : fallback; };
  if (mode == "packed") {
    auto world = fsdpx::dist::MpiCommunicator::world();
    return packed(world, dir, arg(3, 16), static_cast<int>(arg(4, 2)), static_cast<uint64_t>(arg(5, 1)));
  }
  if (mode == "generate") return generate(dir, arg(3, 4), arg(4, 64), arg(5, 64), static_cast<int>(arg(6, 3)));
  std::fprintf(stderr, "bench_rl: MODE must be packed or generate, not '%s'\n", mode.c_str());
  return 2;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_rl: %s\n", e.what());
  return 1;
}
