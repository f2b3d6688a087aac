// A Hugging Face model fine-tuned sharded and exported back (tests/models/export_test.py drives it):
//
//   mpiexec -n 2 fsdpx_hf_train_export <model folder> <out folder> [max shard bytes]
//
// 5 AdamW steps of the sharded model against an unsharded CausalLM trained on the same global batch
// (their parameters must agree), then save_pretrained, then the sharded model's logits on fixed tokens
// into <out folder>.logits.safetensors for the Python side to compare with transformers' on the export.
#include <cstdio>
#include <filesystem>
#include <string>

#include <torch/optim.h>

#include <fsdpx/fsdp.hpp>
#include <fsdpx/models.hpp>

namespace fs = std::filesystem;
namespace models = fsdpx::models;
using Sharded = fsdpx::Fsdp<models::CausalLM, fsdpx::FullShard, fsdpx::NoOffload, fsdpx::FullPrecision,
                            fsdpx::ShardedStateDict, fsdpx::WrapModules<models::DecoderLayerImpl>>;

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s <model folder> <out folder> [max shard bytes]\n", argv[0]);
    return 2;
  }
  auto world = fsdpx::dist::MpiCommunicator::world();
  const fs::path dir = argv[1], out = argv[2];
  const int W = world.size(), rank = world.rank();
  try {
    auto model = models::from_pretrained<Sharded>(dir, world);
    models::CausalLM reference(models::read_decoder_config(dir));
    models::load_pretrained(reference, dir);
    // eps 1e-6: see tests/core/parity.hpp (gradients that are zero up to rounding).
    const auto options = torch::optim::AdamWOptions(1e-2).weight_decay(0.1).eps(1e-6);
    auto optimizer = fsdpx::make_adamw(model, options);
    std::vector<at::Tensor> decay, no_decay;
    for (auto& p : reference->parameters()) (p.dim() >= 2 ? decay : no_decay).push_back(p);
    auto nd = options;
    nd.weight_decay(0.0);
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(options));
    groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(nd));
    torch::optim::AdamW ref_optimizer(std::move(groups), options);

    const int64_t vocab = model->config.vocab_size, per = 2, seq = 12;
    for (int step = 0; step < 5; ++step) {
      at::manual_seed(1000 + step);
      const at::Tensor ids = at::randint(1, vocab, {per * W, seq}, at::kLong);
      const at::Tensor mine = ids.narrow(0, per * rank, per);
      optimizer.zero_grad();
      model.call(&models::CausalLMImpl::loss, mine, mine, at::Tensor()).backward();
      optimizer.step();
      ref_optimizer.zero_grad();
      const at::Tensor loss = reference->loss(ids, ids);
      loss.backward();
      // A mixture of experts' expert that no token chose: fsdpx's unit gives it a zero gradient (AdamW's
      // decay and momentum still apply, docs/core.md), where this unsharded AdamW would skip it.
      for (auto& p : reference->parameters()) {
        if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
      }
      ref_optimizer.step();
      if (rank == 0) std::printf("step %d: reference loss %.5f\n", step, loss.item<double>());
    }
    const auto full = fsdpx::full_state_dict(model.sharded());
    double worst = 0;
    if (rank == 0) {
      auto params = reference->named_parameters();
      for (const auto& e : full.entries) worst = std::max(worst, (e.data() - params[e.name]).abs().max().item<double>());
      std::printf("after 5 AdamW steps at %d ranks: max |sharded - unsharded| = %.3e over %zu tensors\n", W, worst, full.entries.size());
    }
    models::SavePretrainedOptions save{.source_dir = dir};
    if (argc > 3) save.max_shard_bytes = std::stoll(argv[3]);
    const auto saved = models::save_pretrained(model, out, save);
    if (rank == 0) std::printf("exported %zu safetensors files, %lld bytes\n", saved.files.size(), static_cast<long long>(saved.total_size));
    at::manual_seed(99);
    const at::Tensor ids = at::randint(1, vocab, {2, seq}, at::kLong);
    const at::Tensor logits = model(ids);
    if (rank == 0) {
      fsdpx::hf::save_safetensors(out.parent_path(), {{"input_ids", ids}, {"logits", logits.detach()}},
                                          {.name = out.filename().string() + ".logits"});
    }
    if (worst > 5e-5) {
      std::fprintf(stderr, "FAILED: the sharded model drifted from the unsharded one by %.3e (bound 5e-5)\n", worst);
      return 1;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
    return 1;
  }
  return 0;
}
