// fsdpx-merge: a checkpoint's model shards -> the full state dict, as safetensors (Hugging Face's
// model.safetensors layout, sharded with an index when large) or as a torch.load file (model.pt). The
// checkpoint is fsdpx's, or a PyTorch Distributed Checkpoint (DCP) folder as torch wrote it.
//
//   fsdpx-merge <checkpoint root or step dir> --out <dir> [--step N] [--format safetensors|torch]
//               [--dtype float32|bfloat16|float16] [--max-shard-size 5GB] [--no-verify]
//
// Exit code 0 on success, 1 with the error on any failure.
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <iostream>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include <fsdpx/detail/file_io.hpp>
#include <fsdpx/checkpoint/detail/torch_io.hpp>
#include <fsdpx/checkpoint/format.hpp>
#include <fsdpx/checkpoint/layout.hpp>
#include <fsdpx/checkpoint/merge.hpp>
#include <fsdpx/dcp.hpp>  // DCP folders and steps saved in CheckpointFormat::dcp
#include <fsdpx/hf/safetensors.hpp>
#include <fsdpx/error.hpp>
#include <fsdpx/models/pretrained.hpp>

namespace {

namespace fs = std::filesystem;
namespace ckpt = fsdpx::checkpoint;
using fsdpx::detail::str;

constexpr const char* usage =
    "usage: fsdpx-merge <checkpoint root or step dir> --out <dir> [--step N] [--format safetensors|torch]\n"
    "                   [--dtype float32|bfloat16|float16] [--max-shard-size 5GB] [--no-verify]\n"
    "\n"
    "Merges the model shards of an fsdpx checkpoint (…/global_step_<N>/actor/model_world_size_<W>_rank_<r>.pt)\n"
    "into the full state dict.\n"
    "  <path>            a checkpoint root (the step is read from latest_checkpointed_iteration.txt, else\n"
    "                    latest_state_dict_iteration.txt) or a step directory (global_step_<N> or its actor/),\n"
    "                    or a PyTorch Distributed Checkpoint folder (a .metadata and __<rank>_<n>.distcp files:\n"
    "                    its tensors under their saved names; bytes entries, optim_states/ and .pt files aside)\n"
    "  --out DIR         where to write; created when missing\n"
    "  --step N          with a root: merge global_step_<N> instead of the latest\n"
    "  --format F        safetensors (default: model.safetensors, or model-0000i-of-0000n.safetensors and\n"
    "                    model.safetensors.index.json when larger than --max-shard-size), or torch (model.pt,\n"
    "                    a dict name -> tensor for torch.load(path, weights_only=True))\n"
    "  --dtype D         cast floating-point tensors: float32, bfloat16 or float16 (default: as saved)\n"
    "  --max-shard-size  the largest safetensors file, e.g. 5GB (default), 500MB, 2GiB, or bytes\n"
    "  --no-verify       skip checking the files' sizes and CRC-32C against fsdp_config.json\n"
    "The step's huggingface/ files (config.json, tokenizer files), when there are any, are copied into --out.\n"
    "config.json is written only beside the tensor names it implies: a Llama, Qwen2 or Qwen3 config whose\n"
    "tensors (names and shapes) are all there, in transformers' names; otherwise it is left out, with a warning,\n"
    "since from_pretrained would start every tensor it does not find from random weights.\n";

[[noreturn]] void usage_error(const std::string& msg) {
  throw fsdpx::ConfigError(str("fsdpx-merge: ", msg, "\n", usage));
}

/// "5GB" (10^9, as Hugging Face's max_shard_size), "2GiB" (2^30), "500MB", "100KB", "1234".
int64_t parse_size(const std::string& text) {
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (...) {
    usage_error(str("--max-shard-size '", text, "' is not a size like 5GB"));
  }
  std::string unit = text.substr(used);
  for (char& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  double scale = 0;
  if (unit.empty() || unit == "B") scale = 1;
  else if (unit == "KB") scale = 1e3;
  else if (unit == "MB") scale = 1e6;
  else if (unit == "GB") scale = 1e9;
  else if (unit == "TB") scale = 1e12;
  else if (unit == "KIB") scale = 1024.0;
  else if (unit == "MIB") scale = 1024.0 * 1024;
  else if (unit == "GIB") scale = 1024.0 * 1024 * 1024;
  else
    usage_error(
        str("--max-shard-size '", text, "': unknown unit '", text.substr(used), "' (B, KB, MB, GB, KiB, MiB, GiB)"));
  const auto bytes = static_cast<int64_t>(value * scale);
  if (bytes <= 0) usage_error(str("--max-shard-size '", text, "' must be positive"));
  return bytes;
}

bool is_step_dir(const fs::path& dir) {
  const fs::path d = ckpt::model_dir(dir);
  std::error_code ec;
  if (fs::exists(d / ckpt::config_file, ec)) return true;
  for (const auto& e : fs::directory_iterator(d, ec)) {
    if (ckpt::parse_shard_file_name(e.path().filename().string())) return true;
  }
  return false;
}

/// The step directory to merge: `path` itself, or a step of the root `path`.
fs::path resolve_step_dir(const fs::path& path, std::optional<int64_t> step) {
  FSDPX_CHECK_AS(fsdpx::IoError, fs::is_directory(path), "'", path.string(), "' is not a directory");
  if (is_step_dir(path)) {
    if (step) usage_error(str("--step is for a checkpoint root; '", path.string(), "' is a step directory"));
    return ckpt::model_dir(path);
  }
  if (!step) {
    step = ckpt::read_iteration_file(path / ckpt::checkpointed_iteration_file);
    if (!step) step = ckpt::read_iteration_file(path / ckpt::state_dict_iteration_file);
  }
  if (!step) {
    std::string found;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(path, ec)) {
      const std::string name = e.path().filename().string();
      if (name.rfind("global_step_", 0) == 0) found += " " + name;
    }
    throw fsdpx::IoError(str("fsdpx: '", path.string(), "' is neither a step directory nor a checkpoint root with ",
                             ckpt::checkpointed_iteration_file, " or ", ckpt::state_dict_iteration_file,
                             found.empty() ? std::string() : "; pass --step N, it has:" + found));
  }
  const fs::path dir = ckpt::step_dir(path, *step);
  FSDPX_CHECK_AS(fsdpx::IoError, fs::is_directory(dir), "step ", *step, " of '", path.string(), "': '", dir.string(),
                 "' does not exist");
  return dir;
}

int run(int argc, char** argv) {
  std::optional<fs::path> input, out;
  std::optional<int64_t> step;
  std::string format = "safetensors";
  ckpt::MergeOptions options;
  fsdpx::hf::SafetensorsOptions st_options;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage_error(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "-h" || arg == "--help") {
      std::cout << usage;
      return 0;
    } else if (arg == "--out" || arg == "-o") {
      out = value();
    } else if (arg == "--step") {
      const std::string v = value();
      try {
        size_t used = 0;
        step = std::stoll(v, &used);
        if (used != v.size() || *step < 0) throw std::invalid_argument(v);
      } catch (const std::exception&) {
        usage_error("--step '" + v + "' is not a step number");
      }
    } else if (arg == "--format") {
      format = value();
      if (format != "safetensors" && format != "torch")
        usage_error("--format must be safetensors or torch, not '" + format + "'");
    } else if (arg == "--dtype") {
      const std::string d = value();
      if (d == "float32" || d == "fp32") options.dtype = at::kFloat;
      else if (d == "bfloat16" || d == "bf16") options.dtype = at::kBFloat16;
      else if (d == "float16" || d == "fp16") options.dtype = at::kHalf;
      else usage_error("--dtype must be float32, bfloat16 or float16, not '" + d + "'");
    } else if (arg == "--max-shard-size") {
      st_options.max_shard_bytes = parse_size(value());
    } else if (arg == "--no-verify") {
      options.verify_checksums = false;
    } else if (!arg.empty() && arg[0] == '-') {
      usage_error("unknown option '" + arg + "'");
    } else if (!input) {
      input = arg;
    } else {
      usage_error("one checkpoint path only ('" + input->string() + "' and '" + arg + "')");
    }
  }
  if (!input) usage_error("no checkpoint path");
  if (!out) usage_error("--out DIR is required");

  const bool dcp_folder = fsdpx::dcp::is_checkpoint(*input);
  if (dcp_folder && step) usage_error("--step applies to an fsdpx checkpoint root, not to a DCP folder");
  const fs::path dir = dcp_folder ? *input : resolve_step_dir(*input, step);
  options.warn = [](const std::string& w) { std::cerr << "fsdpx-merge: warning: " << w << "\n"; };
  // A step of either format, or a DCP folder: merge_checkpoint reads it through its format's seam
  ckpt::MergeReport report;
  fsdpx::hf::NamedTensors tensors = ckpt::merge_checkpoint(dir, options, &report);
  if (dcp_folder) {
    std::cout << "fsdpx-merge: read the PyTorch Distributed Checkpoint in " << dir.string() << " ("
              << report.files.size() << " data files, world size " << report.world_size << ")\n";
  } else {
    std::cout << "fsdpx-merge: read " << report.files.size()
              << (report.format == fsdpx::CheckpointFormat::dcp ? " DCP data files" : " model files") << " (world size "
              << report.world_size << ", " << report.kind
              << (report.step ? str(", step ", *report.step) : std::string()) << ", "
              << (report.committed ? (report.complete ? "committed" : "weights committed")
                                   : "NOT committed: no fsdp_config.json")
              << ", checksums " << (report.checksums_verified ? "verified" : "not verified") << ") from "
              << report.dir.string() << "\n";
  }
  int64_t elements = 0, bytes = 0;
  for (const auto& [name, t] : tensors) {
    elements += t.numel();
    bytes += t.numel() * static_cast<int64_t>(t.element_size());
  }
  std::cout << "fsdpx-merge: " << tensors.size() << " tensors, " << elements << " elements, " << bytes << " bytes\n";

  // config.json: written only beside the names it implies (renamed to them when the family is known).
  std::optional<fsdpx::detail::Json> config;
  const fs::path hf = ckpt::huggingface_dir(dir);
  if (format == "torch" && !hf.empty() && fs::exists(hf / "config.json")) {
    std::cerr << "fsdpx-merge: warning: config.json is not written with --format torch: from_pretrained does not read "
                 "model.pt (use --format safetensors for a Hugging Face folder)\n";
  } else if (!hf.empty() && fs::is_regular_file(fs::symlink_status(hf / "config.json"))) {
    const fs::path path = hf / "config.json";
    const std::string text = fsdpx::detail::read_text(path, "model configuration");
    std::string why;
    if (auto renamed = fsdpx::models::rename_for_config(tensors, text, path.string(), why)) {
      tensors = std::move(*renamed);
      config = fsdpx::detail::parse_json(text, path.string());
    } else {
      std::cerr << "fsdpx-merge: warning: config.json is not written: " << why
                << ". transformers' from_pretrained would start every tensor it does not find from random weights; "
                   "the tensors are written with the checkpoint's names.\n";
    }
  }

  std::error_code ec;
  fs::create_directories(*out, ec);
  FSDPX_CHECK_AS(fsdpx::IoError, !ec && fs::is_directory(*out), "creating the output directory '", out->string(),
                 "' failed", ec ? ": " + ec.message() : std::string());
  // A config.json an earlier merge left in --out must not stand beside tensors it does not describe.
  if (!config && fs::exists(fs::symlink_status(*out / "config.json")))
    fsdpx::detail::remove_durably(*out / "config.json");
  std::vector<fsdpx::detail::WrittenFile> written;
  if (format == "torch") {
    c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
    for (const auto& [name, t] : tensors) dict.insert(name, t);
    written.push_back(ckpt::detail::save_ivalue(*out / "model.pt", dict));
  } else {
    const fsdpx::hf::SavedSafetensors saved = fsdpx::hf::save_safetensors(*out, tensors, st_options);
    written = saved.files;
    if (saved.index) written.push_back(*saved.index);
  }
  for (const auto& f :
       ckpt::copy_huggingface_files(dir, *out, [](const std::string& f) { return f == "config.json"; })) {
    written.push_back(f);
  }
  if (config) {
    // The dtype of the weights as written ("dtype", and "torch_dtype" for transformers 4.x).
    at::ScalarType dtype = at::kFloat;
    for (const auto& [name, t] : tensors) {
      if (at::isFloatingType(t.scalar_type())) {
        dtype = t.scalar_type();
        break;
      }
    }
    const auto decoder = fsdpx::models::parse_decoder_config(*config, (hf / "config.json").string());
    written.push_back(fsdpx::detail::write_text_durably(*out / "config.json",
                                                        fsdpx::models::to_hf_config(decoder, dtype).dump(2) + "\n"));
  }
  for (const auto& f : written) std::cout << "fsdpx-merge: wrote " << f.path.string() << " (" << f.bytes << " bytes)\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
}
