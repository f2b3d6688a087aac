// merge: a checkpoint of train_gpt (or of any fsdpx job) -> a directory that Python opens: the model
// as safetensors plus the step's huggingface/ files (config.json). It shows the C++ API that the
// fsdpx-merge tool (tools/fsdpx_merge.cpp, more options) is built on:
//
//   checkpoint::merge_checkpoint(step dir)      the shards of every rank -> full tensors (no model, no MPI)
//   fsdpx::hf::save_safetensors(out, tensors)  Hugging Face's model.safetensors layout
//   checkpoint::copy_huggingface_files(...)     config.json (only beside the names it implies), tokenizer files
//
//   merge <checkpoint root or step dir> <out dir> [--step N] [--dtype float32|bfloat16] [--keep-names]
//
// A root merges its newest committed step (or --step N). When the step's huggingface/config.json is a
// GPT-2 configuration (train_gpt writes one), the tensors are renamed to transformers' GPT2LMHeadModel
// names (Linear weights transposed into GPT-2's Conv1D layout), so `from_pretrained` loads the
// directory; --keep-names writes them as the checkpoint names them.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <regex>
#include <string>

#include <fsdpx/checkpoint/layout.hpp>
#include <fsdpx/checkpoint/merge.hpp>
#include <fsdpx/hf/safetensors.hpp>

namespace fs = std::filesystem;
namespace ckpt = fsdpx::checkpoint;

namespace {

/// examples/common/gpt.hpp's names -> transformers' GPT-2 names; `transpose` for Linear -> Conv1D.
std::string gpt2_name(const std::string& name, bool& transpose) {
  static const std::regex block(R"(h(\d+)\.(ln1|ln2|qkv|proj|fc|fc2)\.(weight|bias))");
  transpose = false;
  if (name == "tok.weight") return "transformer.wte.weight";
  if (name == "pos.weight") return "transformer.wpe.weight";
  if (name == "ln_f.weight" || name == "ln_f.bias") return "transformer." + name;
  if (name == "head.weight") return "lm_head.weight";
  std::smatch m;
  FSDPX_CHECK(std::regex_match(name, m, block), "merge: '", name,
              "' is not a parameter of the example GPT; "
              "pass --keep-names to write the tensors as they are named");
  const std::string layer = m[2];
  const std::string to = layer == "ln1"    ? "ln_1"
                         : layer == "ln2"  ? "ln_2"
                         : layer == "qkv"  ? "attn.c_attn"
                         : layer == "proj" ? "attn.c_proj"
                         : layer == "fc"   ? "mlp.c_fc"
                                           : "mlp.c_proj";
  transpose = m[3] == "weight" && layer != "ln1" && layer != "ln2";
  return "transformer.h." + std::string(m[1]) + "." + to + "." + std::string(m[3]);
}

}  // namespace

int main(int argc, char** argv) try {
  std::optional<fs::path> input, out;
  std::optional<int64_t> step;
  ckpt::MergeOptions options;  // checksums verified against fsdp_config.json
  bool keep_names = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto next = [&]() -> std::string {
      FSDPX_CHECK(i + 1 < argc, "merge: ", a, " needs a value");
      return argv[++i];
    };
    if (a == "--step") step = std::stoll(next());
    else if (a == "--dtype") {
      const std::string d = next();
      FSDPX_CHECK(d == "float32" || d == "bfloat16", "merge: --dtype is float32 or bfloat16, not ", d);
      options.dtype = d == "bfloat16" ? at::kBFloat16 : at::kFloat;
    } else if (a == "--keep-names") keep_names = true;
    else if (!input) input = a;
    else if (!out) out = a;
    else FSDPX_CHECK(false, "merge: unexpected argument '", a, "'");
  }
  FSDPX_CHECK(
      input && out,
      "usage: merge <checkpoint root or step dir> <out dir> [--step N] [--dtype float32|bfloat16] [--keep-names]");

  // A root (train_gpt's --ckpt-dir) or one step (global_step_<N> or its actor/).
  fs::path dir = *input;
  if (!fs::exists(ckpt::model_dir(dir) / ckpt::config_file)) {
    if (!step) step = ckpt::find_latest_checkpoint(dir, /*weights_only=*/true);
    FSDPX_CHECK(step.has_value(), "merge: '", dir.string(), "' holds no committed checkpoint (no ",
                ckpt::state_dict_iteration_file, ", no global_step_<N>/actor/", ckpt::config_file, ")");
    dir = ckpt::step_dir(dir, *step);
  }

  ckpt::MergeReport report;
  fsdpx::hf::NamedTensors tensors = ckpt::merge_checkpoint(dir, options, &report);
  FSDPX_CHECK(!tensors.empty(), "merge: the checkpoint in '", dir.string(), "' holds no tensors");
  std::printf("merge: %zu tensors from %zu files of step %lld (world size %d, %s, %s)\n", tensors.size(),
              report.files.size(), static_cast<long long>(report.step.value_or(-1)), report.world_size,
              report.kind.c_str(), report.checksums_verified ? "checksums verified" : "checksums not verified");

  // The step's model description, if the job left one (train_gpt does).
  const fs::path config = ckpt::model_dir(dir) / "huggingface" / "config.json";
  std::ifstream config_in(config);
  const std::string config_text((std::istreambuf_iterator<char>(config_in)), std::istreambuf_iterator<char>());
  const bool gpt2 = std::regex_search(config_text, std::regex(R"("model_type"\s*:\s*"gpt2")"));
  if (gpt2 && !keep_names) {
    for (auto& [name, t] : tensors) {
      bool transpose = false;
      name = gpt2_name(name, transpose);
      if (transpose) t = t.t().contiguous();  // torch.nn.Linear [out, in] -> GPT-2's Conv1D [in, out]
    }
    std::printf("merge: renamed to transformers' GPT2LMHeadModel names (config.json says model_type gpt2)\n");
  }

  const fsdpx::hf::SavedSafetensors saved = fsdpx::hf::save_safetensors(*out, tensors);
  for (const auto& f : saved.files)
    std::printf("merge: wrote %s (%lld bytes)\n", f.path.c_str(), static_cast<long long>(f.bytes));
  // config.json only beside the names it implies: with fsdpx's names, from_pretrained would find none of
  // its tensors and start from random weights.
  const bool write_config = gpt2 && !keep_names;
  const auto copied = ckpt::copy_huggingface_files(
      dir, *out, [&](const std::string& f) { return f == "config.json" && !write_config; });
  if (!write_config && fs::exists(config)) {
    std::printf("merge: config.json not copied: the tensors keep the checkpoint's names, which are not %s\n",
                gpt2 ? "GPT-2's (--keep-names)" : "those of a GPT-2 configuration");
  }
  for (const auto& f : copied) std::printf("merge: wrote %s (copied from the checkpoint)\n", f.path.c_str());

  const std::string o = out->string();
  std::string example = tensors.front().first;  // a name to show: the token embedding when there is one
  for (const auto& [name, t] : tensors) {
    if (name == "transformer.wte.weight" || name == "tok.weight") example = name;
  }
  std::printf(
      "\nOpen it in Python:\n"
      "  from safetensors.torch import load_file\n"
      "  state = load_file(\"%s/model.safetensors\")   # {name: tensor}, e.g. state[\"%s\"].shape\n",
      o.c_str(), example.c_str());
  if (write_config) {
    std::printf(
        "  from transformers import GPT2LMHeadModel\n"
        "  model = GPT2LMHeadModel.from_pretrained(\"%s\")   # byte-level: token id = byte value\n",
        o.c_str());
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 1;
}
