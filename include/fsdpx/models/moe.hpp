// Mixture of experts for models/decoder.hpp's sparse layers (Qwen2-MoE, Qwen3-MoE; models/config.hpp's
// MoeConfig): the router, the experts run over the tokens grouped by expert (per expert, or as grouped
// products), Qwen2-MoE's shared expert, and transformers' load-balancing loss.
#pragma once

#include <cstdint>
#include <utility>
#include <optional>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>

#include <fsdpx/error.hpp>
#include <fsdpx/models/config.hpp>
#include <fsdpx/dist/any.hpp>
#include <fsdpx/models/modules.hpp>

namespace fsdpx::models {

/// How a sparse layer runs its experts over the tokens grouped by expert.
enum class ExpertKernel {
  automatic,   // grouped on CUDA in bfloat16/float16 where the sizes allow, per_expert elsewhere
  per_expert,  // each expert that received tokens: its own three products
  grouped,     // at::_grouped_mm over the experts' weights stacked for the call: two grouped products
};

/// A mixture-of-experts MLP (Qwen2-MoE, Qwen3-MoE; models/config.hpp's MoeConfig). Each expert is a
/// module of its own, named as the Hugging Face files name it ("mlp.experts.3.gate_proj.weight").
/// Tokens are grouped by expert and each expert that received tokens runs once on all of them: the
/// work of the tokens times num_experts_per_tok, whatever the number of experts. An expert that no
/// token chose runs nothing and gets no gradient (the unit protocol reduces it as unused).
struct SparseMoeBlockImpl : torch::nn::Module {
  explicit SparseMoeBlockImpl(const DecoderConfig& c)
      : top_k(c.moe.num_experts_per_tok), norm_topk_prob(c.moe.norm_topk_prob) {
    gate = register_module("gate", Linear(c.hidden_size, c.moe.num_experts, /*bias=*/false));
    auto list = register_module("experts", torch::nn::ModuleList());
    for (int64_t e = 0; e < c.moe.num_experts; ++e) {
      experts.emplace_back(c.hidden_size, c.moe.moe_intermediate_size, /*bias=*/false);
      list->push_back(experts.back());
    }
    if (c.moe.shared_expert_intermediate_size > 0) {
      shared_expert =
          register_module("shared_expert", Mlp(c.hidden_size, c.moe.shared_expert_intermediate_size, false));
      shared_expert_gate = register_module("shared_expert_gate", Linear(c.hidden_size, 1, /*bias=*/false));
    }
  }

  /// x [..., hidden] -> the mixture's output (x's shape) and the router's logits [tokens, experts].
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& x) {
    const at::Tensor h = x.reshape({-1, x.size(-1)});
    const at::Tensor logits = gate(h);
    // As transformers: softmax over all experts in float32, the top k, optionally renormalized, then
    // the weights in the activations' dtype.
    auto [weights, chosen] = at::softmax(logits, -1, at::kFloat).topk(top_k, -1);
    if (norm_topk_prob) weights = weights / weights.sum(-1, /*keepdim=*/true);
    weights = weights.to(h.scalar_type());
    // The (token, slot) pairs sorted by expert: each expert's tokens are one contiguous run.
    const at::Tensor expert_of = chosen.reshape({-1});
    const at::Tensor order = std::get<1>(expert_of.sort(/*stable=*/true, 0, /*descending=*/false));
    const at::Tensor counts = at::bincount(expert_of, {}, static_cast<int64_t>(experts.size())).to(at::kCPU);
    const at::Tensor token_of = order.div(top_k, "floor");
    const at::Tensor weight_of = weights.reshape({-1}).index_select(0, order).unsqueeze(1);
    at::Tensor out;
    if (use_grouped(h)) {
      out = at::zeros_like(h).index_add(0, token_of, grouped_experts(h.index_select(0, token_of), counts) * weight_of);
    } else {
      const int64_t* count = counts.data_ptr<int64_t>();
      std::vector<at::Tensor> outputs;
      int64_t start = 0;
      for (size_t e = 0; e < experts.size(); ++e) {
        const int64_t n = count[e];
        if (n == 0) continue;
        const at::Tensor tokens = token_of.narrow(0, start, n);
        outputs.push_back(experts[e](h.index_select(0, tokens)) * weight_of.narrow(0, start, n));
        start += n;
      }
      out = outputs.empty() ? at::zeros_like(h) : at::zeros_like(h).index_add(0, token_of, at::cat(outputs, 0));
    }
    if (shared_expert) out = out + at::sigmoid(shared_expert_gate(h)) * shared_expert(h);
    return {out.view(x.sizes()), logits};
  }

  /// at::_grouped_mm needs each operand's rows 16-byte aligned: the hidden and expert sizes a multiple
  /// of 16 bytes' worth of elements.
  bool groupable(const at::Tensor& h) const {
    const auto align = static_cast<int64_t>(16 / h.element_size());
    const int64_t inner = experts.empty() ? 0 : experts.front()->down_proj->weight.size(1);
    return h.size(1) % align == 0 && inner % align == 0;
  }
  bool use_grouped(const at::Tensor& h) const {
    if (kernel == ExpertKernel::per_expert || experts.empty()) return false;
    if (kernel == ExpertKernel::grouped) {
      FSDPX_CHECK(groupable(h), "SparseMoeBlock: ExpertKernel::grouped needs the hidden size (", h.size(1),
                  ") and the "
                  "experts' intermediate size to be multiples of ",
                  16 / h.element_size(), " ", h.scalar_type(), " elements");
      return true;
    }
    return h.is_cuda() && (h.scalar_type() == at::kBFloat16 || h.scalar_type() == at::kHalf) && groupable(h);
  }

  /// The experts over tokens sorted by expert (counts: tokens per expert, on the host) as two grouped
  /// products. The weights are stacked for the call (a copy of the layer's experts, as large as its
  /// gather); the gradients flow back through the stack to each expert's own parameters.
  at::Tensor grouped_experts(const at::Tensor& sorted, const at::Tensor& counts) const {
    std::vector<at::Tensor> gate_up, down;
    for (const auto& e : experts) {
      gate_up.push_back(at::cat({e->gate_proj->weight, e->up_proj->weight}, 0));
      down.push_back(e->down_proj->weight);
    }
    const at::Tensor offsets = counts.cumsum(0).to(at::kInt).to(sorted.device());
    const at::Tensor both = at::_grouped_mm(sorted, at::stack(gate_up).transpose(-2, -1), offsets);
    const auto halves = both.chunk(2, -1);
    return at::_grouped_mm(at::silu(halves[0]) * halves[1], at::stack(down).transpose(-2, -1), offsets);
  }

  int64_t top_k;
  bool norm_topk_prob;
  ExpertKernel kernel = ExpertKernel::automatic;
  Linear gate{nullptr};
  std::vector<Mlp> experts;
  Mlp shared_expert{nullptr};
  Linear shared_expert_gate{nullptr};
};
TORCH_MODULE(SparseMoeBlock);

/// transformers' load_balancing_loss_func over the router logits of every sparse layer ([tokens,
/// experts] each, tokens in [batch, seq] order): E x sum over experts of (the share of top-k slots
/// routed to it) x (its mean router probability), pooled over the layers and the tokens that
/// attention_mask [batch, seq] keeps (undefined: all). Undefined when there are no router logits.
/// Under sequence parallelism (`sequence_group`: the ranks holding the other slices of the same rows),
/// this slice's share: the shares of slots and the count of tokens pooled over the group, the
/// probabilities of this slice's tokens, so that the shares sum to the rows' loss and each share's
/// gradient is its own tokens'.
inline at::Tensor load_balancing_loss(const std::vector<at::Tensor>& router_logits, int64_t num_experts, int64_t top_k,
                                      const at::Tensor& attention_mask = {},
                                      std::optional<dist::AnyCommunicator> sequence_group = std::nullopt) {
  if (router_logits.empty()) return {};
  const at::Tensor logits = at::cat(router_logits, 0);
  const at::Tensor probs = at::softmax(logits, -1);
  const at::Tensor chosen = at::one_hot(std::get<1>(probs.topk(top_k, -1)), num_experts).to(at::kFloat);  // [n, k, E]
  const auto layers = static_cast<int64_t>(router_logits.size());
  const at::Tensor keep =
      attention_mask.defined()
          ? attention_mask.to(logits.device()).to(at::kFloat).reshape({1, -1}).expand({layers, -1}).reshape({-1, 1})
          : at::ones({logits.size(0), 1}, probs.options().dtype(at::kFloat));
  at::Tensor kept = keep.sum();  // counts in float32: exact up to 2^24 tokens, whatever the router's dtype
  at::Tensor slots = (chosen * keep.unsqueeze(2)).sum(0);  // [k, E], no gradient (a selection)
  if (sequence_group && sequence_group->size() > 1) {
    sequence_group->all_reduce(kept);
    sequence_group->all_reduce(slots);
  }
  const at::Tensor prob_per_expert = (probs * keep).sum(0) / kept;
  return (slots / kept * prob_per_expert.unsqueeze(0)).sum() * static_cast<double>(num_experts);
}

}  // namespace fsdpx::models
