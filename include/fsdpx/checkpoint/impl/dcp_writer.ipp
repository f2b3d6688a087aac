// Out-of-line functions of fsdpx/checkpoint/dcp_writer.hpp: included by it (header-only) or by
// fsdpx/impl/src.hpp (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <fsdpx/checkpoint/dcp_writer.hpp>

#include <algorithm>
#include <limits>
#include <exception>
#include <map>
#include <optional>
#include <set>
#include <type_traits>
#include <utility>
#include <variant>

#include <ATen/ATen.h>

#include <fsdpx/checkpoint/detail/torch_io.hpp>
#include <fsdpx/checkpoint/state_dict.hpp>
#include <fsdpx/core/optim.hpp>
#include <fsdpx/detail/json.hpp>
#include <fsdpx/dist/outcome.hpp>

namespace fsdpx::checkpoint::dcp {

namespace detail {

/// Appends the boxes covering elements [begin, end) of the sub-tensor at `dim` selected by `prefix`.
inline void cover(std::span<const int64_t> shape, std::span<const int64_t> strides, size_t dim, int64_t begin,
                  int64_t end, std::vector<int64_t>& prefix, std::vector<Chunk>& out) {
  if (begin >= end) return;
  // A box: the prefix's indices, `count` indices from `start` at `dim`, everything after it.
  const auto box = [&](int64_t start, int64_t count) {
    Chunk c;
    c.offsets = prefix;
    c.sizes.assign(prefix.size(), 1);
    c.offsets.push_back(start);
    c.sizes.push_back(count);
    for (size_t d = dim + 1; d < shape.size(); ++d) {
      c.offsets.push_back(0);
      c.sizes.push_back(shape[d]);
    }
    out.push_back(std::move(c));
  };
  const int64_t per_index = strides[dim];
  if (dim + 1 == shape.size()) return box(begin, end - begin);
  const auto inside = [&](int64_t index, int64_t b, int64_t e) {
    prefix.push_back(index);
    cover(shape, strides, dim + 1, b - index * per_index, e - index * per_index, prefix, out);
    prefix.pop_back();
  };
  int64_t first = begin / per_index;
  const int64_t last = (end - 1) / per_index;
  if (first == last) return inside(first, begin, end);
  if (begin % per_index != 0) inside(first, begin, (first + 1) * per_index), ++first;
  const bool partial_tail = end % per_index != 0;
  const int64_t whole_end = partial_tail ? last : last + 1;
  if (whole_end > first) box(first, whole_end - first);
  if (partial_tail) inside(last, last * per_index, end);
}

inline int64_t flat_offset(const Chunk& c, std::span<const int64_t> strides) {
  int64_t at = 0;
  for (size_t d = 0; d < c.offsets.size(); ++d) at += c.offsets[d] * strides[d];
  return at;
}

inline std::vector<int64_t> row_major_strides(std::span<const int64_t> shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (size_t d = shape.size(); d-- > 1;) strides[d - 1] = strides[d] * shape[d];
  return strides;
}

/// Every rank's bytes, in rank order, on every rank (two all-gathers: the sizes, then the padded bytes).
inline std::vector<std::string> all_gather_bytes(dist::AnyCommunicator& comm, const std::string& mine) {
  const int n = comm.size();
  at::Tensor sizes = at::empty({n}, at::kLong);
  comm.all_gather(sizes, at::tensor({static_cast<int64_t>(mine.size())}, at::kLong));
  int64_t largest = 0;
  for (int r = 0; r < n; ++r) largest = std::max(largest, sizes[r].item<int64_t>());
  at::Tensor padded = at::zeros({std::max<int64_t>(largest, 1)}, at::kByte);
  std::copy(mine.begin(), mine.end(), reinterpret_cast<char*>(padded.data_ptr()));
  at::Tensor all = at::empty({n * padded.numel()}, at::kByte);
  comm.all_gather(all, padded);
  std::vector<std::string> out;
  const char* base = reinterpret_cast<const char*>(all.const_data_ptr());
  for (int r = 0; r < n; ++r) out.emplace_back(base + r * padded.numel(), sizes[r].item<int64_t>());
  return out;
}

}  // namespace detail

FSDPX_DECL std::vector<Chunk> cover_flat_range(std::span<const int64_t> shape, int64_t begin, int64_t end) {
  int64_t numel = 1;
  for (const int64_t d : shape) {
    FSDPX_CHECK(d >= 0, "a tensor's size cannot be negative (", d, ")");
    FSDPX_CHECK(d == 0 || numel <= std::numeric_limits<int64_t>::max() / d, "a tensor's element count overflows");
    numel *= d;
  }
  FSDPX_CHECK(0 <= begin && begin <= end && end <= numel, "elements [", begin, ", ", end,
              ") are not within a tensor of ", numel, " elements");
  std::vector<Chunk> out;
  if (begin == end) return out;
  if (shape.empty()) return {Chunk{}};
  const std::vector<int64_t> strides = detail::row_major_strides(shape);
  std::vector<int64_t> prefix;
  detail::cover(shape, strides, 0, begin, end, prefix, out);
  return out;
}

namespace detail {

FSDPX_DECL RankData write_rank_data(const fs::path& dir, int rank, const RankState& state) {
  RankData out;
  out.relative_path = data_file_name(rank);
  std::optional<::fsdpx::detail::DurableFile> file;  // none for a rank with nothing to save (a replica)
  const auto open = [&]() -> ::fsdpx::detail::DurableFile& {
    if (!file) file.emplace(dir / out.relative_path);
    return *file;
  };
  const auto append = [&](const c10::IValue& value) {
    ::fsdpx::checkpoint::detail::write_ivalue(value, [&](const void* bytes, size_t n) { open().append(bytes, n); });
  };
  const auto path_of = [](const std::string& fqn, const std::vector<PathStep>& path) {
    return path.empty() ? std::vector<PathStep>{PathStep(fqn)} : path;
  };
  for (const SavedTensor& t : state.tensors) {
    const at::Tensor data = t.values.contiguous();
    FSDPX_CHECK_AS(InternalError, data.is_cpu() && data.numel() == t.end - t.begin, "the part of '", t.fqn,
                   "' to save holds ", data.numel(), " elements on ", data.device(), ", not ", t.end - t.begin,
                   " on the CPU");
    out.tensors.push_back({t.fqn, data.scalar_type(), t.shape, path_of(t.fqn, t.path)});
    const std::vector<int64_t> strides = row_major_strides(t.shape);
    for (Chunk& chunk : cover_flat_range(t.shape, t.begin, t.end)) {
      // A view of the part's memory (no copy): torch.save writes a tensor's whole storage, so the box
      // is its own storage rather than a view into the part's.
      const int64_t first = (chunk.offsets.empty() ? 0 : flat_offset(chunk, strides)) - t.begin;
      const at::Tensor box =
          at::from_blob(static_cast<char*>(data.data_ptr()) + first * static_cast<int64_t>(data.element_size()),
                        chunk.sizes, data.options());
      const int64_t offset = open().bytes();
      append(box);
      out.pieces.push_back({t.fqn, std::move(chunk), offset, file->bytes() - offset});
    }
  }
  for (const SavedBytes& b : state.bytes) {
    const int64_t offset = open().bytes();
    append(b.value);
    out.bytes.push_back({b.fqn, path_of(b.fqn, b.path), offset, file->bytes() - offset});
  }
  if (file) out.file = file->commit();
  return out;
}

FSDPX_DECL Metadata make_metadata(std::span<const RankData> ranks) {
  Metadata md;
  md.version = current_version;
  md.planner_data.emplace();
  for (const RankData& rank : ranks) {
    for (const RankData::Tensor& t : rank.tensors) {
      auto [it, fresh] = md.entries.try_emplace(t.fqn, TensorEntry{.dtype = t.dtype, .size = t.size});
      const auto* held = std::get_if<TensorEntry>(&it->second);
      FSDPX_CHECK_AS(IoError, held && held->dtype == t.dtype && held->size == t.size,
                     "DCP save: the ranks disagree on '", t.fqn, "': one holds it as ", c10::toString(t.dtype), " ",
                     c10::IntArrayRef(t.size), held ? "" : ", another as a bytes entry");
      if (fresh) (*md.planner_data)[t.fqn] = t.path;
    }
    for (const RankData::Piece& p : rank.pieces) {
      auto& entry = std::get<TensorEntry>(md.entries.at(p.fqn));
      const int64_t index = static_cast<int64_t>(entry.chunks.size());
      entry.chunks.push_back(p.chunk);
      md.storage[StorageIndex{p.fqn, p.chunk.offsets}] = StorageInfo{
          .relative_path = rank.relative_path, .offset = p.offset, .length = p.length, .chunk_index = index};
    }
    for (const RankData::Bytes& b : rank.bytes) {
      FSDPX_CHECK_AS(IoError, md.entries.try_emplace(b.fqn, BytesEntry{}).second, "DCP save: '", b.fqn,
                     "' is saved twice (a bytes entry comes from one rank, and is no tensor)");
      (*md.planner_data)[b.fqn] = b.path;
      md.storage[StorageIndex{b.fqn, std::nullopt}] =
          StorageInfo{.relative_path = rank.relative_path, .offset = b.offset, .length = b.length};
    }
  }
  validate_metadata(md, "the DCP checkpoint being saved");
  return md;
}

namespace {

::fsdpx::detail::Json path_json(const std::vector<PathStep>& path) {
  auto j = ::fsdpx::detail::Json::array();
  for (const PathStep& step : path) std::visit([&](const auto& v) { j.push_back(v); }, step);
  return j;
}

std::vector<PathStep> path_from_json(const ::fsdpx::detail::Json& j) {
  std::vector<PathStep> path;
  for (const auto& step : j) {
    if (step.is_string()) {
      path.emplace_back(step.get<std::string>());
    } else {
      path.emplace_back(step.get<int64_t>());  // anything else: a type error, reported by the caller
    }
  }
  return path;
}

}  // namespace

FSDPX_DECL std::string encode_rank_data(const RankData& data) {
  ::fsdpx::detail::Json j;
  j["path"] = data.relative_path;
  j["tensors"] = ::fsdpx::detail::Json::array();
  for (const auto& t : data.tensors) j["tensors"].push_back({t.fqn, dtype_name(t.dtype), t.size, path_json(t.path)});
  j["pieces"] = ::fsdpx::detail::Json::array();
  for (const auto& p : data.pieces) j["pieces"].push_back({p.fqn, p.chunk.offsets, p.chunk.sizes, p.offset, p.length});
  j["bytes"] = ::fsdpx::detail::Json::array();
  for (const auto& b : data.bytes) j["bytes"].push_back({b.fqn, path_json(b.path), b.offset, b.length});
  return j.dump();
}

FSDPX_DECL RankData decode_rank_data(std::string_view bytes, int rank) {
  try {
    const auto j = ::fsdpx::detail::Json::parse(bytes);
    RankData out;
    out.relative_path = j.at("path").get<std::string>();
    for (const auto& t : j.at("tensors")) {
      const auto dtype = dtype_from_name(t.at(1).get<std::string>());
      FSDPX_CHECK_AS(IoError, dtype.has_value(), "dtype ", t.at(1).dump());
      out.tensors.push_back(
          {t.at(0).get<std::string>(), *dtype, t.at(2).get<std::vector<int64_t>>(), path_from_json(t.at(3))});
    }
    for (const auto& p : j.at("pieces")) {
      out.pieces.push_back({p.at(0).get<std::string>(),
                            Chunk{p.at(1).get<std::vector<int64_t>>(), p.at(2).get<std::vector<int64_t>>()},
                            p.at(3).get<int64_t>(), p.at(4).get<int64_t>()});
    }
    for (const auto& b : j.at("bytes")) {
      out.bytes.push_back(
          {b.at(0).get<std::string>(), path_from_json(b.at(1)), b.at(2).get<int64_t>(), b.at(3).get<int64_t>()});
    }
    return out;
  } catch (const std::exception& e) {
    throw IoError(::fsdpx::detail::str("fsdpx: DCP save: what rank ", rank, " wrote cannot be read: ", e.what()));
  }
}

/// save_state with `state` made by `make` inside the part whose failure every rank learns of (taking a
/// state dict can fail: a host copy out of memory).
inline ::fsdpx::detail::WrittenFile save_made_state(const fs::path& dir, dist::AnyCommunicator& world,
                                                    const std::function<RankState()>& make) {
  // Every rank takes part in each collective whatever happened to it: dist::agree_on_outcome tells all
  // of them what failed where, and every rank throws.
  std::optional<RankData> mine;
  std::exception_ptr failure = dist::capture_failure([&] {
    std::error_code ec;
    fs::create_directories(dir, ec);
    FSDPX_CHECK_AS(IoError, !ec, "cannot create '", dir.string(), "': ", ec.message());
    mine = write_rank_data(dir, world.rank(), make());
  });
  dist::agree_on_outcome<IoError>(
      world, failure,
      ::fsdpx::detail::str("the DCP save's data files in '", dir.string(), "' (no .metadata is written)"));
  std::vector<RankData> ranks;
  const std::vector<std::string> all = all_gather_bytes(world, encode_rank_data(*mine));
  for (int r = 0; r < static_cast<int>(all.size()); ++r) ranks.push_back(decode_rank_data(all[r], r));
  // Rank 0 writes .metadata, last; then every rank learns whether it could.
  ::fsdpx::detail::WrittenFile written;
  failure =
      world.rank() == 0
          ? dist::capture_failure([&] { written = write_metadata(dir / metadata_file_name, make_metadata(ranks)); })
          : nullptr;
  dist::agree_on_outcome<IoError>(world, failure,
                                  ::fsdpx::detail::str("writing the DCP save's .metadata in '", dir.string(), "'"));
  return written;
}

/// The names `name` is saved under (none: left out).
inline std::vector<std::string> saved_names(const SaveOptions& options, const std::string& name) {
  std::string saved = options.saved_name ? options.saved_name(name) : name;
  if (saved.empty()) return {};
  std::vector<std::string> out{saved};
  if (options.also_saved_as) {
    for (std::string& also : options.also_saved_as(saved)) out.push_back(std::move(also));
  }
  return out;
}

/// Where tensor `name` of `shape` is saved: itself, or a run of a larger tensor (SaveOptions::placed_in).
inline Placement placement(const SaveOptions& options, const std::string& name, const std::vector<int64_t>& shape) {
  if (options.placed_in) {
    if (auto at = options.placed_in(name)) return std::move(*at);
  }
  return {name, shape, 0};
}

/// The param group of each trained unit's decayed and other parameters, as (unit, decay) -> group, from
/// every rank's shards (a rank may hold none of a unit's decayed or other elements). Collective.
inline std::map<std::pair<size_t, bool>, size_t> param_group_of_units(core::ShardedModel& model,
                                                                      torch::optim::Optimizer& optimizer) {
  std::map<const c10::TensorImpl*, size_t> group_of_tensor;
  for (size_t g = 0; g < optimizer.param_groups().size(); ++g) {
    for (const at::Tensor& t : optimizer.param_groups()[g].params()) group_of_tensor[t.unsafeGetTensorImpl()] = g;
  }
  auto mine = ::fsdpx::detail::Json::array();
  for (size_t i = 0; i < model.num_units(); ++i) {
    for (const auto& op : model.unit(i).optim_params()) {
      const auto it = group_of_tensor.find(op.tensor.unsafeGetTensorImpl());
      if (it != group_of_tensor.end()) mine.push_back({i, op.decay, it->second});
    }
  }
  std::map<std::pair<size_t, bool>, size_t> out;
  for (const std::string& rank : all_gather_bytes(model.mesh().world(), mine.dump())) {
    for (const auto& e : ::fsdpx::detail::Json::parse(rank))
      out[{e.at(0).get<size_t>(), e.at(1).get<bool>()}] = e.at(2).get<size_t>();
  }
  return out;
}

/// Param group `g`'s entries as torch.optim's class of the same name holds them: LibTorch's
/// hyperparameters, Python's flags at their defaults (LibTorch has none of them), and `params`.
inline void add_param_group(RankState& state, torch::optim::OptimizerOptions& options, size_t g,
                            std::vector<std::string> params) {
  const auto add = [&](const char* key, c10::IValue value) {
    state.bytes.push_back({::fsdpx::detail::str("param_groups.", g, ".", key),
                           std::move(value),
                           {PathStep("param_groups"), PathStep(static_cast<int64_t>(g)), PathStep(key)}});
  };
  const bool known = ::fsdpx::detail::visit_optimizer_row<::fsdpx::detail::AsOptions>(options, [&](auto row, auto& o) {
    add("lr", o.lr());
    if constexpr (decltype(row)::adam_like) {
      add("betas", c10::ivalue::Tuple::create({std::get<0>(o.betas()), std::get<1>(o.betas())}));
      add("eps", o.eps());
      add("weight_decay", o.weight_decay());
      add("amsgrad", o.amsgrad());
      add("capturable", false);
      add("decoupled_weight_decay", std::is_same_v<decltype(row), ::fsdpx::detail::AdamWRow>);
    } else {
      add("momentum", o.momentum());
      add("dampening", o.dampening());
      add("weight_decay", o.weight_decay());
      add("nesterov", o.nesterov());
    }
    add("maximize", false);
    add("foreach", c10::IValue());
    add("differentiable", false);
    add("fused", c10::IValue());
  });
  FSDPX_CHECK(known, "DCP save: this optimizer's type is not known to fsdpx (", ::fsdpx::detail::known_optimizers,
              " are)");
  c10::List<std::string> names;
  for (std::string& n : params) names.push_back(std::move(n));
  add("params", names);
}

}  // namespace detail

FSDPX_DECL ::fsdpx::detail::WrittenFile save_state(const fs::path& dir, dist::AnyCommunicator& world,
                                                   const RankState& state) {
  return detail::save_made_state(dir, world, [&] { return state; });
}

FSDPX_DECL std::vector<SavedTensor> model_tensors(const StateDict& sd, const SaveOptions& options) {
  FSDPX_CHECK(sd.kind != StateDictKind::local, "a DCP checkpoint holds sharded or full state dicts; a local one ",
              "holds flat unit shards, which name no tensor");
  std::vector<SavedTensor> out;
  for (const TensorSlice& slice : sd.entries) {
    for (const std::string& name : detail::saved_names(options, slice.name)) {
      const Placement at = detail::placement(options, name, slice.shape);
      out.push_back({at.fqn, at.shape, at.offset + slice.begin, at.offset + slice.end, slice.tensors.at("data"), {}});
    }
  }
  return out;
}

FSDPX_DECL std::vector<SavedTensor> optimizer_tensors(const StateDict& sd, const SaveOptions& options) {
  std::vector<SavedTensor> out;
  const auto at_path = [](const std::string& name, const std::string& key) {
    return std::vector<PathStep>{PathStep("state"), PathStep(name), PathStep(key)};
  };
  for (const TensorSlice& slice : sd.entries) {
    const std::vector<std::string> names = detail::saved_names(options, slice.name);
    if (names.empty()) continue;
    // A tied weight's state is saved once, as torch saves it; a placed one's as part of the larger tensor's
    const Placement at = detail::placement(options, names.front(), slice.shape);
    for (const auto& [key, values] : slice.tensors) {
      out.push_back({"state." + at.fqn + "." + key, at.shape, at.offset + slice.begin, at.offset + slice.end, values,
                     at_path(at.fqn, key)});
    }
    // The step count, a float32 scalar as torch.optim keeps it, from the rank holding the first element
    if (at.offset + slice.begin == 0) {
      out.push_back({"state." + at.fqn + ".step",
                     {},
                     0,
                     1,
                     at::full({1}, static_cast<double>(slice.step), at::kFloat),
                     at_path(at.fqn, "step")});
    }
  }
  return out;
}

FSDPX_DECL std::vector<SavedBytes> param_group_entries(core::ShardedModel& model, torch::optim::Optimizer& optimizer,
                                                       const SaveOptions& options) {
  const auto group_of = detail::param_group_of_units(model, optimizer);  // collective
  RankState state;
  if (model.mesh().world().rank() != 0) return {};
  for (size_t g = 0; g < optimizer.param_groups().size(); ++g) {
    std::vector<std::string> params;
    std::set<std::string> listed;  // a larger tensor that several are placed in is listed once
    for (size_t i = 0; i < model.num_units(); ++i) {
      for (const core::ParamInfo& p : model.unit(i).layout().params()) {
        const auto it = group_of.find({i, p.decay});
        if (it == group_of.end() || it->second != g) continue;
        const auto names = detail::saved_names(options, p.name);
        if (names.empty()) continue;
        std::string name = detail::placement(options, names.front(), p.shape).fqn;
        if (listed.insert(name).second) params.push_back(std::move(name));
      }
    }
    detail::add_param_group(state, optimizer.param_groups()[g].options(), g, std::move(params));
  }
  return std::move(state.bytes);
}

FSDPX_DECL ::fsdpx::detail::WrittenFile save_model(const fs::path& dir, core::ShardedModel& model,
                                                   const SaveOptions& options) {
  return detail::save_made_state(dir, model.mesh().world(),
                                 [&] { return RankState{model_tensors(sharded_state_dict(model), options), {}}; });
}

FSDPX_DECL ::fsdpx::detail::WrittenFile save_optimizer(const fs::path& dir, core::ShardedModel& model,
                                                       torch::optim::Optimizer& optimizer, const SaveOptions& options) {
  std::vector<SavedBytes> groups = param_group_entries(model, optimizer, options);  // collective: before the rest
  return detail::save_made_state(dir, model.mesh().world(), [&] {
    return RankState{optimizer_tensors(optimizer_state_dict(model, optimizer), options), std::move(groups)};
  });
}

}  // namespace fsdpx::checkpoint::dcp
