#pragma once
// The names the docs' C++ fragments take from the prose around them (tests/docs/extract_snippets.py):
// one namespace per context. Fragments are compiled, never linked, so the objects are declarations
// only. What a fragment needs beyond <fsdpx/fsdp.hpp>, <fsdpx/models.hpp> and <fsdpx/sync.hpp> it includes itself, as
// the reader has to.
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <fsdpx/fsdp.hpp>
#include <fsdpx/models.hpp>
#include <fsdpx/sync.hpp>

namespace fsdpx_doc {

/// What every context holds: the world, the step loop's counters, a batch, paths.
namespace common {
extern fsdpx::dist::MpiCommunicator world;
extern int rank, local_rank, micro_steps, trainers;
extern int64_t step, steps, global_batch, have, tokens_on_this_rank;
extern at::Tensor x, y, loss, tokens;
extern std::vector<std::pair<at::Tensor, at::Tensor>> batches;
extern std::filesystem::path dir, step_dir, hf_dir;
extern at::Device device;
extern double lr;
extern std::string secret;
extern std::vector<fsdpx::sync::NamedTensor> weights;
}  // namespace common

/// A GPT of the user's own (the README's): blocks are the sharding units.
namespace gpt {
using namespace common;
struct GptConfig {
  int64_t vocab = 256, dim = 64, layers = 2, seq = 32;
};
struct BlockImpl : torch::nn::Module {
  at::Tensor forward(const at::Tensor& x);
};
TORCH_MODULE(Block);
struct GptImpl : torch::nn::Module {
  explicit GptImpl(const GptConfig& config);
  at::Tensor forward(const at::Tensor& idx, const at::Tensor& targets);
  at::Tensor logits(const at::Tensor& idx);
  std::vector<Block> blocks;
};
TORCH_MODULE(Gpt);
/// A small network without units (policies.md's plain data parallel).
struct NetImpl : torch::nn::Module {
  at::Tensor forward(const at::Tensor& x, const at::Tensor& y);
};
TORCH_MODULE(Net);

using Sharded = fsdpx::Fsdp<Gpt, fsdpx::FullShard, fsdpx::NoOffload, fsdpx::FullPrecision, fsdpx::ShardedStateDict,
                            fsdpx::WrapModules<BlockImpl>>;
extern GptConfig config;
extern std::vector<Block> blocks;
extern Sharded model, actor;
extern torch::optim::AdamW optimizer;
extern fsdpx::CheckpointCoordinator ckpt;
extern fsdpx::GradNorm norm;
extern Gpt rollout, rollout_model;
void train_step();
void train_step(Sharded& model, torch::optim::Optimizer& optimizer);
void generate(Gpt& rollout);
void log(double grad_norm, double lr);

/// Whether the template `Doc`, declared by a doc, gives `Real`'s default arguments after a model.
template <class T, template <class...> class Real>
struct rebind;
template <template <class...> class Doc, class... Args, template <class...> class Real>
struct rebind<Doc<Args...>, Real> {
  using type = Real<Args...>;
};
template <template <class...> class Doc, template <class...> class Real>
inline constexpr bool same_defaults = std::is_same_v<typename rebind<Doc<Gpt>, Real>::type, Real<Gpt>>;
}  // namespace gpt

/// The same, for the synopses that name fsdpx's policies as fsdpx's own headers do.
namespace unqualified {
using namespace gpt;
using namespace fsdpx;
}  // namespace unqualified

/// The decoder of fsdpx::models (Qwen2/Llama/Mistral as transformers holds them).
namespace causal_lm {
using namespace common;
using Sharded = fsdpx::Fsdp<fsdpx::models::CausalLM, fsdpx::FullShard, fsdpx::NoOffload, fsdpx::BF16Mixed,
                            fsdpx::ShardedStateDict, fsdpx::models::DecoderUnits>;
struct Batch {
  at::Tensor input_ids, labels;
  fsdpx::models::BatchLayout samples;
};
extern fsdpx::models::DecoderConfig config;
extern Batch batch;
extern Sharded model;
extern torch::optim::AdamW optimizer;
}  // namespace causal_lm

/// The communication layer's own names (fsdpx::dist), for its synopses.
namespace dist {
using namespace common;
using namespace fsdpx::dist;
}  // namespace dist

}  // namespace fsdpx_doc
