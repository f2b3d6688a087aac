// Single-process tests of weight sync: the bucket wire format, the in-process Synchronizer and, with
// Boost, the TCP synchronizer service under load (many readers, repeated publishes, readers and
// publishers that vanish mid-transfer).
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn.h>

#include <fsdpx/detail/crc32c.hpp>
#include <fsdpx/sync.hpp>
#if defined(FSDPX_WITH_SYNC_SERVICE)
#include <fsdpx/sync/service.hpp>
#endif

#include "../support/bit_equal.hpp"
#if defined(FSDPX_WITH_SYNC_SERVICE)
#include "raw_handshake.hpp"
#endif

using namespace fsdpx;
using namespace fsdpx::sync;
using namespace std::chrono_literals;

namespace {

using fsdpx::test::bit_equal;

std::vector<NamedTensor> mixed_tensors() {
  at::manual_seed(7);
  return {{"big.weight", at::randn({300, 41})},  // 49,200 bytes: split over several 16 KiB buckets
          {"empty", at::empty({0, 3})},
          {"bf16", at::randn({17, 5}).to(at::kBFloat16)},
          {"ints", at::randint(-1000, 1000, {33}, at::kLong)},
          {"flags", at::randint(0, 2, {9}).to(at::kBool)},
          {"scalar", at::full({}, -0.0)},
          {"half.with.a.long.name.to.fill.the.header", at::randn({2, 3, 4}).to(at::kHalf)}};
}

/// The tensors of `version` in the load tests: every element tells its version and tensor.
std::vector<NamedTensor> versioned(int64_t version, int64_t scale = 1) {
  std::vector<NamedTensor> out;
  for (int i = 0; i < 6; ++i) {
    out.push_back({"layer" + std::to_string(i) + ".weight",
                   at::full({64 * scale, 256}, static_cast<double>(version * 100 + i), at::kFloat)});
  }
  return out;
}

/// A snapshot is torn if any of its tensors disagrees with its version.
void require_consistent(const WeightVersion& s, int64_t scale = 1) {
  REQUIRE(s.tensors.size() == 6);
  for (int i = 0; i < 6; ++i) {
    const auto& t = s.tensors[i].tensor;
    REQUIRE(t.sizes() == c10::IntArrayRef({64 * scale, 256}));
    REQUIRE(t.min().item<float>() == static_cast<float>(s.version * 100 + i));
    REQUIRE(t.max().item<float>() == static_cast<float>(s.version * 100 + i));
  }
}

struct TinyImpl : torch::nn::Module {
  TinyImpl() {
    fc = register_module("fc", torch::nn::Linear(4, 3));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({3})));
  }
  torch::nn::Linear fc{nullptr};
  torch::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(Tiny);

}  // namespace

// ---- the bucket format ------------------------------------------------------------------------------

TEST_CASE("buckets round-trip every dtype, split large tensors, and carry empty ones", "[bucket]") {
  const auto tensors = mixed_tensors();
  std::vector<sync::detail::BucketLayout> layouts;
  const auto buckets = sync::detail::pack_buckets(tensors, 16 << 10, /*version=*/7, &layouts);
  REQUIRE(buckets.size() >= 4);
  int big_chunks = 0;
  sync::detail::TensorCollector collector;
  for (size_t k = 0; k < buckets.size(); ++k) {
    REQUIRE(buckets[k].numel() <= 16 << 10);
    const auto b = sync::detail::decode_header(buckets[k].const_data_ptr<uint8_t>(), buckets[k].numel(), "test");
    CHECK(b.version == 7);
    CHECK(b.index == k);
    CHECK(b.count == buckets.size());
    CHECK(b.last == (k + 1 == buckets.size()));
    CHECK(b.header_bytes % 64 == 0);
    for (const auto& e : b.entries) {
      CHECK(e.byte_offset % 64 == 0);
      if (e.name == "big.weight") ++big_chunks;
      collector.accept(e, sync::detail::entry_view(buckets[k], e));
    }
  }
  CHECK(big_chunks >= 3);
  const auto back = collector.finish();
  REQUIRE(back.size() == tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    INFO(tensors[i].name);
    CHECK(back[i].name == tensors[i].name);
    CHECK(bit_equal(back[i].tensor, tensors[i].tensor));
  }
}

TEST_CASE("a corrupt bucket header is a SyncError that says what is wrong", "[bucket]") {
  const auto buckets = sync::detail::pack_buckets(mixed_tensors(), 16 << 10, 1);
  auto bad = buckets[0].clone();
  bad.data_ptr<uint8_t>()[0] ^= 0xff;
  CHECK_THROWS_WITH(sync::detail::decode_header(bad.const_data_ptr<uint8_t>(), bad.numel(), "test"),
                    Catch::Contains("corrupt weight bucket (test): bad magic number"));
  CHECK_THROWS_AS(sync::detail::decode_header(buckets[0].const_data_ptr<uint8_t>(), 30, "test"), SyncError);
  // An entry pointing past the bucket's end.
  auto past = buckets[0].clone();
  const auto layout = sync::detail::decode_header(past.const_data_ptr<uint8_t>(), past.numel(), "test");
  sync::detail::BucketLayout moved = layout;
  moved.entries[0].byte_offset = layout.total_bytes;
  sync::detail::write_header(past, moved);
  CHECK_THROWS_WITH(sync::detail::decode_header(past.const_data_ptr<uint8_t>(), past.numel(), "test"),
                    Catch::Contains("lies outside the bucket"));
}

TEST_CASE("loading into a module names what does not match", "[bucket]") {
  Tiny m;
  auto good = std::vector<NamedTensor>{};
  for (const auto& p : m->named_parameters()) good.push_back({p.key(), at::randn(p.value().sizes())});
  load_into(*m, good);
  CHECK(bit_equal(m->fc->weight.detach(), good[0].tensor));

  auto wrong = good;
  wrong[0].tensor = at::randn({3, 5});              // fc.weight: wrong shape
  wrong.push_back({"extra.bias", at::randn({2})});  // not in the module
  wrong.erase(wrong.begin() + 3);                   // norm.bias missing
  CHECK_THROWS_WITH(load_into(*m, wrong),
                    Catch::Contains("'fc.weight' has shape [3, 4] in the module but [3, 5] was sent") &&
                        Catch::Contains("not parameters or buffers of the module: extra.bias") &&
                        Catch::Contains("were not sent: norm.bias"));
}

TEST_CASE("a receiving module's large parameters move to 2 MiB pages, keeping the Parameter objects and values",
          "[bucket]") {
  torch::nn::Sequential m(torch::nn::Linear(1024, 1024), torch::nn::Linear(1024, 8));  // 4 MiB, 32 KiB weights
  auto* first = m[0]->as<torch::nn::Linear>();
  m->register_parameter("tied", first->weight);             // the same Parameter under a second name
  m->register_parameter("extra", at::randn({3, 1 << 20}));  // 12 MiB, not used by forward
  const at::Tensor flat = at::randn({2 << 20});
  m->register_parameter("in_flat", flat.narrow(0, 1 << 20, 1 << 20));  // 4 MiB of a flat buffer: stays in it
  std::vector<at::Tensor> params, before;
  for (const auto& p : m->parameters()) params.push_back(p), before.push_back(p.detach().clone());
  const auto* big_impl = first->weight.unsafeGetTensorImpl();

  const int64_t moved = place_on_huge_pages(*m);
  using fsdpx::memory::on_huge_page_boundary;
  if (!fsdpx::memory::host_huge_pages()) {
    CHECK(moved == 0);  // FSDPX_HUGE_PAGES=0 or not Linux: nothing to gain, nothing moved
    return;
  }
  // The tied 4 MiB weight moves once, and so does "extra"; the biases, the 32 KiB weight and the view
  // into `flat` stay.
  CHECK(moved == (int64_t{4} << 20) + (int64_t{12} << 20));
  const auto now = m->named_parameters();
  REQUIRE(now.size() == params.size());
  for (size_t i = 0; i < now.size(); ++i) {
    INFO(now[i].key());
    CHECK(now[i].value().unsafeGetTensorImpl() == params[i].unsafeGetTensorImpl());  // same Parameter objects
    CHECK(now[i].value().requires_grad());
    CHECK(bit_equal(now[i].value().detach(), before[i]));
    CHECK(on_huge_page_boundary(now[i].value()) ==
          (now[i].value().numel() * 4 >= (2 << 20) && now[i].key() != "in_flat"));
  }
  CHECK(m->named_parameters()["in_flat"].const_data_ptr() == flat.narrow(0, 1 << 20, 1).const_data_ptr());
  CHECK(first->weight.unsafeGetTensorImpl() == big_impl);
  CHECK(m->named_parameters()["tied"].const_data_ptr() == first->weight.const_data_ptr());
  CHECK(place_on_huge_pages(*m) == 0);  // already there

  // Still a working module: weights load into it, and gradients flow to the moved storage.
  std::vector<NamedTensor> weights;
  for (const auto& p : m->named_parameters()) {
    if (p.key() != "0.weight") weights.push_back({p.key(), at::randn(p.value().sizes())});  // "tied" fills it
  }
  load_into(*m, weights);
  CHECK(bit_equal(first->weight.detach(), weights[0].tensor));
  m->forward(torch::randn({2, 1024})).sum().backward();
  CHECK(first->weight.grad().defined());
}

TEST_CASE("chunk breaks: no chunk spans one, whatever the bucket size, and bad breaks are refused", "[bucket]") {
  // 1000 float elements broken at 300 and 301 (a one-element piece) and 999.
  const std::vector<int64_t> breaks = {300, 301, 999};
  for (const int64_t capacity : {int64_t{4096}, int64_t{1} << 20}) {
    INFO("capacity " << capacity);
    const auto plan =
        sync::detail::plan_buckets({{"a", {4}, at::kFloat}, {"w", {10, 100}, at::kFloat, breaks}}, capacity, 3);
    int64_t covered = 0;
    for (const auto& b : plan) {
      for (const auto& e : b.entries) {
        if (e.name != "w") continue;
        CHECK(e.element_offset == covered);  // in order, no gap
        covered += e.numel;
        for (const int64_t x : breaks) CHECK_FALSE((e.element_offset < x && x < e.element_offset + e.numel));
      }
    }
    CHECK(covered == 1000);
  }
  CHECK_THROWS_WITH(sync::detail::plan_buckets({{"w", {10}, at::kFloat, {5, 2}}}, 1 << 20, 0),
                    Catch::Contains("breaks of 'w' must ascend"));
  CHECK_THROWS_WITH(sync::detail::plan_buckets({{"w", {10}, at::kFloat, {11}}}, 1 << 20, 0),
                    Catch::Contains("within its 10 elements"));
}

TEST_CASE("a tensor split over buckets is split at aligned elements, whatever the bucket size", "[bucket]") {
  // Bucket sizes that are not multiples of 64 bytes: a chunk that a rollout receives in place must
  // still start 64-byte aligned within its tensor (a misaligned copy runs at a fraction of the speed).
  for (const int64_t capacity : {int64_t{4096} + 4, int64_t{10007}, (int64_t{1} << 20) + 12}) {
    for (const auto dtype : {at::kFloat, at::kBFloat16, at::kByte}) {
      INFO("capacity " << capacity << ", " << dtype);
      const int64_t esize = static_cast<int64_t>(c10::elementSize(dtype));
      const auto plan = sync::detail::plan_buckets({{"a", {3}, dtype}, {"w", {4000, 777}, dtype}}, capacity, 1);
      int64_t covered = 0;
      for (const auto& b : plan) {
        for (const auto& e : b.entries) {
          if (e.name != "w") continue;
          CHECK(e.element_offset == covered);
          CHECK((e.element_offset * esize) % 64 == 0);
          covered += e.numel;
        }
      }
      CHECK(covered == 4000 * 777);
      CHECK(plan.size() > 1);
    }
  }
}

TEST_CASE("a bucket too small for one element of a tensor is refused", "[bucket]") {
  CHECK_THROWS_WITH(sync::detail::plan_buckets({{std::string(4100, 'x'), {2}, at::kFloat}}, 4096, 0),
                    Catch::Contains("cannot fit a bucket of 4096 bytes"));
  CHECK_THROWS_WITH(sync::detail::plan_buckets({{"c", {2}, at::kComplexFloat}}, 1 << 20, 0),
                    Catch::Contains("cannot send tensors of dtype"));
}

// ---- the in-process synchronizer --------------------------------------------------------------------

TEST_CASE("Synchronizer: versions only increase, and waits end in the newest version or a clear error",
          "[synchronizer]") {
  Synchronizer sync;
  CHECK(sync.latest() == nullptr);
  CHECK_THROWS_WITH(sync.wait_newer(no_version, 50ms),
                    Catch::Contains("no weight version newer than -1 was published within 50 ms"));
  sync.publish(1, versioned(1));
  sync.publish(2, versioned(2));
  CHECK_THROWS_WITH(sync.publish(2, versioned(2)), Catch::Contains("not newer than the latest published version, 2"));
  CHECK_THROWS_AS(sync.publish(1, versioned(1)), SyncError);
  // A late reader gets the newest version, not the first it missed.
  const auto late = sync.wait_newer(no_version, 10ms);
  CHECK(late->version == 2);
  require_consistent(*late);

  std::thread publisher([&] {
    std::this_thread::sleep_for(50ms);
    sync.publish(5, versioned(5));
  });
  const auto next = sync.wait_newer(2, 5s);
  publisher.join();
  CHECK(next->version == 5);
  require_consistent(*next);
  CHECK(late->version == 2);  // an earlier snapshot stays whole while readers hold it
  require_consistent(*late);

  std::thread closer([&] {
    std::this_thread::sleep_for(50ms);
    sync.close("the trainer finished");
  });
  CHECK_THROWS_WITH(sync.wait_newer(5, 10s), Catch::Contains("closed (the trainer finished)"));
  closer.join();
  CHECK(sync.wait_newer(4, 0ms)->version == 5);
}

TEST_CASE("Synchronizer: concurrent readers never see a torn version", "[synchronizer]") {
  Synchronizer sync;
  std::atomic<bool> done{false};
  std::atomic<int> reads{0};
  std::vector<std::thread> readers;
  for (int r = 0; r < 4; ++r) {
    readers.emplace_back([&] {
      int64_t have = no_version;
      while (!done) {
        try {
          const auto s = sync.wait_newer(have, 20ms);
          if (s->version <= have) throw std::runtime_error("version went backwards");
          const auto& t = s->tensors;
          for (int i = 0; i < 6; ++i) {
            if (t[i].tensor.max().item<float>() != static_cast<float>(s->version * 100 + i))
              throw std::runtime_error("torn");
          }
          have = s->version;
          ++reads;
        } catch (const SyncError&) {
        }
      }
    });
  }
  for (int v = 0; v < 40; ++v) {
    sync.publish(v, versioned(v));
    std::this_thread::sleep_for(1ms);
  }
  done = true;
  for (auto& t : readers) t.join();
  CHECK(reads > 4);
}

TEST_CASE("CRC-32C matches the reference values, in one piece and in parts", "[service]") {
  using fsdpx::detail::Crc32c;
  CHECK(Crc32c::of("", 0) == 0u);
  CHECK(Crc32c::of("123456789", 9) == 0xE3069283u);  // the check value of CRC-32C (RFC 3720)
  const std::string zeros(32, '\0');
  CHECK(Crc32c::of(zeros.data(), zeros.size()) == 0x8A9136AAu);  // RFC 3720, B.4: 32 bytes of zeros
  Crc32c parts;
  parts.update("12345", 5);
  parts.update("6789", 4);
  CHECK(parts.value() == 0xE3069283u);
  at::manual_seed(3);
  const at::Tensor bytes = at::randint(0, 256, {100003}, at::kByte);
  const auto* p = bytes.const_data_ptr<uint8_t>();
  // Against the definition, bit by bit, at lengths and alignments on both sides of the instruction path's
  // three-lane blocks (3 x 4 KiB).
  const auto bitwise = [](const uint8_t* data, size_t n) {
    uint32_t c = ~0u;
    for (size_t i = 0; i < n; ++i) {
      c ^= data[i];
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (Crc32c::polynomial & (0u - (c & 1u)));
    }
    return ~c;
  };
  for (const size_t n : {size_t{12287}, size_t{12288}, size_t{12289}, size_t{3 * 12288 + 17}, size_t{99990}}) {
    for (const size_t offset : {size_t{0}, size_t{3}}) {
      INFO(n << " bytes at offset " << offset);
      CHECK(Crc32c::of(p + offset, n) == bitwise(p + offset, n));
    }
  }
  // Joined from the checksums of two pieces, wherever the cut (blocks checksummed on several threads).
  for (const size_t cut :
       {size_t{0}, size_t{1}, size_t{7}, size_t{8}, size_t{4096}, size_t{65537}, size_t{100002}, size_t{100003}}) {
    INFO("cut at " << cut);
    CHECK(Crc32c::combine(Crc32c::of(p, cut), Crc32c::of(p + cut, 100003 - cut), 100003 - cut) ==
          Crc32c::of(p, 100003));
  }
  // A tensor's checksum in 4 MiB blocks on two threads is the one-piece checksum.
  const at::Tensor big = at::randint(0, 256, {(int64_t{9} << 20) + 5}, at::kByte);
  const int threads = at::get_num_threads();
  at::set_num_threads(2);
  const uint32_t in_blocks = fsdpx::sync::tensor_crc32c(big);
  at::set_num_threads(threads);
  CHECK(in_blocks == Crc32c::of(big.const_data_ptr(), big.nbytes()));
}

// ---- the TCP service --------------------------------------------------------------------------------
#if defined(FSDPX_WITH_SYNC_SERVICE)

TEST_CASE("service: publish over TCP, fetch newer versions, late readers get the newest, versions never go back",
          "[service]") {
  SynchronizerServer server;
  SynchronizerClient trainer("127.0.0.1", server.port());
  SynchronizerClient reader("127.0.0.1", server.port(), {.io_timeout = 5000ms});
  CHECK_THROWS_WITH(reader.fetch_newer(no_version, 100ms),
                    Catch::Contains("no weight version newer than -1 was published within 100 ms"));
  SynchronizerClient reader2("127.0.0.1", server.port());
  trainer.publish(3, mixed_tensors());
  const auto s = reader2.fetch_newer(no_version, 1s);
  CHECK(s.version == 3);
  const auto expected = mixed_tensors();
  REQUIRE(s.tensors.size() == expected.size());
  for (size_t i = 0; i < expected.size(); ++i) CHECK(bit_equal(s.tensors[i].tensor, expected[i].tensor));

  trainer.publish(4, versioned(4));
  server.publish(6, versioned(6));  // in-process publishing (a trainer that hosts the server)
  CHECK_THROWS_WITH(trainer.publish(5, versioned(5)),
                    Catch::Contains("refused version 5") &&
                        Catch::Contains("not newer than 6, the latest version this trainer run published"));
  SynchronizerClient late("127.0.0.1", server.port());
  const auto newest = late.fetch_newer(no_version, 1s);
  CHECK(newest.version == 6);
  require_consistent(newest);

  // A module loads by name, and the fetch waits for a publish that comes later.
  Tiny m;
  std::vector<NamedTensor> weights;
  for (const auto& p : m->named_parameters()) weights.push_back({p.key(), at::randn(p.value().sizes())});
  std::thread later([&] {
    std::this_thread::sleep_for(100ms);
    trainer.publish(7, weights);
  });
  CHECK(reader.fetch_newer_into(*m, 6, 5s) == 7);
  later.join();
  CHECK(bit_equal(m->norm->weight.detach(), weights[2].tensor));
}

TEST_CASE("service: load_newer_into, the receivers' verb, fetches from the version loaded last, as a delta",
          "[service]") {
  static_assert(Receiver<SynchronizerClient> && Receiver<SynchronizerReader>);
  SynchronizerServer server;
  Tiny m;
  std::vector<NamedTensor> weights;
  for (const auto& p : m->named_parameters()) weights.push_back({p.key(), at::randn(p.value().sizes())});
  server.publish(1, weights);
  SynchronizerClient reader("127.0.0.1", server.port());
  CHECK(reader.last_version() == no_version);
  CHECK(reader.load_newer_into(*m, 5s) == 1);
  CHECK_FALSE(reader.last_was_delta());
  reader.verify(*m);
  weights[0].tensor = weights[0].tensor.clone();
  weights[0].tensor.view(-1)[0] += 1;  // one element changes: a delta
  server.publish(2, weights);
  CHECK(reader.load_newer_into(*m, 5s) == 2);
  CHECK(reader.last_version() == 2);
  CHECK(reader.last_was_delta());
  CHECK(bit_equal(m->named_parameters()[weights[0].name].detach(), weights[0].tensor));
  reader.verify(*m);
  CHECK_THROWS_WITH(reader.load_newer_into(*m, 100ms), Catch::Contains("newer than 2"));
}

TEST_CASE("service under load: many readers, repeated publishes, a reader leaving mid-transfer, nothing torn",
          "[service]") {
  SynchronizerServer server({.bucket_bytes = 64 << 10});
  constexpr int readers_n = 8, versions = 25;
  std::atomic<bool> done{false};
  std::atomic<int> fetched{0};
  std::vector<std::string> failures(readers_n);
  std::vector<std::thread> readers;
  for (int r = 0; r < readers_n; ++r) {
    readers.emplace_back([&, r] {
      try {
        SynchronizerClient c("127.0.0.1", server.port(), {.io_timeout = 10000ms});
        int64_t have = no_version;
        while (!done || have < versions - 1) {
          WeightVersion s;
          try {
            s = c.fetch_newer(have, 200ms);
          } catch (const SyncError& e) {
            // Nothing newer within the wait; or, under this load, a version that began arriving too late
            // to finish within it (the wait covers the transfer): ask again.
            const std::string what = e.what();
            if (what.find("was published within 200 ms") == std::string::npos &&
                what.find("did not finish within the fetch's wait of 200 ms") == std::string::npos) {
              throw;
            }
            continue;
          }
          if (s.version <= have) throw std::runtime_error("version went backwards");
          for (int i = 0; i < 6; ++i) {
            const auto& t = s.tensors.at(i).tensor;
            if (t.min().item<float>() != s.version * 100 + i || t.max().item<float>() != s.version * 100 + i) {
              throw std::runtime_error("torn version " + std::to_string(s.version));
            }
          }
          have = s.version;
          ++fetched;
        }
      } catch (const std::exception& e) {
        failures[r] = e.what();
      }
    });
  }
  // A reader that asks for a version and hangs up after a few kilobytes of it.
  std::thread quitter([&] {
    namespace asio = boost::asio;
    while (server.latest_version() == no_version) std::this_thread::sleep_for(1ms);
    for (int i = 0; i < 5; ++i) {
      asio::io_context io;
      asio::ip::tcp::socket sock(io);
      sock.connect({asio::ip::make_address("127.0.0.1"), server.port()});
      test::handshake_without_secret(sock);
      const sync::detail::FetchBase holds_nothing;
      const auto fetch = sync::detail::make_frame(sync::detail::FrameKind::fetch, no_version, 1000, &holds_nothing,
                                                  sizeof(holds_nothing));
      asio::write(sock, asio::buffer(&fetch, sizeof(fetch)));
      asio::write(sock, asio::buffer(&holds_nothing, sizeof(holds_nothing)));
      std::vector<char> some(4096);
      asio::read(sock, asio::buffer(some));
      sock.close();
    }
  });
  SynchronizerClient trainer("127.0.0.1", server.port(), {.bucket_bytes = 64 << 10});
  for (int v = 0; v < versions; ++v) {
    trainer.publish(v, versioned(v, 4));  // 1.5 MiB each, 24 buckets
  }
  done = true;
  quitter.join();
  for (auto& t : readers) t.join();
  for (int r = 0; r < readers_n; ++r) {
    INFO("reader " << r);
    CHECK(failures[r].empty());
  }
  CHECK(fetched >= readers_n);
  // The server still serves after all that.
  SynchronizerClient after("127.0.0.1", server.port());
  CHECK(after.fetch_newer(no_version, 1s).version == versions - 1);
}

TEST_CASE("service: a trainer lost mid-publish fails waiting readers at once, and the partial version is never served",
          "[service]") {
  SynchronizerServer server;
  {
    SynchronizerClient trainer("127.0.0.1", server.port());
    trainer.publish(1, versioned(1));
  }  // said goodbye: readers are not told anything
  SynchronizerClient reader("127.0.0.1", server.port());
  CHECK_THROWS_WITH(reader.fetch_newer(1, 100ms), Catch::Contains("within 100 ms"));

  std::thread dying([&] {
    namespace asio = boost::asio;
    asio::io_context io;
    asio::ip::tcp::socket sock(io);
    sock.connect({asio::ip::make_address("127.0.0.1"), server.port()});
    test::handshake_without_secret(sock, sync::Role::publish);
    const auto buckets = sync::detail::pack_buckets(versioned(2), 16 << 10, 2);
    // The trainer's own run (this process's, as its client sent with version 1): its loss is the trainer's.
    const std::string& run = sync::detail::process_run();
    const auto begin =
        sync::detail::make_frame(sync::detail::FrameKind::publish_begin, 2, buckets.size(), run.data(), run.size());
    asio::write(sock, asio::buffer(&begin, sizeof(begin)));
    asio::write(sock, asio::buffer(run));
    const auto f = sync::detail::make_frame(sync::detail::FrameKind::bucket, 2, 0, buckets[0].const_data_ptr(),
                                            buckets[0].nbytes());
    asio::write(sock, asio::buffer(&f, sizeof(f)));
    asio::write(sock, asio::buffer(buckets[0].const_data_ptr(), buckets[0].nbytes()));
    std::this_thread::sleep_for(200ms);
    sock.close();  // as if the process died
  });
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(reader.fetch_newer(1, 20s), Catch::Contains("disconnected in the middle of version 2 (1 of") &&
                                                    Catch::Contains("partial version was discarded"));
  CHECK(std::chrono::steady_clock::now() - t0 < 5s);
  dying.join();
  SynchronizerClient other("127.0.0.1", server.port());
  CHECK(other.fetch_newer(no_version, 100ms).version == 1);
  // A new trainer clears the loss.
  SynchronizerClient trainer2("127.0.0.1", server.port());
  trainer2.publish(2, versioned(2));
  CHECK(other.fetch_newer(1, 1s).version == 2);
}

TEST_CASE("service: a server that stops or is absent gives clients a SyncError, never a hang", "[service]") {
  auto server = std::make_unique<SynchronizerServer>();
  const auto port = server->port();
  SynchronizerClient reader("127.0.0.1", port, {.connect_timeout = 300ms});
  std::thread stopper([&] {
    std::this_thread::sleep_for(100ms);
    server->stop();
  });
  CHECK_THROWS_WITH(reader.fetch_newer(no_version, 20s),
                    Catch::Contains("synchronizer at 127.0.0.1:" + std::to_string(port)) &&
                        (Catch::Contains("closed the connection") || Catch::Contains("connection was reset")));
  stopper.join();
  // The next call tries a fresh connection (the server may be back), within connect_timeout.
  CHECK_THROWS_WITH(reader.fetch_newer(no_version, 1s), Catch::Contains("could not connect to the synchronizer"));
  CHECK_THROWS_WITH(
      SynchronizerClient("127.0.0.1", port, {.connect_timeout = 300ms}),
      Catch::Contains("could not connect to the synchronizer at 127.0.0.1:" + std::to_string(port) + " within 300 ms"));
}

TEST_CASE("service: a corrupted frame is refused by its checksum", "[service]") {
  SynchronizerServer server;
  namespace asio = boost::asio;
  asio::io_context io;
  asio::ip::tcp::socket sock(io);
  sock.connect({asio::ip::make_address("127.0.0.1"), server.port()});
  test::handshake_without_secret(sock, sync::Role::publish);
  const auto buckets = sync::detail::pack_buckets(versioned(0), 1 << 20, 0);
  const auto begin = sync::detail::make_frame(sync::detail::FrameKind::publish_begin, 0, buckets.size());
  asio::write(sock, asio::buffer(&begin, sizeof(begin)));
  auto f =
      sync::detail::make_frame(sync::detail::FrameKind::bucket, 0, 0, buckets[0].const_data_ptr(), buckets[0].nbytes());
  f.checksum ^= 1;
  asio::write(sock, asio::buffer(&f, sizeof(f)));
  asio::write(sock, asio::buffer(buckets[0].const_data_ptr(), buckets[0].nbytes()));
  sync::detail::FrameHeader reply;
  asio::read(sock, asio::buffer(&reply, sizeof(reply)));
  std::string text(reply.length, '\0');
  asio::read(sock, asio::buffer(text));
  CHECK(reply.kind == static_cast<uint16_t>(sync::detail::FrameKind::error));
  CHECK_THAT(text, Catch::Contains("checksum does not match"));
  CHECK(server.latest_version() == no_version);
}

#endif  // FSDPX_WITH_BOOST
