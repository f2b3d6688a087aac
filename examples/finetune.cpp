// finetune: a pretrained Hugging Face model (Llama, Qwen2, Qwen3) fine-tuned sharded with fsdpx, with
// background checkpoints and --resume, and handed back as a Hugging Face folder.
//
//   mpiexec -n 2 finetune --model DIR --data tokens.bin --out OUT_DIR [--steps 100] [--batch 8] [--seq 256]
//                         [--lr 2e-5] [--warmup 10] [--save-every 50] [--ckpt-dir DIR] [--resume] [--memory-tier]
//                         [--bf16]
//                         [--activation-checkpointing] [--chunk-logits N] [--sequence-parallel P]
//   torchrun --nproc-per-node=8 --no-python finetune ...        (GPUs: NCCL, one GPU per rank)
//
// --model   a folder with config.json and model.safetensors (or an index and its files), as
//           save_pretrained writes it or the Hugging Face cache holds it
// --data    token ids, little-endian, back to back (--data-dtype uint16, uint32 or int64; default uint32)
// --out     where the fine-tuned model goes: safetensors in transformers' names, config.json and the
//           source folder's tokenizer and generation files; transformers' from_pretrained loads it
//
// Loading: the model is built with deferred_init and each rank reads from the files only the bytes of
// its own shards, so no rank ever holds the whole model. The embedding, each layer and the LM head are
// units (models::DecoderUnits; the head stays gathered from forward to backward). Long sequences (--seq
// 8192 and more): --activation-checkpointing keeps only each layer's input in forward and recomputes
// the layer in backward, and the loss never holds more than --chunk-logits logits (default 2^26: 256
// MiB in float32) (docs/models.md, "Long sequences"); --sequence-parallel P splits each window over
// P ranks (Ulysses: SequenceParallel<P>, each rank --seq / P tokens of it; docs/models.md). Training: AdamW over the
// shards (no weight decay on norms and biases), a cosine schedule with warmup, global-norm clipping at 1.0 (TrainStep).
// Each step's batch is --batch windows of --seq tokens drawn from the data by the step's seed (each
// token predicts the next), the same whatever the world size, so a resumed run continues the same
// sequence of batches.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>

#include <CLI/CLI.hpp>
#include <torch/optim.h>

#include <fsdpx/fsdp.hpp>
#include <fsdpx/models.hpp>

#include "common/launch.hpp"

namespace fs = std::filesystem;
namespace models = fsdpx::models;

namespace {

struct Args {
  std::string model, data, out;
  std::string data_dtype = "uint32";
  int64_t steps = 100;
  int64_t stop_after = 0;  // > 0: stop after this step (an interrupted run); the schedule still spans --steps
  int64_t batch = 8;       // windows per step, over all ranks
  int64_t seq = 256;
  int sequence_parallel = 1;  // ranks per window (Ulysses)
  double lr = 2e-5;
  int64_t warmup = 10;
  int64_t save_every = 50;
  std::string ckpt_dir = "finetune_checkpoints";
  bool resume = false;
  bool memory_tier = false;  // every step kept in the memory tier too (save_to_memory)
  bool bf16 = false;
  bool activation_checkpointing = false;
  int64_t chunk_logits = models::default_chunk_logits;
};

/// A file of token ids read in windows by positioned reads (a corpus may be far larger than memory).
class TokenFile {
 public:
  TokenFile(const fs::path& path, const std::string& dtype) : path_(path) {
    if (dtype == "uint16") {
      type_ = at::kUInt16;
    } else if (dtype == "uint32") {
      type_ = at::kUInt32;
    } else if (dtype == "int64") {
      type_ = at::kLong;
    } else {
      FSDPX_CHECK(false, "finetune: --data-dtype must be uint16, uint32 or int64, not '", dtype, "'");
    }
    std::error_code ec;
    const bool regular = fs::is_regular_file(path, ec);
    const auto bytes = regular ? static_cast<int64_t>(fs::file_size(path, ec)) : 0;
    const int64_t width = static_cast<int64_t>(c10::elementSize(type_));
    FSDPX_CHECK_AS(fsdpx::IoError, regular && !ec, "finetune: --data '", path.string(), "' is not a regular file",
                   ec ? ": " + ec.message() : std::string());
    in_.open(path, std::ios::binary);  // only a regular file: opening a FIFO would block
    FSDPX_CHECK_AS(fsdpx::IoError, in_.is_open(), "finetune: cannot open --data '", path.string(), "'");
    FSDPX_CHECK_AS(fsdpx::IoError, bytes % width == 0, "finetune: --data '", path.string(), "' is not a file of ",
                   dtype, " token ids (", bytes, " bytes)");
    tokens_ = bytes / width;
  }
  int64_t size() const { return tokens_; }

  /// `count` windows of `length` tokens starting at `starts[i]`, as int64 [count, length].
  at::Tensor windows(const std::vector<int64_t>& starts, int64_t length) const {
    const int64_t width = static_cast<int64_t>(c10::elementSize(type_));
    at::Tensor raw = at::empty({static_cast<int64_t>(starts.size()), length}, at::TensorOptions().dtype(type_));
    for (size_t i = 0; i < starts.size(); ++i) {
      auto* p = static_cast<char*>(raw[static_cast<int64_t>(i)].data_ptr());
      in_.seekg(starts[i] * width);
      in_.read(p, length * width);
      FSDPX_CHECK_AS(fsdpx::IoError, in_.gcount() == length * width, "finetune: reading --data '", path_.string(),
                     "' failed at token ", starts[i]);
    }
    return raw.to(at::kLong);
  }

 private:
  fs::path path_;
  mutable std::ifstream in_;  // windows() reads at positions: a const reader moves the stream
  at::ScalarType type_ = at::kUInt32;
  int64_t tokens_ = 0;
};

template <class Sharded>
int run(const Args& args, fsdpx::dist::AnyCommunicator world, c10::Device device) {
  const bool lead = world.rank() == 0;
  const int W = world.size(), P = args.sequence_parallel;
  FSDPX_CHECK(W % P == 0, "finetune: --sequence-parallel ", P, " must divide the world size ", W);
  const int groups = W / P;  // each takes its own windows, its P ranks a slice of each
  FSDPX_CHECK(args.batch % groups == 0, "finetune: --batch ", args.batch, " must be a multiple of the ", groups,
              " sequence groups (the world size ", W, " over --sequence-parallel ", P, ")");
  FSDPX_CHECK(args.seq % P == 0, "finetune: --seq ", args.seq, " must be a multiple of --sequence-parallel ", P);
  const TokenFile data(args.data, args.data_dtype);
  FSDPX_CHECK(data.size() > args.seq + 1, "finetune: --data holds ", data.size(),
              " tokens, fewer than one window of --seq + 1");

  const auto load_start = std::chrono::steady_clock::now();
  fsdpx::SafetensorsLoadReport loaded;
  auto model = models::from_pretrained<Sharded>(args.model, world,
                                                {.device = device,
                                                 .sequence_size = P,
                                                 .reshard_after_forward_for = models::reshard_all_but_head,
                                                 .activation_checkpointing = args.activation_checkpointing},
                                                {}, &loaded);
  model->chunk_logits = args.chunk_logits;
  const auto& config = model->config;
  if (lead) {
    int64_t params = 0;
    for (const auto& t : models::hf_tensors(config)) params += c10::multiply_integers(t.shape);
    std::printf("finetune: %s (%s, %.1fM parameters) loaded in %.2f s over %d ranks (%s); rank 0 read %.1f MiB; %s\n",
                args.model.c_str(), config.model_type.c_str(), params / 1e6,
                std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count(), W,
                std::string(world.backend_name()).c_str(), loaded.bytes_read / 1048576.0,
                fsdpx::examples::memory_line(device).c_str());
    std::printf("finetune: attention %s\n", model->attention_report().to_string().c_str());
    if (P > 1)
      std::printf("finetune: sequence groups of %d ranks (Ulysses), %lld tokens of each window per rank\n", P,
                  static_cast<long long>(args.seq / P));
  }

  auto optimizer = fsdpx::make_adamw(model, torch::optim::AdamWOptions(args.lr).weight_decay(0.1));
  fsdpx::LrScheduler scheduler(optimizer, fsdpx::LrSchedule::cosine(args.warmup, args.steps, /*min_lr_ratio=*/0.1));
  int64_t start = 0;
  if (args.resume) {
    if (const auto info = fsdpx::load_checkpoint(model, args.ckpt_dir, optimizer, scheduler)) {
      start = info->step;
      if (lead)
        std::printf("finetune: resumed from step %lld of %s%s (saved by %d ranks)\n", static_cast<long long>(start),
                    info->source.string().c_str(), info->from_memory ? " (the memory tier)" : "",
                    info->saved_world_size);
    } else if (lead) {
      std::printf("finetune: no checkpoint in %s: starting from the pretrained weights\n", args.ckpt_dir.c_str());
    }
  }
  FSDPX_CHECK(!args.memory_tier || args.save_every > 0,
              "finetune: --memory-tier keeps steps beside the disk's checkpoints: pass --save-every N as well");
#if defined(FSDPX_WITH_BOOST)
  std::optional<fsdpx::CheckpointCoordinator> ckpt;
  // Every step's huggingface/ gets the model folder's config and tokenizer files (never its weights),
  // so fsdpx-merge turns any step into a Hugging Face folder.
  if (args.save_every > 0)
    ckpt.emplace(args.ckpt_dir, model, fsdpx::CheckpointOptions{.max_to_keep = 2, .huggingface_dir = args.model});
#else
  FSDPX_CHECK(args.save_every == 0,
              "finetune: fsdpx was built without Boost, so it cannot save checkpoints; pass --save-every 0");
#endif
  fsdpx::TrainStep<Sharded> train_step(model, optimizer, &scheduler, {.max_grad_norm = 1.0});

  const int64_t per_group = args.batch / groups, group_index = world.rank() / P,
                last = args.stop_after > 0 ? std::min(args.stop_after, args.steps) : args.steps;
  double first_loss = -1, last_loss = 0;
  for (int64_t step = start + 1; step <= last; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    at::manual_seed(step);  // the step's windows, whichever run or world size draws them
    const at::Tensor starts_t = at::randint(data.size() - args.seq, {args.batch}, at::kLong);
    std::vector<int64_t> starts;
    for (int64_t i = 0; i < per_group; ++i) starts.push_back(starts_t[group_index * per_group + i].item<int64_t>());
    at::Tensor ids = data.windows(starts, args.seq);
    if (P > 1) ids = models::sequence_slice(ids, *model.sequence_group());  // on the host: its checksum reads it there
    ids = ids.to(device);
    const auto [lo, hi] = at::aminmax(ids);
    FSDPX_CHECK(lo.item<int64_t>() >= 0 && hi.item<int64_t>() < config.vocab_size,
                "finetune: --data holds token ids in [", lo.item<int64_t>(), ", ", hi.item<int64_t>(),
                "], outside the model's vocabulary [0, ", config.vocab_size, ")");
    const at::Tensor loss = model.call(&models::CausalLMImpl::loss, ids, ids, at::Tensor());
    loss.backward();
    const fsdpx::StepReport report = train_step.optimizer_step();
    auto mean = loss.detach().to(at::kDouble).reshape({1}) * P;  // a sequence group's P shares sum to its mean
    world.all_reduce(mean, fsdpx::dist::ReduceOp::avg);
    const double l = mean.item<double>();
    if (first_loss < 0) first_loss = l;
    last_loss = l;
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (lead) {
      std::printf("step %4lld  loss %.4f  lr %.3g  grad-norm %.3f  %.0f tokens/s  %s\n", static_cast<long long>(step),
                  l, report.lr, report.grad_norm.value_or(0.0), static_cast<double>(args.batch * args.seq) / seconds,
                  fsdpx::examples::memory_line(device).c_str());
      std::fflush(stdout);
    }
#if defined(FSDPX_WITH_BOOST)
    if (ckpt && args.memory_tier) ckpt->save_to_memory(step, model, optimizer, scheduler);
    if (ckpt && step % args.save_every == 0) ckpt->save(step, model, optimizer, scheduler);
#endif
  }
#if defined(FSDPX_WITH_BOOST)
  if (ckpt) ckpt->wait();
#endif
  if (last < args.steps) {
    if (lead)
      std::printf("finetune: stopped after step %lld of %lld (--stop-after); resume with --resume\n",
                  static_cast<long long>(last), static_cast<long long>(args.steps));
    return 0;
  }
  const auto saved = models::save_pretrained(model, args.out, {.source_dir = args.model});
  if (lead) {
    std::printf("finetune: loss %.4f -> %.4f; wrote %s (%zu safetensors files, %.1f MiB of %s weights)\n", first_loss,
                last_loss, args.out.c_str(), saved.files.size(), saved.total_size / 1048576.0,
                c10::toString(config.dtype));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  Args args;
  CLI::App app{"finetune: a pretrained Hugging Face model (Llama, Qwen2, Qwen3) fine-tuned sharded with fsdpx"};
  app.add_option("--model", args.model, "Hugging Face model folder (config.json + safetensors)")
      ->required()
      ->check(CLI::ExistingDirectory);
  app.add_option("--data", args.data, "token ids, little-endian, back to back")->required()->check(CLI::ExistingFile);
  app.add_option("--out", args.out, "where the fine-tuned Hugging Face folder goes")->required();
  app.add_option("--data-dtype", args.data_dtype, "uint16, uint32 or int64")->capture_default_str();
  app.add_option("--steps", args.steps, "optimizer steps (the schedule's length)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--stop-after", args.stop_after, "stop after this step (an interrupted run; resume with --resume)");
  app.add_option("--batch", args.batch, "windows per step, over all ranks")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--seq", args.seq, "tokens per window")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--lr", args.lr, "peak learning rate")->capture_default_str();
  app.add_option("--warmup", args.warmup, "warmup steps")->capture_default_str();
  app.add_option("--save-every", args.save_every, "checkpoint every N steps (0: never)")->capture_default_str();
  app.add_option("--ckpt-dir", args.ckpt_dir, "checkpoint root")->capture_default_str();
  app.add_flag("--resume", args.resume,
               "continue from the newest checkpoint in --ckpt-dir (or the memory tier's, when it is newer)");
  app.add_flag("--memory-tier", args.memory_tier,
               "with --save-every: keep every step in this node's memory too (/dev/shm or $FSDPX_MEMORY_DIR), "
               "so that a relaunch loses one step at most");
  app.add_flag("--bf16", args.bf16, "compute in bfloat16 (float32 masters and gradient reduction)");
  app.add_flag("--activation-checkpointing", args.activation_checkpointing,
               "keep only each layer's input in forward and recompute the layer in backward (long sequences)");
  app.add_option("--sequence-parallel", args.sequence_parallel,
                 "ranks that split each window (Ulysses); must divide the world size and the attention heads")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--chunk-logits", args.chunk_logits, "logits the loss holds at once (0: all of them)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  auto [world, device] = fsdpx::examples::init_world();
  // The layers may recompute in backward (--activation-checkpointing turns it on at run time).
  using Checkpointing = fsdpx::CheckpointNames<"model.layers.*">;
  // Sharded over the whole world; --sequence-parallel sets the sequence groups' size at run time (1: none).
  using Mesh = fsdpx::SequenceParallel<fsdpx::runtime_sequence_size, fsdpx::FullShard>;
  if (args.bf16) {
    return run<fsdpx::Fsdp<models::CausalLM, Mesh, fsdpx::NoOffload, fsdpx::BF16Mixed, fsdpx::ShardedStateDict,
                           models::DecoderUnits, Checkpointing>>(args, world, device);
  }
  return run<fsdpx::Fsdp<models::CausalLM, Mesh, fsdpx::NoOffload, fsdpx::FullPrecision, fsdpx::ShardedStateDict,
                         models::DecoderUnits, Checkpointing>>(args, world, device);
} catch (const std::exception& e) {
  return fsdpx::examples::report_failure("finetune", e);
}
