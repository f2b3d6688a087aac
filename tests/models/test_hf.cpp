// Hugging Face models loaded into fsdpx's decoder, sharded at this job's world size (mpiexec -n 1..3),
// against transformers' own outputs on the same tokens (tests/models/make_hf_models.py made the
// folders and the outputs; FSDPX_HF_FIXTURES names their directory).
#include <catch2/catch.hpp>

#include <cstdlib>
#include <filesystem>
#include <cerrno>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include <unistd.h>

#include <torch/csrc/autograd/autograd.h>
#include <torch/optim.h>

#include <fsdpx/fsdp.hpp>
#include <fsdpx/models.hpp>

#include "../support/mpi_world.hpp"
#include "decoder_path.hpp"

namespace {

namespace fs = std::filesystem;
namespace models = fsdpx::models;

using Sharded = fsdpx::Fsdp<models::CausalLM, fsdpx::FullShard, fsdpx::NoOffload, fsdpx::FullPrecision,
                            fsdpx::ShardedStateDict, fsdpx::WrapModules<models::DecoderLayerImpl>>;
using ShardedBf16 = fsdpx::Fsdp<models::CausalLM, fsdpx::FullShard, fsdpx::NoOffload, fsdpx::BF16Mixed,
                                fsdpx::ShardedStateDict, fsdpx::WrapModules<models::DecoderLayerImpl>>;

fs::path fixtures() {
  const char* dir = std::getenv("FSDPX_HF_FIXTURES");
  REQUIRE(dir != nullptr);
  REQUIRE(fs::exists(fs::path(dir) / "READY"));
  return dir;
}

using fsdpx::test::gradient_bound;
using fsdpx::test::logits_bound;
using fsdpx::test::loss_bound;
namespace rounding = fsdpx::test::rounding;

/// The entropy per token: the log-probabilities' path and one more sum over the vocabulary.
double entropy_bound(const models::DecoderConfig& c, int64_t positions) {
  auto path = fsdpx::test::decoder_path(c, positions);
  ++path.depth;
  return rounding::relative(path);
}

/// max |a - b| / max |b|: the error relative to the logits' scale.
double relative_error(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kFloat) - b.to(at::kFloat)).abs().max().item<double>() / b.abs().max().item<double>();
}

at::Tensor ref(const std::string& model, const std::string& name) {
  fsdpx::hf::SafetensorsDir dir(fixtures() / (model + ".ref.safetensors"));
  return dir.read(name);
}

const char* const float32_models[] = {"llama_gqa", "qwen2_tied", "qwen3_qknorm", "qwen3_moe", "qwen2_moe"};
const char* const moe_models[] = {"qwen3_moe", "qwen2_moe"};
const char* const bf16_models[] = {"llama_gqa_bf16", "qwen3_qknorm_bf16"};

}  // namespace

TEST_CASE("hf: logits of the sharded model equal transformers' (float32 files)", "[hf]") {
  auto& world = fsdpx::test::world();
  for (const char* name : float32_models) {
    INFO(name << " at world size " << world.size());
    fsdpx::SafetensorsLoadReport report;
    auto model = models::from_pretrained<Sharded>(fixtures() / name, world, {}, {}, &report);
    CHECK(report.ok());
    CHECK(report.tensors > 0);
    const at::Tensor ids = ref(name, "input_ids");
    const double bound = logits_bound(model->config, ids.size(1));
    const double err = relative_error(model(ids), ref(name, "logits"));
    const double masked = relative_error(model(ids, ref(name, "attention_mask")), ref(name, "logits_masked"));
    const double left = relative_error(model(ids, ref(name, "attention_mask_left")), ref(name, "logits_left"));
    if (world.rank() == 0) {
      std::printf("hf parity: %s, %d ranks: relative error %.2e, right-padded %.2e, left-padded %.2e (bound %.2e)\n",
                  name, world.size(), err, masked, left, bound);
    }
    CHECK(err <= bound);
    CHECK(masked <= bound);
    CHECK(left <= bound);
    // Elementwise, at most 8 operations (the power, the division, Llama 3.1's scaling and blend), each
    // correctly rounded or within an ulp: two implementations differ by at most 2u per operation.
    CHECK(at::allclose(model->model->rotary.inv_freq(), ref(name, "inv_freq"),
                       8 * 2 * rounding::unit_roundoff(at::kFloat), 0));
  }
}

TEST_CASE("hf: bfloat16 files load exactly into float32 masters", "[hf]") {
  // bfloat16 -> float32 is exact, so in float32 compute the bound is the float32 one: transformers loads
  // the same files upcast (dtype=float32).
  auto& world = fsdpx::test::world();
  for (const char* name : bf16_models) {
    INFO(name);
    auto model = models::from_pretrained<Sharded>(fixtures() / name, world);
    const at::Tensor ids = ref(name, "input_ids");
    const double err = relative_error(model(ids), ref(name, "logits"));
    const double bound = logits_bound(model->config, ids.size(1));
    if (world.rank() == 0)
      std::printf("hf parity: %s (bfloat16 files, float32 compute): relative error %.2e (bound %.2e)\n", name, err,
                  bound);
    CHECK(err <= bound);
  }
}

TEST_CASE("hf: BF16Mixed against transformers in bfloat16", "[hf]") {
  // Both compute in bfloat16 from the same bfloat16 weights, rounding in the same places (fsdpx casts
  // its float32 masters to bfloat16 per unit, exactly the files' values; RoPE tables and norms round as
  // transformers rounds them). With the same ATen kernels they agree bit for bit; other kernels (another
  // kernel set, a GPU's) may round any stage's bfloat16 result (u = 2^-8) differently: the decoder's
  // path with every stage stored in bfloat16.
  auto& world = fsdpx::test::world();
  for (const char* name : bf16_models) {
    INFO(name);
    auto model = models::from_pretrained<ShardedBf16>(fixtures() / name, world);
    const at::Tensor ids = ref(name, "input_ids");
    const at::Tensor logits = model(ids);
    CHECK(logits.scalar_type() == at::kBFloat16);
    const double err = relative_error(logits, ref(name, "logits_bf16"));
    const double bound = logits_bound(model->config, ids.size(1), at::kBFloat16);
    if (world.rank() == 0)
      std::printf("hf parity: %s, BF16Mixed vs transformers bfloat16: relative error %.2e (bound %.2e)\n", name, err,
                  bound);
    CHECK(err <= bound);
  }
}

TEST_CASE("hf: a frozen bfloat16 copy (inference_only) loads the files as they are", "[hf]") {
  // An RL trainer's reference model: shards kept in bfloat16 (2 bytes per parameter over the ranks).
  auto& world = fsdpx::test::world();
  for (const char* name : bf16_models) {
    INFO(name);
    auto model = models::from_pretrained<ShardedBf16>(fixtures() / name, world, {.inference_only = true});
    CHECK(model.sharded().unit(0).shard().scalar_type() == at::kBFloat16);
    at::NoGradGuard no_grad;
    const at::Tensor ids = ref(name, "input_ids");
    CHECK(relative_error(model(ids), ref(name, "logits_bf16")) <=
          logits_bound(model->config, ids.size(1), at::kBFloat16));
  }
}

TEST_CASE("hf: hybrid sharding with CPU offload loads its shards (each replica reads its own)", "[hf]") {
  using Hybrid = fsdpx::Fsdp<models::CausalLM, fsdpx::HybridShard<1>, fsdpx::CpuOffload<false>, fsdpx::FullPrecision,
                             fsdpx::ShardedStateDict, fsdpx::WrapModules<models::DecoderLayerImpl>>;
  auto& world = fsdpx::test::world();
  fsdpx::SafetensorsLoadReport report;
  auto model = models::from_pretrained<Hybrid>(fixtures() / "llama_gqa", world, {}, {}, &report);
  CHECK(report.bytes_read ==
        fsdpx::hf::SafetensorsDir(fixtures() / "llama_gqa").total_bytes());  // a whole replica each
  const at::Tensor ids = ref("llama_gqa", "input_ids");
  CHECK(relative_error(model(ids), ref("llama_gqa", "logits")) <= logits_bound(model->config, ids.size(1)));
}

TEST_CASE("hf: a full disk on the writing rank is an error on every rank, and nothing is left half-written",
          "[hf][errors]") {
  auto& world = fsdpx::test::world();
  auto model = models::from_pretrained<Sharded>(fixtures() / "llama_gqa", world);
  const fs::path out = fs::temp_directory_path() / ("fsdpx_test_hf_full_disk_" + std::to_string(::getppid()));
  if (world.rank() == 0) fs::remove_all(out);
  world.barrier();
  if (world.rank() == 0) fsdpx::detail::inject_write_error(ENOSPC, 100'000);  // the disk fills during the weights
  std::string error;
  try {
    models::save_pretrained(model, out, {.source_dir = fixtures() / "llama_gqa", .max_shard_bytes = 20'000});
  } catch (const fsdpx::IoError& e) {
    error = e.what();
  }
  if (world.rank() == 0) fsdpx::detail::inject_write_error(0);
  INFO(error);
  if (world.rank() == 0) {
    CHECK_THAT(error, Catch::Contains("ENOSPC: the disk is full"));
  } else {
    CHECK_THAT(error, Catch::Contains("failed on rank 0") && Catch::Contains("ENOSPC"));
  }
  world.barrier();
  if (world.rank() == 0) {
    CHECK_FALSE(fs::exists(out / "config.json"));  // the folder does not pass for a model
    for (const auto& e : fs::directory_iterator(out)) CHECK(e.path().extension() != ".tmp");
    fs::remove_all(out);
  }
  // and the model still works: the next save succeeds
  const fs::path again = out.string() + "_again";
  models::save_pretrained(model, again, {});
  if (world.rank() == 0) {
    CHECK(fs::exists(again / "config.json"));
    fs::remove_all(again);
  }
}

TEST_CASE("hf: an unsharded CausalLM loads and computes the same", "[hf]") {
  for (const char* name : float32_models) {
    INFO(name);
    models::CausalLM model(models::read_decoder_config(fixtures() / name));
    const auto report = models::load_pretrained(model, fixtures() / name);
    CHECK(report.ok());
    at::NoGradGuard no_grad;
    const at::Tensor ids = ref(name, "input_ids");
    CHECK(relative_error(model(ids), ref(name, "logits")) <= logits_bound(model->config, ids.size(1)));
  }
}

TEST_CASE("hf: each rank reads only the bytes of its own shards", "[hf]") {
  auto& world = fsdpx::test::world();
  const fs::path dir = fixtures() / "llama_gqa";
  fsdpx::SafetensorsLoadReport report;
  auto model = models::from_pretrained<Sharded>(dir, world, {}, {}, &report);
  const int64_t total = fsdpx::hf::SafetensorsDir(dir).total_bytes();
  int64_t shard_bytes = 0;  // the parameters' elements this rank holds, in the files' float32
  for (size_t i = 0; i < model.sharded().num_units(); ++i) {
    const auto& u = model.sharded().unit(i);
    for (const auto& p : u.layout().params()) {
      const auto r = u.held_range(p);
      shard_bytes += std::max<int64_t>(0, r.end - r.begin) * 4;
    }
  }
  CHECK(report.bytes_read == shard_bytes);
  auto sum = at::full({1}, static_cast<double>(report.bytes_read), at::kDouble);
  world.all_reduce(sum, fsdpx::dist::ReduceOp::sum);
  CHECK(static_cast<int64_t>(sum.item<double>()) == total);  // together, the files once
}

// ---- long sequences: the chunked head, embedding and head as units, checkpointed layers ---------------

namespace {

/// The parameters' gradients of `model` after `backward` of `loss` (cleared first).
std::map<std::string, at::Tensor> gradients_of(models::CausalLM& model, const std::function<at::Tensor()>& loss) {
  model->zero_grad();
  loss().backward();
  std::map<std::string, at::Tensor> out;
  for (const auto& p : model->named_parameters()) {
    if (p.value().grad().defined()) out[p.key()] = p.value().grad().clone();
  }
  return out;
}

double max_relative(const std::map<std::string, at::Tensor>& a, const std::map<std::string, at::Tensor>& b) {
  REQUIRE(a.size() == b.size());
  return fsdpx::test::max_gradient_error(a, b);
}

using ShardedUnits =
    fsdpx::Fsdp<models::CausalLM, fsdpx::FullShard, fsdpx::NoOffload, fsdpx::FullPrecision, fsdpx::ShardedStateDict,
                models::DecoderUnits, fsdpx::CheckpointNames<"model.layers.*">>;

}  // namespace

TEST_CASE("hf: the chunked loss and log-probs equal the unchunked ones and transformers', with their gradients",
          "[hf]") {
  for (const char* name : float32_models) {
    INFO(name);
    models::CausalLM model(models::read_decoder_config(fixtures() / name));
    REQUIRE(models::load_pretrained(model, fixtures() / name).ok());
    const at::Tensor ids = ref(name, "input_ids"), mask = ref(name, "attention_mask");
    const at::Tensor labels = ids.masked_fill(mask == 0, -100);
    const int64_t vocab = model->config.vocab_size, positions = ids.size(1);
    // Chunked and whole share the hidden states; they differ in the head's product and the log-softmax
    // (chunks of other row counts), per token, and in the loss's mean over the tokens.
    const rounding::Path head{.length = std::max(model->config.hidden_size, vocab), .depth = 2};
    // 5 tokens per chunk: 24 tokens make 5 chunks, the last one short.
    const auto loss_with = [&](int64_t chunk_logits, bool masked) {
      model->chunk_logits = chunk_logits;
      return masked ? model->loss(ids, labels, mask) : model->loss(ids, ids);
    };
    for (const bool masked : {false, true}) {
      INFO("padding masked: " << masked);
      const at::Tensor want = ref(name, masked ? "loss_masked" : "loss");
      const int64_t tokens = (masked ? labels : ids).narrow(1, 1, positions - 1).ne(-100).sum().item<int64_t>();
      const at::Tensor chunked = loss_with(5 * vocab, masked), whole = loss_with(0, masked);
      const auto g_chunked = gradients_of(model, [&] { return loss_with(5 * vocab, masked); });
      const auto g_whole = gradients_of(model, [&] { return loss_with(0, masked); });
      const double loss_error = relative_error(chunked, whole), gradients_error = max_relative(g_chunked, g_whole);
      if (fsdpx::test::world().rank() == 0) {
        std::printf("hf chunked loss: %s%s: loss relative error %.2e (bound %.2e), gradients %.2e (bound %.2e)\n", name,
                    masked ? ", padding masked" : "", loss_error, rounding::relative(rounding::loss(head, tokens)),
                    gradients_error, gradient_bound(model->config, positions, tokens));
      }
      CHECK(loss_error <= rounding::relative(rounding::loss(head, tokens)));
      CHECK(relative_error(chunked, want) <= loss_bound(model->config, positions, tokens));
      CHECK(gradients_error <= gradient_bound(model->config, positions, tokens));
    }
    const auto log_probs_with = [&](int64_t chunk_logits) {
      return model->log_probs(ids, {}, {.chunk_logits = chunk_logits, .entropy = true});
    };
    const auto chunked = log_probs_with(5 * vocab), whole = log_probs_with(0);
    CHECK(relative_error(chunked.log_probs, whole.log_probs) <= rounding::relative(head));
    CHECK(relative_error(chunked.log_probs, ref(name, "log_probs")) <= logits_bound(model->config, positions));
    CHECK(relative_error(chunked.entropy, ref(name, "entropy")) <= entropy_bound(model->config, positions));
    // An RL objective of both, differentiated through the chunks and at once.
    const auto objective = [&](int64_t chunk_logits) {
      const auto r = log_probs_with(chunk_logits);
      return (r.log_probs * at::linspace(-1, 1, r.log_probs.numel()).view(r.log_probs.sizes())).sum() +
             0.1 * r.entropy.sum();
    };
    CHECK(max_relative(gradients_of(model, [&] { return objective(5 * vocab); }), gradients_of(model, [&] {
                         return objective(0);
                       })) <= gradient_bound(model->config, positions, ids.size(0) * (positions - 1)));
    // With a temperature, against log_softmax(logits / T) of the whole logits.
    const auto hot = model->log_probs(ids, {}, {.chunk_logits = 5 * vocab, .temperature = 0.7});
    const at::Tensor logits = ref(name, "logits").narrow(1, 0, ids.size(1) - 1) / 0.7;
    const at::Tensor want =
        at::log_softmax(logits, -1).gather(-1, ids.narrow(1, 1, ids.size(1) - 1).unsqueeze(-1)).squeeze(-1);
    CHECK(relative_error(hot.log_probs, want) <= logits_bound(model->config, positions));
  }
}

TEST_CASE(
    "hf: the chunked loss with a bias, either reduction and no gradients; every label ignored gives NaN and "
    "zero gradients; a label outside the vocabulary is an error",
    "[hf]") {
  at::manual_seed(3);
  const int64_t vocab = 11;
  const at::Tensor hidden = at::randn({2, 7, 8}).requires_grad_(), weight = at::randn({vocab, 8}).requires_grad_(),
                   bias = at::randn({vocab}).requires_grad_();
  at::Tensor labels = at::randint(vocab, {2, 7}, at::kLong);
  labels.select(0, 0).select(0, 3).fill_(-100);
  const auto grads_of = [&](const at::Tensor& loss) { return torch::autograd::grad({loss}, {hidden, weight, bias}); };
  for (const auto reduction : {models::LossReduction::mean, models::LossReduction::sum}) {
    const auto loss = [&](int64_t chunk_logits, const at::Tensor& y) {
      return models::linear_cross_entropy(hidden, weight, y, {.chunk_logits = chunk_logits, .reduction = reduction},
                                          bias);
    };
    // 3 tokens per chunk: 14 tokens make 5 chunks, the last one short. The head's product (8 terms) and
    // the log-softmax (11) per token, the 13 labelled tokens' sum; their gradients mirror those sums and
    // the weight's and bias's sum over the 14 tokens.
    const rounding::Path head{.length = vocab, .depth = 2};
    const at::Tensor chunked = loss(3 * vocab, labels), whole = loss(0, labels);
    CHECK(relative_error(chunked, whole) <= rounding::relative(rounding::loss(head, 13)));
    const auto g_chunked = grads_of(chunked), g_whole = grads_of(whole);
    for (size_t i = 0; i < g_whole.size(); ++i) {
      CHECK(relative_error(g_chunked[i], g_whole[i]) <= rounding::relative(rounding::backward(head, 14)));
    }
    {
      at::NoGradGuard no_grad;
      CHECK(at::equal(loss(3 * vocab, labels), chunked.detach()));
    }
    if (reduction == models::LossReduction::mean) {
      const at::Tensor nothing = loss(3 * vocab, at::full_like(labels, -100));
      CHECK(at::isnan(nothing).item<bool>());
      for (const at::Tensor& g : grads_of(nothing)) CHECK(g.abs().max().item<double>() == 0);
    }
    // Its gradients are made in forward and handed on in backward: a second backward is refused.
    const at::Tensor twice = loss(3 * vocab, labels);
    (void)torch::autograd::grad({twice}, {weight}, {}, /*retain_graph=*/true);
    CHECK_THROWS_WITH(torch::autograd::grad({twice}, {weight}), Catch::Contains("cannot be differentiated twice"));
    CHECK_THROWS_WITH(loss(3 * vocab, labels.masked_fill(labels == labels[1][2], vocab)),
                      Catch::Contains("every label must be a token id in [0, 11) or the ignore index -100"));
  }
}

TEST_CASE(
    "hf: embedding and head as units of their own: the root holds only the final norm; logits, loss and "
    "log-probs equal transformers'",
    "[hf]") {
  auto& world = fsdpx::test::world();
  for (const char* name : float32_models) {
    INFO(name << " at world size " << world.size());
    auto model = models::from_pretrained<ShardedUnits>(fixtures() / name, world,
                                                       {.reshard_after_forward_for = models::reshard_all_but_head});
    std::vector<std::string> root;
    for (const auto& p : model.sharded().unit(0).layout().params()) root.push_back(p.name);
    CHECK(root == std::vector<std::string>{"model.norm.weight"});
    const bool tied = model->config.tie_word_embeddings;
    CHECK(model.sharded().num_units() == static_cast<size_t>(model->config.num_hidden_layers + (tied ? 2 : 3)));
    const at::Tensor ids = ref(name, "input_ids"), mask = ref(name, "attention_mask");
    const int64_t positions = ids.size(1);
    const double bound = logits_bound(model->config, positions);
    CHECK(relative_error(model(ids), ref(name, "logits")) <= bound);
    CHECK(relative_error(model(ids, mask), ref(name, "logits_masked")) <= bound);
    const at::Tensor labels = ids.masked_fill(mask == 0, -100);
    const at::Tensor loss = model.call(&models::CausalLMImpl::loss, ids, labels, mask);
    const int64_t tokens = labels.narrow(1, 1, positions - 1).ne(-100).sum().item<int64_t>();
    CHECK(relative_error(loss, ref(name, "loss_masked")) <= loss_bound(model->config, positions, tokens));
    const auto lp =
        model.call(&models::CausalLMImpl::log_probs, ids, at::Tensor(), models::LogProbOptions{.entropy = true});
    CHECK(relative_error(lp.log_probs, ref(name, "log_probs")) <= bound);
    CHECK(relative_error(lp.entropy, ref(name, "entropy")) <= entropy_bound(model->config, positions));
    for (size_t i = 1; i < model.sharded().num_units(); ++i) {  // freed after each call, but the head
      INFO(model.sharded().unit(i).name());
      CHECK(model.sharded().unit(i).unsharded_bytes() ==
            (model.sharded().unit(i).name() == "lm_head" ? model.sharded().unit(i).layout().padded_numel() * 4 : 0));
    }
  }
}

TEST_CASE("hf: layers checkpointed, embedding and head as units, the chunked loss: trains as the unsharded model",
          "[hf][checkpointing]") {
  auto& world = fsdpx::test::world();
  const int W = world.size(), rank = world.rank();
  for (const char* name : {"llama_gqa", "qwen2_tied"}) {
    INFO(name << " at world size " << W);
    auto model = models::from_pretrained<ShardedUnits>(fixtures() / name, world,
                                                       {.reshard_after_forward_for = models::reshard_all_but_head});
    model->chunk_logits = 5 * model->config.vocab_size;
    models::CausalLM reference(models::read_decoder_config(fixtures() / name));
    models::load_pretrained(reference, fixtures() / name);
    reference->chunk_logits = 0;  // transformers' way: all logits at once, nothing recomputed
    const auto options = torch::optim::AdamWOptions(1e-2).weight_decay(0.0).eps(1e-6);
    auto optimizer = fsdpx::make_adamw(model, options);
    torch::optim::AdamW ref_optimizer(reference->parameters(), options);
    // Each step from the same weights (StepParity): loss, every gradient and updated weight this rank holds.
    const int64_t positions = 12;
    fsdpx::test::StepParity parity(fsdpx::test::decoder_step_bounds(model->config, positions, 2 * W * (positions - 1)));
    for (int step = 0; step < 3; ++step) {
      at::manual_seed(500 + step);
      const at::Tensor ids = at::randint(1, model->config.vocab_size, {2 * W, positions}, at::kLong);
      const at::Tensor mine = ids.narrow(0, 2 * rank, 2);
      optimizer.zero_grad();
      const at::Tensor loss = model.call(&models::CausalLMImpl::loss, mine, mine, at::Tensor());
      loss.backward();
      CHECK(model.last_step_stats().recomputations == model->config.num_hidden_layers);
      ref_optimizer.zero_grad();
      const at::Tensor ref_loss = reference->loss(ids, ids);
      ref_loss.backward();
      fsdpx::test::step_both(parity, model, optimizer, *reference, ref_optimizer, loss, ref_loss);
    }
    if (rank == 0)
      std::printf("hf training, %s, checkpointed units, %d ranks, %s\n", name, W, parity.summary().c_str());
    INFO(parity.summary());
    CHECK(parity.holds());
  }
}

TEST_CASE("hf: a config.json that does not describe its weights is refused on every rank before anything is built",
          "[hf][errors][security]") {
  auto& world = fsdpx::test::world();
  const char* tmp = std::getenv("FSDPX_TEST_TMP");
  // A folder of this process's own: the jobs of other world sizes may run this test at the same time.
  const fs::path dir = fs::path(tmp != nullptr ? tmp : "fsdpx_test_tmp") / ("bad_config_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir.parent_path());
  fs::copy(fixtures() / "qwen2_tied", dir, fs::copy_options::recursive);
  const auto config = fsdpx::detail::parse_json(fsdpx::detail::read_text(dir / "config.json"), "config");
  const auto error = [&] {
    try {
      models::from_pretrained<Sharded>(dir, world);
    } catch (const fsdpx::Error& e) {
      return std::string(e.what());
    }
    FAIL("from_pretrained succeeded");
    return std::string();
  };
  const auto with = [&](const char* field, const fsdpx::detail::Json& value) {
    auto c = config;
    c[field] = value;
    if (std::string(field) == "num_hidden_layers") c.erase("layer_types");  // one per layer: its own error
    fsdpx::detail::write_text_durably(dir / "config.json", c.dump());
    return error();
  };
  // Sizes beyond any model of these families: refused by their bounds, before the files are opened.
  CHECK_THAT(with("num_hidden_layers", 1000000),
             Catch::Contains("\"num_hidden_layers\" is 1000000; it must be in [1, 4096]"));
  CHECK_THAT(with("vocab_size", int64_t{1} << 31),
             Catch::Contains("\"vocab_size\" is 2147483648; it must be in [1, 4194304]"));
  CHECK_THAT(with("num_attention_heads", int64_t{1} << 31), Catch::Contains("\"num_attention_heads\" is 2147483648"));
  // Within the bounds but not what the files hold: refused against the files' declared tensors.
  CHECK_THAT(
      with("num_hidden_layers", 4000),
      Catch::Contains("\"num_hidden_layers\" is 4000 but the weight files in") && Catch::Contains("hold 2 layers"));
  CHECK_THAT(with("vocab_size", 4000),
             Catch::Contains("does not describe the weights") &&
                 Catch::Contains("model.embed_tokens.weight: [96, 64] in the files, [4000, 64] by config.json"));
  CHECK_THAT(with("intermediate_size", 1 << 19),
             Catch::Contains("mlp.up_proj.weight: [") && Catch::Contains("[524288, 64] by config.json"));
  // Values that would train to NaN.
  CHECK_THAT(with("rope_theta", -1.0), Catch::Contains("\"rope_theta\" is -1; it must be a finite number > 0"));
  CHECK_THAT(with("rms_norm_eps", -1e-6),
             Catch::Contains("\"rms_norm_eps\" is -1e-06; it must be a finite number > 0"));
  CHECK_THAT(with("max_position_embeddings", 0),
             Catch::Contains("\"max_position_embeddings\" is 0; it must be in [1, "));
  // A 2 GiB config.json (NUL-padded, sparse on disk) is refused by its size, not read.
  fsdpx::detail::write_text_durably(dir / "config.json", config.dump());
  fs::resize_file(dir / "config.json", int64_t{2} << 30);
  CHECK_THAT(error(), Catch::Contains("config.json' has 2147483648 bytes; it may have at most 16777216"));
  fs::remove_all(dir);
}

// ---- packed samples and generation (issue: the decoder as RL trainers drive it) -------------------------

namespace {

/// The padded batch of a packed batch's samples: one sample per row, right-padded with 0; labels -100
/// on the padding.
struct PaddedSamples {
  at::Tensor ids, mask, labels;
};
PaddedSamples pad_samples(const at::Tensor& packed, const models::PackedSamples& samples) {
  const int64_t n = static_cast<int64_t>(samples.spans().size()), longest = samples.max_length();
  PaddedSamples p{at::zeros({n, longest}, at::kLong), at::zeros({n, longest}, at::kLong), {}};
  for (int64_t i = 0; i < n; ++i) {
    const auto& s = samples.spans()[static_cast<size_t>(i)];
    p.ids[i].narrow(0, 0, s.length).copy_(packed[s.row].narrow(0, s.start, s.length));
    p.mask[i].narrow(0, 0, s.length).fill_(1);
  }
  p.labels = p.ids.masked_fill(p.mask == 0, -100);
  return p;
}

/// New tokens of each row up to and including the first `eos` (all of them without one).
at::Tensor lengths_until(const at::Tensor& sequences, int64_t prompt, int64_t eos) {
  const at::Tensor fresh = sequences.narrow(1, prompt, sequences.size(1) - prompt);
  at::Tensor out = at::full({sequences.size(0)}, fresh.size(1), at::kLong);
  for (int64_t r = 0; r < fresh.size(0); ++r) {
    for (int64_t t = 0; t < fresh.size(1); ++t) {
      if (fresh[r][t].item<int64_t>() == eos) {
        out[r] = t + 1;
        break;
      }
    }
  }
  return out;
}

}  // namespace

TEST_CASE("hf: packed samples: each sample's logits equal transformers' of that sample run alone", "[hf][packed]") {
  auto& world = fsdpx::test::world();
  for (const char* name : float32_models) {
    INFO(name << " at world size " << world.size());
    auto model = models::from_pretrained<Sharded>(fixtures() / name, world);
    const at::Tensor ids = ref(name, "packed_ids"), positions = ref(name, "packed_position_ids");
    const at::Tensor want = ref(name, "packed_logits");
    at::NoGradGuard no_grad;
    const auto samples = models::PackedSamples::from_position_ids(positions, ids.size(0));
    CHECK(at::equal(samples.cu_seqlens(), at::tensor(std::vector<int32_t>{0, 5, 8, 12, 19, 24})));
    CHECK(at::equal(samples.position_ids(), positions));
    const double by_positions = relative_error(model(ids, at::Tensor(), positions), want);  // transformers' way
    const double by_samples =
        relative_error(model.call(&models::CausalLMImpl::forward, ids, samples, at::Tensor()), want);
    const double by_cu =
        relative_error(model.call(&models::CausalLMImpl::forward, ids,
                                  models::PackedSamples::from_cu_seqlens(samples.cu_seqlens(), 2, 12), at::Tensor()),
                       want);
    const double unpacked = relative_error(model(ids), want);  // the samples attending to each other
    const double bound = logits_bound(model->config, ids.size(1));
    if (world.rank() == 0) {
      std::printf(
          "hf packed: %s, %d ranks: relative error %.2e (position ids), %.2e (samples), %.2e (cu_seqlens); "
          "not packed %.2e (bound %.2e)\n",
          name, world.size(), by_positions, by_samples, by_cu, unpacked, bound);
    }
    CHECK(by_positions <= bound);
    CHECK(by_samples <= bound);
    CHECK(by_cu <= bound);
    // The samples' separation is what these checks see: attending across them must break the bound.
    CHECK(unpacked > bound);
  }
}

TEST_CASE("hf: a packed batch trains as its samples padded: loss, log-probs and gradients", "[hf][packed]") {
  auto& world = fsdpx::test::world();
  for (const char* name : {"llama_gqa", "qwen2_tied", "qwen2_moe"}) {
    INFO(name << " at world size " << world.size());
    auto model = models::from_pretrained<ShardedUnits>(fixtures() / name, world);
    model->chunk_logits = 5 * model->config.vocab_size;  // several chunks
    const at::Tensor ids = ref(name, "packed_ids");
    const auto samples = models::PackedSamples::from_position_ids(ref(name, "packed_position_ids"), ids.size(0));
    const PaddedSamples padded = pad_samples(ids, samples);
    const auto gradients = [&](auto&& loss_of) {
      for (auto& p : model.parameters()) p.mutable_grad() = at::Tensor();
      const at::Tensor loss = model.call([&](models::CausalLM& m) { return loss_of(m); });
      loss.backward();
      std::vector<at::Tensor> grads{loss.detach()};
      for (const auto& p : model.parameters()) grads.push_back(p.grad().clone());
      return grads;
    };
    const auto packed = gradients([&](models::CausalLM& m) { return m->loss(ids, ids, samples); });
    const auto alone = gradients([&](models::CausalLM& m) { return m->loss(padded.ids, padded.labels, padded.mask); });
    // The loss over the samples' 19 predicted tokens; the gradients along the backward path.
    const int64_t positions = samples.max_length(), tokens = ids.numel() - static_cast<int64_t>(samples.spans().size());
    const double loss_error = relative_error(packed[0], alone[0]);
    double worst = 0;
    for (size_t i = 1; i < packed.size(); ++i) worst = std::max(worst, relative_error(packed[i], alone[i]));
    if (world.rank() == 0) {
      std::printf("hf packed training: %s, %d ranks: loss relative error %.2e, gradients %.2e (bounds %.2e, %.2e)\n",
                  name, world.size(), loss_error, worst, loss_bound(model->config, positions, tokens),
                  gradient_bound(model->config, positions, tokens));
    }
    CHECK(loss_error <= loss_bound(model->config, positions, tokens));
    CHECK(worst <= gradient_bound(model->config, positions, tokens));

    // Per-token log-probs: each sample's equal its padded row's; the boundaries hold 0.
    at::NoGradGuard no_grad;
    const auto lp = model.call(&models::CausalLMImpl::log_probs, ids, samples, models::LogProbOptions{.entropy = true});
    const auto lp_padded =
        model.call(&models::CausalLMImpl::log_probs, padded.ids, padded.mask, models::LogProbOptions{.entropy = true});
    const at::Tensor inside = samples.next_token_mask();
    CHECK(lp.log_probs.masked_select(inside.logical_not()).abs().max().item<double>() == 0.0);
    for (size_t i = 0; i < samples.spans().size(); ++i) {
      const auto& s = samples.spans()[i];
      const auto row = [&](const at::Tensor& t) { return t[s.row].narrow(0, s.start, s.length - 1); };
      const auto own = [&](const at::Tensor& t) { return t[static_cast<int64_t>(i)].narrow(0, 0, s.length - 1); };
      CHECK(relative_error(row(lp.log_probs), own(lp_padded.log_probs)) <= logits_bound(model->config, positions));
      CHECK(relative_error(row(lp.entropy), own(lp_padded.entropy)) <= entropy_bound(model->config, positions));
    }
  }
}

TEST_CASE("hf: greedy generate with a KV cache yields transformers' tokens and logits, sharded and not",
          "[hf][generate]") {
  auto& world = fsdpx::test::world();
  for (const char* name : float32_models) {
    INFO(name << " at world size " << world.size());
    auto sharded = models::from_pretrained<ShardedUnits>(fixtures() / name, world);
    models::CausalLM plain(models::read_decoder_config(fixtures() / name));
    models::load_pretrained(plain, fixtures() / name);
    const at::Tensor prompt = ref(name, "gen_prompt"), mask = ref(name, "gen_prompt_mask");
    const at::Tensor want = ref(name, "gen_greedy");
    const int64_t steps = want.size(1) - prompt.size(1);
    const models::GenerateOptions greedy{.max_new_tokens = steps, .pad_token_id = 0, .output_logits = true};
    // Without a NoGradGuard: generate runs without gradients by itself, and training goes on after it.
    const auto mine = sharded.call(&models::CausalLMImpl::generate, prompt, mask, greedy);
    CHECK(at::equal(mine.sequences, want));
    CHECK(at::equal(mine.generated_lengths, at::full({2}, steps, at::kLong)));
    const double err = relative_error(mine.logits, ref(name, "gen_logits"));
    const double bound = logits_bound(sharded->config, want.size(1));
    if (world.rank() == 0)
      std::printf("hf generate: %s, %d ranks: step logits relative error %.2e (bound %.2e)\n", name, world.size(), err,
                  bound);
    CHECK(err <= bound);
    CHECK(at::equal(plain->generate(prompt, mask, greedy).sequences, want));

    const int64_t eos = ref(name, "gen_eos").item<int64_t>();
    models::GenerateOptions stop = greedy;
    stop.eos_token_ids = {eos};
    const at::Tensor want_eos = ref(name, "gen_greedy_eos");
    const auto ended = sharded.call(&models::CausalLMImpl::generate, prompt, mask, stop);
    CHECK(at::equal(ended.sequences, want_eos));
    CHECK(at::equal(ended.generated_lengths, lengths_until(want_eos, prompt.size(1), eos)));
    CHECK(at::equal(plain->generate(prompt, mask, stop).sequences, want_eos));

    // A step of training after generation.
    const at::Tensor ids = ref(name, "input_ids");
    sharded.call(&models::CausalLMImpl::loss, ids, ids, at::Tensor()).backward();
    CHECK(sharded.sharded().stage() == fsdpx::core::PassStage::idle);
  }
}

TEST_CASE("hf: generation's ranks agree when to stop: a rank whose rows ended keeps stepping with the others",
          "[hf][generate]") {
  auto& world = fsdpx::test::world();
  const char* name = "llama_gqa";
  auto sharded = models::from_pretrained<Sharded>(fixtures() / name, world);
  models::CausalLM plain(models::read_decoder_config(fixtures() / name));
  models::load_pretrained(plain, fixtures() / name);
  const at::Tensor prompt = ref(name, "gen_prompt"), mask = ref(name, "gen_prompt_mask");
  const int64_t eos = ref(name, "gen_eos").item<int64_t>();
  const models::GenerateOptions stop{.max_new_tokens = 8, .eos_token_ids = {eos}, .pad_token_id = 0};
  // Rank 0 generates row 0 (which ends at its EOS), the others row 1 (which runs all 8 steps).
  const int64_t row = world.rank() == 0 ? 0 : 1;
  const at::Tensor mine = prompt.narrow(0, row, 1), mine_mask = mask.narrow(0, row, 1);
  const auto out = sharded.call(&models::CausalLMImpl::generate, mine, mine_mask, stop);
  const auto alone = plain->generate(mine, mine_mask, stop);
  REQUIRE(out.sequences.size(1) >= alone.sequences.size(1));
  CHECK(at::equal(out.sequences.narrow(1, 0, alone.sequences.size(1)), alone.sequences));
  CHECK(out.sequences.narrow(1, alone.sequences.size(1), out.sequences.size(1) - alone.sequences.size(1))
            .eq(0)
            .all()
            .item<bool>());
  CHECK(at::equal(out.generated_lengths, alone.generated_lengths));
}

TEST_CASE("hf: generate refused on one rank is refused on every rank, before any unit is gathered",
          "[hf][generate][errors]") {
  auto& world = fsdpx::test::world();
  auto sharded = models::from_pretrained<Sharded>(fixtures() / "llama_gqa", world);
  const at::Tensor prompt = ref("llama_gqa", "gen_prompt"), mask = ref("llama_gqa", "gen_prompt_mask");
  // Rank 0 asks for more tokens than the model has positions; the others ask for 4.
  const models::GenerateOptions options{.max_new_tokens = world.rank() == 0 ? 1000 : 4};
  std::string error;
  try {
    sharded.call(&models::CausalLMImpl::generate, prompt, mask, options);
  } catch (const fsdpx::Error& e) {
    error = e.what();
  }
  CHECK_THAT(error,
             Catch::Contains(world.rank() == 0 ? "max_new_tokens = 1000" : "another rank's inputs were refused"));
  // And the model goes on: a generation every rank agrees on.
  const auto out =
      sharded.call(&models::CausalLMImpl::generate, prompt, mask, models::GenerateOptions{.max_new_tokens = 3});
  CHECK(out.sequences.size(1) == prompt.size(1) + 3);
}

TEST_CASE("hf: sampling with a seed gives the same tokens sharded as unsharded (so on every world size)",
          "[hf][generate]") {
  auto& world = fsdpx::test::world();
  for (const char* name : {"llama_gqa", "qwen3_qknorm"}) {
    INFO(name << " at world size " << world.size());
    auto sharded = models::from_pretrained<Sharded>(fixtures() / name, world);
    models::CausalLM plain(models::read_decoder_config(fixtures() / name));
    models::load_pretrained(plain, fixtures() / name);
    const at::Tensor prompt = ref(name, "gen_prompt"), mask = ref(name, "gen_prompt_mask");
    const models::GenerateOptions sample{
        .max_new_tokens = 12, .do_sample = true, .temperature = 1.5, .top_k = 30, .top_p = 0.95, .seed = 1234};
    at::NoGradGuard no_grad;
    const at::Tensor a = sharded.call(&models::CausalLMImpl::generate, prompt, mask, sample).sequences;
    const at::Tensor b = plain->generate(prompt, mask, sample).sequences;
    CHECK(at::equal(a, b));
    CHECK(at::equal(plain->generate(prompt, mask, sample).sequences, b));
    models::GenerateOptions other = sample;
    other.seed = 4321;
    CHECK(!at::equal(plain->generate(prompt, mask, other).sequences, b));  // 24 draws at temperature 1.5
  }
}

TEST_CASE("hf: an inference-only bfloat16 copy generates as a plain bfloat16 model", "[hf][generate]") {
  auto& world = fsdpx::test::world();
  for (const char* name : bf16_models) {
    INFO(name);
    auto frozen = models::from_pretrained<ShardedBf16>(fixtures() / name, world, {.inference_only = true});
    models::CausalLM plain(models::read_decoder_config(fixtures() / name));
    models::load_pretrained(plain, fixtures() / name);
    plain->to(at::kBFloat16);
    const at::Tensor prompt = ref(name, "gen_prompt"), mask = ref(name, "gen_prompt_mask");
    const models::GenerateOptions greedy{.max_new_tokens = 6, .output_logits = true};
    const auto a = frozen.call(&models::CausalLMImpl::generate, prompt, mask, greedy);
    const auto b = plain->generate(prompt, mask, greedy);
    CHECK(at::equal(a.sequences, b.sequences));
    CHECK(relative_error(a.logits, b.logits) <= logits_bound(plain->config, a.sequences.size(1), at::kBFloat16));
  }
}

// ---- mixtures of experts (issue: Qwen3-MoE and Qwen2-MoE) -----------------------------------------------

TEST_CASE("hf: mixtures of experts: the load-balancing loss and the loss with it equal transformers'", "[hf][moe]") {
  auto& world = fsdpx::test::world();
  for (const char* name : moe_models) {
    INFO(name << " at world size " << world.size());
    auto model = models::from_pretrained<ShardedUnits>(fixtures() / name, world);
    const at::Tensor ids = ref(name, "input_ids"), mask = ref(name, "attention_mask");
    at::NoGradGuard no_grad;
    const auto out = model.call(&models::CausalLMImpl::forward_with_aux_loss, ids, at::Tensor());
    const auto masked = model.call(&models::CausalLMImpl::forward_with_aux_loss, ids, mask);
    const int64_t positions = ids.size(1), tokens = ids.size(0) * (positions - 1);
    CHECK(relative_error(out.logits, ref(name, "logits")) <= logits_bound(model->config, positions));
    const double aux = relative_error(out.aux_loss.reshape({1}), ref(name, "aux_loss"));
    const double aux_masked = relative_error(masked.aux_loss.reshape({1}), ref(name, "aux_loss_masked"));
    // Without output_router_logits the loss is the cross-entropy alone (transformers' default); with it,
    // router_aux_loss_coef x the aux loss is added.
    const double plain =
        relative_error(model.call(&models::CausalLMImpl::loss, ids, ids, at::Tensor()), ref(name, "loss"));
    model->config.moe.output_router_logits = true;
    const double with_aux =
        relative_error(model.call(&models::CausalLMImpl::loss, ids, ids, at::Tensor()), ref(name, "loss_aux"));
    if (world.rank() == 0) {
      std::printf(
          "hf moe: %s, %d ranks: aux loss %.2e, masked %.2e; loss %.2e, with the aux loss %.2e (relative errors)\n",
          name, world.size(), aux, aux_masked, plain, with_aux);
    }
    // The load-balancing loss: the routers' softmax along the path, and means over every token (a loss's
    // path bounds it).
    const double bound = loss_bound(model->config, positions, tokens);
    CHECK(aux <= bound);
    CHECK(aux_masked <= bound);
    CHECK(plain <= bound);
    CHECK(with_aux <= bound);
  }
}

TEST_CASE("hf: mixtures of experts: 5 AdamW steps with the aux loss train sharded as unsharded", "[hf][moe]") {
  // Step by step: after each step the unsharded model takes the sharded one's weights, so each step is
  // compared from the same weights. Across steps, float32 rounding (a reduction's order) can tip a
  // token whose top-k experts are nearly tied to another expert, and from there the runs are two
  // different trainings, equally right; within a step the routing is the same.
  auto& world = fsdpx::test::world();
  const int W = world.size(), rank = world.rank();
  for (const char* name : moe_models) {
    INFO(name << " at world size " << W);
    auto model = models::from_pretrained<ShardedUnits>(fixtures() / name, world);
    model->config.moe.output_router_logits = true;
    models::CausalLM reference(models::read_decoder_config(fixtures() / name));
    models::load_pretrained(reference, fixtures() / name);
    reference->config.moe.output_router_logits = true;
    const auto options = torch::optim::AdamWOptions(1e-2).weight_decay(0.0).eps(1e-6);
    auto optimizer = fsdpx::make_adamw(model, options);
    torch::optim::AdamW ref_optimizer(reference->parameters(), options);
    const int64_t positions = 10;
    fsdpx::test::StepParity parity(fsdpx::test::decoder_step_bounds(model->config, positions, W * (positions - 1)));
    for (int step = 0; step < 5; ++step) {
      at::manual_seed(700 + step);
      const at::Tensor ids = at::randint(1, model->config.vocab_size, {W, positions}, at::kLong);
      const at::Tensor mine = ids.narrow(0, rank, 1);
      optimizer.zero_grad();
      model.call(&models::CausalLMImpl::loss, mine, mine, at::Tensor()).backward();
      // The sharded ranks average their gradients: the reference averages the ranks' losses.
      ref_optimizer.zero_grad();
      at::Tensor total = at::zeros({});
      for (int r = 0; r < W; ++r) total = total + reference->loss(ids.narrow(0, r, 1), ids.narrow(0, r, 1));
      (total / W).backward();
      // An expert no token chose has a zero gradient in a unit that ran, so AdamW's momentum moves it
      // (docs/core.md, unused parameters); the unsharded model would skip it: give it the zero too.
      for (auto& p : reference->parameters()) {
        if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
      }
      fsdpx::test::step_both(parity, model, optimizer, *reference, ref_optimizer);
    }
    if (rank == 0) std::printf("hf moe training: %s, %d ranks, 5 AdamW steps, %s\n", name, W, parity.summary().c_str());
    INFO(parity.summary());
    CHECK(parity.holds());
  }
}

TEST_CASE("hf: mixtures of experts: an expert no token chose gets no update, and the step completes on every rank",
          "[hf][moe]") {
  auto& world = fsdpx::test::world();
  const char* name = "qwen3_moe";
  auto model = models::from_pretrained<ShardedUnits>(fixtures() / name, world);
  models::CausalLM plain(models::read_decoder_config(fixtures() / name));
  models::load_pretrained(plain, fixtures() / name);
  // Two tokens (one next-token target), the same on every rank, that leave some of layer 0's 4 experts
  // unchosen: those get no gradient anywhere.
  at::Tensor ids;
  std::vector<int64_t> idle;
  for (int64_t token = 1; token < 96 && idle.empty(); ++token) {
    ids = at::full({1, 2}, token, at::kLong);
    std::vector<at::Tensor> router_logits;
    at::NoGradGuard no_grad;
    plain->model->forward(ids, {}, {}, &router_logits);
    REQUIRE(!router_logits.empty());
    const at::Tensor chosen = std::get<1>(router_logits[0].topk(2, -1)).reshape({-1});
    for (int64_t e = 0; e < 4; ++e) {
      if (!chosen.eq(e).any().item<bool>()) idle.push_back(e);
    }
  }
  REQUIRE(!idle.empty());
  std::map<std::string, at::Tensor> before;
  {
    auto scope = model.full_parameters();
    for (const auto& p : model->named_parameters()) before[p.key()] = p.value().detach().clone();
  }
  auto optimizer = fsdpx::make_adamw(model, torch::optim::AdamWOptions(1e-2).weight_decay(0.0));
  optimizer.zero_grad();
  model.call(&models::CausalLMImpl::loss, ids, ids, at::Tensor()).backward();
  optimizer.step();
  CHECK(model.sharded().stage() == fsdpx::core::PassStage::idle);
  int changed_idle = 0, changed_chosen = 0;
  {
    auto scope = model.full_parameters();
    for (const auto& p : model->named_parameters()) {
      const std::string prefix = "model.layers.0.mlp.experts.";
      if (p.key().rfind(prefix, 0) != 0) continue;
      const int64_t e = std::stoll(p.key().substr(prefix.size()));
      const bool same = at::equal(p.value().detach(), before[p.key()]);
      if (std::find(idle.begin(), idle.end(), e) != idle.end()) {
        changed_idle += same ? 0 : 1;
      } else {
        changed_chosen += same ? 0 : 1;
      }
    }
  }
  CHECK(changed_idle == 0);
  CHECK(changed_chosen == 3 * (4 - static_cast<int>(idle.size())));  // gate, up and down of each chosen expert
  // And training goes on: a step on a batch of each rank's own.
  at::manual_seed(31 + world.rank());
  const at::Tensor more = at::randint(1, 96, {2, 8}, at::kLong);
  optimizer.zero_grad();
  model.call(&models::CausalLMImpl::loss, more, more, at::Tensor()).backward();
  optimizer.step();
  CHECK(model.sharded().stage() == fsdpx::core::PassStage::idle);
}

TEST_CASE("hf: mixtures of experts: experts stacked in the files (transformers' own layout) load as the hub's",
          "[hf][moe]") {
  auto& world = fsdpx::test::world();
  auto hub = models::from_pretrained<Sharded>(fixtures() / "qwen3_moe", world);
  auto stacked = models::from_pretrained<Sharded>(fixtures() / "qwen3_moe_stacked", world);
  const at::Tensor ids = ref("qwen3_moe", "input_ids");
  at::NoGradGuard no_grad;
  CHECK(at::equal(stacked(ids), hub(ids)));
  models::CausalLM plain(models::read_decoder_config(fixtures() / "qwen3_moe_stacked"));
  CHECK(models::load_pretrained(plain, fixtures() / "qwen3_moe_stacked").ok());
  CHECK(relative_error(plain(ids), ref("qwen3_moe", "logits")) <= logits_bound(plain->config, ids.size(1)));
}
