// Out-of-line functions of fsdpx/dcp/state_dict_loader.hpp: included by it (header-only) or by
// fsdpx/impl/src.hpp (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <fsdpx/dcp/state_dict_loader.hpp>

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include <fsdpx/checkpoint/detail/slice_loader.hpp>
#include <fsdpx/checkpoint/state_dict.hpp>

namespace fsdpx::dcp {

FSDPX_DECL void load_model(ShardedModelRef model_ref, const Reader& reader, const LoadOptions& options) {
  core::ShardedModel& model = *model_ref;
  model.wait_for_shard_readers();  // a background checkpoint copy may still read the shards
  model.reshard_all();             // the next forward gathers the loaded shards
  // Floating-point values are cast, as from Hugging Face's files: a bf16 checkpoint loads into float32 masters.
  ::fsdpx::detail::SliceLoader loader("model", /*cast_floating=*/true);
  // Where each model tensor is in the checkpoint: an entry of its own, or a run of a larger one (placed_in).
  struct Source {
    std::string fqn;  // the entry, prefix included
    int64_t offset = 0;
    std::optional<std::vector<int64_t>> placed_shape{};  // the larger entry's shape, when placed
  };
  std::map<std::string, Source> source_of;  // by the model's name
  const auto wanted = [&](const std::string& name) {
    const auto file = options.file_name ? options.file_name(name) : std::optional<std::string>(name);
    if (!file) return false;
    Source src{options.prefix + *file};
    if (options.placed_in) {
      // Placed only where the checkpoint has the larger entry: one saved tensor by tensor loads as it is
      if (auto at = options.placed_in(*file); at && reader.find_tensor(options.prefix + at->fqn) != nullptr)
        src = {options.prefix + at->fqn, at->offset, std::move(at->shape)};
    }
    source_of.emplace(name, std::move(src));
    return true;
  };
  ::fsdpx::detail::add_param_targets(loader, model, wanted);
  if (options.buffers) ::fsdpx::detail::add_buffer_targets(loader, model, wanted);
  // One saved "rank" holding everything, fed a slice at a time: only this rank's ranges are read.
  const auto feed = [&](std::optional<TensorSlice> slice) {
    StateDict sd;
    sd.world_size = 1;
    if (slice) sd.entries.push_back(std::move(*slice));
    loader.load(sd, "data");
  };
  const auto empty_slice = [](const std::string& name, const std::vector<int64_t>& shape, c10::ScalarType dtype) {
    return TensorSlice{name, shape, 0, 0, {{"data", at::empty({0}, at::TensorOptions().dtype(dtype))}}};
  };
  feed({});  // so that a name the checkpoint lacks is missing even where this rank holds none of it
  std::set<std::string> used;
  struct Read {
    std::string name;
    std::vector<int64_t> shape;  // the saved shape (the model tensor's own, when placed)
    int64_t begin, end;
  };
  std::vector<Read> reads;
  for (const auto& [name, targets] : loader.targets()) {
    const Source& src = source_of.at(name);
    const TensorEntry* t = reader.find_tensor(src.fqn);
    if (t == nullptr) continue;  // missing: named by finish()
    used.insert(src.fqn);
    std::vector<int64_t> shape = t->size;
    if (src.placed_shape) {
      FSDPX_CHECK_AS(IoError, t->size == *src.placed_shape && !targets.empty(), "DCP checkpoint '",
                     reader.dir().string(), "': '", src.fqn, "' has shape ", c10::IntArrayRef(t->size), ", not ",
                     c10::IntArrayRef(*src.placed_shape), ", the shape '", name, "' lies in from element ", src.offset);
      shape = targets.front().shape;
    }
    for (const auto& target : targets) {
      if (target.begin < target.end && shape == target.shape) reads.push_back({name, shape, target.begin, target.end});
    }
    if (reads.empty() || reads.back().name != name) reads.push_back({name, shape, 0, 0});
  }
  for (const auto& [name, shape, begin, end] : reads) {
    const Source& src = source_of.at(name);
    const TensorEntry& t = reader.tensor(src.fqn);
    if (begin == end) {
      feed(empty_slice(name, shape, t.dtype));  // seen (or its shape mismatch named) without a byte read
      continue;
    }
    feed(TensorSlice{name, shape, begin, end, {{"data", reader.read(src.fqn, src.offset + begin, src.offset + end)}}});
  }
  for (const auto& [fqn, entry] : reader.metadata().entries) {
    const auto* t = std::get_if<TensorEntry>(&entry);
    if (t == nullptr || used.count(fqn) != 0 || fqn.compare(0, options.prefix.size(), options.prefix) != 0) continue;
    const std::string name = fqn.substr(options.prefix.size());
    if (options.ignore && options.ignore(name)) continue;
    feed(empty_slice(name, t->size, t->dtype));  // not in the model: named by finish() when strict
  }
  loader.finish(options.strict);
}

}  // namespace fsdpx::dcp

namespace fsdpx::dcp::detail {

/// A number of a DCP param group (a Python float, int or bool); `what` names it in errors.
inline double group_number(const c10::IValue& v, const std::string& what) {
  if (v.isDouble()) return v.toDouble();
  if (v.isInt()) return static_cast<double>(v.toInt());
  if (v.isBool()) return v.toBool() ? 1.0 : 0.0;
  throw IoError(::fsdpx::detail::str("fsdpx: ", what, " is ", v.tagKind(), ", not a number"));
}

/// Param group `g` of a DCP checkpoint's optimizer state (`param_groups.<g>.<key>` under `prefix`) as the
/// hyperparameters fsdpx restores (group_hyperparameters' keys for `options`' optimizer).
inline std::map<std::string, std::vector<double>> param_group(const Reader& reader, const std::string& prefix, size_t g,
                                                              torch::optim::OptimizerOptions& options) {
  std::map<std::string, std::vector<double>> out;
  for (const auto& [key, want] : ::fsdpx::detail::group_hyperparameters(options)) {
    const std::string fqn = ::fsdpx::detail::str(prefix, "param_groups.", g, ".", key);
    FSDPX_CHECK_AS(IoError, reader.has_bytes(fqn), "DCP checkpoint '", reader.dir().string(), "' has no '", fqn,
                   "': its param group ", g, " was saved by an optimizer of another kind than this one");
    const c10::IValue v = reader.read_bytes(fqn);
    const std::string what = ::fsdpx::detail::str("DCP checkpoint '", reader.dir().string(), "': '", fqn, "'");
    auto& values = out[key];
    if (v.isTuple() || v.isList()) {
      const std::vector<c10::IValue> items = v.isTuple() ? v.toTupleRef().elements().vec() : v.toListRef().vec();
      for (const c10::IValue& item : items) values.push_back(group_number(item, what));
    } else {
      values.push_back(group_number(v, what));
    }
    FSDPX_CHECK_AS(IoError, values.size() == want.size(), what, " holds ", values.size(), " numbers, not ",
                   want.size());
  }
  return out;
}

}  // namespace fsdpx::dcp::detail

namespace fsdpx::dcp {

FSDPX_DECL void load_optimizer(ShardedModelRef model_ref, torch::optim::Optimizer& optimizer, const Reader& reader,
                               const LoadOptions& options) {
  core::ShardedModel& model = *model_ref;
  const auto& entries = reader.metadata().entries;
  const std::string state_prefix = options.prefix + "state.";
  // The state keys the checkpoint holds for each model parameter (by the checkpoint's name of it): those
  // under "state.<name>.", without "step".
  struct Saved {
    std::string name;               // the checkpoint's (a larger tensor's, when placed in one)
    std::vector<std::string> keys;  // exp_avg, exp_avg_sq, ...
    std::vector<int64_t> shape;     // the saved state's shape
    int64_t offset = 0;             // where this parameter's elements start in it
  };

  std::map<std::string, Saved> saved;  // by the model's name
  StateDict sd;
  sd.component = "optim";
  sd.world_size = 1;  // one saved "rank" holding everything: this rank's ranges, read from the chunks
  for (size_t i = 0; i < model.num_units(); ++i) {
    for (const core::ParamInfo& p : model.unit(i).layout().params()) {
      const auto file = options.file_name ? options.file_name(p.name) : std::optional<std::string>(p.name);
      if (!file) continue;
      Saved s{*file, {}, p.shape, 0};
      if (options.placed_in) {
        if (auto at = options.placed_in(*file); at && reader.has_entry_under(state_prefix + at->fqn + "."))
          s = {at->fqn, {}, at->shape, at->offset};
      }
      const std::string base = state_prefix + s.name + ".";
      for (auto it = entries.lower_bound(base); it != entries.end() && it->first.starts_with(base); ++it) {
        const std::string key = it->first.substr(base.size());
        if (key == "step" || key.find('.') != std::string::npos) continue;
        const auto* t = std::get_if<TensorEntry>(&it->second);
        FSDPX_CHECK_AS(
            IoError, t != nullptr && t->size == s.shape, "DCP checkpoint '", reader.dir().string(), "': '", it->first,
            "' is ",
            t ? ::fsdpx::detail::str("a tensor of shape ", c10::IntArrayRef(t->size)) : std::string("a bytes entry"),
            ", not the optimizer state of '", p.name, "' (of shape ", c10::IntArrayRef(s.shape), ")");
        s.keys.push_back(key);
      }
      if (s.keys.empty()) continue;  // no state saved: frozen, or not stepped, when saved
      FSDPX_CHECK_AS(IoError, reader.find_tensor(base + "step") != nullptr, "DCP checkpoint '", reader.dir().string(),
                     "' holds optimizer state for '", s.name, "' but no '", base, "step'");
      sd.trained.push_back(p.name);
      saved.emplace(p.name, std::move(s));
    }
  }
  // This rank's part of each parameter's state, as optimizer_state_dict would have taken it.
  for (size_t i = 0; i < model.num_units(); ++i) {
    const core::Unit& u = model.unit(i);
    const int64_t base = u.layout().shard_range(u.shard_rank()).begin;
    for (const auto& op : u.optim_params()) {
      const int64_t op_begin = base + op.range.begin, op_end = base + op.range.end;
      for (const core::ParamInfo& p : u.layout().params()) {
        const int64_t lo = std::max(p.offset, op_begin), hi = std::min(p.offset + p.numel, op_end);
        const auto it = saved.find(p.name);
        if (lo >= hi || it == saved.end()) continue;
        const std::string prefix = state_prefix + it->second.name + ".";
        const double step = reader.read(prefix + "step").item<double>();
        FSDPX_CHECK_AS(IoError, step >= 0 && step == std::floor(step) && step < 9.0e15, "DCP checkpoint '",
                       reader.dir().string(), "': '", prefix, "step' is ", step, ", not a step count");
        TensorSlice s{p.name, p.shape, lo - p.offset, hi - p.offset, {}, static_cast<int64_t>(step)};
        const int64_t at = it->second.offset;
        for (const std::string& key : it->second.keys)
          s.tensors[key] = reader.read(prefix + key, at + s.begin, at + s.end);
        sd.entries.push_back(std::move(s));
      }
    }
  }
  // The param groups' hyperparameters, when the checkpoint has as many groups and each holds the
  // parameters this rank's group of the same index steps.
  size_t groups = 0;
  while (reader.has_bytes(::fsdpx::detail::str(options.prefix, "param_groups.", groups, ".lr"))) ++groups;
  if (groups == optimizer.param_groups().size()) {
    for (size_t g = 0; g < groups; ++g) {
      sd.param_groups.push_back(detail::param_group(reader, options.prefix, g, optimizer.param_groups()[g].options()));
      const std::string params = ::fsdpx::detail::str(options.prefix, "param_groups.", g, ".params");
      if (!reader.has_bytes(params)) continue;
      const c10::IValue listed = reader.read_bytes(params);
      std::set<std::string> names;
      if (listed.isList()) {
        for (const c10::IValue& n : listed.toListRef()) {
          if (n.isString()) names.insert(n.toStringRef());
        }
      }
      std::set<const c10::TensorImpl*> mine;
      for (const at::Tensor& t : optimizer.param_groups()[g].params()) mine.insert(t.unsafeGetTensorImpl());
      for (size_t i = 0; i < model.num_units(); ++i) {
        const core::Unit& u = model.unit(i);
        for (const auto& op : u.optim_params()) {
          if (mine.count(op.tensor.unsafeGetTensorImpl()) == 0) continue;
          for (const core::ParamInfo& p : u.layout().params()) {
            const auto it = saved.find(p.name);
            FSDPX_CHECK(p.decay != op.decay || it == saved.end() || names.count(it->second.name) != 0,
                        "loading the optimizer state from DCP checkpoint '", reader.dir().string(), "': '", p.name,
                        "' is in this optimizer's param group ", g, ", but not in the checkpoint's ('", params,
                        "'); build the optimizer's groups as the saving job did, or load the state only");
          }
        }
      }
    }
  }
  load_optimizer_state_dict(model, optimizer, sd);
}

}  // namespace fsdpx::dcp
