// Issue 3's GPU parity at one rank (NCCL refuses two ranks per GPU; multi-rank parity is proven on CPU
// ranks with MPI): float32, pinned CPU offload and bfloat16, with the same harness and bounds as
// tests/core/test_parity.cpp (derived from the arithmetic: tests/support/rounding.hpp, so they hold on any
// GPU as on the CPU's kernel sets). Bootstraps NCCL from torchrun-style variables through the TCP store.
#define CATCH_CONFIG_RUNNER
// LibTorch first: c10/util/logging defines its own CHECK (abort on failure, never counted); Catch's,
// defined after it, must be the one these tests use.
#include <torch/torch.h>
#include <catch2/catch.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <optional>
#include <vector>

#include <c10/cuda/CUDAFunctions.h>

#include <fsdpx/dist/nccl.hpp>
#include <fsdpx/models.hpp>
#include <fsdpx/sync/synchronizer.hpp>

#include "../core/parity.hpp"
#include "../models/decoder_path.hpp"

using namespace fsdpx;
using namespace fsdpx::test;
namespace models = fsdpx::models;

namespace {
std::optional<ParityContext> g_context;
}  // namespace

fsdpx::test::ParityContext& fsdpx::test::parity_context() { return *g_context; }

TEST_CASE("GPU: GPT, FullShard, float32", "[gpu][parity]") {
  const GptConfig c;
  check_gpt_parity<Fsdp<Gpt, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<BlockImpl>>>(
      c, {.micro_steps = 2, .clip = 1.0});
}

TEST_CASE("GPU: GPT, FullShard, float32, stepped by FusedAdamW (ATen's CUDA kernel)", "[gpu][parity][optim]") {
  const GptConfig c;
  check_gpt_parity<Fsdp<Gpt, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<BlockImpl>>>(
      c, {.clip = 1.0, .fused_adamw = true});
}

TEST_CASE("GPU: GPT, FullShard + pinned CpuOffload, float32", "[gpu][parity][offload]") {
  const GptConfig c;
  check_gpt_parity<Fsdp<Gpt, FullShard, CpuOffload<true>, FullPrecision, ShardedStateDict, WrapModules<BlockImpl>>>(
      c, {.micro_steps = 2, .clip = 1.0});
}

TEST_CASE("GPU: pinned CpuOffload keeps shards and gradients in pinned host memory", "[gpu][offload]") {
  Gpt model(GptConfig{});
  model->to(parity_context().device);
  Fsdp<Gpt, FullShard, CpuOffload<true>, FullPrecision, ShardedStateDict, WrapModules<BlockImpl>> sharded(
      model, parity_context().comm);
  for (size_t i = 0; i < sharded.sharded().num_units(); ++i) {
    REQUIRE(sharded.sharded().unit(i).shard().is_cpu());
    REQUIRE(sharded.sharded().unit(i).shard().is_pinned());
  }
  for (const auto& p : sharded->parameters()) REQUIRE(p.is_cuda());  // the module computes on the GPU
}

TEST_CASE("GPU: GPT, FullShard + BF16Mixed", "[gpu][parity][bf16]") { check_bf16_parity(GptConfig{}, 5); }

// Issue 15: offload hands the GPU back. A GPT of ~50M parameters (200 MB of float32 shards, 400 MB with
// Adam's moments) trained one step, then offloaded: the driver's free memory must rise by at least
// the shards' and moments' bytes, and reloading must give back the same weights.
TEST_CASE("GPU: offload_model and optimizer-state offload return the memory to the driver", "[gpu][offload][trainer]") {
  GptConfig c;
  c.vocab = 8192, c.seq = 64, c.dim = 512, c.heads = 8, c.layers = 12;
  const auto device = parity_context().device;
  Gpt gpt(c);
  gpt->to(device);
  Fsdp<Gpt, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<BlockImpl>> model(gpt,
                                                                                                 parity_context().comm);
  auto optimizer = make_adamw(model, adamw());
  const auto tokens = at::randint(c.vocab, {4, c.seq + 1}, at::TensorOptions().dtype(at::kLong).device(device));
  model(tokens.narrow(1, 0, c.seq).contiguous(), tokens.narrow(1, 1, c.seq).contiguous()).backward();
  optimizer.step();
  optimizer.zero_grad();
  const int64_t shard_bytes = model.sharded_bytes().parameters;
  at::Tensor before;
  {
    auto scope = model.full_parameters();
    before = model->blocks[0]->fc->weight.detach().to(at::kCPU).clone();
  }
  c10::cuda::device_synchronize();
  const MemoryReport resident = memory_report(device);
  model.offload_model();
  move_optimizer_state(optimizer, at::Device(at::kCPU));
  c10::cuda::device_synchronize();
  const MemoryReport offloaded = memory_report(device);
  const int64_t freed = *offloaded.device_free_bytes - *resident.device_free_bytes;
  std::printf(
      "  offload: %.1f MiB of shards, %.1f MiB with Adam's moments; driver free memory rose by %.1f MiB "
      "(reserved %.1f -> %.1f MiB)\n",
      shard_bytes / 1048576.0, 3 * shard_bytes / 1048576.0, freed / 1048576.0, resident.reserved_bytes / 1048576.0,
      offloaded.reserved_bytes / 1048576.0);
  CHECK(freed >= 3 * shard_bytes);
  for (size_t i = 0; i < model.sharded().num_units(); ++i) CHECK(model.sharded().unit(i).shard().is_pinned());
  model.reload_model();
  move_optimizer_state(optimizer, device);
  auto scope = model.full_parameters();
  CHECK(at::equal(model->blocks[0]->fc->weight.detach().to(at::kCPU), before));
}

// Issue 33: packed samples on CUDA go through ATen's variable-length flash attention; it must equal
// attending sample by sample (SDPA per sample, the CPU path), forward and backward, with a
// sliding-window layer among the layers. Both in bfloat16: every stage of either may round its bfloat16
// result differently (the decoder's path stored in bfloat16, tests/models/decoder_path.hpp).
TEST_CASE("GPU: packed samples: variable-length flash attention equals attention sample by sample", "[gpu][packed]") {
  const auto device = parity_context().device;
  const fsdpx::detail::Json config = {{"model_type", "qwen2"},      {"architectures", {"Qwen2ForCausalLM"}},
                                      {"vocab_size", 512},          {"hidden_size", 256},
                                      {"intermediate_size", 512},   {"num_hidden_layers", 2},
                                      {"num_attention_heads", 4},   {"num_key_value_heads", 2},
                                      {"use_sliding_window", true}, {"sliding_window", 16},
                                      {"max_window_layers", 1},     {"max_position_embeddings", 512}};
  at::manual_seed(3);
  models::CausalLM model(models::parse_decoder_config(config, "config.json"));
  model->to(device, at::kBFloat16);
  const at::Tensor ids = at::randint(1, 512, {2, 96}, at::TensorOptions().dtype(at::kLong).device(device));
  const auto samples = models::PackedSamples::from_cu_seqlens(at::tensor({0, 30, 64, 96, 150, 192}, at::kLong), 2, 96);
  const auto run = [&] {
    for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
    const at::Tensor logits = model->forward(ids, samples);
    model->loss(ids, ids, samples).backward();
    std::map<std::string, at::Tensor> grads;
    for (const auto& p : model->named_parameters()) grads[p.key()] = p.value().grad().to(at::kFloat);
    return std::pair{logits.detach().to(at::kFloat), grads};
  };
  model->set_attention_backend(models::AttentionBackend::flash_varlen);  // an error, not a fallback, if it cannot run
  const auto [flash_logits, flash] = run();
  REQUIRE(model->attention_report().packed == models::AttentionBackend::flash_varlen);
  model->set_attention_backend(models::AttentionBackend::sdpa);
  const auto [logits, by_sample] = run();
  REQUIRE(model->attention_report().packed == models::AttentionBackend::sdpa);
  model->set_attention_backend(models::AttentionBackend::automatic);  // takes flash_varlen where it runs
  run();
  CHECK(model->attention_report().packed == models::AttentionBackend::flash_varlen);
  CHECK(model->attention_report().reason.empty());
  // Attention sums over the longest sample; every token but each sample's last predicts one.
  const int64_t longest = samples.max_length(), tokens = ids.numel() - static_cast<int64_t>(samples.spans().size());
  const double logits_error = (flash_logits - logits).abs().max().item<double>() / logits.abs().max().item<double>();
  const double gradients_error = fsdpx::test::max_gradient_error(flash, by_sample);
  const double logits_bound = fsdpx::test::logits_bound(model->config, longest, at::kBFloat16);
  const double gradient_bound = fsdpx::test::gradient_bound(model->config, longest, tokens, at::kBFloat16);
  std::printf(
      "  packed attention: varlen flash vs sample by sample, bf16: logits relative error %.2e (bound %.2e), "
      "gradients %.2e (bound %.2e)\n",
      logits_error, logits_bound, gradients_error, gradient_bound);
  CHECK(logits_error <= logits_bound);
  CHECK(gradients_error <= gradient_bound);
}

// Issue 51: Ulysses' two all-to-alls on a device, over NCCL, around causal attention in bfloat16 (SDPA
// picks flash or cuDNN there), forward and backward, against the same attention without them. At one rank
// each exchange copies the rank's own block on the GPU, so the outputs must be equal bit for bit; the
// gradients may differ by the attention backward's own nondeterminism (atomic sums in float32, rounded
// to bfloat16 once: at most one bfloat16 ulp of the largest gradient). What this proves is the device
// path: NCCL's all_to_all on CUDA tensors, ordered on the caller's stream, and autograd through it.
TEST_CASE("GPU: Ulysses exchanges over NCCL around bfloat16 attention equal the attention alone", "[gpu][ulysses]") {
  auto& ctx = parity_context();
  const auto options = at::TensorOptions().dtype(at::kBFloat16).device(ctx.device);
  const int64_t batch = 2, tokens = 1024, heads = 8, head_dim = 64;
  at::manual_seed(5);
  const at::Tensor q0 = at::randn({batch, tokens, heads, head_dim}, options),
                   k0 = at::randn({batch, tokens, heads, head_dim}, options),
                   v0 = at::randn({batch, tokens, heads, head_dim}, options),
                   upstream = at::randn({batch, tokens, heads, head_dim}, options.dtype(at::kFloat));
  const auto run = [&](bool exchange) {
    const at::Tensor q = q0.clone().requires_grad_(true), k = k0.clone().requires_grad_(true),
                     v = v0.clone().requires_grad_(true);
    const auto to_heads = [&](const at::Tensor& x) { return exchange ? models::sequence_to_heads(x, ctx.comm) : x; };
    at::Tensor y = at::scaled_dot_product_attention(to_heads(q).transpose(1, 2), to_heads(k).transpose(1, 2),
                                                    to_heads(v).transpose(1, 2), {}, 0.0, /*is_causal=*/true)
                       .transpose(1, 2)
                       .contiguous();
    if (exchange) y = models::heads_to_sequence(y, ctx.comm);
    (y.to(at::kFloat) * upstream).sum().backward();
    return std::vector<at::Tensor>{y.detach(), q.grad(), k.grad(), v.grad()};
  };
  const auto exchanged = run(true), alone = run(false);
  CHECK(at::equal(exchanged[0], alone[0]));
  const double ulp = std::ldexp(1.0, -7);  // bfloat16's spacing relative to a value in [1, 2)
  for (size_t i = 1; i < exchanged.size(); ++i) {
    const double error = (exchanged[i] - alone[i]).abs().max().item<double>();
    const double scale = alone[i].abs().max().item<double>();
    INFO("gradient " << i << ": largest difference " << error << ", largest gradient " << scale);
    CHECK(error <= ulp * scale);
  }
}

// Issue 34: a mixture of experts on CUDA in bfloat16: the grouped products (at::_grouped_mm, the default
// there) against one product per expert, logits and gradients, and the time of each. Bounds: the decoder's
// path stored in bfloat16, as above.
TEST_CASE("GPU: mixture of experts in bfloat16: grouped products equal one product per expert", "[gpu][moe]") {
  const auto device = parity_context().device;
  const fsdpx::detail::Json config = {
      // One layer: its routing sees the same inputs under both kernels (with two, bfloat16 rounding in the
      // first can flip a near tie in the second's top-k, and a token then trains another expert).
      {"model_type", "qwen3_moe"},
      {"vocab_size", 4096},
      {"hidden_size", 1024},
      {"num_hidden_layers", 1},
      {"num_attention_heads", 8},
      {"num_key_value_heads", 4},
      {"num_experts", 32},
      {"num_experts_per_tok", 4},
      {"moe_intermediate_size", 512},
      {"norm_topk_prob", true},
      {"max_position_embeddings", 4096}};
  at::manual_seed(5);
  models::CausalLM model(models::parse_decoder_config(config, "config.json"));
  model->to(device, at::kBFloat16);
  const at::Tensor ids = at::randint(1, 4096, {4, 1024}, at::TensorOptions().dtype(at::kLong).device(device));
  const auto run = [&](models::ExpertKernel kernel, double* seconds) {
    for (auto& layer : model->model->layers) layer->moe->kernel = kernel;
    std::pair<at::Tensor, std::map<std::string, at::Tensor>> out;
    for (int i = 0; i < 3; ++i) {  // the last of 3 is timed
      model->zero_grad();
      c10::cuda::device_synchronize();
      const auto t0 = std::chrono::steady_clock::now();
      const at::Tensor logits = model(ids);
      logits.to(at::kFloat).logsumexp(-1).mean().backward();
      c10::cuda::device_synchronize();
      *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      out.first = logits.detach().to(at::kFloat);
      out.second.clear();
      for (const auto& p : model->named_parameters()) {
        out.second[p.key()] =
            p.value().grad().defined() ? p.value().grad().to(at::kFloat) : at::zeros_like(p.value(), at::kFloat);
      }
    }
    return out;
  };
  double per_expert_s = 0, grouped_s = 0;
  const auto [logits, per_expert] = run(models::ExpertKernel::per_expert, &per_expert_s);
  const auto [grouped_logits, grouped] = run(models::ExpertKernel::grouped, &grouped_s);
  const int64_t positions = ids.size(1), tokens = ids.numel();  // the loss: every position's logsumexp
  const double logits_error = (grouped_logits - logits).abs().max().item<double>() / logits.abs().max().item<double>();
  const double gradients_error = fsdpx::test::max_gradient_error(grouped, per_expert);
  const double logits_bound = fsdpx::test::logits_bound(model->config, positions, at::kBFloat16);
  const double gradient_bound = fsdpx::test::gradient_bound(model->config, positions, tokens, at::kBFloat16);
  std::printf(
      "  MoE bf16 (32 experts, top-4, 4 x 1024 tokens): grouped vs per expert: logits relative error %.2e (bound "
      "%.2e), "
      "gradients %.2e (bound %.2e); forward+backward %.1f ms grouped, %.1f ms per expert (%.2fx)\n",
      logits_error, logits_bound, gradients_error, gradient_bound, grouped_s * 1e3, per_expert_s * 1e3,
      per_expert_s / grouped_s);
  CHECK(logits_error <= logits_bound);
  CHECK(gradients_error <= gradient_bound);
}

// Issue 35 on CUDA: versions published from host tensors (after real AdamW steps at an RL learning
// rate, in bfloat16) land in a CUDA rollout module, deltas in place on the device, every written tensor
// checked; a delta that does not check out there is undone on the device.
TEST_CASE("GPU: weight sync deltas land in a CUDA module bit for bit, and a damaged one is undone there",
          "[gpu][sync]") {
  const auto device = parity_context().device;
  const fsdpx::detail::Json config = {
      {"model_type", "qwen2"},  {"vocab_size", 512},        {"hidden_size", 128},       {"intermediate_size", 256},
      {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"tie_word_embeddings", false}};
  at::manual_seed(7);
  models::CausalLM trainer(models::parse_decoder_config(config, "config.json"));
  models::CausalLM rollout(models::parse_decoder_config(config, "config.json"));
  rollout->to(device, at::kBFloat16);
  torch::optim::AdamW opt(trainer->parameters(), torch::optim::AdamWOptions(1e-5));
  // Encodings by fewest bytes: the same every run (by time, a tensor sent whole would replace the
  // damaged one below instead of failing its check).
  fsdpx::sync::Synchronizer sync({.delta = {.link_bytes_per_second = 0}});
  fsdpx::sync::SynchronizerReader reader(sync);
  const auto bf16_weights = [&] {
    std::vector<fsdpx::sync::NamedTensor> out;
    for (const auto& p : trainer->named_parameters()) out.push_back({p.key(), p.value().detach().to(at::kBFloat16)});
    return out;
  };
  const auto rollout_equals = [&](const std::vector<fsdpx::sync::NamedTensor>& w) {
    auto params = rollout->named_parameters();
    for (const auto& t : w) {
      if (!at::equal(params[t.name].detach().cpu().view(at::kShort), t.tensor.view(at::kShort))) return false;
    }
    return true;
  };
  const auto step = [&](int s) {
    at::manual_seed(100 + s);
    const auto ids = at::randint(0, 512, {2, 32}, at::kLong);
    opt.zero_grad();
    trainer->loss(ids, ids).backward();
    opt.step();
  };
  for (int s = 1; s <= 4; ++s) {
    INFO("step " << s);
    step(s);
    const auto w = bf16_weights();
    sync.publish(s, w);
    CHECK(reader.load_newer_into(*rollout, std::chrono::seconds(5)) == s);
    CHECK(reader.last_was_delta() == (s > 1));
    CHECK(rollout_equals(w));
    reader.verify(*rollout);
  }
  // Every parameter changed on the device behind the reader's back, straight in memory: the next delta does not check
  // out (naming a tensor) and is undone there; the same version then comes whole.
  std::vector<at::Tensor> before;
  for (const auto& p : rollout->parameters()) {
    const at::Tensor t = p.detach();  // straight in memory, as a stray kernel would (no version counter moves)
    at::from_blob(t.data_ptr(), t.sizes(), t.options()).view({-1})[0].add_(1.0);
    before.push_back(t.clone());
  }
  step(5);
  const auto w = bf16_weights();
  sync.publish(5, w);
  CHECK_THROWS_WITH(reader.load_newer_into(*rollout, std::chrono::seconds(5)),
                    Catch::Contains("does not match its checksum") && Catch::Contains("tensor '"));
  const auto after = rollout->parameters();
  for (size_t i = 0; i < after.size(); ++i) CHECK(at::equal(after[i].detach(), before[i]));
  CHECK(reader.load_newer_into(*rollout, std::chrono::seconds(5)) == 5);
  CHECK_FALSE(reader.last_was_delta());
  CHECK(rollout_equals(w));
}

int main(int argc, char** argv) {
  const auto env = dist::detect_launch_env();
  const auto device = static_cast<c10::DeviceIndex>(env.local_rank);
  dist::Rendezvous rendezvous(env);
  auto comm = dist::NcclCommunicator::create(env.rank, env.world_size, device,
                                             dist::NcclCommunicator::unique_id(rendezvous, "gpu_parity"));
  g_context.emplace(ParityContext{comm, at::Device(at::kCUDA, device)});
  const int rc = Catch::Session().run(argc, argv);
  g_context.reset();
  return rc;
}
