// Weight sync between a sharded trainer and rollout ranks, under mpiexec. World ranks [0, T) train a
// GPT with fsdpx (T from FSDPX_SYNC_TRAINERS), the others are rollouts. After every training step:
//   - the trainer broadcasts its weights (WeightBroadcaster -> WeightReceiver), and
//   - trainer rank 0 publishes them to a TCP synchronizer it hosts; the first rollout fetches every
//     version, the last one joins late and must get the newest.
// Every rollout copy must equal the trainer's full parameters bit for bit, cast to the rollout dtype,
// and versions must come in order.
#include <catch2/catch.hpp>

#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include <ATen/ATen.h>

#include <fsdpx/fsdp.hpp>
#include <fsdpx/models.hpp>
#include <fsdpx/sync.hpp>
#if defined(FSDPX_WITH_SYNC_SERVICE)
#include <fsdpx/sync/service.hpp>
#endif

#include "../core/models.hpp"
#include "../support/bit_equal.hpp"
#include "../support/mpi_world.hpp"

using namespace fsdpx;
using namespace fsdpx::sync;

namespace {

using fsdpx::test::bits;

int trainers() {
  const char* v = std::getenv("FSDPX_SYNC_TRAINERS");
  return v ? std::atoi(v) : 2;
}

struct Setup {
  dist::AnyCommunicator world;
  TrainerRolloutGroups groups;
  int rollout_index = -1;  // 0.. on rollout ranks
  int rollouts = 0;
};

Setup& setup() {
  static std::optional<Setup> s;
  if (!s) {
    dist::AnyCommunicator world(test::world());
    auto groups = split_trainer_rollout(world, trainers());
    const int T = trainers();
    s.emplace(Setup{world, std::move(groups), world.rank() >= T ? world.rank() - T : -1, world.size() - T});
  }
  return *s;
}

test::GptConfig config() { return {.vocab = 61, .seq = 16, .dim = 32, .heads = 4, .layers = 3, .tied = false}; }

/// A buffer the trainer changes every step: buffers travel with every version, in their own dtype.
constexpr const char* counter_buffer = "sync_counter";
void add_counter(test::Gpt& model, double value) { model->register_buffer(counter_buffer, at::full({3}, value)); }

/// Parameters, then buffers: the order both sides list their reference tensors in.
template <class Model>
std::vector<std::pair<std::string, at::Tensor>> params_and_buffers(Model& model) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& p : model->named_parameters()) out.emplace_back(p.key(), p.value().detach());
  for (const auto& b : model->named_buffers()) out.emplace_back(b.key(), b.value().detach());
  return out;
}

/// The reference every rollout checks against: the trainer's own full parameters and buffers (call
/// inside `full_parameters()`), each cast to `dtype_of(name)`, in params_and_buffers() order.
template <class Model, class DtypeOf>
void send_reference(dist::AnyCommunicator& group, Model& model, DtypeOf&& dtype_of) {
  for (const auto& [name, t] : params_and_buffers(model)) group.broadcast(t.to(dtype_of(name)).contiguous(), 0);
}

/// A rollout's side of send_reference(), by name; `model` has the trainer's names and shapes.
template <class Model, class DtypeOf>
std::map<std::string, at::Tensor> receive_reference(dist::AnyCommunicator& group, Model& model, DtypeOf&& dtype_of) {
  std::map<std::string, at::Tensor> reference;
  for (const auto& [name, t] : params_and_buffers(model)) {
    auto ref = at::empty(t.sizes(), at::TensorOptions().dtype(dtype_of(name)));
    group.broadcast(ref, 0);
    reference[name] = ref;
  }
  return reference;
}

/// One AdamW step on this trainer rank's share of a fixed batch, then the counter buffer moves.
template <class Sharded, class Optimizer>
void train_step(Sharded& fsdp, test::Gpt& model, Optimizer& optimizer, const dist::AnyCommunicator& trainer, int step) {
  const auto c = config();
  at::manual_seed(100 + step);
  auto tokens = at::randint(c.vocab, {4 * trainer.size(), c.seq + 1}, at::kLong).narrow(0, 4 * trainer.rank(), 4);
  optimizer.zero_grad();
  fsdp(tokens.narrow(1, 0, c.seq).contiguous(), tokens.narrow(1, 1, c.seq).contiguous()).backward();
  optimizer.step();
  model->named_buffers()[counter_buffer].fill_(step + 0.3);
}

/// One scenario: `steps` training steps of the trainer, each followed by both kinds of weight sync.
template <class Sharded>
void run_sync(std::optional<at::ScalarType> send_dtype, at::ScalarType rollout_dtype, FsdpOptions options = {},
              int64_t bucket_bytes = 8 << 10, bool keep_gather_buffers = true, int64_t direct_bytes = 64 << 10) {
  auto& s = setup();
  const int steps = 3;
  const auto version_of = [](int step) { return int64_t{10} * (step + 1); };
  const auto c = config();

  if (s.groups.is_trainer()) {
    auto& trainer = *s.groups.trainer;
    at::manual_seed(1);  // every trainer rank builds the same model
    test::Gpt model(c);
    add_counter(model, 0.0);
    Sharded fsdp(model, trainer, options);
    auto optimizer = make_adamw(fsdp, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    WeightBroadcaster sender(fsdp, s.groups.model_update,
                             {.bucket_bytes = bucket_bytes,
                              .dtype = send_dtype,
                              .tuning = {.keep_gather_buffers = keep_gather_buffers, .direct_bytes = direct_bytes}});
    CHECK(sender.is_sender() == (trainer.rank() == 0));
    std::unique_ptr<SynchronizerServer> server;
    auto port = at::zeros({1}, at::kInt);
    if (trainer.rank() == 0) {
      server = std::make_unique<SynchronizerServer>();
      port.fill_(server->port());
    }
    s.world.broadcast(port, 0);

    for (int step = 0; step < steps; ++step) {
      train_step(fsdp, model, optimizer, trainer, step);
      sender.broadcast(version_of(step));
      if (sender.is_sender()) {
        CHECK(sender.last_stats().buckets > 3);  // small buckets: several, with split tensors
        // Straight from the gather buffers (each rank casts its own shard) whenever chunks may go alone.
        CHECK((sender.last_stats().bytes_in_place > 0) == (keep_gather_buffers && direct_bytes <= 1024));
      }
      auto weights = gather_full_state_dict(fsdp, trainer.rank() == 0, {.dtype = rollout_dtype});
      if (server) server->publish(version_of(step), weights);
      {
        // The reference: the trainer's own full parameters, cast the same way, sent to every rollout.
        auto full = fsdp.full_parameters();
        if (s.groups.model_update)
          send_reference(*s.groups.model_update, model, [&](const std::string&) { return rollout_dtype; });
      }
      s.world.barrier();  // version_of(step) is published
    }
    CHECK(sender.last_version() == version_of(steps - 1));
    s.world.barrier();  // rollouts are done fetching before the server goes
    return;
  }

  // ---- rollout ranks -------------------------------------------------------------------------------
  auto port = at::zeros({1}, at::kInt);
  s.world.broadcast(port, 0);
  at::manual_seed(1000 + s.rollout_index);  // different weights from the trainer's on purpose
  test::Gpt rollout(c);
  add_counter(rollout, -1.0);
  rollout->to(rollout_dtype);
  WeightReceiver receiver(*s.groups.model_update);
  const bool late_joiner = s.rollout_index == s.rollouts - 1;  // with one rollout, also rollout 0
  std::optional<SynchronizerClient> client;
  test::Gpt fetched_model(c);
  add_counter(fetched_model, -1.0);
  fetched_model->to(rollout_dtype);
  int64_t fetched = no_version;

  for (int step = 0; step < steps; ++step) {
    // Rollout 0 loads into its module; another takes the tensors.
    WeightVersion received;
    if (s.rollout_index == 0) {
      received.version = receiver.receive_into(*rollout);
      for (const auto& [name, t] : params_and_buffers(rollout)) received.tensors.push_back({name, t});
    } else {
      received = receiver.receive();
      REQUIRE(received.manifest);  // checked on arrival; the proof stays with the snapshot
      verify(received.tensors, *received.manifest);
      receiver.verify(received.tensors);
    }
    CHECK_FALSE(receiver.last_was_delta());
    CHECK(received.version == version_of(step));
    CHECK(receiver.last_version() == version_of(step));
    CHECK((receiver.last_bytes_in_place() > 0) == (direct_bytes <= 1024));  // received into place, no unpacking

    auto reference =
        receive_reference(*s.groups.model_update, rollout, [&](const std::string&) { return rollout_dtype; });
    s.world.barrier();

    // The TCP hand-off: rollout 0 fetches every version into a module; the last rollout joins at the
    // last step only, with nothing, and must get the newest version.
    const uint16_t server_port = static_cast<uint16_t>(port.item<int>());
    if (s.rollout_index == 0) {
      if (!client) client.emplace("127.0.0.1", server_port);
      const int64_t v = client->fetch_newer_into(*fetched_model, fetched, std::chrono::seconds(30));
      CHECK(v > fetched);
      CHECK(v == version_of(step));
      fetched = v;
      for (const auto& [name, t] : params_and_buffers(fetched_model)) {
        INFO("service, step " << step << ", " << name);
        CHECK(at::equal(bits(t), bits(reference[name])));
      }
    }
    if (late_joiner && step == steps - 1) {
      SynchronizerClient late("127.0.0.1", server_port);
      const WeightVersion snap = late.fetch_newer(no_version, std::chrono::seconds(30));
      CHECK(snap.version == version_of(step));
      REQUIRE(snap.tensors.size() == reference.size());
      for (const auto& t : snap.tensors) {
        INFO("late joiner, " << t.name);
        CHECK(at::equal(bits(t.tensor.to(rollout_dtype)), bits(reference.at(t.name))));
      }
    }

    REQUIRE(received.tensors.size() == reference.size());
    for (const auto& t : received.tensors) {
      INFO("step " << step << ", " << t.name);
      REQUIRE(reference.count(t.name) == 1);
      // Parameters arrive in the rollout dtype, buffers in their own (float32), exactly; loaded into a
      // module (rollout 0), everything takes the module's dtype.
      const bool own_dtype = t.name == counter_buffer && s.rollout_index != 0;
      CHECK(t.tensor.scalar_type() == (own_dtype ? at::kFloat : rollout_dtype));
      CHECK(at::equal(bits(t.tensor.to(rollout_dtype)), bits(reference[t.name])));
    }
  }
  s.world.barrier();
}

/// Cut versions (BroadcastOptions::delta) after AdamW steps at a small learning rate, in bfloat16: from
/// the second version on, deltas while every receiver holds the version before. At `write_step` rollout
/// 0 writes its module in place (through the tensors: their version counters move): it no longer holds
/// the base, says so, and the version goes whole to everyone. At `tamper_step` it changes every
/// parameter straight in memory (no counter moves, as a stray kernel would): the delta does not check out
/// there (an error naming a tensor, the module as it was), the other rollouts take it, and the next
/// version goes whole to everyone. With several rollouts, the last one restarts its receiver (holding
/// nothing) at step 1.
template <class Sharded>
void run_delta_sync(bool keep_gather_buffers, FsdpOptions options = {}) {
  auto& s = setup();
  const int steps = 5, write_step = 2, tamper_step = 3;
  const auto c = config();
  const at::ScalarType wire = at::kBFloat16;
  const bool restarts = s.rollouts > 1;
  // Parameters travel in the wire dtype, the counter buffer in its own (float32).
  const auto dtype_of = [&](const std::string& name) { return name == counter_buffer ? at::kFloat : wire; };
  const auto expect_delta = [&](int step) {
    return step > 0 && step != write_step && step != tamper_step + 1 && !(restarts && step == 1);
  };

  if (s.groups.is_trainer()) {
    auto& trainer = *s.groups.trainer;
    at::manual_seed(1);
    test::Gpt model(c);
    add_counter(model, 0.0);
    Sharded fsdp(model, trainer, options);
    auto optimizer = make_adamw(fsdp, torch::optim::AdamWOptions(1e-5));
    WeightBroadcaster sender(fsdp, s.groups.model_update,
                             {.bucket_bytes = 8 << 10,
                              .dtype = wire,

                              // By fewest bytes: the same encodings every run (by time, a loaded machine
                              // may send a tampered tensor whole, replacing it instead of failing).
                              .delta = DeltaOptions{.link_bytes_per_second = 0},
                              .tuning = {.keep_gather_buffers = keep_gather_buffers}});
    for (int step = 0; step < steps; ++step) {
      train_step(fsdp, model, optimizer, trainer, step);
      sender.broadcast(step + 1);
      if (sender.is_sender()) {
        INFO("step " << step);
        CHECK(sender.last_was_delta() == expect_delta(step));
        if (expect_delta(step)) CHECK(sender.last_stats().bytes < sender.last_stats().full_bytes / 4);
      }
      auto full = fsdp.full_parameters();
      if (s.groups.model_update) send_reference(*s.groups.model_update, model, dtype_of);
      s.world.barrier();
    }
    s.world.barrier();
    return;
  }

  at::manual_seed(1000 + s.rollout_index);
  test::Gpt rollout(c);
  rollout->to(wire);
  add_counter(rollout, -1.0);  // float32, as it travels: the module's tensors can hold the version
  std::optional<WeightReceiver> receiver(std::in_place, *s.groups.model_update);
  for (int step = 0; step < steps; ++step) {
    INFO("rollout " << s.rollout_index << ", step " << step);
    if (restarts && s.rollout_index == s.rollouts - 1 && step == 1) receiver.emplace(*s.groups.model_update);
    std::map<std::string, at::Tensor> before;
    if (s.rollout_index == 0 && step == write_step) rollout->parameters()[0].detach().view({-1})[0].add_(1.0);
    if (s.rollout_index == 0 && step == tamper_step) {
      for (const auto& p : rollout->named_parameters()) {
        const at::Tensor t = p.value().detach();
        at::from_blob(t.data_ptr(), t.sizes(), t.options()).view({-1})[0].add_(1.0);  // behind the counter
        before[p.key()] = t.clone();
      }
    }
    WeightVersion received;
    bool failed = false;
    if (s.rollout_index == 0) {
      try {
        received.version = receiver->receive_into(*rollout);
      } catch (const SyncError& e) {
        failed = true;
        CHECK(step == tamper_step);
        CHECK_THAT(e.what(), Catch::Contains("does not match its checksum") && Catch::Contains("tensor '"));
        for (const auto& p : rollout->named_parameters()) CHECK(at::equal(bits(p.value()), bits(before.at(p.key()))));
      }
      for (const auto& [name, t] : params_and_buffers(rollout)) received.tensors.push_back({name, t});
    } else {
      received = receiver->receive();
      REQUIRE(received.manifest);
      verify(received.tensors, *received.manifest);
    }
    CHECK(failed == (s.rollout_index == 0 && step == tamper_step));
    if (!failed) {
      CHECK(received.version == step + 1);
      CHECK(receiver->last_was_delta() == expect_delta(step));
    }
    const auto reference = receive_reference(*s.groups.model_update, rollout, dtype_of);
    s.world.barrier();
    if (failed) continue;
    REQUIRE(received.tensors.size() == reference.size());
    for (const auto& t : received.tensors) {
      INFO(t.name);
      CHECK(at::equal(bits(t.tensor), bits(reference.at(t.name))));
    }
    if (s.rollout_index == 0) receiver->verify(*rollout);
  }
  s.world.barrier();
}

/// Cut versions of a Qwen2-shaped model (tied embedding and head, q/k/v biases, grouped-query
/// attention; its decoder layers are the units) after AdamW steps at lr 1e-5, sent in bfloat16: every
/// rollout (into a bfloat16 Qwen2, or through receive()) holds the trainer's parameters bit for bit,
/// and versions after the first are deltas.
void run_qwen2_delta_sync() {
  namespace models = fsdpx::models;
  using Sharded = Fsdp<models::CausalLM, FullShard, NoOffload, FullPrecision, ShardedStateDict,
                       WrapModules<models::DecoderLayerImpl>>;
  auto& s = setup();
  const fsdpx::detail::Json json = {{"model_type", "qwen2"},      {"architectures", {"Qwen2ForCausalLM"}},
                                    {"vocab_size", 96},           {"hidden_size", 64},
                                    {"intermediate_size", 112},   {"num_hidden_layers", 2},
                                    {"num_attention_heads", 8},   {"num_key_value_heads", 2},
                                    {"tie_word_embeddings", true}};
  const auto config = models::parse_decoder_config(json, "config.json");
  const int steps = 4;
  const at::ScalarType wire = at::kBFloat16;
  if (s.groups.is_trainer()) {
    auto& trainer = *s.groups.trainer;
    at::manual_seed(1);
    models::CausalLM model(config);
    Sharded fsdp(model, trainer);
    auto optimizer = make_adamw(fsdp, torch::optim::AdamWOptions(1e-5));
    WeightBroadcaster sender(
        fsdp, s.groups.model_update,
        {.bucket_bytes = 16 << 10, .dtype = wire, .delta = DeltaOptions{.link_bytes_per_second = 0}});
    for (int step = 0; step < steps; ++step) {
      at::manual_seed(200 + step);
      const auto ids = at::randint(96, {2 * trainer.size(), 12}, at::kLong).narrow(0, 2 * trainer.rank(), 2);
      optimizer.zero_grad();
      fsdp.call(&models::CausalLMImpl::loss, ids, ids, at::Tensor()).backward();
      optimizer.step();
      sender.broadcast(step + 1);
      if (sender.is_sender()) CHECK(sender.last_was_delta() == (step > 0));
      auto full = fsdp.full_parameters();
      if (s.groups.model_update)
        send_reference(*s.groups.model_update, model, [&](const std::string&) { return wire; });
      s.world.barrier();
    }
    s.world.barrier();
    return;
  }
  at::manual_seed(2000 + s.rollout_index);
  models::CausalLM rollout(config);
  rollout->to(wire);
  WeightReceiver receiver(*s.groups.model_update);
  for (int step = 0; step < steps; ++step) {
    INFO("rollout " << s.rollout_index << ", step " << step);
    std::map<std::string, at::Tensor> received;
    if (s.rollout_index == 0) {
      CHECK(receiver.receive_into(*rollout) == step + 1);
      for (const auto& [name, t] : params_and_buffers(rollout)) received[name] = t;
    } else {
      for (auto& t : receiver.receive().tensors) received[t.name] = t.tensor;
    }
    CHECK(receiver.last_was_delta() == (step > 0));
    const auto reference = receive_reference(*s.groups.model_update, rollout, [&](const std::string&) { return wire; });
    s.world.barrier();
    for (const auto& [name, ref] : reference) {
      INFO(name);
      REQUIRE(received.count(name) == 1);
      CHECK(at::equal(bits(received.at(name)), bits(ref)));
    }
    if (s.rollout_index == 0) receiver.verify(*rollout);
  }
  s.world.barrier();
}

}  // namespace

TEST_CASE("weight sync: cut versions of a Qwen2-shaped model, after AdamW steps, bit for bit", "[sync][delta]") {
  run_qwen2_delta_sync();
}

TEST_CASE(
    "weight sync: cut versions: deltas while every rollout holds the version before, whole otherwise, bit for bit",
    "[sync][delta]") {
  run_delta_sync<Fsdp<test::Gpt, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<test::BlockImpl>>>(
      true);
}

TEST_CASE("weight sync: cut versions through the units' own unshard(), HybridShard with CpuOffload", "[sync][delta]") {
  const int T = trainers();
  run_delta_sync<
      Fsdp<test::Gpt, HybridShard<>, CpuOffload<>, FullPrecision, ShardedStateDict, WrapModules<test::BlockImpl>>>(
      false, {.shard_size = T % 2 == 0 && T > 2 ? 2 : 1});
}

TEST_CASE("weight sync: FullShard, float32 trainer, bfloat16 rollout", "[sync]") {
  run_sync<Fsdp<test::Gpt, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<test::BlockImpl>>>(
      at::kBFloat16, at::kBFloat16);
}

TEST_CASE("weight sync: FullShard, float32 end to end, gathered through the units' own unshard()", "[sync]") {
  // Chunks of 1 KiB and more are received straight into the rollout's parameters.
  run_sync<Fsdp<test::Gpt, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<test::BlockImpl>>>(
      std::nullopt, at::kFloat, {}, 4096, /*keep_gather_buffers=*/false, /*direct_bytes=*/1024);
}

TEST_CASE("weight sync: FullShard, float32 end to end, sent from the gather buffers and received in place", "[sync]") {
  // No cast: chunks of 512 bytes and more go from the gather buffer to the rollout's parameters (or
  // to the tensors of receive()) without a copy on either side; smaller ones are packed.
  run_sync<Fsdp<test::Gpt, FullShard, NoOffload, FullPrecision, ShardedStateDict, WrapModules<test::BlockImpl>>>(
      std::nullopt, at::kFloat, {}, 8 << 10, /*keep_gather_buffers=*/true, /*direct_bytes=*/512);
}

TEST_CASE("weight sync: CpuOffload with BF16Mixed sends the bfloat16 compute parameters", "[sync]") {
  // The compute dtype is the rollout dtype: large chunks are sent straight from the gather buffers.
  run_sync<Fsdp<test::Gpt, FullShard, CpuOffload<>, BF16Mixed, ShardedStateDict, WrapModules<test::BlockImpl>>>(
      std::nullopt, at::kBFloat16, {}, 8 << 10, /*keep_gather_buffers=*/true, /*direct_bytes=*/1024);
}

TEST_CASE("weight sync: BF16Mixed trainer, float32 rollout: bfloat16 values, widened", "[sync]") {
  // The compute dtype is the narrowest: each shard is rounded to bfloat16 before it is widened, so
  // the rollout holds exactly the trainer's compute parameters.
  run_sync<Fsdp<test::Gpt, FullShard, NoOffload, BF16Mixed, ShardedStateDict, WrapModules<test::BlockImpl>>>(
      at::kFloat, at::kFloat, {}, 8 << 10, /*keep_gather_buffers=*/true, /*direct_bytes=*/512);
}

TEST_CASE("weight sync: HybridShard with CpuOffload, float16 rollout", "[sync]") {
  // Shard groups of 1 (T = 2, 3) or 2 (T = 4): replicas gather nothing or half.
  const int T = trainers();
  run_sync<Fsdp<test::Gpt, HybridShard<>, CpuOffload<>, FullPrecision, ShardedStateDict, WrapModules<test::BlockImpl>>>(
      at::kHalf, at::kHalf, {.shard_size = T % 2 == 0 && T > 2 ? 2 : 1});
}
