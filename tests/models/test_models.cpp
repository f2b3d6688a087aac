// fsdpx's decoder and its Hugging Face name table, config.json parsing, and every kind of bad model
// folder: each an error naming the tensor, the file or the field. Single process; the folders come from
// tests/models/make_hf_models.py (FSDPX_HF_FIXTURES).
#include <catch2/catch.hpp>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include <sys/stat.h>

#include <fsdpx/detail/json.hpp>
#include <fsdpx/models.hpp>

#include "decoder_path.hpp"

namespace {

namespace fs = std::filesystem;
namespace models = fsdpx::models;
using fsdpx::detail::Json;

fs::path fixtures() {
  const char* dir = std::getenv("FSDPX_HF_FIXTURES");
  REQUIRE(dir != nullptr);
  REQUIRE(fs::exists(fs::path(dir) / "READY"));
  return dir;
}

struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() /
           ("fsdpx_test_models_" + std::to_string(::getpid()) + "_" + std::to_string(counter()++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  static int& counter() {
    static int n = 0;
    return n;
  }
};

/// A copy of fixture `name` whose tensors pass through `edit` (name -> tensor; erase or add).
fs::path edited_copy(const TempDir& tmp, const std::string& name,
                     const std::function<void(std::map<std::string, at::Tensor>&)>& edit) {
  auto loaded = fsdpx::hf::load_safetensors(fixtures() / name);
  std::map<std::string, at::Tensor> tensors(loaded.begin(), loaded.end());
  edit(tensors);
  const fs::path dir = tmp.path / name;
  fsdpx::hf::NamedTensors out(tensors.begin(), tensors.end());
  fsdpx::hf::save_safetensors(dir, out);
  fs::copy_file(fixtures() / name / "config.json", dir / "config.json");
  return dir;
}

fs::path plain_copy(const TempDir& tmp, const std::string& name) {
  const fs::path dir = tmp.path / name;
  fs::copy(fixtures() / name, dir, fs::copy_options::recursive);
  return dir;
}

std::string load_error(const fs::path& dir) {
  try {
    models::CausalLM model(models::read_decoder_config(dir));
    models::load_pretrained(model, dir);
  } catch (const fsdpx::Error& e) {
    return e.what();
  }
  FAIL("loading " << dir << " succeeded");
  return {};
}

std::string config_error(Json config) {
  try {
    models::parse_decoder_config(config, "config.json");
  } catch (const fsdpx::Error& e) {
    return e.what();
  }
  FAIL("config accepted: " << config.dump());
  return {};
}

Json llama_config() {
  return {{"model_type", "llama"},    {"architectures", {"LlamaForCausalLM"}},
          {"vocab_size", 96},         {"hidden_size", 64},
          {"intermediate_size", 112}, {"num_hidden_layers", 2},
          {"num_attention_heads", 8}, {"num_key_value_heads", 2}};
}

/// The module's parameter names and shapes against the declared table.
void check_table(const models::DecoderConfig& c) {
  models::CausalLM model(c);
  std::map<std::string, std::vector<int64_t>> module, table;
  for (const auto& p : model->named_parameters()) module[p.key()] = p.value().sizes().vec();
  for (const auto& t : models::hf_tensors(c)) {
    CHECK(t.module_name == t.hf_name);
    table[t.module_name] = t.shape;
  }
  CHECK(module == table);
  CHECK(model->named_buffers().is_empty());  // nothing derived from the config is saved
}

}  // namespace

TEST_CASE("models: the name table lists exactly the decoder's parameters", "[hf][unit]") {
  auto c = models::parse_decoder_config(llama_config(), "llama");
  check_table(c);
  c.mlp_bias = c.o_bias = c.qkv_bias = true;
  check_table(c);
  c.tie_word_embeddings = true;
  c.qk_norm = true;
  c.head_dim = 24;
  check_table(c);
  Json qwen2 = llama_config();
  qwen2["model_type"] = "qwen2";
  qwen2["architectures"] = {"Qwen2ForCausalLM"};
  qwen2["attention_bias"] = true;  // Qwen2 ignores it: q/k/v always have biases, o_proj never
  const auto q2 = models::parse_decoder_config(qwen2, "qwen2");
  CHECK(q2.qkv_bias);
  CHECK_FALSE(q2.o_bias);
  check_table(q2);
  Json qwen3 = llama_config();
  qwen3["model_type"] = "qwen3";
  qwen3.erase("architectures");
  const auto q3 = models::parse_decoder_config(qwen3, "qwen3");
  CHECK(q3.head_dim == 128);  // Qwen3Config's default, not hidden / heads
  CHECK(q3.qk_norm);
  check_table(q3);
}

TEST_CASE("models: a config that changes the math is refused, naming the field", "[hf][unit][errors]") {
  Json c = llama_config();
  c["model_type"] = "mistral";
  CHECK_THAT(config_error(c), Catch::Contains("model_type \"mistral\""));
  c = llama_config();
  c["architectures"] = {"LlamaForSequenceClassification"};
  CHECK_THAT(config_error(c), Catch::Contains("LlamaForSequenceClassification"));
  c = llama_config();
  c["rope_parameters"] = {{"rope_type", "yarn"}, {"rope_theta", 10000.0}, {"factor", 4.0}};
  CHECK_THAT(config_error(c), Catch::Contains("RoPE type \"yarn\""));
  c = llama_config();
  c["rope_scaling"] = {{"type", "dynamic"}, {"factor", 2.0}};  // transformers 4.x spelling
  CHECK_THAT(config_error(c), Catch::Contains("RoPE type \"dynamic\""));
  c = llama_config();
  c["partial_rotary_factor"] = 0.5;
  CHECK_THAT(config_error(c), Catch::Contains("partial_rotary_factor"));
  c = llama_config();
  c["hidden_act"] = "gelu";
  CHECK_THAT(config_error(c), Catch::Contains("\"hidden_act\" is \"gelu\""));
  c = llama_config();
  c["quantization_config"] = {{"quant_method", "fp8"}};
  CHECK_THAT(config_error(c), Catch::Contains("quantization_config"));
  c = llama_config();
  c["rope_parameters"] = {{"full_attention", {{"rope_type", "default"}}}};
  CHECK_THAT(config_error(c), Catch::Contains("per layer type"));
  c = llama_config();
  c["num_key_value_heads"] = 3;
  CHECK_THAT(config_error(c), Catch::Contains("cannot be grouped"));
  c = llama_config();
  c["vocab_size"] = "96";
  CHECK_THAT(config_error(c), Catch::Contains("\"vocab_size\" must be an integer"));
  c = llama_config();
  c.erase("hidden_size");
  CHECK_THAT(config_error(c), Catch::Contains("has no \"hidden_size\""));
  c = llama_config();
  c["model_type"] = "qwen2";
  c["architectures"] = {"Qwen2ForCausalLM"};
  c["use_sliding_window"] = true;
  c["sliding_window"] = 4;
  c["layer_types"] = {"full_attention", "chunked_attention"};
  CHECK_THAT(config_error(c), Catch::Contains("layer type \"chunked_attention\""));
}

TEST_CASE("models: transformers 4.x configs (rope_theta, rope_scaling, torch_dtype) read the same", "[hf][unit]") {
  Json c = llama_config();
  c["rope_theta"] = 500000.0;
  c["rope_scaling"] = {{"rope_type", "llama3"},
                       {"factor", 8.0},
                       {"low_freq_factor", 1.0},
                       {"high_freq_factor", 4.0},
                       {"original_max_position_embeddings", 8192}};
  c["torch_dtype"] = "bfloat16";
  const auto config = models::parse_decoder_config(c, "v4");
  CHECK(config.rope.type == "llama3");
  CHECK(config.rope.theta == 500000.0);
  CHECK(config.rope.original_max_position_embeddings == 8192);
  CHECK(config.dtype == at::kBFloat16);
  const Json back = models::to_hf_config(config, at::kFloat);
  CHECK(back["torch_dtype"] == "float32");
  CHECK(back["dtype"] == "float32");
  CHECK(back["rope_scaling"]["factor"] == 8.0);  // 4.x's spelling kept in step with rope_parameters
  CHECK(back["rope_parameters"]["rope_type"] == "llama3");
}

TEST_CASE("models: bad model folders are errors naming the tensor or the file", "[hf][errors]") {
  TempDir tmp;
  SECTION("a missing tensor") {
    const auto dir = edited_copy(tmp, "qwen2_tied", [](auto& t) { t.erase("model.layers.1.mlp.up_proj.weight"); });
    const auto e = load_error(dir);
    CHECK_THAT(e, Catch::Contains("missing (in the model, not in the files): model.layers.1.mlp.up_proj.weight"));
    CHECK_THAT(e, Catch::Contains("nothing was loaded"));
  }
  SECTION("a wrong shape") {
    const auto dir = edited_copy(tmp, "qwen2_tied",
                                 [](auto& t) { t["model.layers.0.self_attn.k_proj.weight"] = at::zeros({16, 64}); });
    CHECK_THAT(load_error(dir), Catch::Contains("model.layers.0.self_attn.k_proj.weight: shape [16, 64]") &&
                                    Catch::Contains("but [32, 64] in the model"));
  }
  SECTION("an unexpected tensor; the ones transformers ignores are not") {
    const auto dir = edited_copy(tmp, "qwen2_tied", [](auto& t) {
      t["model.layers.0.self_attn.rotary_emb.inv_freq"] = at::ones({8});  // older transformers saved these
      t["lm_head.weight"] = at::zeros({96, 64});                          // a tied head's copy
      t["model.layers.7.mlp.extra.weight"] = at::zeros({2});
    });
    const auto e = load_error(dir);
    CHECK_THAT(e, Catch::Contains("unexpected (in the files, not in the model): model.layers.7.mlp.extra.weight"));
    CHECK_THAT(e, !Catch::Contains("inv_freq") && !Catch::Contains("lm_head"));
  }
  SECTION("a dtype the loader cannot cast") {
    const auto dir = edited_copy(tmp, "qwen2_tied", [](auto& t) {
      t["model.norm.weight"] = at::ones({64}, at::kLong);
      t["model.layers.0.input_layernorm.weight"] = at::ones({64}).to(at::kFloat8_e4m3fn);
    });
    const auto e = load_error(dir);
    CHECK_THAT(
        e, Catch::Contains("model.norm.weight: dtype Long") && Catch::Contains("cannot be cast to the model's Float"));
    CHECK_THAT(
        e, Catch::Contains("model.layers.0.input_layernorm.weight: dtype Float8_e4m3fn") && Catch::Contains("scales"));
  }
  SECTION("an unknown model_type") {
    const auto dir = plain_copy(tmp, "qwen2_tied");
    auto config = fsdpx::detail::parse_json(fsdpx::detail::read_text(dir / "config.json"), "config");
    config["model_type"] = "gemma3";
    fsdpx::detail::write_text_durably(dir / "config.json", config.dump());
    CHECK_THAT(load_error(dir), Catch::Contains("model_type \"gemma3\" is not one fsdpx's decoder implements"));
  }
  SECTION("a config.json that is a FIFO: refused, not read forever") {
    const auto dir = plain_copy(tmp, "qwen2_tied");
    fs::remove(dir / "config.json");
    REQUIRE(::mkfifo((dir / "config.json").c_str(), 0600) == 0);
    CHECK_THAT(load_error(dir), Catch::Contains("config.json' is not a regular file"));
  }
  SECTION("a truncated shard file") {
    const auto dir = plain_copy(tmp, "llama_gqa");
    const fs::path file = dir / "model-00003-of-00017.safetensors";
    fs::resize_file(file, fs::file_size(file) - 10);
    CHECK_THAT(load_error(dir), Catch::Contains("'" + file.string() + "' is truncated"));
  }
  SECTION("an index naming an absent file, a path out of the folder, a FIFO") {
    const auto dir = plain_copy(tmp, "llama_gqa");
    const fs::path index = dir / "model.safetensors.index.json";
    const auto original = fsdpx::detail::parse_json(fsdpx::detail::read_text(index), "index");
    const auto with_file = [&](const std::string& file) {
      auto j = original;
      j["weight_map"]["model.norm.weight"] = file;
      fsdpx::detail::write_text_durably(index, j.dump());
    };
    with_file("model-00099-of-00017.safetensors");
    CHECK_THAT(load_error(dir), Catch::Contains("model-00099-of-00017.safetensors' does not exist"));
    for (const std::string escape :
         {"../llama_gqa/model-00001-of-00017.safetensors", "/etc/passwd", "sub/x.safetensors"}) {
      with_file(escape);
      CHECK_THAT(load_error(dir), Catch::Contains("'" + escape + "', which is not a file name inside the folder"));
    }
    REQUIRE(::mkfifo((dir / "fifo.safetensors").c_str(), 0600) == 0);
    with_file("fifo.safetensors");
    CHECK_THAT(load_error(dir), Catch::Contains("fifo.safetensors' is not a regular file"));  // and no hang
  }
  SECTION("a header that lies about its sizes") {
    const auto dir = plain_copy(tmp, "qwen2_tied");
    const fs::path file = dir / "model.safetensors";
    std::string bytes = fsdpx::detail::read_text(file);
    const auto at = bytes.find("[64]");  // a norm's shape -> a shape whose byte count overflows
    REQUIRE(at != std::string::npos);
    bytes.replace(at, 4, "[576460752303423488,64]");
    uint64_t length = 0;
    std::memcpy(&length, bytes.data(), 8);
    length += 19;
    std::memcpy(bytes.data(), &length, 8);
    std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
    CHECK_THAT(load_error(dir),
               Catch::Contains("'" + file.string() + "' has a bad header") && Catch::Contains("overflows"));
  }
}

TEST_CASE("models: a strict failure loads nothing, and not strict it reports and loads the rest", "[hf]") {
  TempDir tmp;
  const auto dir = edited_copy(tmp, "qwen2_tied", [](auto& t) {
    t.erase("model.norm.weight");
    t["model.layers.0.mlp.down_proj.weight"] = at::zeros({64, 7});
    t["extra"] = at::zeros({1});
  });
  models::CausalLM model(models::read_decoder_config(dir));
  std::map<std::string, at::Tensor> before;
  for (const auto& p : model->named_parameters()) before[p.key()] = p.value().clone();
  CHECK_THROWS_AS(models::load_pretrained(model, dir), fsdpx::ConfigError);
  for (const auto& p : model->named_parameters()) CHECK(at::equal(p.value(), before[p.key()]));

  const auto report = models::load_pretrained(model, dir, {.strict = false});
  CHECK(report.missing == std::vector<std::string>{"model.norm.weight"});
  CHECK(report.unexpected == std::vector<std::string>{"extra"});
  REQUIRE(report.mismatched.size() == 1);
  CHECK_THAT(report.mismatched[0], Catch::StartsWith("model.layers.0.mlp.down_proj.weight: shape [64, 7]"));
  CHECK(at::equal(model->named_parameters()["model.norm.weight"], before["model.norm.weight"]));
  CHECK(at::equal(model->named_parameters()["model.layers.0.mlp.down_proj.weight"],
                  before["model.layers.0.mlp.down_proj.weight"]));
  const auto files = fsdpx::hf::load_safetensors(dir);
  for (const auto& [name, t] : files) {
    if (name == "model.layers.1.mlp.up_proj.weight") CHECK(at::equal(model->named_parameters()[name], t));
  }
}

TEST_CASE("models: a merge writes the names its config implies, or refuses the config", "[hf][merge]") {
  const std::string config_text = fsdpx::detail::read_text(fixtures() / "qwen3_qknorm" / "config.json");
  const auto tensors = fsdpx::hf::load_safetensors(fixtures() / "qwen3_qknorm");
  std::string why;
  const auto renamed = models::rename_for_config(tensors, config_text, "config.json", why);
  REQUIRE(renamed.has_value());
  CHECK(renamed->size() == tensors.size());

  auto missing = tensors;
  missing.pop_back();
  CHECK_FALSE(models::rename_for_config(missing, config_text, "config.json", why).has_value());
  CHECK_THAT(why, Catch::Contains("is missing"));
  fsdpx::hf::NamedTensors gpt = {{"tok.weight", at::zeros({96, 64})}, {"h0.qkv.weight", at::zeros({192, 64})}};
  CHECK_FALSE(models::rename_for_config(gpt, config_text, "config.json", why).has_value());
  CHECK_THAT(why, Catch::Contains("'h0.qkv.weight' is not a tensor of this config"));
  const std::string gpt2 = R"({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})";
  CHECK_FALSE(models::rename_for_config(gpt, gpt2, "config.json", why).has_value());
  CHECK_THAT(why, Catch::Contains("model_type \"gpt2\""));
}

namespace {

template <class Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const fsdpx::Error& e) {
    return e.what();
  }
  FAIL("no error");
  return {};
}

at::Tensor longs(std::vector<int64_t> v, std::vector<int64_t> shape) {
  return at::tensor(v, at::kLong).view(shape).clone();
}

}  // namespace

TEST_CASE("models: packed samples from position ids and cumulative lengths, and bad descriptions name the argument",
          "[hf][unit][packed][errors]") {
  const auto samples = models::PackedSamples::from_position_ids(longs({0, 1, 2, 0, 1, 0, 0, 1, 2, 3, 4, 5}, {2, 6}), 2);
  CHECK(samples.spans() == std::vector<models::SampleSpan>{{0, 0, 3}, {0, 3, 2}, {0, 5, 1}, {1, 0, 6}});
  CHECK(samples.max_length() == 6);
  CHECK(at::equal(samples.cu_seqlens(), at::tensor(std::vector<int32_t>{0, 3, 5, 6, 12})));
  CHECK(at::equal(samples.next_token_mask(),
                  at::tensor(std::vector<uint8_t>{1, 1, 0, 1, 0, 1, 1, 1, 1, 1}).to(at::kBool).view({2, 5})));
  const auto again = models::PackedSamples::from_cu_seqlens(samples.cu_seqlens(), 2, 6);
  CHECK(again.spans() == samples.spans());
  CHECK(at::equal(again.position_ids(), samples.position_ids()));
  // One run per row, wherever it starts: not packed (an offset, as a continuation's positions are).
  CHECK(models::PackedSamples::detect(longs({5, 6, 7, 0, 1, 2}, {2, 3}), 2).empty());
  CHECK_FALSE(models::PackedSamples::detect(longs({0, 1, 0}, {1, 3}), 2).empty());  // [1, seq]: every row

  CHECK_THAT(error_of([] { models::PackedSamples::from_position_ids(longs({0, 1, 2, 0, 2, 3}, {1, 6}), 1); }),
             Catch::Contains(
                 "position_ids do not describe packed samples: in row 0 a sample starts at token 4 with position 2"));
  CHECK_THAT(error_of([] { models::PackedSamples::detect(longs({0, 1, 5, 6}, {1, 4}), 1); }),
             Catch::Contains("starts at token 2 with position 5"));
  CHECK_THAT(error_of([] { models::PackedSamples::from_position_ids(at::zeros({2, 3}, at::kInt), 2); }),
             Catch::Contains("position_ids must be int64 [batch, seq]"));
  CHECK_THAT(error_of([] { models::PackedSamples::from_cu_seqlens(longs({0, 3, 5}, {3}), 1, 6); }),
             Catch::Contains("cu_seqlens end at 5 but the batch holds 1 x 6 = 6 tokens"));
  CHECK_THAT(error_of([] { models::PackedSamples::from_cu_seqlens(longs({0, 3, 3, 6}, {4}), 1, 6); }),
             Catch::Contains("sample 1 is empty"));
  CHECK_NOTHROW(models::PackedSamples::from_cu_seqlens(longs({0, 4, 8}, {3}), 2, 4));
  CHECK_THAT(error_of([] { models::PackedSamples::from_cu_seqlens(longs({0, 3, 6, 8}, {4}), 2, 4); }),
             Catch::Contains("sample 1 (tokens 3 to 6) crosses the end of row 0"));
  CHECK_THAT(error_of([] { models::PackedSamples::from_cu_seqlens(longs({1, 6}, {2}), 1, 6); }),
             Catch::Contains("cu_seqlens must start at 0"));

  models::DecoderConfig c = models::parse_decoder_config(llama_config(), "config.json");
  models::CausalLM model(c);
  at::NoGradGuard no_grad;
  CHECK_THAT(error_of([&] { model->forward(at::zeros({1, 6}, at::kLong), samples); }),
             Catch::Contains("the packed samples describe a [2, 6] batch, but the input is [1, 6]"));
}

// Issue 47: attention runs on one explicit backend per model, reported; where the one asked for cannot
// run, the call fails saying why (no silent fallback). On the CPU, flash_varlen cannot run: automatic
// says so in the report, and every backend gives the same packed logits.
TEST_CASE("models: attention runs on the backend asked for, reports what ran and why, and refuses what cannot run",
          "[hf][unit][packed][attention][errors]") {
  at::manual_seed(5);
  models::CausalLM model(models::parse_decoder_config(llama_config(), "config.json"));
  at::NoGradGuard no_grad;
  const auto samples = models::PackedSamples::from_cu_seqlens(longs({0, 3, 6, 8, 12}, {5}), 2, 6);
  const at::Tensor ids = at::randint(1, 64, {2, 6}, at::kLong);
  CHECK(model->attention_report().requested == models::AttentionBackend::automatic);
  CHECK_FALSE(model->attention_report().packed.has_value());
  CHECK_THAT(model->attention_report().to_string(), Catch::Contains("packed samples not run yet"));

  const at::Tensor automatic = model->forward(ids, samples);
  auto report = model->attention_report();
  CHECK(report.packed == models::AttentionBackend::sdpa);
  CHECK_THAT(report.reason, Catch::Contains("flash_varlen needs CUDA tensors, not cpu"));
  CHECK_THAT(report.to_string(),
             Catch::Contains("automatic: whole rows on sdpa, packed samples on sdpa (flash_varlen needs"));

  model->set_attention_backend(models::AttentionBackend::sdpa);
  CHECK_FALSE(model->attention_report().packed.has_value());  // a new choice reports afresh
  CHECK(at::equal(model->forward(ids, samples), automatic));
  CHECK(model->attention_report().packed == models::AttentionBackend::sdpa);
  CHECK(model->attention_report().reason.empty());

  model->set_attention_backend(models::AttentionBackend::flash_varlen);
  CHECK_THAT(
      error_of([&] { model->forward(ids, samples); }),
      Catch::Contains("AttentionBackend::flash_varlen was asked for, but flash_varlen needs CUDA tensors, not cpu"));
  // Whole rows run SDPA under every choice.
  const at::Tensor rows = model->forward(ids);
  model->set_attention_backend(models::AttentionBackend::automatic);
  CHECK(at::equal(model->forward(ids), rows));
}

// Issue 47: the _packed twins became one layout argument; the old names stay one release as
// deprecated forwards, and give exactly what the new spellings give.
TEST_CASE("models: the deprecated _packed names equal forward, loss and log_probs given packed samples",
          "[hf][unit][packed][deprecated]") {
  at::manual_seed(6);
  models::CausalLM model(models::parse_decoder_config(llama_config(), "config.json"));
  const auto samples = models::PackedSamples::from_cu_seqlens(longs({0, 2, 6, 9, 12}, {5}), 2, 6);
  const at::Tensor ids = at::randint(1, 64, {2, 6}, at::kLong);
  at::NoGradGuard no_grad;
  const models::LogProbOptions entropy{.entropy = true};
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
  const at::Tensor old_logits = model->forward_packed(ids, samples);
  const at::Tensor old_loss = model->loss_packed(ids, ids, samples);
  const models::TokenLogProbs old_logp = model->log_probs_packed(ids, samples, entropy);
#pragma GCC diagnostic pop
  CHECK(at::equal(old_logits, model->forward(ids, samples)));
  CHECK(at::equal(old_loss, model->loss(ids, ids, samples)));
  const models::TokenLogProbs logp = model->log_probs(ids, samples, entropy);
  CHECK(at::equal(old_logp.log_probs, logp.log_probs));
  CHECK(at::equal(old_logp.entropy, logp.entropy));
  // Packed, not whole rows: the samples do not attend to each other, and boundaries hold 0.
  CHECK_FALSE(at::allclose(old_logits, model->forward(ids)));
  CHECK(logp.log_probs.masked_select(samples.next_token_mask().logical_not()).eq(0).all().item<bool>());
  CHECK_THAT(error_of([&] { model->forward(ids, samples, samples.position_ids()); }),
             Catch::Contains("packed samples carry their own positions; pass no position_ids"));
}

TEST_CASE("models: pack_sequences fills rows first-fit decreasing, pads the tails as samples of their own, and unpacks",
          "[hf][unit][packed]") {
  std::vector<at::Tensor> seqs;
  for (int64_t n : {3, 7, 2, 5, 4}) seqs.push_back(at::arange(1, n + 1, at::kLong) + 10 * n);
  const auto batch = models::pack_sequences(seqs, {.token_budget = 8, .pad_token_id = 0});
  // 7 -> row 0; 5 -> row 1; 4 -> row 2; 3 -> row 1 (5 + 3 = 8); 2 -> row 2 (4 + 2 = 6)
  CHECK(batch.input_ids.sizes() == at::IntArrayRef({3, 8}));
  CHECK(batch.placement == std::vector<models::SampleSpan>{{1, 5, 3}, {0, 0, 7}, {2, 4, 2}, {1, 0, 5}, {2, 0, 4}});
  CHECK(batch.token_mask.sum().item<int64_t>() == 21);
  CHECK(batch.labels.eq(-100).sum().item<int64_t>() == 3);
  const auto parts = batch.unpack(batch.input_ids);
  for (size_t i = 0; i < seqs.size(); ++i) CHECK(at::equal(parts[i], seqs[i]));
  const auto trimmed = batch.unpack(batch.input_ids.narrow(1, 0, 7), 1);
  for (size_t i = 0; i < seqs.size(); ++i) CHECK(at::equal(trimmed[i], seqs[i].narrow(0, 0, seqs[i].size(0) - 1)));
  CHECK(at::equal(models::PackedSamples::from_position_ids(batch.position_ids, 3).cu_seqlens(),
                  batch.samples.cu_seqlens()));
  CHECK(batch.row_tokens == std::vector<int64_t>{7, 8, 6});
  const auto last = batch.row(2);  // 4 + 2 tokens, no tail padding
  CHECK(at::equal(last.input_ids, at::cat({seqs[4], seqs[2]}).unsqueeze(0)));
  CHECK(last.placement == std::vector<models::SampleSpan>{{0, 4, 2}, {0, 0, 4}});
  CHECK(last.samples.spans().size() == 2);
  CHECK(last.token_mask.all().item<bool>());
  // Rows of a length a multiple of 3 (a sequence group's slices): every row gets a tail of padding.
  const auto aligned = models::pack_sequences(seqs, {.token_budget = 8, .pad_to_multiple_of = 3});
  CHECK(aligned.input_ids.sizes() == at::IntArrayRef({3, 9}));
  CHECK(aligned.placement == batch.placement);
  CHECK(aligned.samples.spans().size() == 8);  // 5 sequences and 3 tails
  CHECK(aligned.labels.eq(-100).sum().item<int64_t>() == 6);

  CHECK_THAT(error_of([&] { models::pack_sequences(seqs, {.token_budget = 6}); }),
             Catch::Contains("sequence 1 holds 7 tokens, more than the token_budget of 6"));
  CHECK_THAT(error_of([] { models::pack_sequences({at::arange(3, at::kLong), at::empty({0}, at::kLong)}); }),
             Catch::Contains("sequence 1 is empty"));
  CHECK_THAT(error_of([] { models::pack_sequences({at::zeros({2, 2}, at::kLong)}); }),
             Catch::Contains("sequence 0 must be a 1-D int64"));
  CHECK_THAT(error_of([&] { models::pack_sequences(seqs, {.pad_to_multiple_of = 0}); }),
             Catch::Contains("pad_to_multiple_of must be positive, not 0"));
}

TEST_CASE("models: generate's bad options are errors naming the argument", "[hf][unit][generate][errors]") {
  models::CausalLM model(models::parse_decoder_config(llama_config(), "config.json"));
  const at::Tensor prompt = at::ones({2, 5}, at::kLong);
  const auto error = [&](models::GenerateOptions o, at::Tensor mask = {}) {
    return error_of([&] { model->generate(prompt, mask, o); });
  };
  const int64_t max_positions = model->config.max_position_embeddings;
  CHECK_THAT(error({.max_new_tokens = max_positions}),
             Catch::Contains("max_new_tokens = " + std::to_string(max_positions) +
                             " after a prompt of 5 tokens exceeds the model's max_position_embeddings"));
  CHECK_THAT(error({.max_new_tokens = -1}), Catch::Contains("max_new_tokens must be >= 0"));
  CHECK_THAT(error({.do_sample = true, .temperature = 0}), Catch::Contains("temperature must be finite and > 0"));
  CHECK_THAT(error({.do_sample = true, .top_k = -2}), Catch::Contains("top_k must be >= 0"));
  CHECK_THAT(error({.do_sample = true, .top_p = 1.5}), Catch::Contains("top_p must be in (0, 1]"));
  CHECK_THAT(error({}, at::ones({2, 4}, at::kLong)), Catch::Contains("attention_mask must be [batch, prompt]"));
  CHECK_THAT(error_of([&] { model->generate(at::ones({2, 5}, at::kInt)); }),
             Catch::Contains("input_ids must be int64"));
  at::Tensor right = at::ones({2, 5}, at::kLong);
  right[1][4] = 0;
  CHECK_THAT(error({}, right),
             Catch::Contains("the prompts must be left-padded (attention_mask's last column is 0 in row 1)"));
  CHECK_THAT(error({.eos_token_ids = {96}}), Catch::Contains("eos_token_ids holds 96 is outside the vocabulary of 96"));
  CHECK_THAT(error_of([&] { model->generate(at::full({1, 3}, 200, at::kLong)); }),
             Catch::Contains("outside the vocabulary"));
  // Greedy with and without the cache: the cache's tokens equal re-running the whole sequence each step.
  const auto out = model->generate(at::randint(1, 96, {2, 5}, at::kLong), {}, {.max_new_tokens = 6});
  at::Tensor seq = out.sequences.narrow(1, 0, 5);
  at::NoGradGuard no_grad;
  for (int step = 0; step < 6; ++step) {
    const at::Tensor next = model(seq).select(1, seq.size(1) - 1).argmax(-1, true);
    seq = at::cat({seq, next}, 1);
  }
  CHECK(at::equal(seq, out.sequences));
}

TEST_CASE("models: mixture-of-experts configs: the families' defaults, their layers, and bad fields named",
          "[hf][unit][moe][errors]") {
  Json q3 = {{"model_type", "qwen3_moe"}, {"architectures", {"Qwen3MoeForCausalLM"}},
             {"vocab_size", 96},          {"hidden_size", 64},
             {"num_hidden_layers", 4},    {"num_attention_heads", 4},
             {"num_key_value_heads", 2},  {"num_local_experts", 8},
             {"num_experts_per_tok", 2},  {"moe_intermediate_size", 32},
             {"decoder_sparse_step", 2},  {"mlp_only_layers", {3}}};
  const auto c = models::parse_decoder_config(q3, "config.json");
  CHECK(c.moe.num_experts == 8);  // transformers 5's spelling of Qwen3-MoE's count
  CHECK(c.sparse_layers == std::vector<bool>{false, true, false, false});  // (i + 1) % 2 == 0, but not layer 3
  CHECK(c.intermediate_size == 6144);                                      // the class's default, for the dense layers
  CHECK(c.head_dim == 16);                                                 // derived (not Qwen3's 128)
  CHECK(c.qk_norm);
  CHECK_FALSE(c.moe.norm_topk_prob);
  CHECK(c.moe.shared_expert_intermediate_size == 0);
  check_table(c);
  Json q2 = q3;
  q2["model_type"] = "qwen2_moe";
  q2["architectures"] = {"Qwen2MoeForCausalLM"};
  q2.erase("num_local_experts");
  q2["num_experts"] = 4;
  q2["shared_expert_intermediate_size"] = 40;
  q2["attention_bias"] = true;  // not read by Qwen2-MoE
  const auto c2 = models::parse_decoder_config(q2, "config.json");
  CHECK(c2.qkv_bias);
  CHECK_FALSE(c2.o_bias);
  CHECK_FALSE(c2.qk_norm);
  CHECK(c2.moe.shared_expert_intermediate_size == 40);
  check_table(c2);
  // The export's config reads back as the same model.
  const auto back = models::parse_decoder_config(models::to_hf_config(c2, at::kFloat), "exported");
  CHECK(back.sparse_layers == c2.sparse_layers);
  CHECK(back.moe.num_experts == 4);
  CHECK(back.moe.shared_expert_intermediate_size == 40);

  Json bad = q3;
  bad["num_experts_per_tok"] = 9;
  CHECK_THAT(config_error(bad), Catch::Contains("\"num_experts_per_tok\" is 9; it must be in [1, num_experts = 8]"));
  bad = q3;
  bad["mlp_only_layers"] = {7};
  CHECK_THAT(config_error(bad), Catch::Contains("\"mlp_only_layers\" names layer 7 of 4"));
  bad = q3;
  bad["decoder_sparse_step"] = 0;
  CHECK_THAT(config_error(bad), Catch::Contains("\"decoder_sparse_step\" is 0"));
  bad = q3;
  bad["use_sliding_window"] = true;
  CHECK_THAT(config_error(bad), Catch::Contains("\"use_sliding_window\" is true in a mixture of experts"));
  bad = q3;
  bad["num_local_experts"] = 100000;
  CHECK_THAT(config_error(bad), Catch::Contains("\"num_experts\" is 100000"));
  bad = q3;
  bad["num_local_experts"] = 4096;
  bad["num_hidden_layers"] = 64;
  bad["decoder_sparse_step"] = 1;
  bad["mlp_only_layers"] = Json::array();
  CHECK_THAT(config_error(bad),
             Catch::Contains("\"num_experts\" 4096 in each of 64 sparse layers makes 262144 experts"));
  Json defaults = q3;
  defaults.erase("num_key_value_heads");
  CHECK(models::parse_decoder_config(defaults, "config.json").num_key_value_heads == 4);  // Qwen3-MoE's class default
  bad = q3;
  bad["router_aux_loss_coef"] = -1;
  CHECK_THAT(config_error(bad), Catch::Contains("\"router_aux_loss_coef\" is -1"));
}

TEST_CASE("models: a mixture of experts whose config does not count the files' experts is refused, naming the field",
          "[hf][moe][errors]") {
  TempDir tmp;
  for (const char* name : {"qwen3_moe", "qwen3_moe_stacked"}) {
    INFO(name);
    const fs::path dir = plain_copy(tmp, name);
    Json config = fsdpx::detail::parse_json(fsdpx::detail::read_text(dir / "config.json"), "config");
    config["num_local_experts"] = 3;
    std::ofstream(dir / "config.json") << config.dump();
    const auto error = [&] {
      try {
        const auto c = models::read_decoder_config(dir);
        fsdpx::hf::SafetensorsDir files = models::open_model_files(c, dir);
        models::check_config_against_files(c, files, dir, /*strict=*/true);
      } catch (const fsdpx::Error& e) {
        return std::string(e.what());
      }
      FAIL("accepted");
      return std::string();
    }();
    CHECK_THAT(error, Catch::Contains("num_experts"));
  }
}

TEST_CASE("models: the experts as grouped products (at::_grouped_mm) equal one product per expert, with gradients",
          "[hf][moe]") {
  // The kernel a GPU uses in bfloat16, checked here in float32 on the CPU (ATen has it on both).
  for (const char* name : {"qwen3_moe", "qwen2_moe"}) {
    INFO(name);
    models::CausalLM model(models::read_decoder_config(fixtures() / name));
    REQUIRE(models::load_pretrained(model, fixtures() / name).ok());
    at::manual_seed(4);
    const at::Tensor ids = at::randint(1, 96, {3, 11}, at::kLong);
    const auto run = [&](models::ExpertKernel kernel) {
      for (auto& layer : model->model->layers) {
        if (layer->moe) layer->moe->kernel = kernel;
      }
      model->zero_grad();
      const at::Tensor logits = model(ids);
      model->loss(ids, ids).backward();
      std::map<std::string, at::Tensor> grads;
      for (const auto& p : model->named_parameters()) {
        grads[p.key()] = p.value().grad().defined() ? p.value().grad().clone() : at::zeros_like(p.value());
      }
      return std::pair{logits.detach(), grads};
    };
    const auto [logits, grads] = run(models::ExpertKernel::per_expert);
    const auto [grouped_logits, grouped_grads] = run(models::ExpertKernel::grouped);
    // The experts' products summed in another order (one grouped product): the logits, and along the
    // backward path every gradient (relative to its layer's: fsdpx::test::layer_of).
    const int64_t positions = ids.size(1);
    CHECK((grouped_logits - logits).abs().max().item<double>() / logits.abs().max().item<double>() <=
          fsdpx::test::logits_bound(model->config, positions));
    CHECK(fsdpx::test::max_gradient_error(grouped_grads, grads) <=
          fsdpx::test::gradient_bound(model->config, positions, ids.size(0) * (positions - 1)));
  }
  // Sizes the grouped product cannot take are an error naming them when asked for.
  Json c = {{"model_type", "qwen3_moe"}, {"vocab_size", 96},         {"hidden_size", 30},
            {"num_hidden_layers", 1},    {"num_attention_heads", 3}, {"num_key_value_heads", 3},
            {"num_experts", 4},          {"num_experts_per_tok", 2}, {"moe_intermediate_size", 6}};
  models::CausalLM odd(models::parse_decoder_config(c, "config.json"));
  odd->model->layers[0]->moe->kernel = models::ExpertKernel::grouped;
  CHECK_THAT(error_of([&] { odd(at::ones({1, 4}, at::kLong)); }),
             Catch::Contains("ExpertKernel::grouped needs the hidden size (30)"));
}

TEST_CASE(
    "models: a label or target outside the vocabulary is refused by loss and log_probs, whose checks are asked "
    "before the layers run",
    "[hf][unit][errors]") {
  at::manual_seed(7);
  models::CausalLM model(models::parse_decoder_config(llama_config(), "config.json"));
  const int64_t vocab = model->config.vocab_size;
  const at::Tensor ids = at::randint(1, vocab, {2, 6}, at::kLong);
  at::NoGradGuard no_grad;
  CHECK(model->loss(ids, ids.masked_fill(ids.eq(ids[0][3]), -100)).isfinite().item<bool>());  // -100: ignored
  const std::string range = "in [0, " + std::to_string(vocab) + ")";
  CHECK_THAT(error_of([&] { model->loss(ids, ids.index_put({at::tensor(1), at::tensor(4)}, at::tensor(vocab))); }),
             Catch::Contains("every label must be a token id " + range + " or the ignore index -100"));
  CHECK_THAT(
      error_of([&] { model->loss(ids, ids.index_put({at::tensor(0), at::tensor(2)}, at::tensor(int64_t{-3}))); }),
      Catch::Contains("every label must be a token id " + range));
  // log_probs' targets are its input ids: one outside the vocabulary fails in the embedding first.
  CHECK_THROWS_WITH(model->log_probs(ids.index_put({at::tensor(1), at::tensor(5)}, at::tensor(vocab + 2))),
                    Catch::Contains("index out of range"));
  // The check itself: with and without an ignore index, and only for the vocabulary it was asked for.
  CHECK(models::LabelCheck(ids, vocab).passed());
  CHECK_FALSE(models::LabelCheck(ids.masked_fill(ids.eq(ids[0][0]), -100), vocab).passed());
  CHECK(models::LabelCheck(ids.masked_fill(ids.eq(ids[0][0]), -100), vocab, -100).passed());
  CHECK_FALSE(models::LabelCheck(ids, ids.max().item<int64_t>()).passed());
  const models::CrossEntropyOptions other{.labels_checked = std::make_shared<const models::LabelCheck>(ids, vocab + 1)};
  CHECK_THAT(error_of([&] { models::linear_cross_entropy(at::randn({2, 6, 8}), at::randn({vocab, 8}), ids, other); }),
             Catch::Contains("a label check asked for a vocabulary of " + std::to_string(vocab + 1) +
                             " was given to a head of " + std::to_string(vocab)));
  // ... and only for the labels it was asked for (as many, the same ignore index).
  const models::CrossEntropyOptions fewer{
      .labels_checked = std::make_shared<const models::LabelCheck>(ids.narrow(1, 0, 3), vocab, int64_t{-100})};
  CHECK_THAT(error_of([&] { models::linear_cross_entropy(at::randn({2, 6, 8}), at::randn({vocab, 8}), ids, fewer); }),
             Catch::Contains("a label check of 6 labels was given to a head of 12"));
}
