// A model's weights to and from a safetensors folder (Hugging Face's layout: model.safetensors, or
// an index and its files), sharded or not.
//
// Loading: a sharded model's ranks each read exactly the bytes of the slices they hold (positioned
// reads) and cast them into their float32 shards: no rank reads, or holds, the whole model. Names
// are matched through a caller's map (a model family's table). Everything is checked before a byte is read: tensors the
// model has and the files lack (missing), tensors the files have and the model lacks (unexpected), and tensors whose
// shape differs or whose dtype cannot be cast (mismatched). Strict (the default), any of them is one error naming them
// all, and the model is left as it was; otherwise they are returned and the rest is loaded.
//
// Saving: a sharded model is gathered one unit at a time (every rank takes part) and world rank 0
// writes each tensor as its unit arrives (SafetensorsWriter), so memory stays bounded by one unit.
#pragma once

#include <fsdpx/detail/config.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <fsdpx/hf/safetensors.hpp>
#include <fsdpx/core/model_ref.hpp>
#include <fsdpx/core/sharded_model.hpp>
#include <fsdpx/dist/any.hpp>
#include <fsdpx/dist/outcome.hpp>
#include <fsdpx/error.hpp>

namespace fsdpx {

struct SafetensorsLoadOptions {
  /// Any missing, unexpected or mismatched tensor is an error (naming them all) and nothing is loaded.
  bool strict = true;
  /// The files' name for the model's tensor `name` (a parameter's or a buffer's fully qualified name);
  /// nullopt: this tensor is not loaded from the files. Empty: the same name.
  std::function<std::optional<std::string>(const std::string&)> file_name;
  /// Tensors of the files that the model deliberately lacks (a tied head's copy, a cached rotary
  /// table): neither loaded nor reported as unexpected.
  std::function<bool(const std::string&)> ignore;
  /// Load the module's buffers too (whole, on every rank; replicated like the module holds them).
  bool buffers = true;
};

/// What a load found and did (on this rank).
struct SafetensorsLoadReport {
  std::vector<std::string> missing;     // the model's tensors the files lack (the files' names)
  std::vector<std::string> unexpected;  // the files' tensors the model lacks
  std::vector<std::string> mismatched;  // "<name>: <why>"
  int64_t tensors = 0;                  // tensors loaded (a sharded model: those this rank holds part of)
  int64_t bytes_read = 0;               // bytes this rank read from the files
  double seconds = 0;
  bool ok() const { return missing.empty() && unexpected.empty() && mismatched.empty(); }
};

namespace hf::detail {

/// One destination: elements [first, last) of the files' tensor `file_name`, into `dst`.
struct LoadTarget {
  std::string file_name;
  std::vector<int64_t> shape;  // the model's, for the shape check
  at::Tensor dst;              // 1-D, last - first elements, any device
  int64_t first = 0, last = 0;
};

/// Checks `targets` against the files, then (when nothing is wrong, or not strict) reads them.
FSDPX_DECL SafetensorsLoadReport load_targets(SafetensorsDir& dir, std::vector<LoadTarget>& targets,
                                              const SafetensorsLoadOptions& options);

using FileNameFn = std::function<std::optional<std::string>(const std::string&)>;

/// The files' name of the model's tensor `name` through `fn` (the same name when fn is empty).
inline std::optional<std::string> file_name_of(const FileNameFn& fn, const std::string& name) {
  return fn ? fn(name) : std::optional<std::string>(name);
}

FSDPX_DECL void add_buffer_targets(torch::nn::Module& module, const SafetensorsLoadOptions& options,
                                   std::vector<LoadTarget>& targets);

}  // namespace hf::detail

/// Loads the safetensors folder `dir` into a sharded model: each rank reads the slices of its own
/// shards (and the module's buffers whole). Every rank calls it; it is not collective.
inline SafetensorsLoadReport load_model_safetensors(ShardedModelRef model_ref, fsdpx::hf::SafetensorsDir& dir,
                                                    const SafetensorsLoadOptions& options = {}) {
  core::ShardedModel& model = *model_ref;
  model.wait_for_shard_readers();  // a background checkpoint copy may still read the shards
  model.reshard_all();             // the next forward gathers the loaded shards
  std::vector<hf::detail::LoadTarget> targets;
  for (size_t i = 0; i < model.num_units(); ++i) {
    core::Unit& u = model.unit(i);
    const int64_t base = u.layout().shard_range(u.shard_rank()).begin;
    for (const core::ParamInfo& p : u.layout().params()) {
      const auto file = hf::detail::file_name_of(options.file_name, p.name);
      if (!file) continue;
      const core::FlatRange r = u.held_range(p);
      if (r.begin < r.end) {
        targets.push_back(
            {*file, p.shape, u.shard().narrow(0, r.begin - base, r.size()), r.begin - p.offset, r.end - p.offset});
      } else {  // this rank holds none of it: its name is still checked
        targets.push_back({*file, p.shape, u.shard().narrow(0, 0, 0), 0, 0});
      }
    }
  }
  hf::detail::add_buffer_targets(model.root_module(), options, targets);
  return hf::detail::load_targets(dir, targets, options);
}

/// Loads the safetensors folder `dir` into a module that is not sharded (every tensor whole).
inline SafetensorsLoadReport load_model_safetensors(torch::nn::Module& module, fsdpx::hf::SafetensorsDir& dir,
                                                    const SafetensorsLoadOptions& options = {}) {
  std::vector<hf::detail::LoadTarget> targets;
  std::vector<std::pair<at::Tensor, at::Tensor>> copy_back;  // (parameter, contiguous staging) for odd layouts
  for (const auto& p : module.named_parameters(/*recurse=*/true)) {
    const auto file = hf::detail::file_name_of(options.file_name, p.key());
    if (!file) continue;
    at::Tensor dst = p.value().is_contiguous() ? p.value().detach().view({-1}) : at::Tensor();
    if (!dst.defined()) {  // a tensor not loaded (not strict) keeps its values through the copy back
      dst = p.value().detach().reshape({-1}).clone();
      copy_back.emplace_back(p.value(), dst);
    }
    targets.push_back({*file, p.value().sizes().vec(), dst, 0, p.value().numel()});
  }
  hf::detail::add_buffer_targets(module, options, targets);
  auto report = hf::detail::load_targets(dir, targets, options);
  at::NoGradGuard no_grad;
  for (auto& [param, staged] : copy_back) param.copy_(staged.view(param.sizes()));
  return report;
}

// ---- saving -------------------------------------------------------------------------------------------

struct SafetensorsSaveOptions {
  /// File size limit, metadata and file name stem.
  fsdpx::hf::SafetensorsOptions files;
  /// Floating-point tensors are written in this dtype (e.g. at::kBFloat16); others as they are.
  std::optional<at::ScalarType> dtype;
  /// The files' name for the model's tensor `name`; nullopt: not written. Empty: the same name.
  std::function<std::optional<std::string>(const std::string&)> file_name;
  /// Write the module's buffers too.
  bool buffers = true;
};

namespace hf::detail {

inline at::ScalarType saved_dtype(at::ScalarType t, const SafetensorsSaveOptions& o) {
  return o.dtype && at::isFloatingType(t) ? *o.dtype : t;
}

}  // namespace hf::detail

/// Writes a sharded model's full weights (its float32 masters, cast per options.dtype) and buffers to
/// `dir` in Hugging Face's safetensors layout. Collective: every rank calls it; one unit is gathered at
/// a time, and world rank 0 writes. Returns what was written on rank 0 (empty elsewhere). A failure on
/// rank 0 (a full disk) does not stop the gathers the others are in; it is an error on every rank
/// once they are done. A rank that cannot allocate a unit's gather says so before anyone gathers it.
inline fsdpx::hf::SavedSafetensors save_model_safetensors(ShardedModelRef model_ref, const std::filesystem::path& dir,
                                                          const SafetensorsSaveOptions& options = {}) {
  core::ShardedModel& model = *model_ref;
  auto& world = model.mesh().world();
  const bool writer = world.rank() == 0;
  // The plan (every tensor's name, dtype and shape, in unit order) is known to all without a gather.
  std::vector<fsdpx::hf::TensorSpec> specs;
  std::vector<std::vector<std::pair<const core::ParamInfo*, std::string>>> unit_names(model.num_units());
  for (size_t i = 0; i < model.num_units(); ++i) {
    for (const core::ParamInfo& p : model.unit(i).layout().params()) {
      const auto file = hf::detail::file_name_of(options.file_name, p.name);
      if (!file) continue;
      unit_names[i].emplace_back(&p, *file);
      specs.push_back({*file, hf::detail::saved_dtype(model.unit(i).options().shard_dtype, options), p.shape});
    }
  }
  std::vector<std::pair<std::string, at::Tensor>> buffers;
  if (options.buffers) {
    for (const auto& b : model.root_module().named_buffers(/*recurse=*/true)) {
      const auto file = hf::detail::file_name_of(options.file_name, b.key());
      if (!file) continue;
      buffers.emplace_back(*file, b.value());
      specs.push_back({*file, hf::detail::saved_dtype(b.value().scalar_type(), options), b.value().sizes().vec()});
    }
  }
  model.wait_for_shard_readers();
  fsdpx::hf::SavedSafetensors saved;
  std::optional<fsdpx::hf::SafetensorsWriter> out;
  std::exception_ptr write_failure;  // rank 0's first; it keeps gathering without writing
  const auto write = [&](auto&& fn) {
    if (writer && !write_failure) write_failure = dist::capture_failure(fn);
  };
  write([&] { out.emplace(dir, specs, options.files); });
  for (size_t i = 0; i < model.num_units(); ++i) {
    core::Unit& u = model.unit(i);
    if (unit_names[i].empty()) continue;
    core::Unit::MasterGather gather;
    dist::agree_on_outcome<Error>(world, dist::capture_failure([&] { gather = u.master_gather_buffers(); }),
                                  ::fsdpx::detail::str("allocating unit '", u.name(), "' whole to save it"));
    model.mesh().shard_group().all_gather(gather.full, gather.input);
    write([&] {
      const at::Tensor host = gather.full.to(at::kCPU);
      for (const auto& [p, name] : unit_names[i]) {
        const at::Tensor t = host.narrow(0, p->offset, p->numel).view(p->shape);
        out->write(name, t.to(hf::detail::saved_dtype(t.scalar_type(), options)));
      }
    });
  }
  write([&] {
    for (const auto& [name, b] : buffers)
      out->write(name, b.to(at::kCPU, hf::detail::saved_dtype(b.scalar_type(), options)));
    saved = out->finish();
  });
  dist::agree_on_outcome<IoError>(world, write_failure,
                                  ::fsdpx::detail::str("writing the model's safetensors to '", dir.string(), "'"));
  return saved;
}

/// Writes a module's weights and buffers (not sharded) to `dir` in Hugging Face's safetensors layout.
inline fsdpx::hf::SavedSafetensors save_model_safetensors(torch::nn::Module& module, const std::filesystem::path& dir,
                                                          const SafetensorsSaveOptions& options = {}) {
  fsdpx::hf::NamedTensors tensors;
  const auto add = [&](const std::string& key, const at::Tensor& t) {
    const auto file = hf::detail::file_name_of(options.file_name, key);
    if (file) tensors.emplace_back(*file, t.detach().to(hf::detail::saved_dtype(t.scalar_type(), options)));
  };
  for (const auto& p : module.named_parameters(/*recurse=*/true)) add(p.key(), p.value());
  if (options.buffers) {
    for (const auto& b : module.named_buffers(/*recurse=*/true)) add(b.key(), b.value());
  }
  return fsdpx::hf::save_safetensors(dir, tensors, options.files);
}

}  // namespace fsdpx

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/hf/impl/model_safetensors.ipp>
#endif
