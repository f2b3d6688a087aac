// rl_hf: an RL post-training loop (GRPO-style policy gradient) on a Hugging Face model folder, with
// fsdpx's decoder doing everything a trainer asks of it. The world splits into trainer ranks and one
// or more rollout ranks (fsdpx::sync::split_trainer_rollout); with --trainers equal to the world size
// there are no rollout ranks and no weight sync.
//
// Each step, on every trainer rank:
//   1. sample: `--samples` completions of each of `--prompts` prompts (random tokens, left-padded to
//      different lengths) with CausalLM::generate from the sharded policy itself (Fsdp::call; each
//      decoding step gathers every unit, and the ranks agree when all rows reached EOS);
//   2. score: a toy reward, the fraction of a completion's tokens whose id is even, and its advantage
//      against the other completions of the same prompt (GRPO: (r - mean) / (std + 1e-4));
//   3. pack the prompt + completion rollouts without padding (models::pack_sequences) and compute their
//      per-token log-probs under the policy (with gradients) and under a frozen bfloat16 reference
//      (FsdpOptions::inference_only), over the completion tokens only;
//   4. step: loss = -mean(advantage * logp) + kl_beta * mean(logp - logp_ref), clipped, AdamW;
// With --sequence-parallel P, the trainer ranks form sequence groups of P (SequenceParallel): the ranks
// of a group sample the same prompts (generation runs with the group off) and take their rank 0's
// rollouts, pack them into rows of a multiple of P tokens and each take a slice of every row for the
// log-probs and the step (Ulysses).
//   5. send the new weights to the rollout ranks (WeightBroadcaster, bfloat16; with --delta each version
//      as the delta from the one before, checked on arrival) and checkpoint in the background every
//      --save-every steps (CheckpointCoordinator; --resume continues from the newest).
// Rollout ranks receive every version into an unsharded bfloat16 copy and report the reward of its
// samples on held-out prompts, always with the same seed (what a rollout engine would do with the weights).
//
//   mpiexec -n 3 rl_hf --model DIR [--trainers 2] [--steps 8] [--prompts 2] [--samples 4] [--new-tokens 12]
//                      [--lr 1e-3] [--kl-beta 0.02] [--eos ID] [--save-every 4] [--ckpt-dir DIR] [--resume]
//                      [--sequence-parallel P] [--delta]
//   torchrun --nproc-per-node=3 --no-python rl_hf ...     (GPUs: NCCL, one GPU per rank)
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <torch/optim.h>

#include <fsdpx/fsdp.hpp>
#include <fsdpx/models.hpp>
#include <fsdpx/sync/broadcast.hpp>

#include "common/launch.hpp"

namespace models = fsdpx::models;
// Sharded over the trainer ranks; --sequence-parallel sets the sequence groups' size at run time (1: none).
using Mesh = fsdpx::SequenceParallel<fsdpx::runtime_sequence_size, fsdpx::FullShard>;
using Policy = fsdpx::Fsdp<models::CausalLM, Mesh, fsdpx::NoOffload, fsdpx::FullPrecision, fsdpx::ShardedStateDict,
                           models::DecoderUnits>;
using Reference = fsdpx::Fsdp<models::CausalLM, Mesh, fsdpx::NoOffload, fsdpx::BF16Mixed, fsdpx::ShardedStateDict,
                              models::DecoderUnits>;

namespace {

struct Args {
  std::string model;
  int trainers = 0;  // 0: all ranks but one
  int64_t steps = 8;
  int64_t prompts = 2;  // per trainer rank
  int64_t samples = 4;  // completions per prompt
  int64_t prompt_tokens = 8;
  int64_t new_tokens = 12;
  int64_t pack_tokens = 0;  // 0: 4 x (prompt_tokens + new_tokens)
  double lr = 1e-3;
  double kl_beta = 0.02;
  double temperature = 1.0;
  std::optional<int64_t> eos;
  int64_t save_every = 4;
  std::string ckpt_dir = "rl_hf_checkpoints";
  bool resume = false;
  int sequence_parallel = 1;  // trainer ranks per sequence group
  bool delta = false;         // weight versions as deltas (cut versions)
};

/// This rank's positions [first, first + n) of rows' [rows, T - 1] next-token values (log_probs' layout).
at::Tensor slice_positions(const at::Tensor& whole, const std::optional<fsdpx::dist::AnyCommunicator>& group) {
  if (!group) return whole;
  const int64_t t = (whole.size(1) + 1) / group->size(), first = group->rank() * t;
  return whole.narrow(1, first, std::min(t, whole.size(1) - first));
}

/// Random prompts [count, prompt_tokens], row i left-padded to a length between 2 and prompt_tokens.
std::pair<at::Tensor, at::Tensor> make_prompts(int64_t count, int64_t tokens, int64_t vocab) {
  at::Tensor ids = at::randint(1, vocab, {count, tokens}, at::kLong), mask = at::ones({count, tokens}, at::kLong);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t pad = at::randint(0, tokens - 1, {1}, at::kLong).item<int64_t>();
    ids[i].narrow(0, 0, pad).fill_(0);
    mask[i].narrow(0, 0, pad).fill_(0);
  }
  return {ids, mask};
}

/// The toy reward of each row: the fraction of its new tokens (up to its length) with an even id.
at::Tensor rewards(const at::Tensor& fresh, const at::Tensor& lengths) {
  const at::Tensor valid = at::arange(fresh.size(1), at::kLong).unsqueeze(0) < lengths.unsqueeze(1);
  return ((fresh.remainder(2) == 0) & valid).sum(1).to(at::kDouble) / lengths.clamp_min(1).to(at::kDouble);
}

}  // namespace

int main(int argc, char** argv) try {
  Args args;
  CLI::App app("rl_hf: GRPO-style RL on a Hugging Face model folder with fsdpx");
  app.add_option("--model", args.model, "a Hugging Face model folder (Llama, Qwen2, Qwen3)")->required();
  app.add_option("--trainers", args.trainers, "trainer ranks (default: all but one; all: no rollout ranks)");
  app.add_option("--steps", args.steps, "policy updates");
  app.add_option("--prompts", args.prompts, "prompts per trainer rank and step");
  app.add_option("--samples", args.samples, "completions per prompt")->check(CLI::Range(2, 64));
  app.add_option("--prompt-tokens", args.prompt_tokens, "longest prompt")->check(CLI::Range(2, 4096));
  app.add_option("--new-tokens", args.new_tokens, "new tokens per completion at most")->check(CLI::Range(1, 4096));
  app.add_option("--pack-tokens", args.pack_tokens, "tokens per packed row (default: 4 rollouts' worth)");
  app.add_option("--lr", args.lr, "AdamW learning rate");
  app.add_option("--kl-beta", args.kl_beta, "weight of the KL penalty against the reference");
  app.add_option("--temperature", args.temperature, "sampling temperature");
  app.add_option("--eos", args.eos, "a token that ends a completion");
  app.add_option("--save-every", args.save_every, "checkpoint every N steps (0: never)");
  app.add_option("--ckpt-dir", args.ckpt_dir, "checkpoint directory");
  app.add_flag("--resume", args.resume, "continue from the newest checkpoint in --ckpt-dir");
  app.add_option("--sequence-parallel", args.sequence_parallel,
                 "trainer ranks that split each packed row (Ulysses); must divide the trainers and the attention heads")
      ->check(CLI::PositiveNumber);
  app.add_flag("--delta", args.delta, "send each weight version to the rollouts as the delta from the one before");
  CLI11_PARSE(app, argc, argv);

  auto [world, device] = fsdpx::examples::init_world();
  const int trainers = args.trainers > 0 ? args.trainers : std::max(1, world.size() - 1);
  FSDPX_CHECK(trainers <= world.size(), "rl_hf: --trainers ", trainers, " exceeds the world size ", world.size());
  const bool with_rollouts = trainers < world.size();
  std::optional<fsdpx::sync::TrainerRolloutGroups> groups;
  if (with_rollouts) groups.emplace(fsdpx::sync::split_trainer_rollout(world, trainers));  // collective
  const bool is_trainer = !groups || groups->is_trainer();
  const auto config = models::read_decoder_config(args.model);
  const models::GenerateOptions sampling{
      .max_new_tokens = args.new_tokens,
      .do_sample = true,
      .temperature = args.temperature,
      .eos_token_ids = args.eos ? std::vector<int64_t>{*args.eos} : std::vector<int64_t>{}};

  bool ok = true;
  if (is_trainer) {
    fsdpx::dist::AnyCommunicator trainer_comm = groups ? *groups->trainer : world;
    const int rank = trainer_comm.rank();
    const bool lead = rank == 0;
    const int P = args.sequence_parallel, sample_group = rank / P;  // the group's ranks sample the same rollouts
    auto policy = models::from_pretrained<Policy>(args.model, trainer_comm, {.device = device, .sequence_size = P});
    auto reference = models::from_pretrained<Reference>(args.model, trainer_comm,
                                                        {.device = device, .sequence_size = P, .inference_only = true});
    std::optional<fsdpx::dist::AnyCommunicator> group = policy.sequence_group();
    if (lead && group) std::printf("rl_hf: sequence groups of %d trainer ranks (Ulysses)\n", P);
    auto optimizer = fsdpx::make_adamw(policy, torch::optim::AdamWOptions(args.lr).weight_decay(0.0));
    int64_t start = 0;
    if (args.resume) {
      if (const auto info = fsdpx::load_checkpoint(policy, args.ckpt_dir, optimizer)) {
        start = info->step;
        if (lead)
          std::printf("rl_hf: resumed from step %lld of %s\n", static_cast<long long>(start), args.ckpt_dir.c_str());
      }
    }
    std::optional<fsdpx::sync::WeightBroadcaster> sender;
    if (groups) {
      auto first = at::full({1}, start + 1, at::TensorOptions().dtype(at::kLong).device(device));
      world.broadcast(first, 0);  // the rollouts learn which version comes first
      fsdpx::sync::BroadcastOptions options{.dtype = at::kBFloat16};
      if (args.delta) options.delta = fsdpx::sync::DeltaOptions{};  // receivers need none: each version says its kind
      sender.emplace(policy, groups->model_update, options);
    }
#if defined(FSDPX_WITH_BOOST)
    std::optional<fsdpx::CheckpointCoordinator> ckpt;
    if (args.save_every > 0) ckpt.emplace(args.ckpt_dir, policy, fsdpx::CheckpointOptions{.max_to_keep = 2});
#endif
    std::vector<double> history;  // mean reward per step
    for (int64_t step = start + 1; step <= args.steps; ++step) {
      // 1. sample (the same draws whichever step the run resumed from)
      at::manual_seed(static_cast<uint64_t>(1000 * step + sample_group));
      const auto [prompt_ids, prompt_mask] = make_prompts(args.prompts, args.prompt_tokens, config.vocab_size);
      const at::Tensor ids = prompt_ids.repeat_interleave(args.samples, 0),
                       mask = prompt_mask.repeat_interleave(args.samples, 0);
      models::GenerateOptions options = sampling;
      options.seed = static_cast<uint64_t>(step * 7919 + sample_group);
      models::GenerateOutput out;
      {
        at::NoGradGuard no_grad;
        models::SequenceGroupOff whole_rows(*policy.module());  // generation runs on whole rows
        out = policy.call(&models::CausalLMImpl::generate, ids.to(device), mask.to(device), options);
      }
      if (group) {  // the group trains on its rank 0's rollouts: a device's sampling need not agree bit for bit
        group->broadcast(out.sequences, 0);
        group->broadcast(out.generated_lengths, 0);
      }
      const at::Tensor fresh = out.sequences.narrow(1, ids.size(1), out.sequences.size(1) - ids.size(1)).cpu();
      const at::Tensor lengths = out.generated_lengths.cpu();

      // 2. score, and advantages within each prompt's group
      const at::Tensor reward = rewards(fresh, lengths);
      const at::Tensor grouped = reward.view({args.prompts, args.samples});
      const at::Tensor advantage =
          ((grouped - grouped.mean(1, true)) / (grouped.std(1, true, true) + 1e-4)).reshape({-1}).to(at::kFloat);

      // 3. pack prompt + completion (without padding) and mark the completion's targets
      std::vector<at::Tensor> rollouts;
      std::vector<int64_t> prompt_lengths;
      for (int64_t i = 0; i < ids.size(0); ++i) {
        const at::Tensor prompt = ids[i].masked_select(mask[i] == 1);
        prompt_lengths.push_back(prompt.size(0));
        rollouts.push_back(at::cat({prompt, fresh[i].narrow(0, 0, lengths[i].item<int64_t>())}));
      }
      const int64_t budget = args.pack_tokens > 0 ? args.pack_tokens : 4 * (args.prompt_tokens + args.new_tokens);
      const auto batch = models::pack_sequences(rollouts, {.token_budget = budget, .pad_to_multiple_of = P});
      at::Tensor completion = at::zeros({batch.input_ids.size(0), batch.input_ids.size(1) - 1});
      at::Tensor token_advantage = at::zeros_like(completion);
      for (size_t i = 0; i < rollouts.size(); ++i) {
        const auto& s = batch.placement[i];
        const int64_t first = s.start + prompt_lengths[i] - 1,
                      count = s.length - prompt_lengths[i];  // targets of new tokens
        completion[s.row].narrow(0, first, count).fill_(1);
        token_advantage[s.row].narrow(0, first, count).fill_(advantage[static_cast<int64_t>(i)].item<float>());
      }
      // Under sequence parallelism each rank takes its slice of the rows (checked equal over the group) and
      // of the targets; the count stays the rows' so that the group's shares sum to the rows' means.
      const at::Tensor count = completion.sum().clamp_min(1).to(device);
      completion = slice_positions(completion, group).to(device);
      token_advantage = slice_positions(token_advantage, group).to(device);
      const at::Tensor packed_ids =
          group ? models::sequence_slice(batch.input_ids, *group).to(device) : batch.input_ids.to(device);
      at::Tensor ref_logp;
      {
        at::NoGradGuard no_grad;
        ref_logp = reference.call(&models::CausalLMImpl::log_probs, packed_ids, batch.samples, models::LogProbOptions{})
                       .log_probs.to(at::kFloat);
      }
      const at::Tensor logp =
          policy.call(&models::CausalLMImpl::log_probs, packed_ids, batch.samples, models::LogProbOptions{}).log_probs;

      // 4. the policy-gradient step
      const at::Tensor pg = -(token_advantage * logp * completion).sum() / count;
      const at::Tensor kl = ((logp - ref_logp) * completion).sum() / count;
      optimizer.zero_grad();
      (pg + args.kl_beta * kl).backward();
      const auto norm = policy.clip_grad_norm_(1.0);
      optimizer.step();

      auto means = at::tensor({reward.mean().item<double>(), kl.item<double>() * P,  // P shares average to the mean
                               lengths.to(at::kDouble).mean().item<double>()},
                              at::kDouble)
                       .to(device);
      trainer_comm.all_reduce(means, fsdpx::dist::ReduceOp::avg);
      const double mean_reward = means[0].item<double>();
      history.push_back(mean_reward);
      ok = ok && std::isfinite(kl.item<double>()) && norm.is_finite();

      // 5. weights to the rollouts, a checkpoint now and then
      if (sender) sender->broadcast(step);
#if defined(FSDPX_WITH_BOOST)
      // With extra state (RNG states, the step): only such a step is complete, and resumable with its optimizer.
      if (ckpt && step % args.save_every == 0) ckpt->save(step, policy, optimizer, fsdpx::ExtraState{});
#endif
      if (lead) {
        std::printf(
            "trainer: step %lld  reward %.3f  kl %.5f  completion %.1f tokens  packed %lld rows x %lld  grad-norm "
            "%.3f\n",
            static_cast<long long>(step), mean_reward, means[1].item<double>(), means[2].item<double>(),
            static_cast<long long>(batch.input_ids.size(0)), static_cast<long long>(batch.input_ids.size(1)),
            norm.value);
        if (step == start + 1) std::printf("trainer: attention %s\n", policy->attention_report().to_string().c_str());
        std::fflush(stdout);
      }
    }
#if defined(FSDPX_WITH_BOOST)
    if (ckpt) ckpt->wait();
#endif
    // A run of 8 steps or more must have learnt something: the last three steps' reward above the first three's.
    if (history.size() >= 8) {
      const double first = (history[0] + history[1] + history[2]) / 3;
      const double last = (history[history.size() - 1] + history[history.size() - 2] + history[history.size() - 3]) / 3;
      if (lead)
        std::printf("trainer: mean reward of the first three steps %.3f, of the last three %.3f\n", first, last);
      ok = ok && last > first;
    }
  } else {
    models::CausalLM rollout(config);  // its own initial values: everything it uses comes from the trainers
    rollout->to(device, at::kBFloat16);
    at::NoGradGuard no_grad;
    fsdpx::sync::WeightReceiver receiver(*groups->model_update, {.device = device});
    at::manual_seed(99);
    const auto [held_out, held_out_mask] = make_prompts(8, args.prompt_tokens, config.vocab_size);
    auto first = at::zeros({1}, at::TensorOptions().dtype(at::kLong).device(device));
    world.broadcast(first, 0);
    for (int64_t expected = first.item<int64_t>(); expected <= args.steps; ++expected) {
      const int64_t version = receiver.receive_into(*rollout);
      ok = ok && version == expected;
      models::GenerateOptions options = sampling;
      options.seed = 99;
      const auto out = rollout->generate(held_out.to(device), held_out_mask.to(device), options);
      const at::Tensor fresh =
          out.sequences.narrow(1, held_out.size(1), out.sequences.size(1) - held_out.size(1)).cpu();
      if (groups->rollout->rank() == 0) {
        std::printf("rollout: version %lld  reward of held-out samples %.3f%s\n", static_cast<long long>(version),
                    rewards(fresh, out.generated_lengths.cpu()).mean().item<double>(),
                    receiver.last_was_delta() ? "  (delta)" : "");
        std::fflush(stdout);
      }
    }
  }
  auto all_ok = at::full({1}, ok ? 1.0 : 0.0, at::TensorOptions().dtype(at::kDouble).device(device));
  world.all_reduce(all_ok, fsdpx::dist::ReduceOp::min);
  const bool passed = all_ok.item<double>() == 1.0;
  if (world.rank() == 0) std::printf("rl_hf: %s\n", passed ? "done" : "FAILED");
  return passed ? 0 : 1;
} catch (const std::exception& e) {
  return fsdpx::examples::report_failure("rl_hf", e);
}
