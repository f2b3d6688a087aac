// fsdpx and PyTorch FSDP2 resume each other's PyTorch Distributed Checkpoints (tests/models/dcp_interop_test.py
// drives it, with FSDP2 on gloo ranks on the other side):
//
//   mpiexec -n W fsdpx_dcp_interop_job train  <model folder> <batches.safetensors> <out folder>
//   mpiexec -n W fsdpx_dcp_interop_job resume <model folder> <batches.safetensors> <checkpoint> <reference.safetensors>
//
// train: AdamW steps on the batches "step0" and "step1" from the model folder's weights, then the model saved as
// DCP in <out folder> and the optimizer in <out folder>/optim_states (LightRFT's layout, transformers' names:
// models::dcp_save_options).
// resume: the model and its AdamW state loaded from such a checkpoint, whoever wrote it (fsdpx or FSDP2; a folder
// with scheduler_state.pt through load_checkpoint, as LightRFT's whole step folder, which must say step 2, the
// scheduler at step 2 and 24 consumed samples in client_state.pt; a folder without optim_states/ as torchtitan's
// one DCP of "model.", "optimizer." (flattened), "lr_scheduler." and "train_state.", through load_checkpoint
// too), then the
// step on "step2", compared with another computation of that step from the same state, the reference's:
// "loss", "grad.<name>" (its gradients) and "after.<name>" (its weights after its step), within the bounds of
// tests/support/step_parity.hpp. Every parameter's step count must be 3 after it (2 restored, then this one).
//
// Each batch is [12, seq] token ids: rank r of W trains on rows [12 r / W, 12 (r + 1) / W).
#include <cstdio>
#include <filesystem>
#include <map>
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

namespace {

constexpr int64_t batch_rows = 12;

std::map<std::string, at::Tensor> read_named(const fs::path& path) {
  std::map<std::string, at::Tensor> out;
  for (auto& [name, t] : fsdpx::hf::load_safetensors(path)) out.emplace(name, t);
  return out;
}

/// The tensors of `all` named "<prefix><name>", by name.
std::map<std::string, at::Tensor> with_prefix(const std::map<std::string, at::Tensor>& all, const std::string& prefix) {
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, t] : all) {
    if (name.starts_with(prefix)) out.emplace(name.substr(prefix.size()), t);
  }
  return out;
}

at::Tensor rows_of_rank(const at::Tensor& batch, int rank, int world) {
  const int64_t per = batch_rows / world;
  return batch.narrow(0, per * rank, per);
}

at::Tensor loss_of(Sharded& model, const at::Tensor& ids) {
  return model.call(&models::CausalLMImpl::loss, ids, ids, at::Tensor());
}

}  // namespace

int main(int argc, char** argv) {
  auto world = fsdpx::dist::MpiCommunicator::world();
  const int W = world.size(), rank = world.rank();
  const std::string mode = argc > 1 ? argv[1] : "";
  if ((mode != "train" || argc != 5) && (mode != "resume" || argc != 6)) {
    std::fprintf(stderr,
                 "usage: %s train <model> <batches> <out> | resume <model> <batches> <checkpoint> <reference>\n",
                 argv[0]);
    return 2;
  }
  if (batch_rows % W != 0) {
    std::fprintf(stderr, "the batches' %lld rows do not split over %d ranks\n", static_cast<long long>(batch_rows), W);
    return 2;
  }
  try {
    const fs::path dir = argv[2], checkpoint = argv[4];
    const auto batches = read_named(argv[3]);
    auto model = models::from_pretrained<Sharded>(dir, world);
    // eps 1e-6: see tests/core/parity.hpp (gradients that are zero up to rounding).
    auto optimizer = fsdpx::make_adamw(model, torch::optim::AdamWOptions(1e-2).weight_decay(0.1).eps(1e-6));
    if (mode == "train") {
      for (const char* step : {"step0", "step1"}) {
        optimizer.zero_grad();
        const at::Tensor loss = loss_of(model, rows_of_rank(batches.at(step), rank, W));
        loss.backward();
        optimizer.step();
        if (rank == 0) std::printf("%s: loss of rank 0's rows %.6f\n", step, loss.item<double>());
      }
      const auto names = models::dcp_save_options(model->config);
      fsdpx::dcp::save_model(model, checkpoint, names);
      fsdpx::dcp::save_optimizer(model, optimizer, checkpoint / "optim_states", names);
      if (rank == 0) std::printf("saved DCP: %s and %s/optim_states\n", argv[4], argv[4]);
      return 0;
    }
    if (fs::exists(checkpoint / "scheduler_state.pt")) {
      // LightRFT's whole step folder, as load_checkpoint resumes it: the model, the optimizer, the scheduler
      // (a constant LR here, as the Python side's LambdaLR) and the client state
      fsdpx::LrScheduler scheduler(optimizer, fsdpx::LrSchedule::constant());
      const auto info = fsdpx::load_checkpoint(model, checkpoint, optimizer, scheduler,
                                               {.dcp = models::dcp_load_options(model->config)});
      const c10::IValue consumed =
          info->extra.client.contains("consumed_samples") ? info->extra.client.at("consumed_samples") : c10::IValue();
      if (info->step != 2 || scheduler.last_step() != 2 || !consumed.isInt() || consumed.toInt() != 2 * batch_rows) {
        std::fprintf(stderr, "rank %d: load_checkpoint of '%s': step %lld, scheduler step %lld, consumed_samples %s\n",
                     rank, argv[4], static_cast<long long>(info->step), static_cast<long long>(scheduler.last_step()),
                     consumed.isInt() ? std::to_string(consumed.toInt()).c_str() : "missing");
        return 1;
      }
      if (rank == 0) std::printf("load_checkpoint: step 2, the scheduler at step 2, the client state read\n");
    } else if (fs::exists(checkpoint / "optim_states")) {
      fsdpx::dcp::load_model(model, checkpoint, models::dcp_load_options(model->config));
      fsdpx::dcp::load_optimizer(model, optimizer, checkpoint / "optim_states");
    } else {
      // torchtitan's layout: one DCP of {"model": ..., "optimizer": get_optimizer_state_dict(...,
      // flatten_optimizer_state_dict=True), "lr_scheduler": ..., "train_state": ...}, resumed by load_checkpoint
      fsdpx::LrScheduler scheduler(optimizer, fsdpx::LrSchedule::constant());
      const auto info = fsdpx::load_checkpoint(model, checkpoint, optimizer, scheduler,
                                               {.dcp = models::dcp_load_options(model->config)});
      if (info->step != 2 || scheduler.last_step() != 2) {
        std::fprintf(stderr, "rank %d: load_checkpoint of '%s' (torchtitan's layout): step %lld, scheduler step %lld\n",
                     rank, argv[4], static_cast<long long>(info->step), static_cast<long long>(scheduler.last_step()));
        return 1;
      }
      if (rank == 0) std::printf("torchtitan's layout: load_checkpoint read train_state.step 2, the scheduler at 2\n");
    }
    const auto reference = read_named(argv[5]);
    const auto gradients = with_prefix(reference, "grad."), after = with_prefix(reference, "after.");
    const at::Tensor batch = batches.at("step2");
    const int64_t seq = batch.size(1);
    fsdpx::test::StepParity parity(fsdpx::test::decoder_step_bounds(model->config, seq, batch_rows * (seq - 1)));
    optimizer.zero_grad();
    const at::Tensor loss = loss_of(model, rows_of_rank(batch, rank, W));
    loss.backward();
    parity.note_reference_gradients(model.sharded(), gradients, false);
    parity.check_gradients(model.sharded(), gradients);
    auto global = loss.detach().to(at::kDouble).reshape({1});
    world.all_reduce(global, fsdpx::dist::ReduceOp::avg);
    parity.check_loss(global.item<double>(), reference.at("loss").item<double>());
    optimizer.step();
    parity.check_step(optimizer, model.sharded(), after);
    int64_t wrong_steps = 0;
    for (const auto& s : fsdpx::test::held_slices(model.sharded(), &optimizer)) wrong_steps += s.step != 3 ? 1 : 0;
    auto held = at::full({1}, parity.holds() && wrong_steps == 0 ? 1.0 : 0.0, at::kDouble);
    world.all_reduce(held, fsdpx::dist::ReduceOp::min);
    std::printf("rank %d of %d: step 3 from '%s' against '%s': %s; slices whose step count is not 3: %lld\n", rank, W,
                argv[4], argv[5], parity.summary().c_str(), static_cast<long long>(wrong_steps));
    if (held.item<double>() != 1.0) {
      std::fprintf(stderr, "FAILED: step 3 left its bounds on some rank (see each rank's line)\n");
      return 1;
    }
    if (rank == 0) std::printf("PASSED\n");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
    return 1;
  }
  return 0;
}
