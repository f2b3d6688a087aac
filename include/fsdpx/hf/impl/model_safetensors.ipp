// Out-of-line functions of fsdpx/hf/model_safetensors.hpp: included by it (header-only) or by fsdpx/impl/src.hpp
// (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <fsdpx/hf/model_safetensors.hpp>

namespace fsdpx::hf::detail {

FSDPX_DECL SafetensorsLoadReport load_targets(SafetensorsDir& dir, std::vector<LoadTarget>& targets,
                                              const SafetensorsLoadOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  SafetensorsLoadReport report;
  std::set<std::string> claimed;
  std::set<std::string> bad;
  for (const LoadTarget& t : targets) {
    claimed.insert(t.file_name);
    const SafetensorsEntry* e = dir.find(t.file_name);
    if (e == nullptr) {
      report.missing.push_back(t.file_name);
      bad.insert(t.file_name);
    } else if (e->shape != t.shape) {
      report.mismatched.push_back(::fsdpx::detail::str(t.file_name, ": shape ", c10::IntArrayRef(e->shape), " in '",
                                                       dir.file_of(t.file_name).path().string(), "' but ",
                                                       c10::IntArrayRef(t.shape), " in the model"));
      bad.insert(t.file_name);
    } else if (e->dtype != t.dst.scalar_type() &&
               !(at::isFloatingType(e->dtype) && at::isFloatingType(t.dst.scalar_type()) &&
                 !c10::isFloat8Type(e->dtype))) {
      report.mismatched.push_back(::fsdpx::detail::str(
          t.file_name, ": dtype ", e->dtype, " in '", dir.file_of(t.file_name).path().string(),
          "' cannot be cast to the model's ", t.dst.scalar_type(),
          c10::isFloat8Type(e->dtype) ? " (a float8 checkpoint needs its scales, which a cast would drop)" : ""));
      bad.insert(t.file_name);
    }
  }
  for (const std::string& name : dir.names()) {
    if (claimed.count(name) == 0 && !(options.ignore && options.ignore(name))) report.unexpected.push_back(name);
  }
  std::sort(report.missing.begin(), report.missing.end());
  report.missing.erase(std::unique(report.missing.begin(), report.missing.end()), report.missing.end());
  std::sort(report.mismatched.begin(), report.mismatched.end());
  report.mismatched.erase(std::unique(report.mismatched.begin(), report.mismatched.end()), report.mismatched.end());
  if (options.strict && !report.ok()) {
    std::string msg;
    if (!report.missing.empty())
      msg += "\n  missing (in the model, not in the files): " + ::fsdpx::detail::join_names(report.missing);
    if (!report.unexpected.empty())
      msg += "\n  unexpected (in the files, not in the model): " + ::fsdpx::detail::join_names(report.unexpected);
    if (!report.mismatched.empty()) msg += "\n  mismatched: " + ::fsdpx::detail::join_names(report.mismatched);
    throw ConfigError(::fsdpx::detail::str("fsdpx: loading '", dir.path().string(),
                                           "': the files do not match the model (nothing was loaded):", msg));
  }
  at::NoGradGuard no_grad;
  const int64_t bytes_before = dir.bytes_read();
  std::set<std::string> loaded;
  at::Tensor staging;  // for destinations that are not contiguous host memory
  for (LoadTarget& t : targets) {
    if (bad.count(t.file_name) != 0 || t.first == t.last) continue;
    loaded.insert(t.file_name);
    if (t.dst.is_cpu() && t.dst.is_contiguous()) {
      dir.read(t.file_name, t.first, t.last, t.dst);
      continue;
    }
    const int64_t step = std::max<int64_t>(1, SafetensorsDir::chunk_bytes / static_cast<int64_t>(t.dst.element_size()));
    for (int64_t pos = t.first; pos < t.last; pos += step) {
      const int64_t n = std::min(step, t.last - pos);
      if (!staging.defined() || staging.scalar_type() != t.dst.scalar_type() || staging.numel() < n) {
        staging = at::empty({std::min(step, t.last - t.first)},
                            at::TensorOptions().dtype(t.dst.scalar_type()).pinned_memory(t.dst.is_cuda()));
      }
      const at::Tensor piece = staging.narrow(0, 0, n);
      dir.read(t.file_name, pos, pos + n, piece);
      t.dst.narrow(0, pos - t.first, n).copy_(piece);
    }
  }
  report.tensors = static_cast<int64_t>(loaded.size());
  report.bytes_read = dir.bytes_read() - bytes_before;
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return report;
}

FSDPX_DECL void add_buffer_targets(torch::nn::Module& module, const SafetensorsLoadOptions& options,
                                   std::vector<LoadTarget>& targets) {
  if (!options.buffers) return;
  for (const auto& b : module.named_buffers(/*recurse=*/true)) {
    const auto file = file_name_of(options.file_name, b.key());
    if (!file) continue;
    at::Tensor flat = b.value().is_contiguous() ? b.value().view({-1}) : at::Tensor();
    FSDPX_CHECK(flat.defined(), "loading safetensors: buffer '", b.key(), "' is not contiguous");
    targets.push_back({*file, b.value().sizes().vec(), flat, 0, b.value().numel()});
  }
}

}  // namespace fsdpx::hf::detail
