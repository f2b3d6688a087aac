// Crafted checkpoints and model folders (label "security"): random and targeted mutations of a commit
// record, shard files, safetensors files and their index, fed to merge, the commit-record reader, the
// shard reader and the safetensors loader. Each must end in the result or an fsdpx::Error (which names
// the file): never another exception, an allocation beyond the input, a hang or a crash. Bounded in
// count and time; the seed is printed, and FSDPX_FUZZ_SEED replays a run.
#include <catch2/catch.hpp>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <fsdpx/checkpoint/merge.hpp>
#include <fsdpx/hf/model_safetensors.hpp>
#include <fsdpx/hf/safetensors.hpp>

#include "merge_fixture.hpp"

namespace {

namespace fs = std::filesystem;
namespace ckpt = fsdpx::checkpoint;

std::string read_all(const fs::path& p) { return fsdpx::detail::read_text(p); }
void write_all(const fs::path& p, const std::string& bytes) { std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes; }

/// One mutation of `bytes`, described in `what`.
std::string mutate(std::string bytes, std::mt19937_64& rng, std::string& what) {
  const auto pick = [&](uint64_t n) { return n == 0 ? 0 : static_cast<size_t>(rng() % n); };
  switch (rng() % 7) {
    case 0: {  // flip a few bytes
      const int n = 1 + static_cast<int>(rng() % 8);
      for (int i = 0; i < n && !bytes.empty(); ++i) bytes[pick(bytes.size())] ^= static_cast<char>(1 + rng() % 255);
      what = "flipped " + std::to_string(n) + " bytes";
      break;
    }
    case 1: {  // truncate
      const size_t at = pick(bytes.size());
      bytes.resize(at);
      what = "truncated to " + std::to_string(at) + " bytes";
      break;
    }
    case 2: {  // append garbage
      const size_t n = 1 + pick(64);
      for (size_t i = 0; i < n; ++i) bytes.push_back(static_cast<char>(rng()));
      what = "appended " + std::to_string(n) + " bytes";
      break;
    }
    case 3: {  // a number in the text replaced by an extreme one
      static const char* extremes[] = {"9223372036854775807", "-1", "4294967298", "1e308", "-9223372036854775808",
                                       "18446744073709551615", "2.5", "0"};
      std::vector<size_t> digits;
      for (size_t i = 0; i < bytes.size(); ++i) {
        if (bytes[i] >= '0' && bytes[i] <= '9' && (i == 0 || !(bytes[i - 1] >= '0' && bytes[i - 1] <= '9'))) digits.push_back(i);
      }
      if (digits.empty()) return mutate(std::move(bytes), rng, what);
      const size_t at = digits[pick(digits.size())];
      size_t end = at;
      while (end < bytes.size() && bytes[end] >= '0' && bytes[end] <= '9') ++end;
      const std::string e = extremes[pick(std::size(extremes))];
      bytes.replace(at, end - at, e);
      what = "a number at byte " + std::to_string(at) + " replaced by " + e;
      break;
    }
    case 4: {  // a quoted string replaced by a path out of the folder or another type
      static const char* values[] = {"\"../escape.safetensors\"", "\"/etc/passwd\"", "{}", "[[[[]]]]", "null", "\"\""};
      const size_t at = bytes.find('"', pick(bytes.size()));
      if (at == std::string::npos) return mutate(std::move(bytes), rng, what);
      const size_t end = bytes.find('"', at + 1);
      if (end == std::string::npos) return mutate(std::move(bytes), rng, what);
      const std::string v = values[pick(std::size(values))];
      bytes.replace(at, end - at + 1, v);
      what = "a string at byte " + std::to_string(at) + " replaced by " + v;
      break;
    }
    case 5: {  // a stretch of bytes duplicated (shifts everything after it)
      const size_t at = pick(bytes.size()), n = 1 + pick(32);
      bytes.insert(at, bytes.substr(at, n));
      what = "bytes duplicated at " + std::to_string(at);
      break;
    }
    default: {  // deep nesting spliced in
      const size_t at = pick(bytes.size());
      bytes.insert(at, std::string(5000, '[') + std::string(5000, ']'));
      what = "5000 nested arrays inserted at " + std::to_string(at);
    }
  }
  return bytes;
}

/// Runs `op`: fine when it returns or throws fsdpx::Error; a failure otherwise.
void expect_clean(const std::string& op, const std::string& what, const std::function<void()>& fn) {
  try {
    fn();
  } catch (const fsdpx::Error&) {
  } catch (const std::exception& e) {
    FAIL(op << " after " << what << " threw a " << typeid(e).name() << " instead of an fsdpx::Error: " << e.what());
  }
}

uint64_t seed() {
  const char* s = std::getenv("FSDPX_FUZZ_SEED");
  const uint64_t v = s != nullptr ? std::stoull(s) : std::random_device{}();
  std::printf("fuzz seed %llu (FSDPX_FUZZ_SEED replays it)\n", static_cast<unsigned long long>(v));
  return v;
}

constexpr int iterations = 400;
constexpr auto time_limit = std::chrono::seconds(60);

/// Up to `iterations` rounds (within `time_limit`): one of `files` in `dir` is mutated, `check(what)`
/// runs the readers on it, and the file is restored. Returns the rounds done.
int fuzz_files(const fs::path& dir, const std::vector<std::string>& files, const std::function<void(const std::string&)>& check) {
  std::vector<std::string> originals;
  for (const auto& f : files) originals.push_back(read_all(dir / f));
  std::mt19937_64 rng(seed());
  const auto start = std::chrono::steady_clock::now();
  int done = 0;
  for (; done < iterations && std::chrono::steady_clock::now() - start < time_limit; ++done) {
    const size_t target = rng() % files.size();
    std::string what;
    write_all(dir / files[target], mutate(originals[target], rng, what));
    check(files[target] + ": " + what);
    write_all(dir / files[target], originals[target]);
  }
  return done;
}

}  // namespace

TEST_CASE("fuzz: crafted checkpoint files end in an error naming the file, never a crash", "[security][checkpoint]") {
  merge_fixture::TempDir tmp;
  const fs::path dir = merge_fixture::write_checkpoint(tmp.path / "ckpt", 12, merge_fixture::shard(merge_fixture::originals(), 2));
  const std::vector<std::string> files = {ckpt::config_file, "model_world_size_2_rank_0.pt", "model_world_size_2_rank_1.pt",
                                          "optim_world_size_2_rank_0.pt"};
  const int done = fuzz_files(dir, files, [&](const std::string& what) {
    for (const bool verify : {true, false}) {  // unverified, the corrupt bytes reach the parsers
      expect_clean("merge", what, [&] { ckpt::merge_checkpoint(dir, {.verify_checksums = verify, .warn = [](const std::string&) {}}); });
    }
    expect_clean("read_commit_record", what, [&] {
      if (const auto r = ckpt::read_commit_record(dir)) ckpt::verify_step(dir, *r, true);
    });
    for (size_t i = 1; i < files.size(); ++i) expect_clean("load_shard_file " + files[i], what, [&] { ckpt::load_shard_file(dir, files[i]); });
  });
  std::printf("fuzz: %d crafted checkpoints\n", done);
  CHECK(done >= 50);
  CHECK(ckpt::merge_checkpoint(dir).size() == merge_fixture::originals().size());  // and the intact one still merges
}

TEST_CASE("fuzz: crafted safetensors files and indexes end in an error naming the file, never a crash", "[security][safetensors]") {
  merge_fixture::TempDir tmp;
  fsdpx::hf::NamedTensors tensors;
  for (int i = 0; i < 6; ++i) tensors.emplace_back("layer" + std::to_string(i) + "_w", at::full({10, 10}, float(i)));
  tensors.emplace_back("bf16", at::arange(50, at::kFloat).to(at::kBFloat16));
  const fs::path dir = tmp.path / "model";
  fsdpx::hf::save_safetensors(dir, tensors, {.max_shard_bytes = 900});
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(dir)) files.push_back(e.path().filename().string());
  std::sort(files.begin(), files.end());
  REQUIRE(files.size() >= 4);
  torch::nn::Module model;  // a module with the folder's tensors (in float32: a cast), for the model loader
  for (const auto& [name, t] : tensors) model.register_parameter(name, at::zeros(t.sizes()));
  const int done = fuzz_files(dir, files, [&](const std::string& what) {
    expect_clean("load_model_safetensors", what, [&] {
      fsdpx::hf::SafetensorsDir st(dir);
      fsdpx::load_model_safetensors(model, st, {.strict = false});
    });
    expect_clean("SafetensorsDir", what, [&] {
      fsdpx::hf::SafetensorsDir st(dir);
      for (const auto& name : st.names()) st.read(name);
    });
    expect_clean("load_safetensors", what, [&] { fsdpx::hf::load_safetensors(dir); });
  });
  std::printf("fuzz: %d crafted safetensors folders\n", done);
  CHECK(done >= 50);
  CHECK(fsdpx::hf::load_safetensors(dir).size() == tensors.size());
  CHECK_FALSE(fs::exists(tmp.path / "escape.safetensors"));
}
