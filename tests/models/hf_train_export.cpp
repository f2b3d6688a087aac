// A Hugging Face model fine-tuned sharded and exported back (tests/models/export_test.py drives it):
//
//   mpiexec -n 2 fsdpx_hf_train_export <model folder> <out folder> [max shard bytes]
//
// 5 AdamW steps of the sharded model against an unsharded CausalLM trained on the same global batch,
// each step compared from the same weights (tests/support/step_parity.hpp: the loss, every gradient and
// updated weight within the bounds the arithmetic gives), then save_pretrained, then the sharded model's
// logits on fixed tokens and their bound against another computation of them (the export's dtype) into
// <out folder>.logits.safetensors for the Python side to compare with transformers' on the export; and the
// trained weights as PyTorch Distributed Checkpoint in <out folder>.dcp (fsdpx::dcp::save_model, named as
// transformers' state dict: models::dcp_save_options).
#include <cstdio>
#include <filesystem>
#include <string>

#include <torch/optim.h>

#include <fsdpx/dcp.hpp>
#include <fsdpx/fsdp.hpp>
#include <fsdpx/models.hpp>

#include "decoder_path.hpp"

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
    fsdpx::test::StepParity parity(fsdpx::test::decoder_step_bounds(model->config, seq, per * W * (seq - 1)));
    for (int step = 0; step < 5; ++step) {
      at::manual_seed(1000 + step);
      const at::Tensor ids = at::randint(1, vocab, {per * W, seq}, at::kLong);
      const at::Tensor mine = ids.narrow(0, per * rank, per);
      optimizer.zero_grad();
      const at::Tensor mine_loss = model.call(&models::CausalLMImpl::loss, mine, mine, at::Tensor());
      mine_loss.backward();
      ref_optimizer.zero_grad();
      const at::Tensor loss = reference->loss(ids, ids);
      loss.backward();
      // A mixture of experts' expert that no token chose: fsdpx's unit gives it a zero gradient (AdamW's
      // decay and momentum still apply, docs/core.md), where this unsharded AdamW would skip it.
      for (auto& p : reference->parameters()) {
        if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
      }
      fsdpx::test::step_both(parity, model, optimizer, *reference, ref_optimizer, mine_loss, loss);
      if (rank == 0) std::printf("step %d: reference loss %.5f\n", step, loss.item<double>());
    }
    // Every rank's verdict, so that all of them agree on the exit code.
    auto held = at::full({1}, parity.holds() ? 1.0 : 0.0, at::kDouble);
    world.all_reduce(held, fsdpx::dist::ReduceOp::min);
    std::printf("rank %d, 5 AdamW steps at %d ranks against the unsharded model, %s\n", rank, W,
                parity.summary().c_str());
    models::SavePretrainedOptions save{.source_dir = dir};
    if (argc > 3) save.max_shard_bytes = std::stoll(argv[3]);
    const auto saved = models::save_pretrained(model, out, save);
    if (rank == 0)
      std::printf("exported %zu safetensors files, %lld bytes\n", saved.files.size(),
                  static_cast<long long>(saved.total_size));
    // The same weights as PyTorch Distributed Checkpoint, for transformers' dcp.load (export_test.py).
    fsdpx::dcp::save_model(model, out.string() + ".dcp", models::dcp_save_options(model->config));
    at::manual_seed(99);
    const at::Tensor ids = at::randint(1, vocab, {2, seq}, at::kLong);
    const at::Tensor logits = model(ids);
    // transformers computes with the export's weights: the float32 masters as they are, or rounded to the
    // export's dtype (each product's weights rounded, as a stage stored in that dtype rounds).
    const double bound = fsdpx::test::logits_bound(model->config, seq, model->config.dtype);
    if (rank == 0) {
      fsdpx::hf::save_safetensors(
          out.parent_path(),
          {{"input_ids", ids}, {"logits", logits.detach()}, {"logits_bound", at::full({1}, bound, at::kDouble)}},
          {.name = out.filename().string() + ".logits"});
    }
    if (held.item<double>() != 1.0) {
      std::fprintf(stderr, "FAILED: a step of the sharded model left its bounds: %s\n", parity.summary().c_str());
      return 1;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
    return 1;
  }
  return 0;
}
