// Hugging Face model folders in and out of fsdpx's decoder, sharded or not, with no Python:
//
//   using Sharded = fsdpx::Fsdp<models::CausalLM, FullShard, NoOffload, BF16Mixed, ShardedStateDict,
//                               WrapModules<models::DecoderLayerImpl>>;
//   auto model = models::from_pretrained<Sharded>(dir, world);     // deferred: no rank holds the model
//   ... train ...
//   models::save_pretrained(model, out_dir, {.source_dir = dir});  // collective; rank 0 writes
//
// Loading reads config.json, then each rank reads from the safetensors files exactly the byte ranges
// of its own shards (checkpoint/model_safetensors.hpp) and casts them into its float32 masters.
// Saving gathers one unit at a time and rank 0 writes safetensors with transformers' names, config.json
// (the source's, with the dtype written) and the source folder's tokenizer and generation files, so
// transformers' from_pretrained loads the folder as it is.
#pragma once

#include <algorithm>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include <fsdpx/hf/model_folder.hpp>
#include <fsdpx/hf/model_safetensors.hpp>
#include <fsdpx/hf/safetensors.hpp>
#include <fsdpx/checkpoint/names.hpp>
#include <fsdpx/core/deferred_init.hpp>
#include <fsdpx/core/fsdp.hpp>
#include <fsdpx/dist/outcome.hpp>
#include <fsdpx/models/config.hpp>
#include <fsdpx/models/decoder.hpp>

namespace fsdpx::models {

namespace fs = std::filesystem;

// ---- the family's name table ---------------------------------------------------------------------------

/// One tensor of a Hugging Face checkpoint of the Llama family: its name in the files, the name of the
/// CausalLM tensor it fills, and its shape.
struct HfTensor {
  std::string hf_name;
  std::string module_name;
  std::vector<int64_t> shape;
};

/// The declared name table of the Llama family (llama, qwen2, qwen3, qwen2_moe, qwen3_moe): every tensor
/// a config implies. A mixture of experts' experts are named as the hub's files name them, one tensor
/// per expert and projection (transformers 5 holds them stacked in memory and writes them so).
/// fsdpx's modules are named as transformers names them, so the two names agree; a family whose
/// module names differ declares its pairs here, and loading, saving and merging follow it.
inline std::vector<HfTensor> hf_tensors(const DecoderConfig& c) {
  std::vector<HfTensor> out;
  const auto add = [&](const std::string& name, std::vector<int64_t> shape) {
    out.push_back({name, name, std::move(shape)});
  };
  const int64_t h = c.hidden_size, q = c.num_attention_heads * c.head_dim, kv = c.num_key_value_heads * c.head_dim,
                m = c.intermediate_size;
  add("model.embed_tokens.weight", {c.vocab_size, h});
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string l = "model.layers." + std::to_string(i) + ".";
    add(l + "input_layernorm.weight", {h});
    for (const auto& [proj, rows] : {std::pair{"q_proj", q}, {"k_proj", kv}, {"v_proj", kv}}) {
      add(l + "self_attn." + proj + ".weight", {rows, h});
      if (c.qkv_bias) add(l + "self_attn." + proj + ".bias", {rows});
    }
    add(l + "self_attn.o_proj.weight", {h, q});
    if (c.o_bias) add(l + "self_attn.o_proj.bias", {h});
    if (c.qk_norm) {
      add(l + "self_attn.q_norm.weight", {c.head_dim});
      add(l + "self_attn.k_norm.weight", {c.head_dim});
    }
    add(l + "post_attention_layernorm.weight", {h});
    const auto mlp = [&](const std::string& prefix, int64_t inner, bool bias) {
      for (const auto& [proj, shape] : {std::pair{"gate_proj", std::vector<int64_t>{inner, h}},
                                        {"up_proj", {inner, h}},
                                        {"down_proj", {h, inner}}}) {
        add(prefix + proj + ".weight", shape);
        if (bias) add(prefix + proj + ".bias", {shape[0]});
      }
    };
    if (!c.is_sparse(i)) {
      mlp(l + "mlp.", m, c.mlp_bias);
      continue;
    }
    add(l + "mlp.gate.weight", {c.moe.num_experts, h});
    for (int64_t e = 0; e < c.moe.num_experts; ++e)
      mlp(l + "mlp.experts." + std::to_string(e) + ".", c.moe.moe_intermediate_size, false);
    if (c.moe.shared_expert_intermediate_size > 0) {
      mlp(l + "mlp.shared_expert.", c.moe.shared_expert_intermediate_size, false);
      add(l + "mlp.shared_expert_gate.weight", {1, h});
    }
  }
  add("model.norm.weight", {h});
  if (!c.tie_word_embeddings) add("lm_head.weight", {c.vocab_size, h});
  return out;
}

/// Tensors of a checkpoint that transformers' classes of this family ignore when loading: the rotary
/// caches older versions saved, and the head of a tied model (the embedding is used instead).
inline bool ignored_on_load(const std::string& hf_name, const DecoderConfig& c) {
  const std::string rotary = ".self_attn.rotary_emb.inv_freq";
  if (hf_name.size() > rotary.size() && hf_name.compare(hf_name.size() - rotary.size(), rotary.size(), rotary) == 0)
    return true;
  return c.tie_word_embeddings && hf_name == "lm_head.weight";
}

/// Where an expert's projection (the hub's per-expert name, "model.layers.L.mlp.experts.E.gate_proj.weight")
/// lies in transformers 5's stacked experts of its layer: "mlp.experts.gate_up_proj" [experts, 2 x
/// moe_intermediate, hidden] (each expert's gate rows, then its up rows) or "mlp.experts.down_proj" [experts,
/// hidden, moe_intermediate]; each projection is a contiguous run of those. nullopt for any other name.
inline std::optional<Placement> stacked_expert_place(const DecoderConfig& c, const std::string& name) {
  const int64_t h = c.hidden_size, inner = c.moe.moe_intermediate_size, experts = c.moe.num_experts;
  if (experts <= 0 || !name.starts_with("model.layers.")) return std::nullopt;
  const std::string marker = ".mlp.experts.";
  const size_t at = name.find(marker);
  if (at == std::string::npos) return std::nullopt;
  const std::string layer = name.substr(0, at + marker.size());  // "model.layers.L.mlp.experts."
  const std::string rest = name.substr(layer.size());            // "E.gate_proj.weight"
  const size_t dot = rest.find('.');
  if (dot == 0 || dot == std::string::npos || rest.find_first_not_of("0123456789") != dot || dot > 9)
    return std::nullopt;
  const int64_t e = std::stoll(rest.substr(0, dot));
  const std::string proj = rest.substr(dot + 1);
  if (e >= experts) return std::nullopt;
  if (proj == "gate_proj.weight") return Placement{layer + "gate_up_proj", {experts, 2 * inner, h}, e * 2 * inner * h};
  if (proj == "up_proj.weight")
    return Placement{layer + "gate_up_proj", {experts, 2 * inner, h}, (e * 2 + 1) * inner * h};
  if (proj == "down_proj.weight") return Placement{layer + "down_proj", {experts, h, inner}, e * h * inner};
  return std::nullopt;
}

/// A decoder's PyTorch Distributed Checkpoint named as torch names the transformers model's state dict
/// (fsdpx's names are transformers' own): a tied head's weight is saved under "lm_head.weight" too, as
/// get_model_state_dict lists a tied weight under each of its names, so FSDP2 and plain transformers
/// models load it strictly; its optimizer state, as torch's, under the embedding's name only. A mixture's
/// experts are saved stacked, as transformers 5 holds them in memory (stacked_expert_place), unless
/// `stacked_experts` is false (transformers 4's per-expert modules, the hub's names).
inline SaveNames dcp_save_options(const DecoderConfig& c, bool stacked_experts = true) {
  SaveNames o;
  if (c.tie_word_embeddings) {
    o.also_saved_as = [](const std::string& name) {
      return name == "model.embed_tokens.weight" ? std::vector<std::string>{"lm_head.weight"}
                                                 : std::vector<std::string>{};
    };
  }
  if (stacked_experts && c.moe.num_experts > 0)
    o.placed_in = [c](const std::string& name) { return stacked_expert_place(c, name); };
  return o;
}

/// Loading a decoder from a DCP checkpoint (under `prefix`: "model." for dcp.save({"model": ...})): what
/// transformers ignores (ignored_on_load: a tied head's copy, rotary caches) is not reported as unexpected,
/// and a mixture's experts are read from transformers 5's stacked tensors where the checkpoint has them (else
/// from the hub's per-expert ones).
inline LoadNames dcp_load_options(const DecoderConfig& c, std::string prefix = {}) {
  LoadNames o;
  o.prefix = std::move(prefix);
  o.ignore = [c](const std::string& name) { return ignored_on_load(name, c); };
  if (c.moe.num_experts > 0) o.placed_in = [c](const std::string& name) { return stacked_expert_place(c, name); };
  return o;
}

/// A mixture of experts saved with transformers' in-memory layout (save_pretrained(...,
/// save_original_format=False)): each sparse layer's experts stacked in "mlp.experts.gate_up_proj"
/// [experts, 2 x moe_intermediate, hidden] (each expert's gate rows, then its up rows) and
/// "mlp.experts.down_proj" [experts, hidden, moe_intermediate]. Each expert's projection is a
/// contiguous run of those, so it is read as a view of its own under the hub's per-expert name.
/// Files in the hub's layout are left as they are.
inline void view_stacked_experts(const DecoderConfig& c, fsdpx::hf::SafetensorsDir& files, const fs::path& dir) {
  const int64_t h = c.hidden_size, inner = c.moe.moe_intermediate_size, experts = c.moe.num_experts;
  const std::string doc = (dir / "config.json").string();
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string l = "model.layers." + std::to_string(i) + ".mlp.experts.";
    const fsdpx::hf::SafetensorsEntry* gate_up = files.find(l + "gate_up_proj");
    const fsdpx::hf::SafetensorsEntry* down = files.find(l + "down_proj");
    if (gate_up == nullptr && down == nullptr) continue;
    FSDPX_CHECK_AS(ConfigError, c.is_sparse(i), "'", dir.string(), "' holds stacked experts for layer ", i, ", which '",
                   doc, "' makes a dense layer (num_experts, decoder_sparse_step, mlp_only_layers)");
    FSDPX_CHECK_AS(ConfigError, gate_up != nullptr && down != nullptr, "'", dir.string(), "' holds only one of ", l,
                   "gate_up_proj and ", l, "down_proj");
    FSDPX_CHECK_AS(ConfigError,
                   gate_up->shape == std::vector<int64_t>({experts, 2 * inner, h}) &&
                       down->shape == std::vector<int64_t>({experts, h, inner}),
                   "'", doc, "' (\"num_experts\" ", experts, ", \"moe_intermediate_size\" ", inner,
                   ", \"hidden_size\" ", h, ") does not describe the stacked experts of layer ", i, " in '",
                   dir.string(), "': gate_up_proj ", c10::IntArrayRef(gate_up->shape), ", down_proj ",
                   c10::IntArrayRef(down->shape));
    for (int64_t e = 0; e < experts; ++e) {
      for (const auto& [proj, shape] : {std::pair{"gate_proj.weight", std::vector<int64_t>{inner, h}},
                                        std::pair{"up_proj.weight", std::vector<int64_t>{inner, h}},
                                        std::pair{"down_proj.weight", std::vector<int64_t>{h, inner}}}) {
        const std::string name = l + std::to_string(e) + "." + proj;
        const auto at = stacked_expert_place(c, name);
        files.add_view(name, at->fqn, at->offset, shape);
      }
    }
  }
}

/// The folder's safetensors files as `c`'s name table reads them.
inline fsdpx::hf::SafetensorsDir open_model_files(const DecoderConfig& c, const fs::path& dir) {
  fsdpx::hf::SafetensorsDir files(dir);
  if (c.is_moe()) view_stacked_experts(c, files, dir);
  return files;
}

/// Module name -> file name through the table (names outside the table keep their own).
class HfNameMap {
 public:
  explicit HfNameMap(const DecoderConfig& c) {
    for (auto& t : hf_tensors(c)) to_hf_.emplace(t.module_name, t.hf_name);
  }
  std::string operator()(const std::string& module_name) const {
    const auto it = to_hf_.find(module_name);
    return it == to_hf_.end() ? module_name : it->second;
  }

 private:
  std::unordered_map<std::string, std::string> to_hf_;
};

// ---- loading -------------------------------------------------------------------------------------------

struct LoadPretrainedOptions {
  /// Missing, unexpected or mismatched tensors are one error naming them all (nothing is loaded).
  /// Not strict: they are returned in the report and the rest is loaded.
  bool strict = true;
};

namespace detail {

inline SafetensorsLoadOptions load_options(const DecoderConfig& c, const LoadPretrainedOptions& o) {
  HfNameMap names(c);
  return {.strict = o.strict,
          .file_name = [names](const std::string& n) { return std::optional<std::string>(names(n)); },
          .ignore = [c](const std::string& n) { return ignored_on_load(n, c); }};
}

inline std::vector<int64_t> sparse_indices(const DecoderConfig& c) {
  std::vector<int64_t> out;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    if (c.is_sparse(i)) out.push_back(i);
  }
  return out;
}

/// The folder's config must describe the model it is loaded into (same shapes and switches).
inline void check_same_architecture(const DecoderConfig& model, const DecoderConfig& files, const fs::path& dir) {
  std::vector<std::string> diff;
  const auto same = [&](const char* name, const auto& a, const auto& b) {
    if (a != b) diff.push_back(::fsdpx::detail::str(name, " ", a, " in the model, ", b, " in the folder"));
  };
  same("model_type", model.model_type, files.model_type);
  same("num_hidden_layers", model.num_hidden_layers, files.num_hidden_layers);
  same("hidden_size", model.hidden_size, files.hidden_size);
  same("num_attention_heads", model.num_attention_heads, files.num_attention_heads);
  same("num_key_value_heads", model.num_key_value_heads, files.num_key_value_heads);
  same("head_dim", model.head_dim, files.head_dim);
  same("tie_word_embeddings", model.tie_word_embeddings, files.tie_word_embeddings);
  same("num_experts", model.moe.num_experts, files.moe.num_experts);
  same("moe_intermediate_size", model.moe.moe_intermediate_size, files.moe.moe_intermediate_size);
  same("sparse layers", ::fsdpx::detail::str(c10::IntArrayRef(sparse_indices(model))),
       ::fsdpx::detail::str(c10::IntArrayRef(sparse_indices(files))));
  if (diff.empty()) return;
  std::string msg;
  for (const auto& d : diff) msg += "\n  " + d;
  throw ConfigError(::fsdpx::detail::str("fsdpx: the model folder '", dir.string(),
                                         "' holds another architecture than the "
                                         "model it is loaded into:",
                                         msg));
}

}  // namespace detail

/// Before anything is built from `c` (a folder's config.json, untrusted): the layers and the tensors it
/// implies against those the folder's files declare, so a config that does not describe its weights
/// (10^6 layers, a vocabulary of 2^31) is an error naming its field, not an allocation of what it says.
/// Strict, every tensor of the name table must be in the files with its shape; not strict, the layer
/// count and the shapes of the tensors that are there.
inline void check_config_against_files(const DecoderConfig& c, const fsdpx::hf::SafetensorsDir& files,
                                       const fs::path& dir, bool strict) {
  const std::string doc = (dir / "config.json").string();
  // One pass over the files' names: 1 + the highest layer index of a "model.layers.<i>." tensor, and per
  // layer 1 + the highest expert index of a "model.layers.<i>.mlp.experts.<e>." tensor.
  const auto index_at = [](const std::string& name, size_t from) -> std::optional<int64_t> {
    const size_t end = name.find('.', from);
    const std::string index = name.substr(from, end == std::string::npos ? std::string::npos : end - from);
    if (index.empty() || index.size() > 9 || index.find_first_not_of("0123456789") != std::string::npos)
      return std::nullopt;
    return std::stoll(index);
  };
  const std::string prefix = "model.layers.", experts_infix = ".mlp.experts.";
  int64_t layers = 0;
  std::map<int64_t, int64_t> experts_in_files;
  for (const std::string& name : files.names()) {
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    const auto layer = index_at(name, prefix.size());
    if (!layer) continue;
    layers = std::max<int64_t>(layers, *layer + 1);
    const size_t at = name.find('.', prefix.size());  // index_at found the index's end there
    if (name.compare(at, experts_infix.size(), experts_infix) != 0) continue;
    if (const auto expert = index_at(name, at + experts_infix.size())) {
      experts_in_files[*layer] = std::max(experts_in_files[*layer], *expert + 1);
    }
  }
  FSDPX_CHECK_AS(ConfigError, layers == 0 ? !strict : layers == c.num_hidden_layers, "'", doc,
                 "': \"num_hidden_layers\" is ", c.num_hidden_layers, " but the weight files in '", dir.string(),
                 "' hold ", layers, " layers");
  // A mixture of experts: the files' experts per layer against num_experts (more would be unexpected
  // tensors, fewer missing ones; say which field).
  for (int64_t i = 0; i < c.num_hidden_layers && c.is_moe(); ++i) {
    const auto it = experts_in_files.find(i);
    const int64_t count = it == experts_in_files.end() ? 0 : it->second;
    const int64_t want = c.is_sparse(i) ? c.moe.num_experts : 0;
    FSDPX_CHECK_AS(ConfigError, count == want || (count == 0 && !strict), "'", doc, "': layer ", i, " has ", want,
                   " experts by \"num_experts\" (", c.moe.num_experts,
                   "), \"decoder_sparse_step\" and \"mlp_only_layers\", "
                   "but the weight files in '",
                   dir.string(), "' hold ", count);
  }
  std::vector<std::string> missing, mismatched;
  for (const HfTensor& t : hf_tensors(c)) {
    const fsdpx::hf::SafetensorsEntry* e = files.find(t.hf_name);
    if (e == nullptr) {
      if (strict) missing.push_back(t.hf_name);
    } else if (e->shape != t.shape) {
      mismatched.push_back(::fsdpx::detail::str(t.hf_name, ": ", c10::IntArrayRef(e->shape), " in the files, ",
                                                c10::IntArrayRef(t.shape), " by config.json"));
    }
  }
  if (missing.empty() && mismatched.empty()) return;
  std::string msg;
  if (!mismatched.empty())
    msg +=
        "\n  shapes that differ (vocab_size, hidden_size, intermediate_size, moe_intermediate_size, heads or "
        "head_dim): " +
        ::fsdpx::detail::join_names(mismatched);
  if (!missing.empty()) msg += "\n  tensors it implies that the files lack: " + ::fsdpx::detail::join_names(missing);
  throw ConfigError(
      ::fsdpx::detail::str("fsdpx: '", doc, "' does not describe the weights in '", dir.string(), "':", msg));
}

/// An Fsdp<CausalLM, ...>.
template <class T>
concept ShardedCausalLM = requires { typename T::ModelType; } && std::is_same_v<typename T::ModelType, CausalLM>;

namespace detail {
/// The folder's weights into a model whose config is the folder's (its config.json read once, by the
/// caller).
template <class Sharded>
SafetensorsLoadReport load_weights(Sharded& model, fsdpx::hf::SafetensorsDir& files,
                                   const LoadPretrainedOptions& options) {
  return load_model_safetensors(model.sharded(), files, load_options(model->config, options));
}
}  // namespace detail

/// Loads the weights of the Hugging Face folder `dir` into a sharded CausalLM: each rank reads the byte
/// ranges of its own shards. Every rank calls it; it is not collective.
template <class Sharded>
  requires ShardedCausalLM<Sharded>
SafetensorsLoadReport load_pretrained(Sharded& model, const fs::path& dir, const LoadPretrainedOptions& options = {}) {
  detail::check_same_architecture(model->config, read_decoder_config(dir), dir);
  fsdpx::hf::SafetensorsDir files = open_model_files(model->config, dir);
  return detail::load_weights(model, files, options);
}

/// Loads the weights of the Hugging Face folder `dir` into a CausalLM that is not sharded.
inline SafetensorsLoadReport load_pretrained(CausalLM& model, const fs::path& dir,
                                             const LoadPretrainedOptions& options = {}) {
  detail::check_same_architecture(model->config, read_decoder_config(dir), dir);
  fsdpx::hf::SafetensorsDir files = open_model_files(model->config, dir);
  return load_model_safetensors(*model, files, detail::load_options(model->config, options));
}

/// A sharded CausalLM with the weights of the Hugging Face folder `dir`: built with deferred_init (no
/// rank ever holds the whole model), sharded over `world`, then loaded (each rank its own byte ranges).
/// Collective: every rank calls it. Strict, units are left uninitialized before the load (every
/// value is loaded); not strict, tensors the folder lacks keep transformers' random initialization.
template <class Sharded>
  requires ShardedCausalLM<Sharded>
Sharded from_pretrained(const fs::path& dir, dist::AnyCommunicator world, FsdpOptions options = {},
                        const LoadPretrainedOptions& load = {}, SafetensorsLoadReport* report = nullptr) {
  // config.json and the files' headers are read, and checked against each other, before anything is
  // built; every rank learns whether any failed (a flaky mount may fail one) before the first collective.
  DecoderConfig config;
  std::optional<fsdpx::hf::SafetensorsDir> files;
  dist::agree_on_outcome<IoError>(world, dist::capture_failure([&] {
                                    config = read_decoder_config(dir);
                                    files.emplace(open_model_files(config, dir));
                                    check_config_against_files(config, *files, dir, load.strict);
                                  }),
                                  "reading '" + dir.string() + "'");
  if (!options.init_module) options.init_module = load.strict ? ModuleInit(skip_init) : init_module(config);
  Sharded model(deferred_init<CausalLM>(config), std::move(world), std::move(options));
  SafetensorsLoadReport r;
  // A rank whose read fails (the same files fail alike everywhere; a flaky mount may not) must not
  // leave the others waiting in the first gather of training.
  // The model was built from this folder's config.json: the weights are read without reading it again.
  dist::agree_on_outcome<IoError>(model.sharded().mesh().world(),
                                  dist::capture_failure([&] { r = detail::load_weights(model, *files, load); }),
                                  "loading '" + dir.string() + "'");
  if (report != nullptr) *report = r;
  return model;
}

// ---- saving --------------------------------------------------------------------------------------------

struct SavePretrainedOptions {
  /// The folder the model came from: its tokenizer, generation and other non-weight files are copied
  /// (config.json is written from the model's config). Empty: none are copied.
  fs::path source_dir;
  /// The dtype of the weights written; default: the dtype the model was saved in (config "dtype").
  std::optional<at::ScalarType> dtype;
  /// Bytes per safetensors file before another is started (save_pretrained's "5GB").
  int64_t max_shard_bytes = 5'000'000'000;
};

namespace detail {

inline SafetensorsSaveOptions save_options(const DecoderConfig& c, at::ScalarType dtype,
                                           const SavePretrainedOptions& o) {
  HfNameMap names(c);
  return {.files = {.max_shard_bytes = o.max_shard_bytes, .metadata = {}, .name = "model"},
          .dtype = dtype,
          .file_name = [names](const std::string& n) { return std::optional<std::string>(names(n)); },
          .buffers = true};
}

/// config.json and the source folder's other files, after the weights.
inline void write_folder_files(const ::fsdpx::detail::Json& config, const fs::path& out,
                               const SavePretrainedOptions& o) {
  fsdpx::detail::write_text_durably(out / "config.json", config.dump(2) + "\n");
  if (!o.source_dir.empty()) {
    fsdpx::hf::copy_model_files(
        o.source_dir, out, {.follow_symlinks = true, .skip = [](const std::string& n) { return n == "config.json"; }});
  }
}

}  // namespace detail

/// Writes a sharded CausalLM as a Hugging Face folder `out`: safetensors with transformers' names
/// (an index above max_shard_bytes), config.json, and the source folder's tokenizer and generation
/// files. Collective: one unit is gathered at a time and world rank 0 writes; a failure there (a full
/// disk) is an error on every rank.
template <class Sharded>
  requires ShardedCausalLM<Sharded>
fsdpx::hf::SavedSafetensors save_pretrained(Sharded& model, const fs::path& out,
                                            const SavePretrainedOptions& options = {}) {
  const DecoderConfig& config = model->config;
  const at::ScalarType dtype = options.dtype.value_or(config.dtype);
  const ::fsdpx::detail::Json hf_config =
      to_hf_config(config, dtype);  // refuses what transformers cannot express, before any write
  const auto saved = save_model_safetensors(model.sharded(), out, detail::save_options(config, dtype, options));
  auto& world = model.sharded().mesh().world();
  std::exception_ptr failure;
  if (world.rank() == 0) failure = dist::capture_failure([&] { detail::write_folder_files(hf_config, out, options); });
  dist::agree_on_outcome<IoError>(world, failure, "writing the model folder '" + out.string() + "'");
  return saved;
}

/// Writes a CausalLM that is not sharded as a Hugging Face folder `out`.
inline fsdpx::hf::SavedSafetensors save_pretrained(CausalLM& model, const fs::path& out,
                                                   const SavePretrainedOptions& options = {}) {
  const at::ScalarType dtype = options.dtype.value_or(model->config.dtype);
  const ::fsdpx::detail::Json hf_config = to_hf_config(model->config, dtype);
  const auto saved = save_model_safetensors(*model, out, detail::save_options(model->config, dtype, options));
  detail::write_folder_files(hf_config, out, options);
  return saved;
}

// ---- merged checkpoints --------------------------------------------------------------------------------

/// For a merge (fsdpx-merge): the tensors of a checkpoint renamed to the names its config.json implies,
/// or, when they are not exactly the tensors that config describes (names and shapes), nullopt and a
/// sentence in `why`: the config must then not be written beside them, since transformers would load
/// random weights in place of every tensor it does not find. `config_json` is config.json's text.
inline std::optional<fsdpx::hf::NamedTensors> rename_for_config(fsdpx::hf::NamedTensors tensors,
                                                                const std::string& config_json, const std::string& doc,
                                                                std::string& why) {
  DecoderConfig c;
  try {
    c = parse_decoder_config(::fsdpx::detail::parse_json(config_json, doc), doc);
  } catch (const Error& e) {
    why = e.what();
    return std::nullopt;
  }
  std::map<std::string, const HfTensor*> expected;
  const auto table = hf_tensors(c);
  for (const auto& t : table) expected.emplace(t.module_name, &t);
  std::vector<std::string> problems;
  std::set<std::string> seen;
  for (auto& [name, t] : tensors) {
    const auto it = expected.find(name);
    if (it == expected.end()) {
      problems.push_back("'" + name + "' is not a tensor of this config");
      continue;
    }
    seen.insert(name);
    if (t.sizes() != c10::IntArrayRef(it->second->shape)) {
      problems.push_back(::fsdpx::detail::str("'", name, "' has shape ", t.sizes(), ", the config implies ",
                                              c10::IntArrayRef(it->second->shape)));
    }
    name = it->second->hf_name;
  }
  for (const auto& t : table) {
    if (seen.count(t.module_name) == 0) problems.push_back("'" + t.module_name + "' is missing");
  }
  if (problems.empty()) return tensors;
  why = ::fsdpx::detail::str("the checkpoint's tensors are not those of its config.json (model_type \"", c.model_type,
                             "\"): ", ::fsdpx::detail::join_names(problems));
  return std::nullopt;
}

}  // namespace fsdpx::models
