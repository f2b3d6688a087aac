// save_safetensors / load_safetensors: Hugging Face's layout, byte for byte where it is specified.
#include <catch2/catch.hpp>

#include <cstring>
#include <fstream>
#include <string>

#include <fsdpx/checkpoint/merge.hpp>
#include <fsdpx/hf/safetensors.hpp>
#include <fsdpx/detail/json.hpp>

#include "merge_fixture.hpp"
#include "require_same.hpp"

namespace {

namespace fs = std::filesystem;
namespace ckpt = fsdpx::checkpoint;
using fsdpx::detail::Json;
using merge_fixture::NamedTensors;

using merge_fixture::TempDir;

using merge_fixture::require_same;

std::string load_error(const fs::path& path) {
  try {
    fsdpx::hf::load_safetensors(path);
  } catch (const fsdpx::IoError& e) {
    return e.what();
  }
  FAIL("load_safetensors succeeded on " << path);
  return {};
}

/// Every dtype safetensors names that LibTorch has, with awkward shapes (0-d, empty, odd sizes).
NamedTensors all_dtypes() {
  NamedTensors t;
  t.emplace_back("f32", at::arange(12, at::kFloat).reshape({3, 4}) / 7);
  t.emplace_back("bf16", (at::arange(5, at::kFloat) / 3).to(at::kBFloat16));
  t.emplace_back("f16", (at::arange(3, at::kFloat) / 3).to(at::kHalf));
  t.emplace_back("f64", at::arange(7, at::kDouble).reshape({7, 1}) / 3);
  t.emplace_back("i64", at::arange(-3, 3, at::kLong));
  t.emplace_back("i32", at::arange(4, at::kInt));
  t.emplace_back("i16", at::arange(2, at::kShort));
  t.emplace_back("i8", at::arange(-1, 2, at::kChar));
  t.emplace_back("u8", at::arange(9, at::kByte).reshape({3, 3}));
  t.emplace_back("bool", at::arange(5) % 2 == 0);
  t.emplace_back("scalar", at::scalar_tensor(2.5, at::kFloat));
  t.emplace_back("empty", at::empty({0, 4}, at::kFloat));
  t.emplace_back("transposed", at::arange(6, at::kFloat).reshape({2, 3}).t());  // not contiguous
  return t;
}

}  // namespace

TEST_CASE("safetensors: one file, Hugging Face's byte layout", "[checkpoint][safetensors]") {
  TempDir tmp("fsdpx_test_safetensors_");
  const NamedTensors tensors = all_dtypes();
  const auto saved = fsdpx::hf::save_safetensors(tmp.path, tensors, {.metadata = {{"fsdpx_step", "12"}}});
  REQUIRE(saved.files.size() == 1);
  CHECK_FALSE(saved.index.has_value());
  const fs::path file = tmp.path / "model.safetensors";
  CHECK(saved.files[0].path == file);
  CHECK_FALSE(fs::exists(tmp.path / "model.safetensors.index.json"));

  const std::string bytes = fsdpx::detail::read_text(file);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  CHECK(n % 8 == 0);
  const std::string header = bytes.substr(8, n);
  CHECK(header.front() == '{');
  const Json h = fsdpx::detail::parse_json(header, "header");
  CHECK(h["__metadata__"]["format"] == "pt");
  CHECK(h["__metadata__"]["fsdpx_step"] == "12");
  CHECK(h["bf16"]["dtype"] == "BF16");
  CHECK(h["f32"]["dtype"] == "F32");
  CHECK(h["f32"]["shape"].size() == 2);
  CHECK(h["scalar"]["shape"].empty());
  CHECK(h["bool"]["dtype"] == "BOOL");
  CHECK(h["f32"]["data_offsets"][0] == 0);
  CHECK(h["f32"]["data_offsets"][1] == 48);
  CHECK(h["bf16"]["data_offsets"][0] == 48);  // in the given order, contiguous
  // the data: f32 first, little-endian
  float first[12];
  std::memcpy(first, bytes.data() + 8 + n, sizeof first);
  CHECK(first[7] == at::arange(12, at::kFloat)[7].item<float>() / 7);
  CHECK(fsdpx::hf::read_safetensors_metadata(file).at("format") == "pt");

  NamedTensors want;
  for (const auto& [name, t] : tensors) want.emplace_back(name, t.contiguous());
  require_same(fsdpx::hf::load_safetensors(file), want);
  require_same(fsdpx::hf::load_safetensors(tmp.path), want);  // a directory
}

TEST_CASE("safetensors: sharded with an index, and a bfloat16 cast", "[checkpoint][safetensors]") {
  TempDir tmp("fsdpx_test_safetensors_");
  // 6 tensors of 400 bytes (float32) and a large one of 2000 bytes, at most 1000 bytes a file
  NamedTensors tensors;
  for (int i = 0; i < 6; ++i) tensors.emplace_back("layers." + std::to_string(i) + ".w", at::full({10, 10}, float(i)));
  tensors.emplace_back("big", at::arange(500, at::kFloat));
  tensors.emplace_back("tail", at::ones({3}));
  const auto saved = fsdpx::hf::save_safetensors(tmp.path, tensors, {.max_shard_bytes = 1000});
  // [0,1] [2,3] [4,5] [big] [tail]
  REQUIRE(saved.files.size() == 5);
  REQUIRE(saved.index.has_value());
  CHECK(saved.total_size == 6 * 400 + 2000 + 12);
  for (int i = 0; i < 5; ++i) {
    CHECK(saved.files[i].path.filename() == "model-0000" + std::to_string(i + 1) + "-of-00005.safetensors");
  }
  const Json index =
      fsdpx::detail::parse_json(fsdpx::detail::read_text(tmp.path / "model.safetensors.index.json"), "index");
  CHECK(index["metadata"]["total_size"] == saved.total_size);
  CHECK(index["weight_map"]["layers.3.w"] == "model-00002-of-00005.safetensors");
  CHECK(index["weight_map"]["big"] == "model-00004-of-00005.safetensors");
  CHECK(index["weight_map"].size() == tensors.size());
  CHECK_FALSE(fs::exists(tmp.path / "model.safetensors"));
  require_same(fsdpx::hf::load_safetensors(tmp.path), tensors);

  // saved again, smaller, into the same directory: the stale shards and the index go
  NamedTensors bf16;
  for (const auto& [name, t] : tensors) bf16.emplace_back(name, t.to(at::kBFloat16));
  const auto again = fsdpx::hf::save_safetensors(tmp.path, bf16);
  REQUIRE(again.files.size() == 1);
  CHECK(fs::exists(tmp.path / "model.safetensors"));
  CHECK_FALSE(fs::exists(tmp.path / "model.safetensors.index.json"));
  CHECK_FALSE(fs::exists(tmp.path / "model-00001-of-00005.safetensors"));
  require_same(fsdpx::hf::load_safetensors(tmp.path), bf16);
}

TEST_CASE("safetensors: a merged checkpoint round-trips", "[checkpoint][safetensors][merge]") {
  TempDir tmp("fsdpx_test_safetensors_");
  const NamedTensors full = merge_fixture::originals();
  const fs::path dir = merge_fixture::write_checkpoint(tmp.path / "ckpt", 12, merge_fixture::shard(full, 3));
  const NamedTensors merged = ckpt::merge_checkpoint(dir);
  fsdpx::hf::save_safetensors(tmp.path / "one", merged);
  require_same(fsdpx::hf::load_safetensors(tmp.path / "one"), merged);
  fsdpx::hf::save_safetensors(tmp.path / "many", merged, {.max_shard_bytes = 256});
  CHECK(fs::exists(tmp.path / "many" / "model.safetensors.index.json"));
  // sharded files come back in file order: compare by name
  auto got = fsdpx::hf::load_safetensors(tmp.path / "many");
  REQUIRE(got.size() == full.size());
  std::map<std::string, at::Tensor> by_name(got.begin(), got.end());
  for (const auto& [name, t] : full) CHECK(at::equal(by_name.at(name), t));
}

TEST_CASE("safetensors: truncated and malformed files are named", "[checkpoint][safetensors][errors]") {
  TempDir tmp("fsdpx_test_safetensors_");
  fsdpx::hf::save_safetensors(tmp.path, all_dtypes());
  const fs::path file = tmp.path / "model.safetensors";
  const std::string good = fsdpx::detail::read_text(file);
  const auto write = [&](const std::string& bytes) {
    std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
  };

  write(good.substr(0, good.size() - 3));
  CHECK_THAT(load_error(file), Catch::Contains("'" + file.string() + "' is truncated"));
  write(good.substr(0, good.size() / 2));
  CHECK_THAT(load_error(file), Catch::Contains("'" + file.string() + "' is truncated"));
  write(good.substr(0, 5));
  CHECK_THAT(load_error(file), Catch::Contains("'" + file.string() + "' is truncated"));
  write(good + "xx");
  CHECK_THAT(load_error(file), Catch::Contains("'" + file.string() + "' is corrupt"));
  std::string bad = good;
  bad[12] = '#';  // inside the JSON
  write(bad);
  CHECK_THAT(load_error(file), Catch::Contains("'" + file.string() + "' has a bad header"));
  bad = good;
  bad[7] = 0x40;  // a huge header length
  write(bad);
  CHECK_THAT(load_error(file), Catch::Contains("'" + file.string() + "' is truncated or not a safetensors file"));
  CHECK_THAT(load_error(tmp.path / "missing.safetensors"), Catch::Contains("missing.safetensors' does not exist"));

  // an index naming a file that is not there
  TempDir sharded;
  fsdpx::hf::save_safetensors(sharded.path, all_dtypes(), {.max_shard_bytes = 64});
  for (const auto& e : fs::directory_iterator(sharded.path)) {
    if (e.path().filename().string().rfind("model-00002-of-", 0) == 0) fs::remove(e.path());
  }
  CHECK_THAT(load_error(sharded.path), Catch::Contains("model-00002-of-") && Catch::Contains("does not exist"));
}
