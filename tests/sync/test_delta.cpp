// Delta versions and their manifests (fsdpx/sync/delta.hpp): every encoding round-trips bit for bit,
// and every damaged or misdirected delta is refused naming the tensor, the receiver's weights intact.
#include <catch2/catch.hpp>

#if defined(FSDPX_WITH_ZLIB)
#include <zlib.h>
#endif

#include <cstring>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <fsdpx/sync.hpp>
#if defined(FSDPX_WITH_SYNC_SERVICE)
#include <fsdpx/sync/service.hpp>
#endif

namespace fxs = fsdpx::sync;
using fxs::DeltaEncoding;
using fxs::NamedTensor;
using fxs::detail::VersionStore;

namespace {

std::vector<NamedTensor> weights(int seed) {
  torch::manual_seed(seed);
  return {{"embed.weight", torch::randn({64, 32}).to(torch::kBFloat16)},
          {"blocks.0.norm.weight", torch::ones({32}, torch::kBFloat16)},
          {"blocks.0.fc.weight", torch::randn({96, 32}).to(torch::kBFloat16)},
          {"blocks.0.fc.bias", torch::randn({96})},
          {"steps", torch::tensor({3}, torch::kLong)}};
}

std::vector<NamedTensor> copy(const std::vector<NamedTensor>& w) {
  std::vector<NamedTensor> out;
  for (const auto& t : w) out.push_back({t.name, t.tensor.clone()});
  return out;
}

bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() &&
         std::memcmp(a.contiguous().const_data_ptr(), b.contiguous().const_data_ptr(), a.nbytes()) == 0;
}

void require_same(const std::vector<NamedTensor>& a, const std::vector<NamedTensor>& b) {
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    INFO(a[i].name);
    REQUIRE(a[i].name == b[i].name);
    REQUIRE(same_bits(a[i].tensor, b[i].tensor));
  }
}

/// The next version: a few elements of embed, every element of fc, nothing of the norm, bias halfway.
std::vector<NamedTensor> step(const std::vector<NamedTensor>& w) {
  auto next = copy(w);
  next[0].tensor.view({-1}).narrow(0, 100, 5).add_(1.0);
  next[2].tensor.add_(torch::full_like(next[2].tensor, 0.5));
  next[3].tensor.narrow(0, 0, 10).mul_(2.0);
  next[4].tensor.add_(1);
  return next;
}

/// The payload of `name` in an encoded version (its tensors after the manifest).
at::Tensor& payload(fxs::detail::EncodedVersion& v, const std::string& name) {
  for (auto& t : v.tensors) {
    if (t.name == name) return t.tensor;
  }
  FAIL("no payload " << name);
  throw;
}

}  // namespace

TEST_CASE("delta: a manifest round-trips, and its digest covers every tensor's name, shape and checksum",
          "[sync][delta]") {
  const auto w = weights(1);
  const fxs::Manifest m = fxs::full_manifest(7, w);
  const fxs::Manifest back = fxs::Manifest::decode(m.encode(), "test");
  REQUIRE(back.version == 7);
  REQUIRE_FALSE(back.is_delta());
  REQUIRE(back.digest == m.digest);
  REQUIRE(back.entries.size() == w.size());
  REQUIRE(back.entries[2].crc == fxs::tensor_crc32c(w[2].tensor));
  auto other = w;
  other[1].tensor = other[1].tensor.clone();
  other[1].tensor[3] = 2.0;
  REQUIRE(fxs::full_manifest(7, other).digest != m.digest);

  at::Tensor bytes = m.encode();
  SECTION("a byte flipped in an entry") {
    bytes[60] = bytes[60].item<uint8_t>() ^ 1;
    REQUIRE_THROWS_WITH(fxs::Manifest::decode(bytes, "test"), Catch::Contains("the manifest from test"));
  }
  SECTION("truncated") {
    REQUIRE_THROWS_WITH(fxs::Manifest::decode(bytes.narrow(0, 0, bytes.numel() - 3).clone(), "test"),
                        Catch::Contains("ends inside"));
  }
  SECTION("a count its bytes cannot hold") {
    const uint32_t huge = 0x7fffffff;
    std::memcpy(static_cast<uint8_t*>(bytes.data_ptr()) + 32, &huge, 4);
    REQUIRE_THROWS_WITH(fxs::Manifest::decode(bytes, "test"), Catch::Contains("cannot fit"));
  }
}

TEST_CASE("delta: each encoding carries the next version bit for bit, in place and copy-on-write", "[sync][delta]") {
  const auto v1 = weights(2);
  fxs::detail::VersionStore publisher;
  auto full = publisher.cut(1, v1);
  REQUIRE_FALSE(full.manifest.is_delta());
  REQUIRE(full.bytes > full.full_bytes);  // the manifest rides along
  const auto sent_full = full.tensors;
  publisher.commit(std::move(full));
  fxs::detail::VersionStore receiver;
  receiver.accept(sent_full, fxs::detail::VersionStore::Apply::copy_on_write, "test");
  require_same(receiver.tensors(), v1);
  REQUIRE(receiver.holds(1, publisher.digest()));

  const auto v2 = step(v1);
  auto delta = publisher.cut(2, v2);
  REQUIRE(delta.manifest.is_delta());
  REQUIRE(delta.manifest.base_version == 1);
  const auto& e = delta.manifest.entries;
  CHECK(e[0].encoding == DeltaEncoding::sparse);
  CHECK(e[0].changed == 5);
  CHECK(e[1].encoding == DeltaEncoding::unchanged);
  CHECK(e[2].encoding == DeltaEncoding::full);
  CHECK(e[3].encoding == DeltaEncoding::sparse);
  CHECK(e[4].encoding == DeltaEncoding::full);  // one int64: 8 bytes whole, 12 as an index and a value
  REQUIRE(delta.bytes < delta.full_bytes);
  const std::vector<at::Tensor> before = [&] {
    std::vector<at::Tensor> out;
    for (const auto& t : receiver.tensors()) out.push_back(t.tensor);
    return out;
  }();
  const auto sent = delta.tensors;
  publisher.commit(std::move(delta));
  require_same(publisher.tensors(), v2);

  SECTION("copy-on-write: the tensors handed out before keep their values") {
    receiver.accept(sent, fxs::detail::VersionStore::Apply::copy_on_write, "test");
    require_same(receiver.tensors(), v2);
    for (size_t i = 0; i < before.size(); ++i) CHECK(same_bits(before[i], v1[i].tensor));
    CHECK(receiver.tensors()[1].tensor.is_same(before[1]));  // unchanged: shared, not copied
  }
  SECTION("in place: the held tensors are the ones written") {
    receiver.accept(sent, fxs::detail::VersionStore::Apply::in_place, "test");
    require_same(receiver.tensors(), v2);
    for (size_t i = 0; i < before.size(); ++i) CHECK(receiver.tensors()[i].tensor.is_same(before[i]));
  }
  REQUIRE(receiver.holds(2, publisher.digest()));
  fxs::verify(receiver.tensors(), publisher.manifest());
}

#if defined(FSDPX_WITH_ZLIB)
TEST_CASE("delta: by fewest bytes, dense small changes travel as compressed XOR, by time on a fast link not",
          "[sync][delta]") {
  torch::manual_seed(3);
  std::vector<NamedTensor> v1{{"w", torch::randn({256, 1024}).mul(0.02).to(torch::kBFloat16)}};
  auto v2 = copy(v1);
  // About a third of the elements move by one unit in the last place: dense, but each change a low bit.
  auto bits = v2[0].tensor.view({-1}).view(torch::kShort);
  const auto mask = torch::rand({bits.numel()}) < 0.3;
  bits.add_(mask.to(torch::kShort));
  fxs::detail::VersionStore publisher;
  publisher.commit(publisher.cut(1, v1));
  const auto by_bytes = publisher.cut(2, v2, {.link_bytes_per_second = 0});
  REQUIRE(by_bytes.manifest.entries[0].encoding == DeltaEncoding::xor_zlib);
  CHECK(by_bytes.bytes < by_bytes.full_bytes / 3);
  const auto by_time = publisher.cut(2, v2, {.link_bytes_per_second = 1e12});
  CHECK(by_time.manifest.entries[0].encoding != DeltaEncoding::xor_zlib);
  const auto off = publisher.cut(2, v2, {.enabled = false});
  CHECK_FALSE(off.manifest.is_delta());
  // Every element moved: a delta would cost what the version does, so it goes full.
  auto everything = copy(v1);
  everything[0].tensor.add_(1.0);
  const auto all = publisher.cut(2, everything, {.link_bytes_per_second = 1e12});
  CHECK_FALSE(all.manifest.is_delta());
  CHECK(all.bytes > all.full_bytes);

  fxs::detail::VersionStore receiver;
  receiver.accept(copy(publisher.cut(1, v1).tensors), fxs::detail::VersionStore::Apply::in_place,
                  "test");  // a full version 1
  // (the store above already holds 1: cutting 1 again against it sends it full)
  receiver.accept(by_bytes.tensors, fxs::detail::VersionStore::Apply::in_place, "test");
  require_same(receiver.tensors(), v2);
}

#endif  // FSDPX_WITH_ZLIB

TEST_CASE("delta: a damaged or misdirected delta is refused naming the tensor, and the receiver keeps its weights",
          "[sync][delta][security]") {
  const auto v1 = weights(4);
  fxs::detail::VersionStore publisher;
  auto full = publisher.cut(1, v1);
  fxs::detail::VersionStore receiver;
  receiver.accept(full.tensors, fxs::detail::VersionStore::Apply::in_place, "test");
  publisher.commit(std::move(full));
  const auto v2 = step(v1);
  auto delta = publisher.cut(2, v2);
  const auto held_before = copy(receiver.tensors());
  const auto refused = [&](const std::string& why) {
    for (const auto mode : {fxs::detail::VersionStore::Apply::in_place, fxs::detail::VersionStore::Apply::owned,
                            fxs::detail::VersionStore::Apply::copy_on_write}) {
      REQUIRE_THROWS_WITH(receiver.accept(delta.tensors, mode, "test"), Catch::Contains(why));
      require_same(receiver.tensors(), held_before);
      REQUIRE(receiver.version() == 1);
    }
  };
  SECTION("a value byte corrupted") {
    auto& p = payload(delta, "blocks.0.fc.bias");
    p = p.clone();
    p[p.numel() - 1] = p[p.numel() - 1].item<uint8_t>() ^ 0x40;
    refused("tensor 'blocks.0.fc.bias' (sparse): the result does not match its checksum");
  }
  SECTION("a tensor applied before the damaged one is rolled back") {
    auto& p = payload(delta, "steps");
    p = p.clone();
    p[0] = 77;
    refused("tensor 'steps' (full)");  // in place it is checked as it came, before anything is copied
  }
  SECTION("an index out of range") {
    auto& p = payload(delta, "embed.weight");
    p = p.clone();
    const uint32_t far = 1u << 30;
    std::memcpy(static_cast<uint8_t*>(p.data_ptr()) + 4 * 4, &far, 4);
    refused("tensor 'embed.weight' (sparse): index 1073741824 lies outside its 2048 elements");
  }
  SECTION("indices that do not ascend") {
    auto& p = payload(delta, "embed.weight");
    p = p.clone();
    const uint32_t back = 0;
    std::memcpy(static_cast<uint8_t*>(p.data_ptr()) + 4 * 2, &back, 4);
    refused("tensor 'embed.weight' (sparse): indices do not ascend");
  }
  SECTION("a truncated payload") {
    auto& p = payload(delta, "embed.weight");
    p = p.narrow(0, 0, p.numel() - 1).clone();
    refused("tensor 'embed.weight' (sparse): 29 bytes where 5 changes take 30");
  }
  SECTION("a full tensor of another shape") {
    auto& p = payload(delta, "blocks.0.fc.weight");
    p = p.reshape({32, 96}).clone();
    refused("tensor 'blocks.0.fc.weight' (full): arrived as");
  }
  SECTION("a delta cut from another base") {
    receiver.accept(copy(fxs::detail::VersionStore().cut(5, v1).tensors), fxs::detail::VersionStore::Apply::in_place,
                    "test");
    REQUIRE_THROWS_WITH(receiver.accept(delta.tensors, fxs::detail::VersionStore::Apply::in_place, "test"),
                        Catch::Contains("it is a delta from version 1") && Catch::Contains("holds version 5"));
    require_same(receiver.tensors(), held_before);
  }
#if defined(FSDPX_WITH_ZLIB)
  SECTION("an XOR stream that inflates beyond its tensor, or ends early") {
    std::vector<NamedTensor> x1{{"w", torch::zeros({4096}, torch::kBFloat16)}};
    auto x2 = copy(x1);
    x2[0].tensor.view(torch::kShort).narrow(0, 0, 4096).fill_(1);
    fxs::detail::VersionStore p;
    auto first = p.cut(1, x1);
    fxs::detail::VersionStore r;
    r.accept(first.tensors, fxs::detail::VersionStore::Apply::in_place, "test");
    p.commit(std::move(first));
    auto xd = p.cut(2, x2, {.link_bytes_per_second = 0, .xor_min_changed = 1});
    REQUIRE(xd.manifest.entries[0].encoding == DeltaEncoding::xor_zlib);
    const auto bomb = [](int64_t bytes) {
      std::vector<uint8_t> zeros(static_cast<size_t>(bytes), 0);
      uLongf n = compressBound(static_cast<uLong>(bytes));
      std::vector<uint8_t> out(n);
      compress2(out.data(), &n, zeros.data(), static_cast<uLong>(bytes), 9);
      at::Tensor t = at::empty({static_cast<int64_t>(n)}, at::kByte);
      std::memcpy(t.data_ptr(), out.data(), n);
      return t;
    };
    xd.tensors[1].tensor = bomb(int64_t{64} << 20);
    REQUIRE_THROWS_WITH(r.accept(xd.tensors, fxs::detail::VersionStore::Apply::in_place, "test"),
                        Catch::Contains("tensor 'w' (xor): the stream inflates beyond the tensor's 8192 bytes"));
    xd.tensors[1].tensor = bomb(100);
    REQUIRE_THROWS_WITH(r.accept(xd.tensors, fxs::detail::VersionStore::Apply::in_place, "test"),
                        Catch::Contains("tensor 'w' (xor): the stream inflates to 100 bytes, the tensor has 8192"));
    require_same(r.tensors(), x1);
  }
#endif
}

TEST_CASE("delta: verify says whether weights are exactly a version, naming what differs", "[sync][delta]") {
  const auto w = weights(5);
  const fxs::Manifest m = fxs::full_manifest(3, w);
  auto mine = copy(w);
  fxs::verify(mine, m);
  mine[2].tensor[0][0] = 9.0;
  REQUIRE_THROWS_WITH(fxs::verify(mine, m),
                      Catch::Contains("not version 3") && Catch::Contains("'blocks.0.fc.weight' differs"));
  mine.pop_back();
  REQUIRE_THROWS_WITH(fxs::verify(mine, m), Catch::Contains("'steps' is missing"));
}

#if defined(FSDPX_WITH_SYNC_SERVICE)

#include <fsdpx/models.hpp>

namespace {

using namespace std::chrono_literals;

/// A tiny Qwen2 (tied head, q/k/v biases) in float32, and its weights as a bfloat16 rollout receives them.
fsdpx::models::DecoderConfig tiny_qwen2() {
  const fsdpx::detail::Json j = {{"model_type", "qwen2"},      {"architectures", {"Qwen2ForCausalLM"}},
                                 {"vocab_size", 96},           {"hidden_size", 64},
                                 {"intermediate_size", 112},   {"num_hidden_layers", 2},
                                 {"num_attention_heads", 8},   {"num_key_value_heads", 2},
                                 {"tie_word_embeddings", true}};
  return fsdpx::models::parse_decoder_config(j, "config.json");
}

std::vector<NamedTensor> wire_weights(torch::nn::Module& m) {
  std::vector<NamedTensor> out;
  for (const auto& p : m.named_parameters()) out.push_back({p.key(), p.value().detach().to(torch::kBFloat16)});
  return out;
}

void train_step(fsdpx::models::CausalLM& model, torch::optim::Optimizer& opt, int step) {
  torch::manual_seed(100 + step);
  const auto ids = torch::randint(0, 96, {2, 12}, torch::kLong);
  opt.zero_grad();
  model->loss(ids, ids).backward();
  opt.step();
}

/// A version that does not fit a module (another intermediate size): `load(module)` must fail saying so,
/// and load nothing of it.
template <class Load>
void check_misfit_loads_nothing(Load&& load) {
  auto other_config = tiny_qwen2();
  other_config.intermediate_size = 96;
  fsdpx::models::CausalLM other(other_config);
  other->to(torch::kBFloat16);
  std::vector<NamedTensor> before;
  for (const auto& p : other->named_parameters()) before.push_back({p.key(), p.value().detach().clone()});
  CHECK_THROWS_WITH(load(*other),
                    Catch::Contains("nothing was loaded") && Catch::Contains("mlp.up_proj.weight' has shape"));
  for (const auto& t : before) CHECK(same_bits(other->named_parameters()[t.name], t.tensor));
}

bool module_equals(torch::nn::Module& m, const std::vector<NamedTensor>& w) {
  const auto params = m.named_parameters();
  for (const auto& t : w) {
    if (!same_bits(params[t.name], t.tensor)) return false;
  }
  return true;
}

}  // namespace

TEST_CASE(
    "delta service: after real AdamW steps every reader holds the trainer's weights bit for bit, deltas when it "
    "holds the base, full versions otherwise",
    "[sync][delta][service]") {
  const double lr = GENERATE(1e-5, 1e-3);
  INFO("lr " << lr);
  fxs::SynchronizerServer server({.bucket_bytes = 256 << 10});
  torch::manual_seed(13);  // LibTorch seeds its generator anew in each process: the same weights every run
  fsdpx::models::CausalLM trainer_model(tiny_qwen2());
  torch::optim::AdamW opt(trainer_model->parameters(), torch::optim::AdamWOptions(lr));
  fxs::SynchronizerClient trainer("127.0.0.1", server.port(), {.bucket_bytes = 256 << 10});
  fxs::SynchronizerClient keeper("127.0.0.1", server.port());   // its own copy, copy-on-write
  fxs::SynchronizerClient loader("127.0.0.1", server.port());   // into a bfloat16 rollout model, in place
  fxs::SynchronizerClient skipper("127.0.0.1", server.port());  // fetches every other version
  fsdpx::models::CausalLM rollout(tiny_qwen2());
  rollout->to(torch::kBFloat16);
  int64_t keeper_has = fxs::no_version, loader_has = fxs::no_version, skipper_has = fxs::no_version;
  // At lr 1e-3 nearly every bfloat16 element moves each step: a delta would be as large as the version,
  // so the publisher sends it full (and readers take it as any full version).
  const bool deltas = lr < 1e-4;
  fxs::WeightVersion previous;
  std::vector<NamedTensor> previous_weights;
  for (int step = 1; step <= 6; ++step) {
    train_step(trainer_model, opt, step);
    const auto weights = wire_weights(*trainer_model);
    trainer.publish(step, weights);
    INFO("step " << step);
    CHECK(trainer.last_transfer().delta == (deltas && step > 1));
    if (step > 1 && deltas) CHECK(trainer.last_transfer().bytes < trainer.last_transfer().full_bytes);

    const auto s = keeper.fetch_newer(keeper_has, 5s);
    CHECK(s.version == step);
    CHECK(keeper.last_transfer().delta == (deltas && step > 1));
    require_same(s.tensors, weights);
    keeper.verify(s.tensors);
    fxs::verify(s.tensors, *s.manifest);
    if (step > 1) require_same(previous.tensors, previous_weights);  // a snapshot handed out never changes
    previous = s;
    previous_weights = weights;
    keeper_has = s.version;

    loader_has = loader.fetch_newer_into(*rollout, loader_has, 5s);
    CHECK(loader.last_transfer().delta == (deltas && step > 1));
    CHECK(module_equals(*rollout, weights));
    loader.verify(*rollout);

    if (step % 2 == 0) {  // it missed the version before: the delta is not for it
      const auto k = skipper.fetch_newer(skipper_has, 5s);
      CHECK_FALSE(skipper.last_transfer().delta);
      require_same(k.tensors, weights);
      skipper_has = k.version;
    }
  }
  // A reader that joins late gets the whole newest version.
  fxs::SynchronizerClient late("127.0.0.1", server.port());
  const auto l = late.fetch_newer(fxs::no_version, 5s);
  CHECK_FALSE(late.last_transfer().delta);
  require_same(l.tensors, wire_weights(*trainer_model));
  const auto stats = server.stats();
  CHECK(stats.served_delta == (deltas ? 10 : 0));  // keeper and loader, versions 2-6
  CHECK(stats.served_full == 2 + 3 + 1 + (deltas ? 0 : 10));

  // A rollout whose weights were changed behind the client's back: verify() says so; the next delta, if
  // it touches that tensor without replacing it whole, does not check out: the module is left as it was,
  // the error names the tensor, and the next fetch brings a full version. Either way it ends exact.
  auto params = rollout->named_parameters();
  params["model.embed_tokens.weight"].detach()[0][0] = 7.0;
  const auto tampered = params["model.embed_tokens.weight"].detach().clone();
  CHECK_THROWS_WITH(loader.verify(*rollout), Catch::Contains("'model.embed_tokens.weight' differs"));
  train_step(trainer_model, opt, 7);
  trainer.publish(7, wire_weights(*trainer_model));
  try {
    loader_has = loader.fetch_newer_into(*rollout, loader_has, 5s);
  } catch (const fsdpx::SyncError& e) {
    CHECK_THAT(e.what(),
               Catch::Contains("tensor 'model.embed_tokens.weight'") && Catch::Contains("does not match its checksum"));
    CHECK(same_bits(params["model.embed_tokens.weight"], tampered));
    loader_has = loader.fetch_newer_into(*rollout, loader_has, 5s);
    CHECK_FALSE(loader.last_transfer().delta);
  }
  CHECK(module_equals(*rollout, wire_weights(*trainer_model)));
  loader.verify(*rollout);

  // The rollout's parameters moved to new memory (Module::to round trip): a delta must not land in the
  // old memory, so the next version comes full, and exact.
  rollout->to(torch::kFloat);
  rollout->to(torch::kBFloat16);
  train_step(trainer_model, opt, 8);
  trainer.publish(8, wire_weights(*trainer_model));
  loader_has = loader.fetch_newer_into(*rollout, loader_has, 5s);
  CHECK_FALSE(loader.last_transfer().delta);
  CHECK(module_equals(*rollout, wire_weights(*trainer_model)));

  // A version that does not fit the module (another shape): nothing of it is loaded.
  fxs::SynchronizerClient mismatched("127.0.0.1", server.port());
  check_misfit_loads_nothing([&](torch::nn::Module& m) { mismatched.fetch_newer_into(m, fxs::no_version, 5s); });
}

TEST_CASE(
    "delta service: a trainer hosting the server cuts deltas too, and a publisher whose base the server no longer "
    "holds sends its version full",
    "[sync][delta][service]") {
  fxs::SynchronizerServer server;
  torch::manual_seed(13);
  fsdpx::models::CausalLM model(tiny_qwen2());
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-5));
  fxs::SynchronizerClient reader("127.0.0.1", server.port());
  int64_t have = fxs::no_version;
  for (int step = 1; step <= 3; ++step) {
    train_step(model, opt, step);
    const auto weights = wire_weights(*model);
    server.publish(step, weights);
    const auto s = reader.fetch_newer(have, 5s);
    CHECK(reader.last_transfer().delta == (step > 1));
    require_same(s.tensors, weights);
    have = s.version;
  }
  // Two publishers in turn (another run takes over each time): each one's delta is cut from its own last
  // version, which the server no longer holds; it is refused for that alone and sent full.
  fxs::SynchronizerClient a("127.0.0.1", server.port(), {.run = "a"});
  fxs::SynchronizerClient b("127.0.0.1", server.port(), {.run = "b"});
  for (int step = 4; step <= 7; ++step) {
    train_step(model, opt, step);
    const auto weights = wire_weights(*model);
    auto& publisher = step % 2 == 0 ? a : b;
    publisher.publish(step, weights);
    CHECK_FALSE(publisher.last_transfer().delta);
    const auto s = reader.fetch_newer(have, 5s);
    require_same(s.tensors, weights);
    have = s.version;
  }
  train_step(model, opt, 8);
  b.publish(8, wire_weights(*model));  // b published 7: its delta is taken
  CHECK(b.last_transfer().delta);
  require_same(reader.fetch_newer(have, 5s).tensors, wire_weights(*model));
}

#endif  // FSDPX_WITH_SYNC_SERVICE

TEST_CASE(
    "delta in process: a SynchronizerReader's module holds the trainer's weights bit for bit after real AdamW "
    "steps, deltas when it holds the version before, whole versions otherwise",
    "[sync][delta][synchronizer]") {
  const double lr = GENERATE(1e-5, 1e-3);
  const bool enabled = GENERATE(true, false);
  INFO("lr " << lr << ", deltas " << (enabled ? "on" : "off"));
  fxs::SynchronizerOptions options;
  options.delta.enabled = enabled;
  // Encodings by fewest bytes: the same every run (by time, a loaded machine may send a tensor whole,
  // which replaces a tampered one instead of failing its check below).
  options.delta.link_bytes_per_second = 0;
  fxs::Synchronizer sync(options);
  torch::manual_seed(13);  // LibTorch seeds its generator anew in each process: the same weights every run
  fsdpx::models::CausalLM trainer_model(tiny_qwen2());
  torch::optim::AdamW opt(trainer_model->parameters(), torch::optim::AdamWOptions(lr));
  fsdpx::models::CausalLM rollout(tiny_qwen2()), skipped(tiny_qwen2());
  rollout->to(torch::kBFloat16);
  skipped->to(torch::kBFloat16);
  fxs::SynchronizerReader reader(sync), skipper(sync);
  // By fewest bytes even at lr 1e-3, where most bfloat16 elements move, the XOR of the bits compresses
  // below 90% of the version: deltas whenever they are on.
  const bool deltas = enabled;
  std::shared_ptr<const fxs::WeightVersion> previous;
  std::vector<NamedTensor> previous_weights;
  for (int step = 1; step <= 5; ++step) {
    INFO("step " << step);
    train_step(trainer_model, opt, step);
    const auto weights = wire_weights(*trainer_model);
    sync.publish(step, copy(weights));
    const auto snapshot = sync.latest();
    REQUIRE(snapshot->manifest);
    CHECK_FALSE(snapshot->manifest->is_delta());
    fxs::verify(snapshot->tensors, *snapshot->manifest);
    if (previous) require_same(previous->tensors, previous_weights);  // a snapshot never changes
    previous = snapshot;
    previous_weights = weights;

    CHECK(reader.load_newer_into(*rollout, 5s) == step);
    CHECK(reader.last_was_delta() == (deltas && step > 1));
    CHECK(module_equals(*rollout, weights));
    reader.verify(*rollout);
    if (step % 2 == 1) {  // it missed the version before (from step 3): the delta is not for it
      CHECK(skipper.load_newer_into(*skipped, 5s) == step);
      CHECK_FALSE(skipper.last_was_delta());
      CHECK(module_equals(*skipped, weights));
    }
  }
  CHECK_THROWS_WITH(reader.load_newer_into(*rollout, 10ms), Catch::Contains("no weight version newer than 5"));

  // A module changed behind the reader's back, straight in memory (no version counter moves, as a stray
  // kernel would): verify() names the tensor; the next delta does not check out (the module keeps its
  // weights, the error names the tensor) and the same version then comes whole, exact. Whatever the
  // kernels computed, the damage must stay for the checksum to fail: the element changed is one the next
  // version leaves as it is, and the tensor never travels whole. By fewest bytes it goes sparse at lr 1e-5
  // (fewer than a third of its elements change) and as a compressed XOR at 1e-3 (most change, but the
  // XOR of their bits compresses), and either keeps an element it does not change.
  train_step(trainer_model, opt, 6);
  const auto next = wire_weights(*trainer_model);
  auto params = rollout->named_parameters();
  {
    const auto index = [&](const std::vector<NamedTensor>& w) {
      for (size_t i = 0; i < w.size(); ++i) {
        if (w[i].name == "model.embed_tokens.weight") return i;
      }
      FAIL("no embedding");
      return size_t{0};
    };
    const at::Tensor before = previous_weights[index(previous_weights)].tensor.reshape({-1}).view(at::kShort);
    const at::Tensor after = next[index(next)].tensor.reshape({-1}).view(at::kShort);
    const at::Tensor kept = before.eq(after);
    REQUIRE(kept.any().item<bool>());
    if (lr < 1e-4) REQUIRE(3 * (before.numel() - kept.sum().item<int64_t>()) < before.numel());
    const int64_t element = kept.nonzero()[0][0].item<int64_t>();
    const at::Tensor embed = params["model.embed_tokens.weight"].detach();
    auto raw = at::from_blob(embed.data_ptr(), {embed.numel()}, embed.options());
    raw[element] = raw[element].item<double>() == 7.0 ? 8.0 : 7.0;
  }
  const auto tampered = params["model.embed_tokens.weight"].detach().clone();
  CHECK_THROWS_WITH(reader.verify(*rollout), Catch::Contains("'model.embed_tokens.weight' differs"));
  sync.publish(6, next);
  if (deltas) {
    CHECK_THROWS_WITH(reader.load_newer_into(*rollout, 5s), Catch::Contains("tensor 'model.embed_tokens.weight'") &&
                                                                Catch::Contains("does not match its checksum"));
    CHECK(same_bits(params["model.embed_tokens.weight"], tampered));
    CHECK(reader.last_version() == 5);
    CHECK_FALSE(reader.last_was_delta());
  }
  CHECK(reader.load_newer_into(*rollout, 5s) == 6);
  CHECK_FALSE(reader.last_was_delta());
  CHECK(module_equals(*rollout, wire_weights(*trainer_model)));
  reader.verify(*rollout);

  // Written in place through the tensors (their version counters move, as load_state_dict's would): it
  // no longer holds the version before, so the next comes whole, exact.
  train_step(trainer_model, opt, 7);
  sync.publish(7, wire_weights(*trainer_model));
  params["model.norm.weight"].detach().add_(1.0);
  CHECK(reader.load_newer_into(*rollout, 5s) == 7);
  CHECK_FALSE(reader.last_was_delta());
  CHECK(module_equals(*rollout, wire_weights(*trainer_model)));

  // Parameters moved to new memory (Module::to round trip): the next version comes whole, and exact.
  rollout->to(torch::kFloat);
  rollout->to(torch::kBFloat16);
  train_step(trainer_model, opt, 8);
  sync.publish(8, wire_weights(*trainer_model));
  CHECK(reader.load_newer_into(*rollout, 5s) == 8);
  CHECK_FALSE(reader.last_was_delta());
  CHECK(module_equals(*rollout, wire_weights(*trainer_model)));

  // A version that does not fit the module: nothing of it is loaded.
  fxs::SynchronizerReader mismatched(sync);
  check_misfit_loads_nothing([&](torch::nn::Module& m) { mismatched.load_newer_into(m, 5s); });
}
