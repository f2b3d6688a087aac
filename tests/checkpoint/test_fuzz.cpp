// Crafted checkpoints and model folders (label "security"): random and targeted mutations of a commit
// record, shard files, safetensors files and their index, and a model folder's config.json, fed to
// merge, the commit-record reader, the shard reader, the safetensors loader and the config reader.
// Each must end in the result or an fsdpx::Error (which names the file): never another exception, an
// allocation beyond the input, a hang or a crash. Bounded in count and time; the seed is printed, and
// FSDPX_FUZZ_SEED replays a run. Special and huge files, and records that contradict their files, are
// targeted cases at the end.
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <sys/stat.h>

#include <fsdpx/checkpoint/layout.hpp>
#include <fsdpx/checkpoint/merge.hpp>
#include <fsdpx/hf/model_safetensors.hpp>
#include <fsdpx/hf/safetensors.hpp>
#include <fsdpx/models/pretrained.hpp>

#include "merge_fixture.hpp"

namespace {

namespace fs = std::filesystem;
namespace ckpt = fsdpx::checkpoint;

std::string read_all(const fs::path& p) { return fsdpx::detail::read_text(p); }
void write_all(const fs::path& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes;
}

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
      static const char* extremes[] = {"9223372036854775807",  "-1",  "4294967298", "1e308", "-9223372036854775808",
                                       "18446744073709551615", "2.5", "0"};
      std::vector<size_t> digits;
      for (size_t i = 0; i < bytes.size(); ++i) {
        if (bytes[i] >= '0' && bytes[i] <= '9' && (i == 0 || !(bytes[i - 1] >= '0' && bytes[i - 1] <= '9')))
          digits.push_back(i);
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
int fuzz_files(const fs::path& dir, const std::vector<std::string>& files,
               const std::function<void(const std::string&)>& check) {
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
  const fs::path dir =
      merge_fixture::write_checkpoint(tmp.path / "ckpt", 12, merge_fixture::shard(merge_fixture::originals(), 2));
  const std::vector<std::string> files = {ckpt::config_file, "model_world_size_2_rank_0.pt",
                                          "model_world_size_2_rank_1.pt", "optim_world_size_2_rank_0.pt"};
  const int done = fuzz_files(dir, files, [&](const std::string& what) {
    for (const bool verify : {true, false}) {  // unverified, the corrupt bytes reach the parsers
      expect_clean("merge", what, [&] {
        ckpt::merge_checkpoint(dir, {.verify_checksums = verify, .warn = [](const std::string&) {}});
      });
    }
    expect_clean("read_commit_record", what, [&] {
      if (const auto r = ckpt::read_commit_record(dir)) ckpt::verify_step(dir, *r, true);
    });
    for (size_t i = 1; i < files.size(); ++i)
      expect_clean("load_shard_file " + files[i], what, [&] { ckpt::load_shard_file(dir, files[i]); });
  });
  std::printf("fuzz: %d crafted checkpoints\n", done);
  CHECK(done >= 50);
  CHECK(ckpt::merge_checkpoint(dir).size() == merge_fixture::originals().size());  // and the intact one still merges
}

TEST_CASE("fuzz: crafted safetensors files and indexes end in an error naming the file, never a crash",
          "[security][safetensors]") {
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

namespace {

/// The IoError `fn` throws (any other outcome fails the test), within a few seconds: never a hang.
template <class Fn>
std::string io_error(Fn&& fn) {
  const auto start = std::chrono::steady_clock::now();
  try {
    fn();
  } catch (const fsdpx::IoError& e) {
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));
    return e.what();
  }
  FAIL("no IoError");
  return {};
}

void make_fifo(const fs::path& p) {
  fs::remove(p);
  REQUIRE(::mkfifo(p.c_str(), 0600) == 0);
}

}  // namespace

TEST_CASE("special files, huge files and records that contradict their files are refused at once, naming them",
          "[security][checkpoint]") {
  merge_fixture::TempDir tmp;
  const auto fresh = [&](const std::string& name,
                         std::vector<fsdpx::StateDict> sds = merge_fixture::shard(merge_fixture::originals(), 2)) {
    const fs::path root = tmp.path / name;
    return std::pair{root, merge_fixture::write_checkpoint(root, 12, sds)};
  };
  SECTION("FIFOs where the iteration file, the commit record or a shard file should be") {
    auto [root, dir] = fresh("fifo");
    make_fifo(root / ckpt::checkpointed_iteration_file);
    CHECK_THAT(io_error([&] { ckpt::find_latest_checkpoint(root, false); }), Catch::Contains("is not a regular file"));
    make_fifo(dir / ckpt::config_file);
    CHECK_THAT(io_error([&] { ckpt::read_commit_record(dir); }),
               Catch::Contains("commit record '" + (dir / ckpt::config_file).string() + "' is not a regular file"));
    auto [root2, dir2] = fresh("fifo_shard");
    make_fifo(dir2 / "model_world_size_2_rank_1.pt");
    CHECK_THAT(io_error([&] { ckpt::merge_checkpoint(dir2, {.warn = [](const std::string&) {}}); }),
               Catch::Contains("model_world_size_2_rank_1.pt' is not a regular file"));
  }
  SECTION("a 2 GiB commit record or shard file (NUL-padded, sparse) is refused by its size, not read") {
    auto [root, dir] = fresh("huge");
    fs::resize_file(dir / "model_world_size_2_rank_0.pt", int64_t{2} << 30);
    CHECK_THAT(io_error([&] { ckpt::merge_checkpoint(dir, {.warn = [](const std::string&) {}}); }),
               Catch::Contains("has 2147483648 bytes but fsdp_config.json records"));
    fs::resize_file(dir / ckpt::config_file, int64_t{2} << 30);
    CHECK_THAT(io_error([&] { ckpt::read_commit_record(dir); }),
               Catch::Contains("has 2147483648 bytes; it may have at most 16777216"));
  }
  SECTION("a commit record whose world size is not that of its files; one that is not complete") {
    auto [root, dir] = fresh("world");
    auto record = fsdpx::detail::parse_json(fsdpx::detail::read_text(dir / ckpt::config_file), "record");
    for (const int world : {1, 3}) {
      record["world_size"] = world;
      fsdpx::detail::write_text_durably(dir / ckpt::config_file, record.dump());
      CHECK_THAT(io_error([&] { ckpt::read_commit_record(dir); }),
                 Catch::Contains("world_size is " + std::to_string(world) + " but it lists '") &&
                     Catch::Contains("of a world of 2"));
    }
    record["world_size"] = 2;
    record["complete"] = false;
    fsdpx::detail::write_text_durably(dir / ckpt::config_file, record.dump());
    CHECK_THAT(io_error([&] { ckpt::find_latest_checkpoint(root, false); }), Catch::Contains("is not complete"));
    CHECK(ckpt::find_latest_checkpoint(root, true) == 12);  // its weights are committed
  }
  SECTION("slices of one tensor in two ranks' files are refused, not merged with the later one winning") {
    auto sds = merge_fixture::shard(merge_fixture::originals(), 2);
    // A slice of rank 0's that rank 1's file does not name (a file holds one entry per name).
    const auto twice = std::find_if(sds[0].entries.begin(), sds[0].entries.end(), [&](const fsdpx::TensorSlice& s) {
      return std::none_of(sds[1].entries.begin(), sds[1].entries.end(),
                          [&](const fsdpx::TensorSlice& o) { return o.name == s.name; });
    });
    REQUIRE(twice != sds[0].entries.end());
    sds[1].entries.push_back(*twice);
    auto [root, dir] = fresh("twice", sds);
    CHECK_THAT(
        io_error([&] { ckpt::merge_checkpoint(dir, {.warn = [](const std::string&) {}}); }),
        Catch::Contains("hold parts of parameters in more than one rank's file: '" + twice->name + "' elements [" +
                        std::to_string(twice->begin) + ", " + std::to_string(twice->end) + ")"));
  }
}

TEST_CASE(
    "fuzz: a crafted config.json is refused naming its field, or describes the weights: never a crash or an "
    "allocation beyond the files",
    "[security][hf]") {
  merge_fixture::TempDir tmp;
  // A tiny Qwen2 folder: its config.json and weights of the shapes it implies.
  fsdpx::models::DecoderConfig c;
  c.model_type = "qwen2";
  c.vocab_size = 16, c.hidden_size = 8, c.intermediate_size = 12, c.num_hidden_layers = 2;
  c.num_attention_heads = 2, c.num_key_value_heads = 1, c.head_dim = 4, c.qkv_bias = true;
  c.max_position_embeddings = 64;
  const fs::path dir = tmp.path / "model";
  fs::create_directories(dir);
  fsdpx::hf::NamedTensors weights;
  for (const auto& t : fsdpx::models::hf_tensors(c)) weights.emplace_back(t.hf_name, at::randn(t.shape));
  fsdpx::hf::save_safetensors(dir, weights);
  fsdpx::detail::write_text_durably(dir / "config.json", fsdpx::models::to_hf_config(c, at::kFloat).dump(2));
  // Found by this fuzz: a number beyond a double's range was nlohmann's out_of_range, not an fsdpx::Error.
  CHECK_THROWS_AS(fsdpx::detail::parse_json("{\"rope_theta\": 10000.1e308}", "config.json"), fsdpx::IoError);
  int built = 0;
  const int done = fuzz_files(dir, {"config.json"}, [&](const std::string& what) {
    expect_clean("read_decoder_config + check_config_against_files + load_pretrained", what, [&] {
      const auto config = fsdpx::models::read_decoder_config(dir);
      fsdpx::hf::SafetensorsDir files(dir);
      fsdpx::models::check_config_against_files(config, files, dir, /*strict=*/true);
      // What passes describes the files: the model it builds is theirs, and loads.
      fsdpx::models::CausalLM model(config);
      fsdpx::models::load_pretrained(model, dir);
      ++built;
    });
  });
  std::printf("fuzz: %d crafted config.json files, %d of them built and loaded\n", done, built);
  CHECK(done >= 50);
  CHECK(built > 0);  // mutations that keep the model's shapes still load
}
