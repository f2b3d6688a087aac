// rl_trainer: the loop of an RL post-training trainer, on toy data. The world splits into a trainer
// group and a rollout group (fsdpx::sync::split_trainer_rollout).
//
// Trainer ranks:
//   - the actor: a GPT sharded with fsdpx (FullShard, float32 masters), trained through
//     fsdpx::TrainStep (2 micro-steps per update, global-norm clip, cosine LR schedule with warmup);
//   - the reference: the same GPT frozen in bfloat16 (FsdpOptions::inference_only: 2 bytes per
//     parameter over the trainers, no gradients), loaded from the actor's initial weights, computing
//     per-token log-probabilities for a KL penalty: loss = NLL + beta * mean(logp_actor - logp_ref);
//   - after each update the new weights go to the rollouts (WeightBroadcaster), then the actor and its
//     optimizer state are offloaded while the rollouts generate (on a GPU: the device memory is handed
//     back to the driver; memory_report() says how much), and reloaded for the next update;
//   - checkpoints in the background (CheckpointCoordinator) with the scheduler's state; --resume
//     continues from the newest one, mid-schedule.
// Rollout ranks: an unsharded bfloat16 copy that receives every version and measures a held-out loss.
//
//   mpiexec -n 3 rl_trainer [--trainers 2] [--steps 8] [--stop-after N] [--save-every 4] [--ckpt-dir DIR] [--resume]
//                           [--corpus FILE]
//   torchrun --nproc-per-node=3 --no-python rl_trainer ...     (GPUs: NCCL, one GPU per rank)
#include <cmath>
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <sstream>
#include <string>

#include <torch/nn.h>
#include <torch/optim.h>

#include <fsdpx/fsdp.hpp>
#include <fsdpx/sync/broadcast.hpp>

#include "common/corpus.hpp"
#include "common/gpt.hpp"
#include "common/launch.hpp"

using fsdpx::examples::BlockImpl;
using fsdpx::examples::Gpt;
using fsdpx::examples::GptConfig;
using fsdpx::examples::GptImpl;

using Actor = fsdpx::Fsdp<Gpt, fsdpx::FullShard, fsdpx::NoOffload, fsdpx::FullPrecision, fsdpx::ShardedStateDict,
                          fsdpx::WrapModules<BlockImpl>>;
using Reference = fsdpx::Fsdp<Gpt, fsdpx::FullShard, fsdpx::NoOffload, fsdpx::BF16Mixed, fsdpx::ShardedStateDict,
                              fsdpx::WrapModules<BlockImpl>>;

namespace {

struct Args {
  int trainers = 2;
  int64_t steps = 8;
  int64_t stop_after = 0;  // > 0: stop after this step (an interrupted run), the schedule still spans --steps
  int64_t save_every = 4;
  int64_t batch = 8;  // global over the trainers, per micro-step
  int64_t micro_steps = 2;
  int64_t seq = 32;
  int64_t dim = 64;
  int64_t layers = 2;
  double lr = 3e-3;
  double kl_beta = 0.1;
  std::string ckpt_dir = "rl_trainer_checkpoints";
  bool resume = false;
  std::string corpus;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    const auto next = [&]() -> std::string {
      FSDPX_CHECK(i + 1 < argc, "rl_trainer: ", k, " needs a value");
      return argv[++i];
    };
    if (k == "--trainers") a.trainers = std::stoi(next());
    else if (k == "--steps") a.steps = std::stoll(next());
    else if (k == "--save-every") a.save_every = std::stoll(next());
    else if (k == "--stop-after") a.stop_after = std::stoll(next());
    else if (k == "--batch") a.batch = std::stoll(next());
    else if (k == "--micro-steps") a.micro_steps = std::stoll(next());
    else if (k == "--seq") a.seq = std::stoll(next());
    else if (k == "--dim") a.dim = std::stoll(next());
    else if (k == "--layers") a.layers = std::stoll(next());
    else if (k == "--lr") a.lr = std::stod(next());
    else if (k == "--kl-beta") a.kl_beta = std::stod(next());
    else if (k == "--ckpt-dir") a.ckpt_dir = next();
    else if (k == "--resume") a.resume = true;
    else if (k == "--corpus") a.corpus = next();
    else FSDPX_CHECK(false, "rl_trainer: unknown option ", k);
  }
  return a;
}

/// log p(target) per token, in float32.
at::Tensor token_log_probs(const at::Tensor& logits, const at::Tensor& targets) {
  return at::log_softmax(logits.to(at::kFloat), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1);
}

std::string memory_text(const c10::Device& device) {
  std::ostringstream os;
  os << fsdpx::memory_report(device);
  return os.str();
}

}  // namespace

int main(int argc, char** argv) try {
  const Args args = parse(argc, argv);
  auto [world, device] = fsdpx::examples::init_world();
  FSDPX_CHECK(world.size() > args.trainers, "rl_trainer: ", args.trainers,
              " trainers need at least one more rank for "
              "the rollouts; run it with mpiexec -n ",
              args.trainers + 1, " or more");
  FSDPX_CHECK(args.batch % args.trainers == 0, "rl_trainer: --batch must be a multiple of --trainers");
  auto groups = fsdpx::sync::split_trainer_rollout(world, args.trainers);  // collective over the world
  std::string corpus_path;
  const at::Tensor text = fsdpx::examples::load_corpus(args.corpus, corpus_path);
  const int64_t split = text.numel() * 9 / 10;  // the last tenth is held out for the rollouts
  const at::Tensor train = text.narrow(0, 0, split), held_out = text.narrow(0, split, text.numel() - split);

  GptConfig config;
  config.vocab = 256;
  config.seq = args.seq;
  config.dim = args.dim;
  config.heads = 4;
  config.layers = args.layers;
  const auto schedule = fsdpx::LrSchedule::cosine(/*warmup=*/2, /*total=*/args.steps, /*min_lr_ratio=*/0.1);
  const int64_t last_step = args.stop_after > 0 ? std::min(args.stop_after, args.steps) : args.steps;

  bool ok = true;
  if (groups.is_trainer()) {
    auto& trainers = *groups.trainer;
    const bool lead = trainers.rank() == 0;
    at::manual_seed(0);
    Gpt gpt(config);
    gpt->to(device);
    Actor actor(gpt, trainers);
    // The reference: the actor's initial weights, cast into bfloat16 shards as they load.
    Gpt frozen(config);
    frozen->to(device);
    Reference reference(frozen, trainers, {.inference_only = true});
    fsdpx::load_model_state_dict(reference, fsdpx::sharded_state_dict(actor));

    auto optimizer = fsdpx::make_adamw(actor, torch::optim::AdamWOptions(args.lr).weight_decay(0.1));
    fsdpx::LrScheduler scheduler(optimizer, schedule);
    int64_t start = 0;
    if (args.resume) {
      if (const auto info = fsdpx::load_checkpoint(actor, args.ckpt_dir, optimizer, scheduler)) {
        start = info->step;
        if (lead) {
          std::printf("rl_trainer: resumed from step %lld of %s (saved by %d trainers); LR %.3g\n",
                      static_cast<long long>(start), args.ckpt_dir.c_str(), info->saved_world_size, scheduler.lr());
        }
      } else if (lead) {
        std::printf("rl_trainer: no checkpoint in %s: starting from step 0\n", args.ckpt_dir.c_str());
      }
    }
    // The rollouts learn which versions will come (the first trainer is world rank 0).
    auto first_version = at::full({1}, start + 1, at::TensorOptions().dtype(at::kLong).device(device));
    world.broadcast(first_version, 0);
#if defined(FSDPX_WITH_BOOST)
    std::optional<fsdpx::CheckpointCoordinator> ckpt;
    if (args.save_every > 0) ckpt.emplace(args.ckpt_dir, actor, fsdpx::CheckpointOptions{.max_to_keep = 2});
#else
    FSDPX_CHECK(args.save_every == 0,
                "rl_trainer: fsdpx was built without Boost, so it cannot save checkpoints; pass --save-every 0");
#endif
    fsdpx::TrainStep<Actor> train_step(actor, optimizer, &scheduler,
                                       {.accumulation_steps = args.micro_steps, .max_grad_norm = 1.0});
    fsdpx::sync::WeightBroadcaster sender(actor, groups.model_update, {.dtype = at::kBFloat16});
    if (lead) {
      const auto held = reference.sharded_bytes();
      std::printf("rl_trainer: %d trainers (actor float32 + reference bf16: %.1f KiB per rank), %d rollouts, over %s\n",
                  args.trainers, held.parameters / 1024.0, world.size() - args.trainers,
                  std::string(world.backend_name()).c_str());
    }
    const int64_t per_rank = args.batch / args.trainers;
    double first_nll = -1, last_nll = 0;
    for (int64_t step = start + 1; step <= last_step; ++step) {
      double nll_sum = 0, kl_sum = 0;
      fsdpx::StepReport report;
      for (int64_t m = 0; m < args.micro_steps; ++m) {
        at::manual_seed(1000 * step + m);  // the same data whichever step the run started from
        const auto mine = fsdpx::examples::random_windows(train, args.batch, args.seq)
                              .narrow(0, trainers.rank() * per_rank, per_rank)
                              .to(device);
        const auto idx = mine.narrow(1, 0, args.seq).contiguous(), targets = mine.narrow(1, 1, args.seq).contiguous();
        at::Tensor ref_logp;
        {
          at::NoGradGuard no_grad;
          ref_logp = token_log_probs(reference.call(&GptImpl::logits, idx), targets);
        }
        const auto logp = token_log_probs(actor.call(&GptImpl::logits, idx), targets);
        const auto nll = -logp.mean();
        const auto kl = (logp - ref_logp).mean();
        ((nll + args.kl_beta * kl) / args.micro_steps).backward();
        report = train_step.optimizer_step();
        nll_sum += nll.item<double>();
        kl_sum += kl.item<double>();
      }
      auto means = at::tensor({nll_sum / args.micro_steps, kl_sum / args.micro_steps}, at::kDouble).to(device);
      trainers.all_reduce(means, fsdpx::dist::ReduceOp::avg);
      const double nll = means[0].item<double>(), kl = means[1].item<double>();
      if (first_nll < 0) first_nll = nll;
      last_nll = nll;

      sender.broadcast(step);
#if defined(FSDPX_WITH_BOOST)
      if (ckpt && step % args.save_every == 0) ckpt->save(step, actor, optimizer, scheduler);
#endif
      // The rollouts generate now: the actor's shards and optimizer state leave the device.
      actor.offload_model();
      fsdpx::move_optimizer_state(optimizer, at::Device(at::kCPU));
      const std::string offloaded = memory_text(device);
      actor.reload_model();
      fsdpx::move_optimizer_state(optimizer, device);
      if (lead) {
        std::printf("trainer: step %lld  nll %.4f  kl %.5f  grad-norm %.3f  lr %.3g  %s  offloaded: %s\n",
                    static_cast<long long>(step), nll, kl, report.grad_norm.value_or(0.0), report.lr,
                    report.stepped ? "stepped" : "SKIPPED", offloaded.c_str());
        std::fflush(stdout);
      }
      ok = ok && report.stepped && std::isfinite(kl);
    }
#if defined(FSDPX_WITH_BOOST)
    if (ckpt) ckpt->wait();
#endif
    if (last_step - start >= 2 && !(last_nll < first_nll)) {
      if (lead) std::printf("trainer: the loss did not fall (%.4f -> %.4f)\n", first_nll, last_nll);
      ok = false;
    }
  } else {
    Gpt rollout(config);  // its own initial values: everything it uses comes from the trainers
    rollout->to(device, at::kBFloat16);
    torch::NoGradGuard no_grad;
    fsdpx::sync::WeightReceiver receiver(*groups.model_update, {.device = device});
    at::manual_seed(7);
    const auto eval = fsdpx::examples::random_windows(held_out, 8, args.seq).to(device);
    auto first_version = at::zeros({1}, at::TensorOptions().dtype(at::kLong).device(device));
    world.broadcast(first_version, 0);
    for (int64_t expected = first_version.item<int64_t>(); expected <= last_step; ++expected) {
      const int64_t version = receiver.receive_into(*rollout);
      ok = ok && version == expected;
      const double loss =
          rollout->forward(eval.narrow(1, 0, args.seq).contiguous(), eval.narrow(1, 1, args.seq).contiguous())
              .item<double>();
      if (groups.rollout->rank() == 0) {
        std::printf("rollout: version %lld  held-out loss %.4f\n", static_cast<long long>(version), loss);
        std::fflush(stdout);
      }
    }
  }
  auto all_ok = at::full({1}, ok ? 1.0 : 0.0, at::TensorOptions().dtype(at::kDouble).device(device));
  world.all_reduce(all_ok, fsdpx::dist::ReduceOp::min);
  const bool passed = all_ok.item<double>() == 1.0;
  if (world.rank() == 0) std::printf("rl_trainer: %s\n", passed ? "done" : "FAILED");
  return passed ? 0 : 1;
} catch (const std::exception& e) {
  return fsdpx::examples::report_failure("rl_trainer", e);
}
