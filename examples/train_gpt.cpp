// train_gpt: a byte-level GPT trained with fsdpx on text that needs no download (Debian's license
// texts, or this repository's README), one line per step: loss, tokens/s, memory per rank; periodic
// background checkpoints; --resume. `make demo` runs it on 2 CPU ranks under mpirun.
//
//   mpiexec -n 2 train_gpt [--steps 40] [--save-every 20] [--resume]            CPU ranks (MPI)
//   torchrun --nproc-per-node=8 --no-python train_gpt ...                       GPUs (NCCL, one per rank)
//   srun -n 16 --gpus-per-task=1 train_gpt ...                                   GPUs under SLURM (export
//   MASTER_ADDR/PORT)
//
// Options:
//   --steps N          train until global step N (default 40; with --resume, the steps already done count)
//   --batch B          global batch, split across ranks (default 8); --seq T (128); --dim D (192);
//   --layers L (4); --heads H (4); --lr LR (3e-3); --corpus FILE (default: a Debian license text or README.md)
//   --ckpt-dir DIR     checkpoint root (default checkpoints/train_gpt, relative to the working directory)
//   --save-every N     save model, optimizer and data position every N steps and at the last step, in the
//                      background (fsdpx::CheckpointCoordinator); 0 (default): no checkpoints
//   --keep K           keep only the newest K checkpoints (default 2; 0: all)
//   --resume           continue from the newest committed checkpoint in --ckpt-dir (starts from step 0
//                      when there is none), or from the memory tier's when it is newer
//   --memory-tier      with --save-every: keep every step in the memory tier too (save_to_memory: a copy in
//                      this node's /dev/shm or $FSDPX_MEMORY_DIR), so that a relaunch loses one step at most
//   --overwrite        a run without --resume refuses a --ckpt-dir that already holds checkpoints; this
//                      removes them first (their global_step_* directories and iteration files)
//   --check            exit 1 unless the loss fell (used by the tests)
//
// Each checkpoint step directory also gets huggingface/config.json (written by rank 0): a GPT-2
// configuration of this model, so that `merge` (examples/merge.cpp) or `fsdpx-merge` turns the
// checkpoint into a Hugging Face model directory.
//
// Policies are chosen at build time, through CMake cache variables (examples/CMakeLists.txt):
//   cmake -DFSDPX_EXAMPLE_MESH='HybridShard<2>' -DFSDPX_EXAMPLE_OFFLOAD='CpuOffload<>'
//         -DFSDPX_EXAMPLE_PRECISION=BF16Mixed -DFSDPX_EXAMPLE_STATE_DICT=FullStateDict ...
// (defaults: FullShard, NoOffload, FullPrecision, ShardedStateDict); a combination that makes no sense
// does not compile, with one sentence saying why.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include <torch/nn.h>
#include <torch/optim.h>

#include <fsdpx/fsdp.hpp>

#include "common/corpus.hpp"
#include "common/gpt.hpp"
#include "common/launch.hpp"

#ifndef FSDPX_EXAMPLE_MESH
#define FSDPX_EXAMPLE_MESH FullShard
#endif
#ifndef FSDPX_EXAMPLE_OFFLOAD
#define FSDPX_EXAMPLE_OFFLOAD NoOffload
#endif
#ifndef FSDPX_EXAMPLE_PRECISION
#define FSDPX_EXAMPLE_PRECISION FullPrecision
#endif
#ifndef FSDPX_EXAMPLE_STATE_DICT
#define FSDPX_EXAMPLE_STATE_DICT ShardedStateDict
#endif
#define FSDPX_EXAMPLE_STR2(...) #__VA_ARGS__
#define FSDPX_EXAMPLE_STR(...) FSDPX_EXAMPLE_STR2(__VA_ARGS__)

using fsdpx::examples::BlockImpl;
using fsdpx::examples::Gpt;
using fsdpx::examples::GptConfig;

using Sharded =
    fsdpx::Fsdp<Gpt, fsdpx::FSDPX_EXAMPLE_MESH, fsdpx::FSDPX_EXAMPLE_OFFLOAD, fsdpx::FSDPX_EXAMPLE_PRECISION,
                fsdpx::FSDPX_EXAMPLE_STATE_DICT, fsdpx::WrapModules<BlockImpl>>;

namespace {

namespace fs = std::filesystem;

struct Args {
  int64_t steps = 40;
  int64_t batch = 8;  // global, split across ranks
  int64_t seq = 128;
  int64_t dim = 192;
  int64_t layers = 4;
  int64_t heads = 4;
  double lr = 3e-3;
  std::string corpus;
  std::string ckpt_dir = "checkpoints/train_gpt";
  int64_t save_every = 0;
  int keep = 2;
  bool resume = false;
  bool memory_tier = false;
  bool overwrite = false;
  bool check = false;  // exit 1 unless the loss fell (used by the tests)
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    const auto next = [&]() -> std::string {
      FSDPX_CHECK(i + 1 < argc, "train_gpt: ", k, " needs a value");
      return argv[++i];
    };
    if (k == "--steps") a.steps = std::stoll(next());
    else if (k == "--batch") a.batch = std::stoll(next());
    else if (k == "--seq") a.seq = std::stoll(next());
    else if (k == "--dim") a.dim = std::stoll(next());
    else if (k == "--layers") a.layers = std::stoll(next());
    else if (k == "--heads") a.heads = std::stoll(next());
    else if (k == "--lr") a.lr = std::stod(next());
    else if (k == "--corpus") a.corpus = next();
    else if (k == "--ckpt-dir") a.ckpt_dir = next();
    else if (k == "--save-every") a.save_every = std::stoll(next());
    else if (k == "--keep") a.keep = std::stoi(next());
    else if (k == "--resume") a.resume = true;
    else if (k == "--memory-tier") a.memory_tier = true;
    else if (k == "--overwrite") a.overwrite = true;
    else if (k == "--check") a.check = true;
    else
      FSDPX_CHECK(false, "train_gpt: unknown option ", k,
                  " (the options are listed at the top of examples/train_gpt.cpp)");
  }
  FSDPX_CHECK(a.steps >= 0 && a.save_every >= 0 && a.keep >= 0,
              "train_gpt: --steps, --save-every and --keep must be >= 0");
  return a;
}

/// A GPT-2 configuration of this model, for <step dir>/huggingface/config.json. examples/merge.cpp
/// renames the tensors to GPT-2's (transformers' GPT2LMHeadModel) when it finds this file.
std::string gpt2_config_json(const GptConfig& c) {
  char buf[1024];
  std::snprintf(
      buf, sizeof buf,
      "{\n  \"architectures\": [\"GPT2LMHeadModel\"],\n  \"model_type\": \"gpt2\",\n"
      "  \"vocab_size\": %lld,\n  \"n_positions\": %lld,\n  \"n_embd\": %lld,\n  \"n_layer\": %lld,\n"
      "  \"n_head\": %lld,\n  \"n_inner\": %lld,\n  \"activation_function\": \"gelu\",\n"
      "  \"layer_norm_epsilon\": 1e-05,\n  \"resid_pdrop\": 0.0,\n  \"embd_pdrop\": 0.0,\n  \"attn_pdrop\": 0.0,\n"
      "  \"tie_word_embeddings\": %s,\n  \"bos_token_id\": 0,\n  \"eos_token_id\": 0,\n  \"torch_dtype\": "
      "\"float32\",\n"
      "  \"fsdpx_example\": \"train_gpt: byte-level (token = byte value); tensors named as in examples/common/gpt.hpp "
      "until examples/merge.cpp renames them\"\n}\n",
      static_cast<long long>(c.vocab), static_cast<long long>(c.seq), static_cast<long long>(c.dim),
      static_cast<long long>(c.layers), static_cast<long long>(c.heads), static_cast<long long>(4 * c.dim),
      c.tied ? "true" : "false");
  return buf;
}

/// Removes an earlier run's checkpoints (only what a checkpoint root holds).
void remove_checkpoints(const fs::path& root) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("global_step_", 0) == 0 || name == fsdpx::checkpoint::checkpointed_iteration_file ||
        name == fsdpx::checkpoint::state_dict_iteration_file) {
      fs::remove_all(e.path(), ec);
    }
  }
}

int64_t client_int(const c10::impl::GenericDict& d, const char* key, int64_t fallback) {
  const auto it = d.find(std::string(key));
  return it == d.end() ? fallback : it->value().toInt();
}
double client_double(const c10::impl::GenericDict& d, const char* key, double fallback) {
  const auto it = d.find(std::string(key));
  return it == d.end() ? fallback : it->value().toDouble();
}

}  // namespace

int main(int argc, char** argv) try {
  const Args args = parse(argc, argv);
  auto [world, device] = fsdpx::examples::init_world();
  const int W = world.size(), r = world.rank();
  FSDPX_CHECK(args.batch % W == 0, "train_gpt: --batch ", args.batch, " must be a multiple of the ", W, " ranks");
  std::string corpus_path;
  const at::Tensor corpus = fsdpx::examples::load_corpus(args.corpus, corpus_path);
  FSDPX_CHECK(corpus.numel() > args.seq + 1, "train_gpt: the corpus is shorter than --seq");

  GptConfig config;
  config.vocab = 256;  // bytes
  config.seq = args.seq;
  config.dim = args.dim;
  config.heads = args.heads;
  config.layers = args.layers;
  at::manual_seed(0);  // the same initial model on every rank
  Gpt gpt(config);
  gpt->to(device);
  Sharded model(gpt, world);
  auto optimizer = fsdpx::make_adamw(model, torch::optim::AdamWOptions(args.lr).weight_decay(0.1));
  int64_t params = 0;
  for (const auto& p : model->parameters()) params += p.numel();
  if (r == 0) {
    std::printf(
        "train_gpt: %d ranks (%s, %s), %.2fM parameters, %zu units, corpus %s (%lld bytes), global batch %lld x %lld\n"
        "train_gpt: policies %s, %s, %s, %s\n",
        W, std::string(world.backend_name()).c_str(), device.str().c_str(), params / 1e6, model.sharded().num_units(),
        corpus_path.c_str(), static_cast<long long>(corpus.numel()), static_cast<long long>(args.batch),
        static_cast<long long>(args.seq), FSDPX_EXAMPLE_STR(FSDPX_EXAMPLE_MESH),
        FSDPX_EXAMPLE_STR(FSDPX_EXAMPLE_OFFLOAD), FSDPX_EXAMPLE_STR(FSDPX_EXAMPLE_PRECISION),
        FSDPX_EXAMPLE_STR(FSDPX_EXAMPLE_STATE_DICT));
    std::fflush(stdout);
  }

  // ---- resume: model, optimizer, RNG and our client state (the data position) ----
  const fs::path root = args.ckpt_dir;
  int64_t start = 0, tokens_seen = 0;
  std::optional<double> first;
  if (args.resume) {
    if (const auto info = fsdpx::load_checkpoint(model, root, &optimizer)) {
      const auto& c = info->extra.client;
      FSDPX_CHECK(client_int(c, "dim", args.dim) == args.dim && client_int(c, "layers", args.layers) == args.layers &&
                      client_int(c, "seq", args.seq) == args.seq && client_int(c, "batch", args.batch) == args.batch,
                  "train_gpt: the checkpoint in ", root.string(), " was saved with --dim ", client_int(c, "dim", 0),
                  " --layers ", client_int(c, "layers", 0), " --seq ", client_int(c, "seq", 0), " --batch ",
                  client_int(c, "batch", 0), "; resume with the same options");
      start = info->step;
      tokens_seen = client_int(c, "tokens_seen", start * args.batch * args.seq);
      if (const double f = client_double(c, "first_loss", -1); f >= 0) first = f;
      if (r == 0) {
        std::printf("resumed from step %lld of %s%s (saved by %d ranks; %lld tokens seen)\n",
                    static_cast<long long>(start), info->source.string().c_str(),
                    info->from_memory ? " (the memory tier)" : "", info->saved_world_size,
                    static_cast<long long>(tokens_seen));
      }
    } else if (r == 0) {
      std::printf("train_gpt: no committed checkpoint in %s: starting from step 0\n", root.string().c_str());
    }
  }

  // One line per step and per checkpoint event, on rank 0.
  fsdpx::ProgressReporter progress(world, {.total_steps = args.steps}, device);

  // ---- background checkpoints ----
  FSDPX_CHECK(!args.memory_tier || args.save_every > 0,
              "train_gpt: --memory-tier keeps steps beside the disk's checkpoints: pass --save-every N as well");
#if defined(FSDPX_WITH_BOOST)
  std::optional<fsdpx::CheckpointCoordinator> ckpt;
  if (args.save_every > 0) {
    if (!args.resume && r == 0 && fs::exists(root)) {
      const auto latest = fsdpx::checkpoint::list_steps(root);
      if (!latest.empty() && !args.overwrite) {
        std::fprintf(stderr,
                     "train_gpt: %s already holds checkpoints (up to global_step_%lld): pass --resume to continue "
                     "from the newest, --overwrite to start over, or another --ckpt-dir\n",
                     root.string().c_str(), static_cast<long long>(latest.back().step));
        std::fflush(stderr);
        std::_Exit(2);  // mpirun then stops the other ranks
      }
      remove_checkpoints(root);
    }
    // The model's configuration, which the coordinator copies into every step's huggingface/, so
    // a merged checkpoint opens with transformers (examples/merge.cpp).
    const fs::path hf_source = root / ".huggingface";
    if (r == 0) {
      fs::create_directories(hf_source);
      std::ofstream(hf_source / "config.json") << gpt2_config_json(config);
    }
    world.barrier();  // the root is clean before any rank writes into it
    ckpt.emplace(root, model, fsdpx::CheckpointOptions{.max_to_keep = args.keep, .huggingface_dir = hf_source});
    ckpt->add_monitor(
        {.on_commit =
             [&progress](int64_t step, bool weights_only) {
               if (!weights_only) progress.committed(step);
             },
         .on_failure = [&progress](int64_t step, const std::string& why) { progress.failed(step, why); }});
  }
#else
  FSDPX_CHECK(args.save_every == 0,
              "train_gpt: checkpoints need Boost.Asio (fsdpx::CheckpointCoordinator); this build has none");
#endif

  if (start >= args.steps && r == 0) {
    std::printf("train_gpt: the checkpoint is at step %lld and --steps is %lld: nothing to train\n",
                static_cast<long long>(start), static_cast<long long>(args.steps));
  }
  const int64_t per_rank = args.batch / W;
  double last = first.value_or(0);
  for (int64_t step = start + 1; step <= args.steps; ++step) {
    // Every rank draws the same global batch of windows (a function of the step alone, so a resumed
    // run sees the same data) and takes its own rows.
    at::manual_seed(1000 + step);
    const auto windows = fsdpx::examples::random_windows(corpus, args.batch, args.seq);
    const auto mine = windows.narrow(0, r * per_rank, per_rank).to(device);

    optimizer.zero_grad();
    auto loss = model(mine.narrow(1, 0, args.seq).contiguous(), mine.narrow(1, 1, args.seq).contiguous());
    loss.backward();
    const fsdpx::GradNorm norm = model.clip_grad_norm_(1.0);
    optimizer.step();
    auto global = loss.detach().reshape({1}).to(at::kDouble);
    world.all_reduce(global, fsdpx::dist::ReduceOp::avg);
    last = global.item<double>();  // waits for the device
    tokens_seen += args.batch * args.seq;
    if (!first) first = last;
    progress.step(step, loss, per_rank * args.seq, norm.value);
#if defined(FSDPX_WITH_BOOST)
    const bool to_disk = args.save_every > 0 && (step % args.save_every == 0 || step == args.steps);
    if (ckpt && (to_disk || args.memory_tier)) {
      fsdpx::ExtraState extra;  // the RNG states are added by the coordinator
      extra.client.insert_or_assign("tokens_seen", tokens_seen);
      extra.client.insert_or_assign("first_loss", *first);
      extra.client.insert_or_assign("loss", last);
      extra.client.insert_or_assign("dim", args.dim);  // a resume with other model options is refused
      extra.client.insert_or_assign("layers", args.layers);
      extra.client.insert_or_assign("seq", args.seq);
      extra.client.insert_or_assign("batch", args.batch);
      if (args.memory_tier) ckpt->save_to_memory(step, model, &optimizer, &extra);
      if (to_disk) {
        ckpt->save(step, model, optimizer, extra);  // copies the shards, then writes in the background
        progress.saving(step);
      }
    }
#endif
  }
#if defined(FSDPX_WITH_BOOST)
  if (ckpt) {
    ckpt->wait();  // every save durable, and committed by rank 0
    world.barrier();
    if (r == 0) {
      std::printf("checkpoint: latest %s/%s = %lld\n", root.string().c_str(),
                  fsdpx::checkpoint::checkpointed_iteration_file, static_cast<long long>(ckpt->latest_committed()));
    }
  }
#endif
  if (r == 0 && first)
    std::printf("loss %.4f -> %.4f at step %lld\n", *first, last, static_cast<long long>(args.steps));
  return args.check && !(first && last < *first) ? 1 : 0;
} catch (const std::exception& e) {
  return fsdpx::examples::report_failure("train_gpt", e);
}
