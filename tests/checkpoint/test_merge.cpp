// merge_checkpoint: shards of any world size -> the full state dict, and every way a checkpoint can be
// broken (missing, truncated, corrupt, stale or renamed files; a gap) named in the error.
#include <catch2/catch.hpp>

#include <algorithm>
#include <fstream>
#include <string>
#include <vector>

#include <fsdpx/checkpoint/merge.hpp>

#include "merge_fixture.hpp"
#include "require_same.hpp"

namespace {

namespace fs = std::filesystem;
namespace ckpt = fsdpx::checkpoint;
using merge_fixture::NamedTensors;

using merge_fixture::TempDir;

/// `got` holds `want`'s tensors exactly, in name order (the files' order: the pickler sorts dict keys).
void require_same_sorted(const NamedTensors& got, NamedTensors want) {
  std::sort(want.begin(), want.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  merge_fixture::require_same(got, want);
}

/// The IoError merge_checkpoint throws, as text (the test fails when there is none).
std::string merge_error(const fs::path& dir, ckpt::MergeOptions options = {}) {
  options.warn = [](const std::string&) {};
  try {
    ckpt::merge_checkpoint(dir, options);
  } catch (const fsdpx::IoError& e) {
    return e.what();
  }
  FAIL("merge_checkpoint succeeded on a broken checkpoint in " << dir);
  return {};
}

fs::path model_file(const fs::path& dir, int world, int rank) {
  return dir / ckpt::shard_file_name(ckpt::Component::model, world, rank);
}

void truncate_in_half(const fs::path& path) { fs::resize_file(path, fs::file_size(path) / 2); }

void flip_bytes(const fs::path& path, int64_t at, int n) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  for (int i = 0; i < n; ++i) {
    f.seekg(at + i);
    const char c = static_cast<char>(f.get());
    f.seekp(at + i);
    f.put(static_cast<char>(c ^ 0x5a));
  }
}

}  // namespace

TEST_CASE("merge: world sizes 1-4, equal to the original tensors", "[checkpoint][merge]") {
  const NamedTensors full = merge_fixture::originals();
  for (const int world : {1, 2, 3, 4}) {
    DYNAMIC_SECTION("world size " << world) {
      TempDir tmp;
      const fs::path dir = merge_fixture::write_checkpoint(tmp.path, 12, merge_fixture::shard(full, world));
      ckpt::MergeReport report;
      require_same_sorted(ckpt::merge_checkpoint(dir, {}, &report), full);
      CHECK(report.world_size == world);
      CHECK(report.committed);
      CHECK(report.checksums_verified);
      CHECK(report.step == 12);
      CHECK(report.kind == "sharded");
      CHECK(report.files.size() == static_cast<size_t>(world));
      CHECK(report.warnings.empty());
      // global_step_<N> works as well as global_step_<N>/actor
      require_same_sorted(ckpt::merge_checkpoint(dir.parent_path()), full);
    }
  }
}

TEST_CASE("merge: hybrid sharding, replicas with empty files", "[checkpoint][merge]") {
  const NamedTensors full = merge_fixture::originals();
  TempDir tmp;
  const auto sds = merge_fixture::shard(full, /*shard_size=*/2, /*replicate=*/2);
  REQUIRE(sds[2].entries.empty());
  REQUIRE(sds[3].entries.empty());
  const fs::path dir = merge_fixture::write_checkpoint(tmp.path, 3, sds);
  require_same_sorted(ckpt::merge_checkpoint(dir), full);
}

TEST_CASE("merge: a full state dict, and a cast to bfloat16", "[checkpoint][merge]") {
  const NamedTensors full = merge_fixture::originals();
  TempDir tmp;
  // rank 0 holds everything whole; rank 1 nothing
  auto sds = merge_fixture::shard(full, 1, 2, fsdpx::StateDictKind::full);
  const fs::path dir = merge_fixture::write_checkpoint(tmp.path, 1, sds);
  require_same_sorted(ckpt::merge_checkpoint(dir), full);

  NamedTensors bf16;
  for (const auto& [name, t] : full) bf16.emplace_back(name, t.to(at::kBFloat16));
  require_same_sorted(ckpt::merge_checkpoint(dir, {.dtype = at::kBFloat16}), bf16);
}

TEST_CASE("merge: without fsdp_config.json, with a warning that it is not committed", "[checkpoint][merge]") {
  const NamedTensors full = merge_fixture::originals();
  TempDir tmp;
  const fs::path dir = merge_fixture::write_checkpoint(tmp.path, 7, merge_fixture::shard(full, 3), /*commit=*/false);
  std::vector<std::string> warnings;
  ckpt::MergeReport report;
  require_same_sorted(
      ckpt::merge_checkpoint(dir, {.warn = [&](const std::string& w) { warnings.push_back(w); }}, &report), full);
  REQUIRE(warnings.size() == 1);
  CHECK_THAT(warnings[0], Catch::Contains("never committed") && Catch::Contains("cannot be verified") &&
                              Catch::Contains("world size, 3,"));
  CHECK_FALSE(report.committed);
  CHECK_FALSE(report.checksums_verified);

  // ... but files of two world sizes cannot be told apart
  ckpt::save_state_dict(model_file(dir, 2, 0), merge_fixture::shard(full, 2)[0]);
  CHECK_THAT(merge_error(dir),
             Catch::Contains("2 different world sizes") && Catch::Contains(model_file(dir, 2, 0).string()));
}

TEST_CASE("merge: a missing rank file is named", "[checkpoint][merge][errors]") {
  TempDir tmp;
  const fs::path dir =
      merge_fixture::write_checkpoint(tmp.path, 12, merge_fixture::shard(merge_fixture::originals(), 3));
  fs::remove(model_file(dir, 3, 1));
  CHECK_THAT(merge_error(dir), Catch::Contains(model_file(dir, 3, 1).string() + "' (rank 1 of 3) is missing"));
}

TEST_CASE("merge: a stale file of another world size is named", "[checkpoint][merge][errors]") {
  const NamedTensors full = merge_fixture::originals();
  TempDir tmp;
  const fs::path dir = merge_fixture::write_checkpoint(tmp.path, 12, merge_fixture::shard(full, 3));
  ckpt::save_state_dict(model_file(dir, 4, 3), merge_fixture::shard(full, 4)[3]);
  CHECK_THAT(merge_error(dir), Catch::Contains(model_file(dir, 4, 3).string() + "' is from world size 4, not 3"));
}

TEST_CASE("merge: fsdp_config.json's world size against the file names", "[checkpoint][merge][errors]") {
  // A job of 3 committed, but the files present are those of a world size 2 save
  const NamedTensors full = merge_fixture::originals();
  TempDir tmp;
  const fs::path dir = merge_fixture::write_checkpoint(tmp.path, 12, merge_fixture::shard(full, 3));
  for (int r = 0; r < 3; ++r) fs::remove(model_file(dir, 3, r));
  for (const auto& sd : merge_fixture::shard(full, 2)) ckpt::save_state_dict(model_file(dir, 2, sd.rank), sd);
  const std::string msg = merge_error(dir);
  CHECK_THAT(msg, Catch::Contains(model_file(dir, 2, 0).string() + "' is from world size 2, not 3") &&
                      Catch::Contains(model_file(dir, 2, 1).string()) &&
                      Catch::Contains(model_file(dir, 3, 2).string() + "' (rank 2 of 3) is missing") &&
                      Catch::Contains("fsdp_config.json"));
}

TEST_CASE("merge: a truncated file is named", "[checkpoint][merge][errors]") {
  TempDir tmp;
  const fs::path dir =
      merge_fixture::write_checkpoint(tmp.path, 12, merge_fixture::shard(merge_fixture::originals(), 3));
  const fs::path victim = model_file(dir, 3, 2);
  const auto bytes = static_cast<int64_t>(fs::file_size(victim));
  truncate_in_half(victim);
  // against fsdp_config.json
  CHECK_THAT(merge_error(dir), Catch::Contains("'" + victim.string() + "' has " + std::to_string(bytes / 2) +
                                               " bytes but fsdp_config.json records " + std::to_string(bytes)) &&
                                   Catch::Contains("truncated"));
  // and by the reader itself when not verified
  CHECK_THAT(merge_error(dir, {.verify_checksums = false}),
             Catch::Contains("'" + victim.string() + "'") && Catch::Contains("truncated or corrupt"));
  // and without a commit record
  fs::remove(dir / ckpt::config_file);
  CHECK_THAT(merge_error(dir), Catch::Contains("'" + victim.string() + "'") && Catch::Contains("truncated or corrupt"));
}

TEST_CASE("merge: corrupted bytes fail the CRC check, naming the file", "[checkpoint][merge][errors]") {
  TempDir tmp;
  const fs::path dir =
      merge_fixture::write_checkpoint(tmp.path, 12, merge_fixture::shard(merge_fixture::originals(), 3));
  const fs::path victim = model_file(dir, 3, 1);
  const auto size = static_cast<int64_t>(fs::file_size(victim));
  flip_bytes(victim, size / 2, 4);
  REQUIRE(static_cast<int64_t>(fs::file_size(victim)) == size);
  CHECK_THAT(merge_error(dir), Catch::Contains("'" + victim.string() + "' is corrupt: its CRC-32C is"));
}

TEST_CASE("merge: a file whose world size and rank disagree with its name", "[checkpoint][merge][errors]") {
  TempDir tmp;
  const fs::path dir =
      merge_fixture::write_checkpoint(tmp.path, 12, merge_fixture::shard(merge_fixture::originals(), 3));
  // swap ranks 0 and 2 (sizes and CRCs no longer match either: skip that check to reach the fields)
  fs::rename(model_file(dir, 3, 0), dir / "tmp.pt");
  fs::rename(model_file(dir, 3, 2), model_file(dir, 3, 0));
  fs::rename(dir / "tmp.pt", model_file(dir, 3, 2));
  CHECK_THAT(merge_error(dir, {.verify_checksums = false}),
             Catch::Contains("'" + model_file(dir, 3, 0).string() +
                             "' says it is rank 2 of 3, but its name says rank 0 of 3"));
}

TEST_CASE("merge: a gap in a parameter names the parameter and the range", "[checkpoint][merge][errors]") {
  TempDir tmp;
  auto sds = merge_fixture::shard(merge_fixture::originals(), 3);
  // drop rank 1's slice of lm_head.weight
  auto& entries = sds[1].entries;
  const auto it =
      std::find_if(entries.begin(), entries.end(), [](const auto& s) { return s.name == "lm_head.weight"; });
  REQUIRE(it != entries.end());
  const int64_t begin = it->begin, end = it->end;
  entries.erase(it);
  const fs::path dir = merge_fixture::write_checkpoint(tmp.path, 12, sds);
  CHECK_THAT(merge_error(dir),
             Catch::Contains("uncovered") && Catch::Contains("'lm_head.weight' elements [" + std::to_string(begin) +
                                                             ", " + std::to_string(end) + ")"));
}

TEST_CASE("merge: a local state dict cannot be merged without the model", "[checkpoint][merge][errors]") {
  TempDir tmp;
  const fs::path dir = merge_fixture::write_checkpoint(
      tmp.path, 12, merge_fixture::shard(merge_fixture::originals(), 2, 1, fsdpx::StateDictKind::local));
  CHECK_THAT(merge_error(dir), Catch::Contains("\"local\" state dict") && Catch::Contains("without the model") &&
                                   Catch::Contains("fsdp_config.json"));
  fs::remove(dir / ckpt::config_file);
  CHECK_THAT(merge_error(dir), Catch::Contains(model_file(dir, 2, 0).string()) && Catch::Contains("without the model"));
}

TEST_CASE("merge: not a checkpoint", "[checkpoint][merge][errors]") {
  TempDir tmp;
  CHECK_THAT(merge_error(tmp.path), Catch::Contains("holds no model shard files"));
  CHECK_THAT(merge_error(tmp.path / "nope"), Catch::Contains("does not exist"));
}

TEST_CASE("merge: the huggingface directory is copied", "[checkpoint][merge]") {
  TempDir tmp;
  const fs::path dir =
      merge_fixture::write_checkpoint(tmp.path, 12, merge_fixture::shard(merge_fixture::originals(), 2));
  const auto written = ckpt::copy_huggingface_files(dir, tmp.path / "out");
  REQUIRE(written.size() == 1);
  CHECK(fsdpx::detail::read_text(tmp.path / "out" / "config.json") == "{\"model_type\": \"fsdpx-test\"}\n");
}

TEST_CASE("merge: the commit record of the weights alone (\"complete\": false) is enough", "[checkpoint][merge]") {
  const NamedTensors full = merge_fixture::originals();
  TempDir tmp;
  const fs::path dir = merge_fixture::write_checkpoint(tmp.path, 12, merge_fixture::shard(full, 3));
  const fs::path config = dir / ckpt::config_file;
  std::string text = fsdpx::detail::read_text(config);
  const auto replace = [&](const std::string& from, const std::string& to) {
    const auto at = text.find(from);
    REQUIRE(at != std::string::npos);
    text.replace(at, from.size(), to);
  };
  replace("\"complete\": true", "\"complete\": false");
  fsdpx::detail::write_text_durably(config, text);
  ckpt::MergeReport report;
  require_same_sorted(ckpt::merge_checkpoint(dir, {}, &report), full);
  CHECK(report.committed);
  CHECK_FALSE(report.complete);
  // but a record without the model is not
  replace("\"model\",", "");
  fsdpx::detail::write_text_durably(config, text);
  CHECK_THAT(merge_error(dir), Catch::Contains("commit record '" + config.string() + "'") &&
                                   Catch::Contains("model component is not committed"));
}

TEST_CASE("merge: a crafted commit record cannot make it allocate, wrap a number or overflow the stack",
          "[checkpoint][merge][errors]") {
  TempDir tmp;
  const fs::path dir =
      merge_fixture::write_checkpoint(tmp.path, 12, merge_fixture::shard(merge_fixture::originals(), 2));
  const fs::path config = dir / ckpt::config_file;
  const std::string good = fsdpx::detail::read_text(config);
  const auto with = [&](const std::string& from, const std::string& to) {
    std::string text = good;
    const auto at = text.find(from);
    REQUIRE(at != std::string::npos);
    text.replace(at, from.size(), to);
    fsdpx::detail::write_text_durably(config, text);
  };
  with("\"world_size\": 2", "\"world_size\": 2000000000");  // would allocate per rank
  CHECK_THAT(merge_error(dir), Catch::Contains("commit record '" + config.string() + "': world_size is 2000000000") &&
                                   Catch::Contains("it must be in [1, 131072]"));
  with("\"world_size\": 2", "\"world_size\": 4294967298");  // 2 once wrapped to 32 bits
  CHECK_THAT(merge_error(dir), Catch::Contains("'" + config.string() + "': \"world_size\" must be an integer in") &&
                                   Catch::Contains("not the integer 4294967298"));
  with("\"world_size\": 2", "\"world_size\": -2");
  CHECK_THAT(merge_error(dir), Catch::Contains("world_size is -2"));
  with("\"world_size\": 2", "\"world_size\": 2.5");
  CHECK_THAT(merge_error(dir),
             Catch::Contains("\"world_size\" must be an integer") && Catch::Contains("not the number 2.5"));
  // 200,000 nested arrays: a recursive parser would overflow the stack.
  fsdpx::detail::write_text_durably(config, std::string(200000, '[') + std::string(200000, ']'));
  CHECK_THAT(merge_error(dir),
             Catch::Contains("'" + config.string() + "' nests JSON objects and arrays deeper than 64 levels"));
  fsdpx::detail::write_text_durably(config, "{\"format\": \"fsdpx\", \"format_version\": ");
  CHECK_THAT(merge_error(dir), Catch::Contains("'" + config.string() + "' is not valid JSON at byte"));
}

TEST_CASE("merge: links in a checkpoint's huggingface/ are not followed, and nothing is written outside the output",
          "[checkpoint][merge][errors]") {
  TempDir tmp;
  const fs::path dir =
      merge_fixture::write_checkpoint(tmp.path / "ckpt", 12, merge_fixture::shard(merge_fixture::originals(), 2));
  const fs::path hf = dir / "huggingface";
  const fs::path secret = tmp.path / "secret.txt";
  std::ofstream(secret) << "not for the output\n";
  fs::create_symlink(secret, hf / "tokenizer.json");  // a link out of the checkpoint
  fs::create_directories(tmp.path / "outside");
  fs::create_directory_symlink(tmp.path / "outside", hf / "sub");  // and a linked folder
  std::ofstream(hf / "generation_config.json") << "{}\n";
  const fs::path out = tmp.path / "out";
  fs::create_directories(out);
  const fs::path target = tmp.path / "outside" / "victim.json";
  std::ofstream(target) << "unchanged\n";
  fs::create_symlink(target, out / "generation_config.json");  // a link already in the output
  const auto written = ckpt::copy_huggingface_files(dir, out);
  std::vector<std::string> names;
  for (const auto& f : written) names.push_back(f.path.filename().string());
  std::sort(names.begin(), names.end());
  CHECK(names == std::vector<std::string>{"config.json", "generation_config.json"});
  CHECK_FALSE(fs::exists(out / "tokenizer.json"));
  CHECK_FALSE(fs::exists(out / "sub"));
  CHECK(fsdpx::detail::read_text(target) == "unchanged\n");  // the link was replaced, not followed
  CHECK_FALSE(fs::is_symlink(out / "generation_config.json"));
  CHECK(fsdpx::detail::read_text(out / "generation_config.json") == "{}\n");
}
