// The configuration of a decoder-only causal language model of the Llama family, read from a Hugging
// Face config.json: Llama ("llama"), Qwen2 ("qwen2"), Qwen3 ("qwen3") and their mixtures of experts
// ("qwen2_moe", "qwen3_moe"). They share one architecture and differ in switches this struct names:
// biases, per-head q/k norms, RoPE scaling, sliding-window layers, a tied head, and which layers route
// each token to a few of many experts (MoeConfig). A field that changes the math and that this
// implementation does not reproduce (another model_type, activation, RoPE type, quantization, ...) is an
// error naming it, never a silently different model; absent fields take the family's class defaults.
// model_families holds one row per family: how its transformers class reads config.json into these
// switches, and its defaults. Adding a family is a row plus the module code its math needs
// (docs/models.md, "Adding a family").
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <c10/core/ScalarType.h>

#include <fsdpx/detail/file_io.hpp>
#include <fsdpx/detail/json.hpp>
#include <fsdpx/error.hpp>
#include <fsdpx/policies/dtype_names.hpp>

namespace fsdpx::models {

/// Rotary position embedding: the inverse frequencies of transformers' RoPE types "default",
/// "linear" and "llama3" (Llama 3.1's frequency-dependent scaling).
struct RopeConfig {
  std::string type = "default";
  double theta = 10000.0;
  double factor = 1.0;                              // linear, llama3
  double low_freq_factor = 1.0;                     // llama3
  double high_freq_factor = 4.0;                    // llama3
  int64_t original_max_position_embeddings = 8192;  // llama3
};

/// The sparse layers of a mixture of experts (Qwen2-MoE, Qwen3-MoE): a router (a linear map to one logit
/// per expert), softmax in float32, the top num_experts_per_tok experts of each token, their weights
/// renormalized to sum 1 when norm_topk_prob, and each chosen expert a SwiGLU MLP of
/// moe_intermediate_size; Qwen2-MoE adds a shared expert on every token, gated by a sigmoid.
struct MoeConfig {
  int64_t num_experts = 0;  // 0: no sparse layers
  int64_t num_experts_per_tok = 1;
  int64_t moe_intermediate_size = 0;
  int64_t shared_expert_intermediate_size = 0;  // 0: no shared expert (Qwen3-MoE)
  bool norm_topk_prob = false;
  double router_aux_loss_coef = 0.001;
  /// transformers adds router_aux_loss_coef x the load-balancing loss to the loss only when this is set.
  bool output_router_logits = false;
};

struct DecoderConfig {
  std::string model_type = "llama";  // "llama", "qwen2", "qwen3", "qwen2_moe" or "qwen3_moe"
  int64_t vocab_size = 32000;
  int64_t hidden_size = 4096;
  int64_t intermediate_size = 11008;
  int64_t num_hidden_layers = 32;
  int64_t num_attention_heads = 32;
  int64_t num_key_value_heads = 32;  // grouped-query attention when fewer than the heads
  int64_t head_dim = 128;
  double rms_norm_eps = 1e-6;
  RopeConfig rope;
  int64_t max_position_embeddings = 2048;
  bool qkv_bias = false;  // biases on q_proj, k_proj, v_proj (Qwen2: always)
  bool o_bias = false;    // a bias on o_proj (Llama and Qwen3: attention_bias)
  bool mlp_bias = false;  // biases on gate_proj, up_proj, down_proj (Llama: mlp_bias)
  bool qk_norm = false;   // Qwen3: RMSNorm over each head of q and k, before RoPE
  bool tie_word_embeddings = false;
  std::optional<int64_t> pad_token_id;  // the embedding row that gets no gradient
  double attention_dropout = 0.0;       // applied in training mode only
  /// Per layer: attends within the last `sliding_window` positions only (Qwen2/Qwen3 layer_types).
  std::vector<bool> sliding_layers;
  int64_t sliding_window = 0;
  MoeConfig moe;
  /// Per layer: a sparse (mixture-of-experts) MLP instead of the dense one (decoder_sparse_step,
  /// mlp_only_layers).
  std::vector<bool> sparse_layers;
  double initializer_range = 0.02;  // std of the normal initialization of new weights
  /// The dtype the weights were saved in ("dtype" / "torch_dtype"): what an export writes by default.
  c10::ScalarType dtype = c10::kFloat;
  /// config.json as read, written back by an export (with "dtype" updated); empty when built by hand.
  ::fsdpx::detail::Json source;

  int64_t kv_groups() const { return num_attention_heads / num_key_value_heads; }
  bool is_sliding(int64_t layer) const {
    return layer < static_cast<int64_t>(sliding_layers.size()) && sliding_layers[static_cast<size_t>(layer)];
  }
  bool is_sparse(int64_t layer) const {
    return layer < static_cast<int64_t>(sparse_layers.size()) && sparse_layers[static_cast<size_t>(layer)];
  }
  /// Whether the family has sparse layers (its row in model_families says so).
  bool is_moe() const;
};

/// One family of decoders: how its transformers config class reads config.json into DecoderConfig's
/// switches, and its defaults for absent fields. A row of model_families.
struct ModelFamily {
  /// Where the attention projections' biases come from.
  enum class Biases {
    attention_bias,  // "attention_bias" sets q, k, v and o_proj's (Llama, Qwen3)
    qkv_always,      // q, k and v have biases and o_proj none, always (Qwen2)
    qkv_bias,        // "qkv_bias" (default true) sets q, k and v's; o_proj has none (Qwen2-MoE)
  };
  std::string_view model_type;
  std::string_view architecture;  // config.json "architectures": what the class is called, and what an export writes
  std::string_view name;          // the family as errors name it
  Biases biases = Biases::attention_bias;
  bool mlp_bias = false;         // reads "mlp_bias" (Llama)
  bool qk_norm = false;          // RMSNorm over each head of q and k before RoPE (Qwen3)
  bool sliding_windows = false;  // reads use_sliding_window, sliding_window, layer_types, max_window_layers
  bool moe = false;              // sparse layers (MoeConfig)
  bool shared_expert = false;    // a shared expert on every token (Qwen2-MoE)
  // The class's defaults for absent fields.
  int64_t intermediate_size = 0;    // 0: the field is required
  int64_t num_key_value_heads = 0;  // 0: the attention heads (and a null field: the heads, in every family)
  int64_t head_dim = 0;             // 0: hidden_size / num_attention_heads
  int64_t max_position_embeddings = 32768;
  int64_t num_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t moe_intermediate_size = 0;
  int64_t shared_expert_intermediate_size = 0;
};

/// The families fsdpx's decoder reproduces, as transformers' config classes define them.
// clang-format off: one row per family, as docs/models.md's "Adding a family" describes
inline constexpr std::array<ModelFamily, 5> model_families{{
    {.model_type = "llama", .architecture = "LlamaForCausalLM", .name = "Llama", .mlp_bias = true,
     .max_position_embeddings = 2048},
    {.model_type = "qwen2", .architecture = "Qwen2ForCausalLM", .name = "Qwen2", .biases = ModelFamily::Biases::qkv_always,
     .sliding_windows = true, .num_key_value_heads = 32},
    {.model_type = "qwen3", .architecture = "Qwen3ForCausalLM", .name = "Qwen3", .qk_norm = true, .sliding_windows = true,
     .num_key_value_heads = 32, .head_dim = 128},
    {.model_type = "qwen2_moe", .architecture = "Qwen2MoeForCausalLM", .name = "Qwen2-MoE",
     .biases = ModelFamily::Biases::qkv_bias, .moe = true, .shared_expert = true, .intermediate_size = 5632,
     .num_key_value_heads = 16, .num_experts = 60, .num_experts_per_tok = 4, .moe_intermediate_size = 1408,
     .shared_expert_intermediate_size = 5632},
    {.model_type = "qwen3_moe", .architecture = "Qwen3MoeForCausalLM", .name = "Qwen3-MoE", .qk_norm = true, .moe = true,
     .intermediate_size = 6144, .num_key_value_heads = 4, .num_experts = 128, .num_experts_per_tok = 8,
     .moe_intermediate_size = 768},
}};
// clang-format on

/// The row of `model_type`, or null when no family has it.
inline const ModelFamily* find_model_family(std::string_view model_type) {
  for (const ModelFamily& f : model_families) {
    if (f.model_type == model_type) return &f;
  }
  return nullptr;
}

/// "llama, qwen2, ...": the model types there are rows for.
inline std::string model_family_list() {
  std::string list;
  for (const ModelFamily& f : model_families) list += (list.empty() ? "" : ", ") + std::string(f.model_type);
  return list;
}

/// The row of a config's model_type; ConfigError naming it when there is none.
inline const ModelFamily& model_family(const DecoderConfig& c) {
  const ModelFamily* f = find_model_family(c.model_type);
  if (f == nullptr) {
    throw ConfigError(::fsdpx::detail::str("fsdpx: model_type \"", c.model_type,
                                           "\" is not one fsdpx's decoder implements (", model_family_list(), ")"));
  }
  return *f;
}

inline bool DecoderConfig::is_moe() const {
  const ModelFamily* f = find_model_family(model_type);
  return f != nullptr && f->moe;
}

/// The largest sizes a config.json may declare (each well above every released model of these
/// families; docs/models.md): a config is untrusted, and these bound what it can make a rank build
/// before the weight files' own shapes are checked against it.
struct DecoderConfigBounds {
  int64_t vocab_size = int64_t{1} << 22;
  int64_t hidden_size = int64_t{1} << 16;
  int64_t intermediate_size = int64_t{1} << 20;
  int64_t num_hidden_layers = 4096;
  int64_t num_attention_heads = 4096;
  int64_t head_dim = 4096;
  int64_t max_position_embeddings = int64_t{1} << 26;
  int64_t num_experts = 4096;
  int64_t experts_in_model = int64_t{1} << 17;  // num_experts x the sparse layers
};

/// The architectures (config.json "architectures") that fsdpx's decoder reproduces, by model_type.
inline const char* causal_lm_architecture(const std::string& model_type) {
  const ModelFamily* f = find_model_family(model_type);
  return f == nullptr ? nullptr : f->architecture.data();  // the table's literals end in a NUL
}

namespace detail {

/// The dtypes a model's weights may have (config.json's "dtype", in torch's names: policies/dtype_names.hpp).
inline bool is_weight_dtype(c10::ScalarType t) {
  return t == c10::kFloat || t == c10::kBFloat16 || t == c10::kHalf || t == c10::kDouble;
}

inline c10::ScalarType parse_torch_dtype(const std::string& name, const std::string& doc) {
  // "float" and "half" are torch's aliases of float32 and float16 (torch.float, torch.half)
  const auto t = torch_dtype_from_name(name == "float" ? "float32" : name == "half" ? "float16" : name);
  if (t && is_weight_dtype(*t)) return *t;
  throw ConfigError(::fsdpx::detail::str("fsdpx: '", doc, "': \"dtype\" is \"", name,
                                         "\"; a model's weights are float32, bfloat16, float16 or float64"));
}

/// torch's name of a model's weight dtype, for config.json.
inline const char* weight_dtype_name(c10::ScalarType t) {
  if (is_weight_dtype(t)) return torch_dtype_name(t);
  throw ConfigError(
      ::fsdpx::detail::str("fsdpx: a Hugging Face model's weights are float32, bfloat16, float16 or float64, not ", t));
}

/// A field that must be a finite number > 0 (an eps, a RoPE base or factor): anything else trains to NaN.
inline void check_positive(double v, const char* name, const std::string& doc) {
  FSDPX_CHECK_AS(IoError, std::isfinite(v) && v > 0, "'", doc, "': \"", name, "\" is ", v,
                 "; it must be a finite number > 0");
}

[[noreturn]] inline void unsupported(const std::string& doc, const std::string& what) {
  throw ConfigError(::fsdpx::detail::str("fsdpx: '", doc, "': ", what,
                                         "; fsdpx's decoder does not reproduce it, and would train a different model"));
}

inline RopeConfig parse_rope(const ::fsdpx::detail::Json& j, const std::string& doc) {
  using ::fsdpx::detail::json_find;
  RopeConfig r;
  // transformers 5 writes "rope_parameters" (holding rope_theta); 4.x wrote rope_theta and "rope_scaling".
  // As transformers: "rope_scaling" (4.x) wins over "rope_parameters" when both are there.
  const ::fsdpx::detail::Json* params = nullptr;
  std::string where = "rope_scaling";
  if (const auto s = j.find("rope_scaling"); s != j.end() && !s->is_null()) {
    params = &*s;
  } else if (const auto it = j.find("rope_parameters"); it != j.end() && !it->is_null()) {
    params = &*it;
    where = "rope_parameters";
  }
  r.theta = json_find<double>(j, "rope_theta", doc).value_or(r.theta);
  check_positive(r.theta, "rope_theta", doc);
  if (const auto f = json_find<double>(j, "partial_rotary_factor", doc); f && *f != 1.0) {
    unsupported(doc, ::fsdpx::detail::str("\"partial_rotary_factor\" is ", *f, " (RoPE on part of each head)"));
  }
  if (params == nullptr) return r;
  const std::string pdoc = doc + "\": \"" + where;
  if (!params->is_object()) unsupported(doc, "\"" + where + "\" is not an object");
  for (const auto& [key, value] : params->items()) {
    if (value.is_object()) unsupported(doc, "\"" + where + "\" holds RoPE parameters per layer type (\"" + key + "\")");
  }
  r.type = json_find<std::string>(*params, "rope_type", pdoc)
               .value_or(json_find<std::string>(*params, "type", pdoc).value_or("default"));
  r.theta = json_find<double>(*params, "rope_theta", pdoc).value_or(r.theta);
  check_positive(r.theta, "rope_theta", pdoc);
  if (const auto f = json_find<double>(*params, "partial_rotary_factor", pdoc); f && *f != 1.0) {
    unsupported(doc, ::fsdpx::detail::str("\"partial_rotary_factor\" is ", *f, " (RoPE on part of each head)"));
  }
  if (r.type == "default") return r;
  if (r.type != "linear" && r.type != "llama3") {
    unsupported(doc, "the RoPE type \"" + r.type + "\" (supported: default, linear, llama3)");
  }
  r.factor = json_find<double>(*params, "factor", pdoc).value_or(1.0);
  check_positive(r.factor, "factor", pdoc);
  if (r.type == "llama3") {
    r.low_freq_factor = ::fsdpx::detail::json_get<double>(*params, "low_freq_factor", pdoc);
    r.high_freq_factor = ::fsdpx::detail::json_get<double>(*params, "high_freq_factor", pdoc);
    check_positive(r.low_freq_factor, "low_freq_factor", pdoc);
    check_positive(r.high_freq_factor, "high_freq_factor", pdoc);
    FSDPX_CHECK(r.high_freq_factor != r.low_freq_factor, "'", doc,
                "': llama3 RoPE needs high_freq_factor != low_freq_factor");
    // A top-level original_max_position_embeddings wins, as in transformers (Phi-3 writes it there).
    const auto top = json_find<int64_t>(j, "original_max_position_embeddings", doc);
    r.original_max_position_embeddings =
        top.value_or(json_find<int64_t>(*params, "original_max_position_embeddings", pdoc)
                         .value_or(json_find<int64_t>(j, "max_position_embeddings", doc).value_or(8192)));
    FSDPX_CHECK_AS(IoError, r.original_max_position_embeddings > 0, "'", doc,
                   "': \"original_max_position_embeddings\" is ", r.original_max_position_embeddings,
                   "; it must be positive");
  }
  return r;
}

/// The sparse layers of a mixture-of-experts family, with its class's defaults.
inline void parse_moe(const ::fsdpx::detail::Json& j, const std::string& doc, const ModelFamily& family,
                      DecoderConfig& c) {
  using ::fsdpx::detail::json_find;
  const DecoderConfigBounds bounds;
  MoeConfig& m = c.moe;
  // transformers 5 saves Qwen3-MoE's count as "num_local_experts" (its attribute_map); the hub's files say
  // "num_experts".
  m.num_experts = json_find<int64_t>(j, "num_experts", doc)
                      .value_or(json_find<int64_t>(j, "num_local_experts", doc).value_or(family.num_experts));
  FSDPX_CHECK_AS(IoError, m.num_experts >= 0 && m.num_experts <= bounds.num_experts, "'", doc, "': \"num_experts\" is ",
                 m.num_experts, "; it must be in [0, ", bounds.num_experts, "]");
  m.num_experts_per_tok = json_find<int64_t>(j, "num_experts_per_tok", doc).value_or(family.num_experts_per_tok);
  m.moe_intermediate_size = json_find<int64_t>(j, "moe_intermediate_size", doc).value_or(family.moe_intermediate_size);
  m.shared_expert_intermediate_size = family.shared_expert
                                          ? json_find<int64_t>(j, "shared_expert_intermediate_size", doc)
                                                .value_or(family.shared_expert_intermediate_size)
                                          : 0;
  m.norm_topk_prob = json_find<bool>(j, "norm_topk_prob", doc).value_or(false);
  m.router_aux_loss_coef = json_find<double>(j, "router_aux_loss_coef", doc).value_or(0.001);
  FSDPX_CHECK_AS(IoError, std::isfinite(m.router_aux_loss_coef) && m.router_aux_loss_coef >= 0, "'", doc,
                 "': \"router_aux_loss_coef\" is ", m.router_aux_loss_coef, "; it must be a finite number >= 0");
  m.output_router_logits = json_find<bool>(j, "output_router_logits", doc).value_or(false);
  if (m.num_experts == 0) return;  // every layer dense, as transformers builds it
  FSDPX_CHECK_AS(IoError, m.num_experts_per_tok >= 1 && m.num_experts_per_tok <= m.num_experts, "'", doc,
                 "': \"num_experts_per_tok\" is ", m.num_experts_per_tok,
                 "; it must be in [1, num_experts = ", m.num_experts, "]");
  FSDPX_CHECK_AS(IoError, m.moe_intermediate_size > 0 && m.moe_intermediate_size <= bounds.intermediate_size, "'", doc,
                 "': \"moe_intermediate_size\" is ", m.moe_intermediate_size, "; it must be in [1, ",
                 bounds.intermediate_size, "]");
  FSDPX_CHECK_AS(
      IoError, m.shared_expert_intermediate_size >= 0 && m.shared_expert_intermediate_size <= bounds.intermediate_size,
      "'", doc, "': \"shared_expert_intermediate_size\" is ", m.shared_expert_intermediate_size, "; it must be in [0, ",
      bounds.intermediate_size, "]");
  const int64_t step = json_find<int64_t>(j, "decoder_sparse_step", doc).value_or(1);
  FSDPX_CHECK_AS(IoError, step >= 1, "'", doc, "': \"decoder_sparse_step\" is ", step, "; it must be >= 1");
  std::vector<bool> dense(static_cast<size_t>(c.num_hidden_layers), false);
  if (const auto it = j.find("mlp_only_layers"); it != j.end() && !it->is_null()) {
    FSDPX_CHECK_AS(IoError, it->is_array(), "'", doc, "': \"mlp_only_layers\" must be a list of layer indices");
    for (const auto& v : *it) {
      const auto layer = ::fsdpx::detail::json_as<int64_t>(v, "'" + doc + "': an entry of \"mlp_only_layers\"");
      FSDPX_CHECK_AS(IoError, layer >= 0 && layer < c.num_hidden_layers, "'", doc,
                     "': \"mlp_only_layers\" names layer ", layer, " of ", c.num_hidden_layers);
      dense[static_cast<size_t>(layer)] = true;
    }
  }
  // As transformers: layer i is sparse unless listed in mlp_only_layers, when (i + 1) % decoder_sparse_step == 0.
  int64_t sparse = 0;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    c.sparse_layers[static_cast<size_t>(i)] = !dense[static_cast<size_t>(i)] && (i + 1) % step == 0;
    sparse += c.sparse_layers[static_cast<size_t>(i)] ? 1 : 0;
  }
  // Each expert is a module and a line of the name table: bounded before any is built.
  FSDPX_CHECK_AS(IoError, m.num_experts * sparse <= bounds.experts_in_model, "'", doc, "': \"num_experts\" ",
                 m.num_experts, " in each of ", sparse, " sparse layers makes ", m.num_experts * sparse,
                 " experts; at most ", bounds.experts_in_model, " are built");
}

}  // namespace detail

/// Reads a config.json document (`doc` names it in errors).
inline DecoderConfig parse_decoder_config(const ::fsdpx::detail::Json& j, const std::string& doc) {
  using ::fsdpx::detail::json_find;
  using ::fsdpx::detail::json_get;
  FSDPX_CHECK_AS(IoError, j.is_object(), "'", doc, "' is not a JSON object");
  DecoderConfig c;
  c.source = j;
  c.model_type = json_get<std::string>(j, "model_type", doc);
  const ModelFamily* found = find_model_family(c.model_type);
  if (found == nullptr) {
    throw ConfigError(::fsdpx::detail::str("fsdpx: '", doc, "': model_type \"", c.model_type,
                                           "\" is not one fsdpx's decoder implements (", model_family_list(), ")"));
  }
  const ModelFamily& family = *found;
  if (const auto arch = j.find("architectures"); arch != j.end() && arch->is_array()) {
    for (const auto& a : *arch) {
      const std::string name = ::fsdpx::detail::json_as<std::string>(a, "'" + doc + "': an architecture");
      if (name != family.architecture) {
        throw ConfigError(::fsdpx::detail::str("fsdpx: '", doc, "': architecture \"", name, "\" (model_type \"",
                                               c.model_type, "\"): fsdpx's decoder is a ", family.architecture));
      }
    }
  }
  c.vocab_size = json_get<int64_t>(j, "vocab_size", doc);
  c.hidden_size = json_get<int64_t>(j, "hidden_size", doc);
  // The MoE classes default the dense layers' size (a config of only sparse layers may leave it out).
  c.intermediate_size = family.intermediate_size > 0
                            ? json_find<int64_t>(j, "intermediate_size", doc).value_or(family.intermediate_size)
                            : json_get<int64_t>(j, "intermediate_size", doc);
  c.num_hidden_layers = json_get<int64_t>(j, "num_hidden_layers", doc);
  c.num_attention_heads = json_get<int64_t>(j, "num_attention_heads", doc);
  // Absent, the family's default (Llama's: the attention heads); null, every class takes the heads.
  c.num_key_value_heads = j.contains("num_key_value_heads") || family.num_key_value_heads == 0
                              ? json_find<int64_t>(j, "num_key_value_heads", doc).value_or(c.num_attention_heads)
                              : family.num_key_value_heads;
  // Checked before anything is sized by them: a config.json is untrusted, and a field of 10^6 layers or
  // 2^31 rows would otherwise build until memory runs out, naming nothing.
  const DecoderConfigBounds bounds;
  const auto in_range = [&](const char* name, int64_t v, int64_t max) {
    FSDPX_CHECK_AS(IoError, v > 0 && v <= max, "'", doc, "': \"", name, "\" is ", v, "; it must be in [1, ", max, "]");
  };
  in_range("vocab_size", c.vocab_size, bounds.vocab_size);
  in_range("hidden_size", c.hidden_size, bounds.hidden_size);
  in_range("intermediate_size", c.intermediate_size, bounds.intermediate_size);
  in_range("num_hidden_layers", c.num_hidden_layers, bounds.num_hidden_layers);
  in_range("num_attention_heads", c.num_attention_heads, bounds.num_attention_heads);
  in_range("num_key_value_heads", c.num_key_value_heads, c.num_attention_heads);
  FSDPX_CHECK_AS(IoError, c.num_attention_heads % c.num_key_value_heads == 0, "'", doc, "': ", c.num_attention_heads,
                 " attention heads cannot be grouped over ", c.num_key_value_heads, " key/value heads");
  c.head_dim = json_find<int64_t>(j, "head_dim", doc)
                   .value_or(family.head_dim > 0 ? family.head_dim : c.hidden_size / c.num_attention_heads);
  in_range("head_dim", c.head_dim, bounds.head_dim);
  FSDPX_CHECK_AS(IoError, c.head_dim % 2 == 0, "'", doc, "': \"head_dim\" is ", c.head_dim,
                 "; RoPE needs an even head dimension");
  c.rms_norm_eps = json_find<double>(j, "rms_norm_eps", doc).value_or(1e-6);
  detail::check_positive(c.rms_norm_eps, "rms_norm_eps", doc);
  c.max_position_embeddings =
      json_find<int64_t>(j, "max_position_embeddings", doc).value_or(family.max_position_embeddings);
  in_range("max_position_embeddings", c.max_position_embeddings, bounds.max_position_embeddings);
  c.rope = detail::parse_rope(j, doc);
  const std::string act = json_find<std::string>(j, "hidden_act", doc).value_or("silu");
  if (act != "silu") detail::unsupported(doc, "\"hidden_act\" is \"" + act + "\" (fsdpx's SwiGLU MLP uses silu)");
  // Read (and its type checked) in every family, as transformers' classes accept it.
  const bool attention_bias = json_find<bool>(j, "attention_bias", doc).value_or(false);
  switch (family.biases) {
    case ModelFamily::Biases::attention_bias: c.qkv_bias = c.o_bias = attention_bias; break;
    case ModelFamily::Biases::qkv_always: c.qkv_bias = true; break;
    case ModelFamily::Biases::qkv_bias: c.qkv_bias = json_find<bool>(j, "qkv_bias", doc).value_or(true); break;
  }
  c.mlp_bias = family.mlp_bias && json_find<bool>(j, "mlp_bias", doc).value_or(false);
  c.qk_norm = family.qk_norm;
  c.tie_word_embeddings = json_find<bool>(j, "tie_word_embeddings", doc).value_or(false);
  c.pad_token_id = json_find<int64_t>(j, "pad_token_id", doc);
  FSDPX_CHECK_AS(IoError, !c.pad_token_id || (*c.pad_token_id >= -c.vocab_size && *c.pad_token_id < c.vocab_size), "'",
                 doc, "': \"pad_token_id\" is ", c.pad_token_id.value_or(0), ", outside the vocabulary of ",
                 c.vocab_size);
  c.attention_dropout = json_find<double>(j, "attention_dropout", doc).value_or(0.0);
  FSDPX_CHECK_AS(IoError, c.attention_dropout >= 0 && c.attention_dropout < 1, "'", doc, "': \"attention_dropout\" is ",
                 c.attention_dropout);
  c.initializer_range = json_find<double>(j, "initializer_range", doc).value_or(0.02);
  FSDPX_CHECK_AS(IoError, std::isfinite(c.initializer_range) && c.initializer_range >= 0, "'", doc,
                 "': \"initializer_range\" is ", c.initializer_range, "; it must be a finite number >= 0");
  if (const auto d =
          json_find<std::string>(j, "dtype", doc).value_or(json_find<std::string>(j, "torch_dtype", doc).value_or(""));
      !d.empty()) {
    c.dtype = detail::parse_torch_dtype(d, doc);
  }
  c.sparse_layers.assign(static_cast<size_t>(c.num_hidden_layers), false);
  if (family.moe) detail::parse_moe(j, doc, family, c);
  // Sliding-window layers (Qwen2/Qwen3): "sliding_window" counts only with "use_sliding_window".
  c.sliding_layers.assign(static_cast<size_t>(c.num_hidden_layers), false);
  if (family.moe && json_find<bool>(j, "use_sliding_window", doc).value_or(false)) {
    detail::unsupported(doc,
                        "\"use_sliding_window\" is true in a mixture of experts (whose classes choose the sliding "
                        "layers by rules of their own)");
  }
  if (family.sliding_windows) {
    // Absent, the window is the classes' default of 4096; null, there is none.
    const bool use = json_find<bool>(j, "use_sliding_window", doc).value_or(false);
    // (not an optional built by ?: : GCC 12 at -O1 warns its value "may be used uninitialized")
    std::optional<int64_t> window;
    if (use) window = j.contains("sliding_window") ? json_find<int64_t>(j, "sliding_window", doc) : int64_t{4096};
    if (window) in_range("sliding_window", *window, int64_t{1} << 31);
    if (const auto types = j.find("layer_types"); types != j.end() && !types->is_null()) {
      FSDPX_CHECK_AS(IoError, types->is_array() && static_cast<int64_t>(types->size()) == c.num_hidden_layers, "'", doc,
                     "': \"layer_types\" must list one type for each of the ", c.num_hidden_layers, " layers");
      for (size_t i = 0; i < types->size(); ++i) {
        const std::string t = ::fsdpx::detail::json_as<std::string>((*types)[i], "'" + doc + "': a layer type");
        if (t != "full_attention" && t != "sliding_attention") detail::unsupported(doc, "the layer type \"" + t + "\"");
        FSDPX_CHECK_AS(IoError, t == "full_attention" || window.has_value(), "'", doc, "': layer ", i,
                       " is a sliding_attention layer but there is no window (\"use_sliding_window\" is false or "
                       "\"sliding_window\" null)");
        c.sliding_layers[i] = t == "sliding_attention";
      }
    } else if (window) {
      const int64_t from = json_find<int64_t>(j, "max_window_layers", doc).value_or(28);
      FSDPX_CHECK_AS(IoError, from >= 0, "'", doc, "': \"max_window_layers\" is ", from, "; it must be >= 0");
      for (int64_t i = from; i < c.num_hidden_layers; ++i) c.sliding_layers[static_cast<size_t>(i)] = true;
    }
    c.sliding_window = window.value_or(0);
  }
  // Fields that change the math and that none of these families' transformers classes read: present,
  // they mean a model other than the one this config's model_type builds.
  for (const char* field : {"quantization_config", "attn_logit_softcapping", "final_logit_softcapping", "logit_scale",
                            "embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"}) {
    if (const auto it = j.find(field); it != j.end() && !it->is_null()) {
      detail::unsupported(doc, ::fsdpx::detail::str("\"", field, "\" is set"));
    }
  }
  return c;
}

/// Reads `<dir>/config.json` (or the file itself when `path` is a file).
inline DecoderConfig read_decoder_config(const std::filesystem::path& path) {
  const std::filesystem::path file = std::filesystem::is_directory(path) ? path / "config.json" : path;
  FSDPX_CHECK_AS(IoError, std::filesystem::exists(file), "'", file.string(),
                 "' does not exist: a Hugging Face model folder "
                 "holds its configuration in config.json");
  return parse_decoder_config(
      ::fsdpx::detail::parse_json(fsdpx::detail::read_text(file, "model configuration"), file.string()), file.string());
}

/// Whether `c` is a model its model_type's transformers class builds; ConfigError naming what is not.
inline void check_expressible(const DecoderConfig& c) {
  const ModelFamily& family = model_family(c);
  const std::string name(family.name);
  std::vector<std::string> why;
  const auto need = [&](bool ok, const std::string& what) {
    if (!ok) why.push_back(what);
  };
  const auto none = [](const std::vector<bool>& layers) {
    return std::none_of(layers.begin(), layers.end(), [](bool b) { return b; });
  };
  switch (family.biases) {
    case ModelFamily::Biases::attention_bias:
      need(c.qkv_bias == c.o_bias, "q/k/v and o_proj biases differ (" + name + "'s attention_bias sets all four)");
      break;
    case ModelFamily::Biases::qkv_always:
      need(c.qkv_bias && !c.o_bias, name + " has q/k/v biases and no o_proj bias, always");
      break;
    case ModelFamily::Biases::qkv_bias: need(!c.o_bias, "an o_proj bias (" + name + " has none)"); break;
  }
  if (!family.mlp_bias) need(!c.mlp_bias, "MLP biases (Llama's mlp_bias)");
  need(c.qk_norm == family.qk_norm,
       family.qk_norm ? "no q/k norms (" + name + " always has them)" : "q/k norms (Qwen3's)");
  if (!family.shared_expert) need(c.moe.shared_expert_intermediate_size == 0, "a shared expert (Qwen2-MoE's)");
  if (!family.moe) need(none(c.sparse_layers), "sparse layers (the MoE families')");
  if (family.moe) need(none(c.sliding_layers), "sliding-window layers in a mixture of experts");
  if (!family.moe && !family.sliding_windows) need(none(c.sliding_layers), "sliding-window layers (Qwen's)");
  need(c.rope.type == "default" || c.rope.type == "linear" || c.rope.type == "llama3",
       "a RoPE type other than default, linear, llama3");
  if (why.empty()) return;
  std::string list;
  for (const auto& w : why) list += "\n  " + w;
  throw ConfigError(::fsdpx::detail::str("fsdpx: this DecoderConfig has switches transformers' ", family.architecture,
                                         " cannot express, so no config.json would describe the model:", list));
}

/// The config.json an export writes: every field fsdpx's decoder uses, from `c` (so a config changed
/// after loading, e.g. a resized vocabulary, is written as it now is), over the config it was read from
/// (whose other fields: token ids, generation defaults, survive); "dtype" names the weights written.
/// ConfigError when `c` is not a model its model_type's class builds.
inline ::fsdpx::detail::Json to_hf_config(const DecoderConfig& c, c10::ScalarType dtype) {
  check_expressible(c);
  const ModelFamily& family = model_family(c);
  ::fsdpx::detail::Json j = c.source.is_object() ? c.source : ::fsdpx::detail::Json::object();
  j["architectures"] = {std::string(family.architecture)};
  j["model_type"] = c.model_type;
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  j["head_dim"] = c.head_dim;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["hidden_act"] = "silu";
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["attention_dropout"] = c.attention_dropout;
  j["initializer_range"] = c.initializer_range;
  j["pad_token_id"] = c.pad_token_id ? ::fsdpx::detail::Json(*c.pad_token_id) : ::fsdpx::detail::Json(nullptr);
  if (family.biases == ModelFamily::Biases::attention_bias) j["attention_bias"] = c.o_bias;
  if (family.biases == ModelFamily::Biases::qkv_bias) j["qkv_bias"] = c.qkv_bias;
  if (family.mlp_bias) j["mlp_bias"] = c.mlp_bias;
  ::fsdpx::detail::Json rope = {{"rope_type", c.rope.type}, {"rope_theta", c.rope.theta}};
  if (c.rope.type != "default") rope["factor"] = c.rope.factor;
  if (c.rope.type == "llama3") {
    rope["low_freq_factor"] = c.rope.low_freq_factor;
    rope["high_freq_factor"] = c.rope.high_freq_factor;
    rope["original_max_position_embeddings"] = c.rope.original_max_position_embeddings;
  }
  j["rope_parameters"] = rope;
  // transformers 4.x's spelling, kept in step where the source had it (4.x reads only these).
  if (j.contains("rope_theta")) j["rope_theta"] = c.rope.theta;
  if (j.contains("rope_scaling")) j["rope_scaling"] = c.rope.type == "default" ? ::fsdpx::detail::Json(nullptr) : rope;
  j.erase("original_max_position_embeddings");  // it would win over rope_parameters' (see parse_rope)
  if (family.moe) {
    // decoder_sparse_step 1 and the dense layers listed: the same layers, whatever the source said.
    j["num_experts"] = c.moe.num_experts;
    j.erase("num_local_experts");
    j["num_experts_per_tok"] = c.moe.num_experts_per_tok;
    j["moe_intermediate_size"] = c.moe.moe_intermediate_size;
    if (family.shared_expert) j["shared_expert_intermediate_size"] = c.moe.shared_expert_intermediate_size;
    j["norm_topk_prob"] = c.moe.norm_topk_prob;
    j["router_aux_loss_coef"] = c.moe.router_aux_loss_coef;
    j["output_router_logits"] = c.moe.output_router_logits;
    j["decoder_sparse_step"] = 1;
    ::fsdpx::detail::Json dense = ::fsdpx::detail::Json::array();
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      if (!c.is_sparse(i)) dense.push_back(i);
    }
    j["mlp_only_layers"] = dense;
    j["use_sliding_window"] = false;
  } else if (family.sliding_windows) {
    bool any = false;
    ::fsdpx::detail::Json types = ::fsdpx::detail::Json::array();
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      any = any || c.is_sliding(i);
      types.push_back(c.is_sliding(i) ? "sliding_attention" : "full_attention");
    }
    j["layer_types"] = types;
    j["use_sliding_window"] = any;
    j["sliding_window"] = any ? ::fsdpx::detail::Json(c.sliding_window) : ::fsdpx::detail::Json(nullptr);
  }
  // transformers 5 reads "dtype", 4.x "torch_dtype": both name the weights as written.
  j["dtype"] = detail::weight_dtype_name(dtype);
  if (j.contains("torch_dtype")) j["torch_dtype"] = detail::weight_dtype_name(dtype);
  return j;
}

}  // namespace fsdpx::models
