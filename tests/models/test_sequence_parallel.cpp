// Sequence parallelism at the world size mpiexec gives (CTest runs 1, 2 and 4): Ulysses' all-to-alls put
// every value where attention needs it and every gradient back where its value came from, exactly (they
// only move data); attention over the exchanged heads equals attention over the whole sequence; the
// decoder given each rank's slice of the rows (whole, padded or packed, a sample crossing slices)
// computes the whole rows' logits, loss, log-probs, load-balancing loss and gradients; and
// Fsdp<CausalLM, SequenceParallel<P, Mesh>> with checkpointed layers trains three AdamW steps as the
// unsharded model trains on the same rows.
#include <catch2/catch.hpp>

#include <cmath>
#include <map>
#include <string>

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <torch/optim.h>

#include <fsdpx/detail/json.hpp>
#include <fsdpx/dist/any.hpp>
#include <fsdpx/dist/mpi.hpp>
#include <fsdpx/fsdp.hpp>
#include <fsdpx/models.hpp>

#include "../support/mpi_world.hpp"
#include "decoder_path.hpp"

using fsdpx::test::world;
namespace models = fsdpx::models;

namespace {

// The same on every rank: seeded, then drawn in the same order everywhere.
at::Tensor shared_randn(at::IntArrayRef sizes, uint64_t seed) {
  at::manual_seed(seed);
  return at::randn(sizes);
}

// This rank's slice of dimension 1 (its consecutive tokens) or of dimension 2 (its group of heads).
at::Tensor slice(const at::Tensor& t, int64_t dim, int rank, int ranks) {
  const int64_t n = t.size(dim) / ranks;
  return t.narrow(dim, rank * n, n).contiguous();
}

}  // namespace

TEST_CASE("Ulysses: each rank gets its heads for the whole sequence and gives them back, values and gradients exact",
          "[ulysses]") {
  const int P = world().size(), r = world().rank();
  const fsdpx::dist::AnyCommunicator group(world());
  const int64_t b = 2, T = 3 * P, H = 2 * P, D = 4;
  const at::Tensor whole = shared_randn({b, T, H, D}, 11);
  const at::Tensor mine = slice(whole, 1, r, P).requires_grad_(true);

  const at::Tensor heads = models::sequence_to_heads(mine, group);
  REQUIRE(heads.sizes() == at::IntArrayRef({b, T, H / P, D}));
  CHECK(at::equal(heads, slice(whole, 2, r, P)));
  const at::Tensor back = models::heads_to_sequence(heads, group);
  CHECK(at::equal(back, mine));

  // The gradient of sum over ranks of <w, heads> reaches each value's owner: w at its place.
  const at::Tensor w = shared_randn({b, T, H, D}, 12);
  (heads * slice(w, 2, r, P)).sum().backward();
  CHECK(at::equal(mine.grad(), slice(w, 1, r, P)));

  // Through both exchanges the gradient is the upstream one, untouched.
  mine.mutable_grad() = at::Tensor();
  const at::Tensor round_trip = models::heads_to_sequence(models::sequence_to_heads(mine, group), group);
  (round_trip * slice(w, 1, r, P)).sum().backward();
  CHECK(at::equal(mine.grad(), slice(w, 1, r, P)));
}

TEST_CASE("Ulysses: causal attention over the exchanged heads equals attention over the whole sequence", "[ulysses]") {
  const int P = world().size(), r = world().rank();
  const fsdpx::dist::AnyCommunicator group(world());
  const int64_t b = 1, T = 8 * P, H = 2 * P, D = 16;
  const at::Tensor q = shared_randn({b, T, H, D}, 21), k = shared_randn({b, T, H, D}, 22),
                   v = shared_randn({b, T, H, D}, 23);
  const auto attend = [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {  // [b, t, h, d] layout
    return at::scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), {}, 0.0,
                                            /*is_causal=*/true)
        .transpose(1, 2);
  };
  const at::Tensor want = slice(attend(q, k, v), 1, r, P);
  const at::Tensor got = models::heads_to_sequence(
      attend(models::sequence_to_heads(slice(q, 1, r, P), group), models::sequence_to_heads(slice(k, 1, r, P), group),
             models::sequence_to_heads(slice(v, 1, r, P), group))
          .contiguous(),
      group);
  // Each head's attention is the same computation on the same values, on however many heads a rank holds.
  CHECK(at::equal(got, want));
}

TEST_CASE("Ulysses: shapes that do not split over the group are refused, naming the remedy", "[ulysses][errors]") {
  const int P = world().size();
  const fsdpx::dist::AnyCommunicator group(world());
  using Catch::Matchers::Contains;
  CHECK_THROWS_WITH(models::sequence_to_heads(at::zeros({2, 3, 4}), group),
                    Contains("must be [batch, tokens, heads, head_dim]"));
  if (P > 1) {
    CHECK_THROWS_WITH(models::sequence_to_heads(at::zeros({1, 2, P + 1, 4}), group),
                      Contains(std::to_string(P + 1) + " heads do not split over a sequence group of " +
                               std::to_string(P) + " ranks; repeat the key/value heads"));
    CHECK_THROWS_WITH(models::heads_to_sequence(at::zeros({1, P + 1, 2, 4}), group),
                      Contains("tokens (the whole sequence) do not split into " + std::to_string(P) + " slices"));
  }
  world().barrier();
}

namespace {

// Tiny decoders of each family, with grouped-query heads (4 query heads over 2 key/value heads: split
// over 2 ranks, repeated over 4): Qwen2's with a sliding layer whose window is shorter than the rows,
// Qwen3's with per-head norms, Qwen3-MoE's with the load-balancing loss in its loss.
const char* const families[] = {"llama", "qwen2", "qwen3", "qwen3_moe"};

models::DecoderConfig tiny_decoder(const std::string& family) {
  fsdpx::detail::Json c = {
      {"model_type", family},   {"vocab_size", 64},         {"hidden_size", 32},        {"intermediate_size", 48},
      {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"tie_word_embeddings", false}};
  if (family == "qwen2") {
    c["use_sliding_window"] = true;
    c["sliding_window"] = 5;
    c["layer_types"] = {"sliding_attention", "full_attention"};
  } else if (family == "qwen3") {
    c["head_dim"] = 8;
  } else if (family == "qwen3_moe") {
    c["num_experts"] = 4;
    c["num_experts_per_tok"] = 2;
    c["moe_intermediate_size"] = 16;
    c["output_router_logits"] = true;
    c["router_aux_loss_coef"] = 0.1;
  }
  return models::parse_decoder_config(c, family);
}

std::map<std::string, at::Tensor> gradients(torch::nn::Module& m) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : m.named_parameters()) out[p.key()] = p.value().grad().clone();
  return out;
}

enum class Rows { whole, padded, packed };
const char* name_of(Rows r) { return r == Rows::whole ? "whole rows" : r == Rows::padded ? "padded" : "packed"; }

// Two rows of T tokens (T a multiple of 6). Padded: row 0 right-padded by 3, row 1 left-padded by 2,
// labels -100 there. Packed: row 0 holds samples of T/2 - 1 and T/2 + 1 tokens (at 2 and 4 ranks the
// second crosses slices), row 1 samples of 3 and T - 3.
struct Batch {
  at::Tensor ids, labels, mask;  // mask: padded rows only
  models::PackedSamples samples;
  models::BatchLayout layout() const {
    if (mask.defined()) return mask;
    return samples;
  }
  /// This rank's part: the mask's slice, or the whole rows' samples.
  models::BatchLayout slice_layout(const fsdpx::dist::AnyCommunicator& group) const {
    if (mask.defined()) return slice(mask, 1, group.rank(), group.size());
    return samples;
  }
};

Batch make_batch(Rows rows, int64_t T, int64_t vocab, uint64_t seed) {
  Batch b;
  at::manual_seed(seed);
  b.ids = at::randint(vocab, {2, T}, at::kLong);
  b.labels = b.ids.clone();
  if (rows == Rows::padded) {
    b.mask = at::ones({2, T}, at::kLong);
    b.mask[0].narrow(0, T - 3, 3).zero_();
    b.mask[1].narrow(0, 0, 2).zero_();
    b.labels.masked_fill_(b.mask.eq(0), -100);
  } else if (rows == Rows::packed) {
    const at::Tensor positions =
        at::cat({at::arange(T / 2 - 1), at::arange(T / 2 + 1), at::arange(3), at::arange(T - 3)}).view({2, T});
    b.samples = models::PackedSamples::from_position_ids(positions, 2);
  }
  return b;
}

// The group's slices [batch, n_r] laid end to end (n_r may differ by rank, as the last log-probs slice).
at::Tensor gather_varying(const at::Tensor& mine, int64_t t) {
  const int P = world().size();
  const at::Tensor padded = at::constant_pad_nd(mine, {0, t - mine.size(1)}, 0).contiguous();
  at::Tensor all = at::empty({P, mine.size(0), t}, mine.options());
  world().all_gather(all, padded);
  return all.permute({1, 0, 2}).reshape({mine.size(0), P * t});
}

}  // namespace

TEST_CASE(
    "Ulysses in the decoder: each rank's slice of whole, padded or packed rows gives the whole rows' "
    "logits, loss, log-probs and gradients",
    "[ulysses][decoder]") {
  const int P = world().size(), r = world().rank();
  const fsdpx::dist::AnyCommunicator group(world());
  for (const std::string family : families) {
    const models::DecoderConfig config = tiny_decoder(family);
    for (const Rows rows : {Rows::whole, Rows::padded, Rows::packed}) {
      INFO(family << ", " << name_of(rows) << ", at " << P << " ranks");
      const int64_t T = 6 * P;
      at::manual_seed(3);
      models::CausalLM whole(config);
      at::manual_seed(3);
      models::CausalLM split(config);
      split->set_sequence_group(group);
      const Batch batch = make_batch(rows, T, config.vocab_size, 4);
      const at::Tensor mine = slice(batch.ids, 1, r, P), my_labels = slice(batch.labels, 1, r, P);
      const models::BatchLayout layout = batch.layout(), my_layout = batch.slice_layout(group);
      // Padding positions hold values nobody reads (transformers' too): compared where tokens are.
      const at::Tensor kept = batch.mask.defined() ? batch.mask.to(at::kBool) : at::ones({2, T}, at::kBool);

      const at::Tensor want_logits = whole->forward(batch.ids, layout).detach();
      const at::Tensor logits = split->forward(mine, my_layout).detach();
      const at::Tensor my_kept = slice(kept, 1, r, P).unsqueeze(2);
      CHECK(((logits - slice(want_logits, 1, r, P)) * my_kept).abs().max().item<double>() <=
            fsdpx::test::logits_bound(config, T) * want_logits.abs().max().item<double>());

      // loss(): each rank's share of the mean (and of the load-balancing loss); their sum is the rows' loss.
      const at::Tensor want_loss = whole->loss(batch.ids, batch.labels, layout);
      want_loss.backward();
      const at::Tensor share = split->loss(mine, my_labels, my_layout);
      share.backward();
      at::Tensor loss = share.detach().clone();
      world().all_reduce(loss);
      const int64_t tokens = 2 * (T - 1);
      CHECK(std::abs(loss.item<double>() - want_loss.item<double>()) <=
            fsdpx::test::loss_bound(config, T, tokens) * std::abs(want_loss.item<double>()));
      // Each rank's gradients are its share: summed over the group, the whole rows' gradients.
      auto got = gradients(*split);
      for (auto& [name, g] : got) world().all_reduce(g);
      CHECK(fsdpx::test::max_gradient_error(got, gradients(*whole)) <= fsdpx::test::gradient_bound(config, T, tokens));

      // log_probs(): this slice's positions; laid end to end, the rows' [batch, T - 1].
      at::NoGradGuard no_grad;
      const models::LogProbOptions entropy{.entropy = true};
      const models::TokenLogProbs want = whole->log_probs(batch.ids, layout, entropy);
      const models::TokenLogProbs part = split->log_probs(mine, my_layout, entropy);
      REQUIRE(part.log_probs.size(1) == (r + 1 < P ? T / P : T / P - 1));
      const at::Tensor both_kept = kept.narrow(1, 0, T - 1) & kept.narrow(1, 1, T - 1);
      const auto error = [&](const at::Tensor& got_part, const at::Tensor& w) {
        return ((gather_varying(got_part, T / P).narrow(1, 0, T - 1) - w) * both_kept).abs().max().item<double>();
      };
      CHECK(error(part.log_probs, want.log_probs) <=
            fsdpx::test::logits_bound(config, T) * want.log_probs.abs().max().item<double>());
      CHECK(error(part.entropy, want.entropy) <=
            fsdpx::test::logits_bound(config, T) * want.entropy.abs().max().item<double>());

      if (config.moe.num_experts > 0) {  // the load-balancing loss: shares that sum to the rows'
        const at::Tensor want_aux = whole->forward_with_aux_loss(batch.ids, layout).aux_loss;
        at::Tensor aux = split->forward_with_aux_loss(mine, my_layout).aux_loss.clone();
        world().all_reduce(aux);
        CHECK(std::abs(aux.item<double>() - want_aux.item<double>()) <=
              fsdpx::test::loss_bound(config, T, tokens) * std::abs(want_aux.item<double>()));
      }
    }
  }
}

TEST_CASE("Ulysses in the decoder: what does not split, or differs across the group, is refused on every rank",
          "[ulysses][decoder][errors]") {
  const int P = world().size(), r = world().rank();
  if (P == 1) return;  // a group of one is no sequence parallelism: everything runs as without it
  const fsdpx::dist::AnyCommunicator group(world());
  models::CausalLM m(tiny_decoder("llama"));
  m->set_sequence_group(group);
  using Catch::Matchers::Contains;
  // Rank 1 holds other rows (or a slice of another length): the group's checks say so before any exchange.
  const at::Tensor rows = at::randint(64, {1, 4 * P}, at::kLong);
  at::Tensor differs = rows.clone();
  if (r == 1) differs[0][0] = (differs[0][0].item<int64_t>() + 1) % 64;
  CHECK_THROWS_WITH(models::sequence_slice(differs, group),
                    Contains("rank 1 of the sequence group passed rows whose checksum is"));
  CHECK_THROWS_WITH(models::sequence_slice(rows.narrow(1, 0, 4 * P - 1), group), Contains("do not split into"));
  const at::Tensor ids = models::sequence_slice(rows, group);
  CHECK_THROWS_WITH(m->forward(r == 1 ? ids.narrow(1, 0, 3) : ids),
                    Contains("rank 1 of the sequence group passed tokens per slice 3 where rank 0 passed 4"));
  CHECK_THROWS_WITH(m->forward(ids, r == 1 ? at::Tensor() : at::ones({1, 4}, at::kLong)),
                    Contains("rank 1 of the sequence group passed an attention mask (1: yes) 0"));
  const models::PackedSamples mine = models::PackedSamples::from_position_ids(
      at::cat({at::arange(r == 1 ? 3 : 2), at::arange(4 * P - (r == 1 ? 3 : 2))}).unsqueeze(0), 1);
  CHECK_THROWS_WITH(m->forward(ids, mine), Contains("rank 1 of the sequence group passed packed samples (crc)"));
  CHECK_THROWS_WITH(m->forward(ids, models::PackedSamples::from_position_ids(at::arange(4).unsqueeze(0), 1)),
                    Contains("the whole rows of a sequence group"));
  CHECK_THROWS_WITH(m->generate(ids), Contains("generation runs without sequence parallelism"));
  // A rank whose own input is wrong throws its own error; the others learn it before any exchange.
  const at::Tensor bad_labels = r == 1 ? ids.narrow(1, 0, 3) : ids;
  CHECK_THROWS_WITH(m->loss(ids, bad_labels), Contains(r == 1 ? "labels must be int64 [batch, seq] like input_ids"
                                                              : "rank 1 of the sequence group refused its inputs"));
  CHECK_THROWS_WITH(m->log_probs(r == 1 ? ids.narrow(1, 0, 1) : ids),
                    Contains(r == 1 ? "with seq >= 2" : "rank 1 of the sequence group refused its inputs"));
  CHECK_THROWS_WITH(models::sequence_slice(r == 1 ? rows.narrow(1, 0, 4 * P - 1) : rows, group),
                    Contains(r == 1 ? "do not split into" : "rank 1 of the sequence group refused its inputs"));
  if (P == 4) {  // 6 query heads do not split over 4 ranks
    models::DecoderConfig six = tiny_decoder("llama");
    six.num_attention_heads = 6;
    six.head_dim = 8;
    models::CausalLM m6(six);
    m6->set_sequence_group(group);
    CHECK_THROWS_WITH(m6->forward(ids), Contains("6 query heads do not split over a sequence group of 4 ranks"));
  }
  m->set_sequence_group(std::nullopt);
  CHECK(m->forward(ids).size(1) == 4);  // off again: the slice is a whole sequence of its own
}

namespace {

// Layers checkpointed (the recomputation repeats the all-to-alls), embedding and head as units, the
// chunked loss.
using SequenceSharded =
    fsdpx::Fsdp<models::CausalLM, fsdpx::SequenceParallel<2>, fsdpx::NoOffload, fsdpx::FullPrecision,
                fsdpx::ShardedStateDict, models::DecoderUnits, fsdpx::CheckpointNames<"model.layers.*">>;
using RuntimeSequenceHybrid =
    fsdpx::Fsdp<models::CausalLM, fsdpx::SequenceParallel<fsdpx::runtime_sequence_size, fsdpx::HybridShard<>>,
                fsdpx::NoOffload, fsdpx::FullPrecision, fsdpx::ShardedStateDict, models::DecoderUnits,
                fsdpx::CheckpointNames<"model.layers.*">>;

// Three AdamW steps (whole, packed, then padded rows) of `model` against the unsharded model on the same
// rows: each sequence group of P ranks takes two rows of its own (its slices of them), the reference
// takes every group's rows and averages the groups' losses, as data parallelism averages its ranks'.
template <class Sharded>
void check_three_steps(Sharded& model, const models::DecoderConfig& config) {
  const fsdpx::dist::AnyCommunicator group = *model.sequence_group();
  const int P = group.size(), W = world().size(), groups = W / P, g = world().rank() / P;
  models::CausalLM reference(config);
  fsdpx::test::take_weights(*reference, model);
  const auto options = torch::optim::AdamWOptions(1e-2).weight_decay(0.0).eps(1e-6);
  auto optimizer = fsdpx::make_adamw(model, options);
  torch::optim::AdamW ref_optimizer(reference->parameters(), options);
  const int64_t T = 6 * P;
  fsdpx::test::StepParity parity(fsdpx::test::decoder_step_bounds(config, T, 2 * (T - 1)));
  int step = 0;
  for (const Rows rows : {Rows::whole, Rows::packed, Rows::padded}) {
    INFO(name_of(rows));
    optimizer.zero_grad();
    ref_optimizer.zero_grad();
    at::Tensor ref_loss = at::zeros({});
    Batch mine;
    for (int other = 0; other < groups; ++other) {
      const Batch b = make_batch(rows, T, config.vocab_size, 700 + 10 * step + other);
      const at::Tensor l = reference->loss(b.ids, b.labels, b.layout()) / groups;
      l.backward();
      ref_loss += l.detach();
      if (other == g) mine = b;
    }
    const at::Tensor share = model.call(&models::CausalLMImpl::loss, models::sequence_slice(mine.ids, group),
                                        models::sequence_slice(mine.labels, group), mine.slice_layout(group));
    share.backward();
    CHECK(model.last_step_stats().recomputations == config.num_hidden_layers);
    // step_both averages the ranks' losses; a rank's share times P averages to the groups' mean.
    fsdpx::test::step_both(parity, model, optimizer, *reference, ref_optimizer, share * P, ref_loss);
    ++step;
  }
  INFO(parity.summary());
  CHECK(parity.holds());
}

}  // namespace

TEST_CASE(
    "Fsdp<CausalLM, SequenceParallel<P, Mesh>>: checkpointed layers train three AdamW steps as the "
    "unsharded model on the same rows",
    "[ulysses][fsdp]") {
  const int W = world().size();
  using Catch::Matchers::Contains;
  if (W % 2 != 0) {  // a sequence group of 2 does not tile the world
    CHECK_THROWS_WITH(SequenceSharded(models::CausalLM(tiny_decoder("llama")), world()),
                      Contains("cannot be split into sequence groups of 2 ranks"));
    return;
  }
  for (const std::string family : families) {
    INFO(family << " at world size " << W);
    const models::DecoderConfig config = tiny_decoder(family);
    at::manual_seed(5);
    SequenceSharded model(models::CausalLM(config), world());
    REQUIRE(model.sequence_group()->size() == 2);
    model->chunk_logits = 2 * config.vocab_size;
    check_three_steps(model, config);
    if (W == 4) {  // groups of 2 across shard groups of 2, sizes given at run time; one group of 4
      at::manual_seed(5);
      RuntimeSequenceHybrid hybrid(models::CausalLM(config), world(), {.shard_size = 2, .sequence_size = 2});
      REQUIRE(hybrid.mesh().is_hybrid());
      check_three_steps(hybrid, config);
      at::manual_seed(5);
      RuntimeSequenceHybrid four(models::CausalLM(config), world(), {.shard_size = 4, .sequence_size = 4});
      REQUIRE(four.sequence_group()->size() == 4);
      check_three_steps(four, config);
    }
  }
  if (W == 4) {
    CHECK_THROWS_WITH(
        RuntimeSequenceHybrid(models::CausalLM(tiny_decoder("llama")), world(), {.shard_size = 2, .sequence_size = 3}),
        Contains("sequence parallel size must divide the world size (one of: 1, 2, 4)"));
  }
  {  // The group off (for generation) with gradients on would scale whole-row gradients by P.
    at::manual_seed(5);
    SequenceSharded model(models::CausalLM(tiny_decoder("llama")), world());
    const at::Tensor ids = at::randint(64, {1, 8}, at::kLong);
    {
      models::SequenceGroupOff whole_rows(*model.module());
      CHECK_FALSE(model->sequence_group().has_value());
      CHECK_THROWS_WITH(model.call(&models::CausalLMImpl::loss, ids, ids, models::BatchLayout{}),
                        Contains("the model's sequence group is off, and gradients are on"));
      at::NoGradGuard no_grad;
      CHECK(model.call(&models::CausalLMImpl::forward, ids, models::BatchLayout{}, at::Tensor()).size(1) == 8);
    }
    CHECK(model->sequence_group()->size() == 2);  // back on at the scope's end
  }
  // A model given a group by hand under a mesh without a sequence dimension would average shares.
  models::CausalLM by_hand(tiny_decoder("llama"));
  by_hand->set_sequence_group(fsdpx::dist::AnyCommunicator(world()));
  using Plain = fsdpx::Fsdp<models::CausalLM, fsdpx::FullShard>;
  CHECK_THROWS_WITH(Plain(by_hand, world()), Contains("use Fsdp<Model, SequenceParallel<P, Mesh>>"));
}

TEST_CASE(
    "Fsdp<CausalLM, SequenceParallel<2>> in bfloat16 with CPU offload computes what the mesh without it "
    "computes on the whole rows",
    "[ulysses][fsdp][bf16]") {
  const int W = world().size(), r = world().rank();
  if (W % 2 != 0) return;
  using Checkpointing = fsdpx::CheckpointNames<"model.layers.*">;
  using Split = fsdpx::Fsdp<models::CausalLM, fsdpx::SequenceParallel<2>, fsdpx::CpuOffload<false>, fsdpx::BF16Mixed,
                            fsdpx::ShardedStateDict, models::DecoderUnits, Checkpointing>;
  using Whole = fsdpx::Fsdp<models::CausalLM, fsdpx::FullShard, fsdpx::CpuOffload<false>, fsdpx::BF16Mixed,
                            fsdpx::ShardedStateDict, models::DecoderUnits, Checkpointing>;
  const models::DecoderConfig config = tiny_decoder("llama");
  at::manual_seed(8);
  Split split(models::CausalLM(config), world());
  at::manual_seed(8);
  Whole whole(models::CausalLM(config), world());
  const fsdpx::dist::AnyCommunicator group = *split.sequence_group();
  const int64_t T = 12;
  // Both ranks of a group take its rows: the whole model averages the duplicates, which is the groups' mean.
  const Batch b = make_batch(Rows::packed, T, config.vocab_size, 900 + r / 2);
  const at::Tensor ids = models::sequence_slice(b.ids, group), labels = models::sequence_slice(b.labels, group);

  // Both compute in bfloat16, rounding each stage's result (u = 2^-8) in their own places.
  const double logits_bound = fsdpx::test::logits_bound(config, T, at::kBFloat16);
  at::Tensor want_logits, logits;
  {
    at::NoGradGuard no_grad;
    want_logits = whole.call(&models::CausalLMImpl::forward, b.ids, b.layout(), at::Tensor()).to(at::kFloat);
    logits = split.call(&models::CausalLMImpl::forward, ids, b.slice_layout(group), at::Tensor()).to(at::kFloat);
  }
  const double scale = want_logits.abs().max().item<double>();
  CHECK((logits - slice(want_logits, 1, group.rank(), 2)).abs().max().item<double>() <= logits_bound * scale);

  const at::Tensor want_loss = whole.call(&models::CausalLMImpl::loss, b.ids, b.labels, b.layout());
  want_loss.backward();
  const at::Tensor share = split.call(&models::CausalLMImpl::loss, ids, labels, b.slice_layout(group));
  share.backward();
  // A log-softmax moves by at most twice the largest change of its logits.
  at::Tensor losses = at::stack({share.detach().to(at::kDouble) * 2, want_loss.detach().to(at::kDouble)});
  world().all_reduce(losses, fsdpx::dist::ReduceOp::avg);
  CHECK(std::abs(losses[0].item<double>() - losses[1].item<double>()) <= 2 * logits_bound * scale);

  // Every gradient element this rank holds (the same slices in both: the same units over the same world),
  // relative to the largest gradient element of its layer, over all ranks.
  const auto got = fsdpx::test::held_slices(split.sharded()), want = fsdpx::test::held_slices(whole.sharded());
  REQUIRE(got.size() == want.size());
  const auto layer_index = [&](const std::string& name) {
    const std::string layer = fsdpx::test::layer_of(name);
    return layer.empty() ? int64_t{0} : std::stoll(layer.substr(layer.rfind('.') + 1)) + 1;
  };
  at::Tensor layer_max = at::zeros({config.num_hidden_layers + 1}, at::kDouble);
  for (const auto& s : want) {
    const int64_t i = layer_index(s.name);
    layer_max[i] = std::max(layer_max[i].item<double>(), s.grad.abs().max().item<double>());
  }
  world().all_reduce(layer_max, fsdpx::dist::ReduceOp::max);
  const int64_t tokens = 2 * (T - 1);
  const double gradient_bound = fsdpx::test::gradient_bound(config, T, tokens, at::kBFloat16);
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    REQUIRE(got[i].name == want[i].name);
    const double error = (got[i].grad - want[i].grad).abs().max().item<double>();
    worst = std::max(worst, error / (gradient_bound * layer_max[layer_index(got[i].name)].item<double>()));
  }
  INFO("gradients: " << worst << " of their bound");
  CHECK(worst <= 1);
}
