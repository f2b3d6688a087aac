// Sequence parallelism at the world size mpiexec gives (CTest runs 1, 2 and 4): Ulysses' all-to-alls put
// every value where attention needs it and every gradient back where its value came from, exactly (they
// only move data); attention over the exchanged heads equals attention over the whole sequence; and the
// decoder given each rank's slice of the rows computes the whole rows' logits, loss and gradients.
#include <catch2/catch.hpp>

#include <cmath>
#include <map>
#include <string>

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <fsdpx/detail/json.hpp>
#include <fsdpx/dist/any.hpp>
#include <fsdpx/dist/mpi.hpp>
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

// A tiny decoder with grouped-query heads: 4 query heads over 2 key/value heads, which split over 2 ranks
// and are repeated over 4. Qwen2's variant has a sliding layer whose window is shorter than the rows.
models::DecoderConfig tiny_decoder(bool sliding) {
  fsdpx::detail::Json c = {{"model_type", sliding ? "qwen2" : "llama"},
                           {"architectures", {sliding ? "Qwen2ForCausalLM" : "LlamaForCausalLM"}},
                           {"vocab_size", 64},
                           {"hidden_size", 32},
                           {"intermediate_size", 48},
                           {"num_hidden_layers", 2},
                           {"num_attention_heads", 4},
                           {"num_key_value_heads", 2},
                           {"tie_word_embeddings", false}};
  if (sliding) {
    c["use_sliding_window"] = true;
    c["sliding_window"] = 5;
    c["layer_types"] = {"sliding_attention", "full_attention"};
  }
  return models::parse_decoder_config(c, sliding ? "qwen2 (sliding)" : "llama");
}

std::map<std::string, at::Tensor> gradients(models::CausalLM& m) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : m->named_parameters()) out[p.key()] = p.value().grad().clone();
  return out;
}

}  // namespace

TEST_CASE("Ulysses in the decoder: each rank's slice of the rows gives the whole rows' logits, loss and gradients",
          "[ulysses][decoder]") {
  const int P = world().size(), r = world().rank();
  const fsdpx::dist::AnyCommunicator group(world());
  for (const bool sliding : {false, true}) {
    const models::DecoderConfig config = tiny_decoder(sliding);
    INFO(config.model_type << " at " << P << " ranks");
    const int64_t b = 2, T = 6 * P;
    at::manual_seed(3);
    models::CausalLM whole(config);
    at::manual_seed(3);
    models::CausalLM split(config);
    split->set_sequence_group(group);
    at::manual_seed(4);
    const at::Tensor ids = at::randint(config.vocab_size, {b, T}, at::kLong);
    const at::Tensor mine = slice(ids, 1, r, P);

    const at::Tensor want_logits = slice(whole->forward(ids).detach(), 1, r, P);
    const at::Tensor logits = split->forward(mine).detach();
    CHECK((logits - want_logits).abs().max().item<double>() <=
          fsdpx::test::logits_bound(config, T) * want_logits.abs().max().item<double>());

    // loss(): each rank's share of the mean; their sum is the whole rows' loss.
    const at::Tensor want_loss = whole->loss(ids, ids);
    want_loss.backward();
    const at::Tensor share = split->loss(mine, mine);
    share.backward();
    at::Tensor loss = share.detach().clone();
    world().all_reduce(loss);
    const int64_t tokens = b * (T - 1);
    CHECK(std::abs(loss.item<double>() - want_loss.item<double>()) <=
          fsdpx::test::loss_bound(config, T, tokens) * std::abs(want_loss.item<double>()));

    // Each rank's gradients are its share: summed over the group, the whole rows' gradients.
    auto got = gradients(split);
    for (auto& [name, g] : got) world().all_reduce(g);
    CHECK(fsdpx::test::max_gradient_error(got, gradients(whole)) <= fsdpx::test::gradient_bound(config, T, tokens));
  }
}

TEST_CASE("Ulysses in the decoder: what it does not take yet is refused, naming it", "[ulysses][decoder][errors]") {
  const int P = world().size();
  if (P == 1) return;  // a group of one is no sequence parallelism: everything runs as without it
  models::CausalLM m(tiny_decoder(false));
  m->set_sequence_group(fsdpx::dist::AnyCommunicator(world()));
  const at::Tensor ids = at::randint(64, {1, 4}, at::kLong);
  using Catch::Matchers::Contains;
  CHECK_THROWS_WITH(m->forward(ids, at::ones({1, 4}, at::kLong)), Contains("no attention mask and no position ids"));
  CHECK_THROWS_WITH(m->loss(ids, ids, at::ones({1, 4}, at::kLong)), Contains("whole, unpadded rows"));
  CHECK_THROWS_WITH(m->log_probs(ids), Contains("log_probs under sequence parallelism is not supported yet"));
  CHECK_THROWS_WITH(m->forward_with_aux_loss(ids), Contains("forward_with_aux_loss under sequence parallelism"));
  if (P == 4) {  // 6 query heads do not split over 4 ranks
    models::DecoderConfig six = tiny_decoder(false);
    six.num_attention_heads = 6;
    six.head_dim = 8;
    models::CausalLM m6(six);
    m6->set_sequence_group(fsdpx::dist::AnyCommunicator(world()));
    CHECK_THROWS_WITH(m6->forward(ids), Contains("6 query heads do not split over a sequence group of 4 ranks"));
  }
  m->set_sequence_group(std::nullopt);
  CHECK(m->forward(ids).size(1) == 4);  // off again: the slice is a whole sequence of its own
}
