// A model larger than one rank should hold: deferred_init + Fsdp materialize, shard and release it
// unit by unit. Measures each rank's peak RSS growth over construction + wrapping next to the model's
// size, then trains a step.
//   mpiexec -n 4 fsdpx_large_model deferred   (exits 1 if any rank held the whole model)
//   mpiexec -n 4 fsdpx_large_model eager      (for comparison: ordinary construction)
#include <cmath>
#include <cstdio>
#include <string>

#include <torch/nn.h>
#include <torch/optim.h>

#include <fsdpx/fsdp.hpp>

#include "../../examples/common/gpt.hpp"
#include "../../examples/common/memory.hpp"

using namespace fsdpx;
using examples::BlockImpl;
using examples::Gpt;
using examples::GptConfig;
using examples::peak_rss_mib;

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "deferred";
  auto world = dist::MpiCommunicator::world();
  GptConfig c;
  c.vocab = 8192;
  c.seq = 64;
  c.dim = 768;
  c.heads = 8;
  c.layers = 8;

  const double before = peak_rss_mib();
  at::manual_seed(0);
  Gpt model = mode == "deferred" ? deferred_init<Gpt>(c) : Gpt(c);
  int64_t numel = 0;
  for (const auto& p : model->parameters()) numel += p.numel();
  Fsdp<Gpt, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<BlockImpl>> sharded(model, world);
  const double growth = peak_rss_mib() - before;

  const double model_mib = numel * 4.0 / (1 << 20);
  int64_t largest_unit = 0;
  for (size_t i = 0; i < sharded.sharded().num_units(); ++i) {
    largest_unit = std::max(largest_unit, sharded.sharded().unit(i).layout().padded_numel());
  }
  // Its share, two units in flight (one materialized, one being sharded), and a fixed allowance for the
  // process itself (MPI and torch thread arenas), whose growth varies by ~32 MiB run to run under load.
  const double bound = model_mib / world.size() + 2.0 * largest_unit * 4 / (1 << 20) + 96;
  auto worst = at::full({1}, growth, at::kDouble);
  world.all_reduce(worst, dist::ReduceOp::max);

  // The materialized model is initialized (LayerNorm weights 1, biases 0) and trains.
  at::manual_seed(1);
  const auto tokens = at::randint(c.vocab, {1, c.seq + 1}, at::kLong);
  const auto options = torch::optim::AdamWOptions(1e-4);
  auto optimizer = make_adamw(sharded, options);
  auto loss = sharded(tokens.narrow(1, 0, c.seq).contiguous(), tokens.narrow(1, 1, c.seq).contiguous());
  loss.backward();
  optimizer.step();
  bool initialized = std::isfinite(loss.item<float>()) && std::abs(loss.item<float>() - std::log(8192.0f)) < 2.0f;
  {
    auto full = sharded.full_parameters();
    // Initialized to ones, then one AdamW step: lr |m_hat| / (sqrt(v_hat) + eps) <= lr (m_hat = g and
    // v_hat = g^2 at the first step); a norm's weight does not decay (make_adamw); and the float32 rounding
    // of 1 - step.
    const double moved = options.lr() + 0x1p-24;
    initialized = initialized && at::allclose(sharded->ln_f->weight, at::ones_like(sharded->ln_f->weight), 0, moved) &&
                  sharded->tok->weight.std().item<float>() > 0.5f;  // N(0, 1), not garbage or zeros
  }
  if (world.rank() == 0) {
    std::printf(
        "RESULT mode=%s ranks=%d params=%lld model_mib=%.0f peak_growth_mib=%.0f (%.2f of the model) "
        "bound_mib=%.0f first_loss=%.3f initialized=%d\n",
        mode.c_str(), world.size(), static_cast<long long>(numel), model_mib, worst.item<double>(),
        worst.item<double>() / model_mib, bound, loss.item<float>(), initialized ? 1 : 0);
  }
  if (mode == "deferred" && (worst.item<double>() > bound || worst.item<double>() >= model_mib || !initialized)) {
    if (world.rank() == 0) std::fprintf(stderr, "fsdpx_large_model: a rank held more than its share\n");
    return 1;
  }
  return 0;
}
