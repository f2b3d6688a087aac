// Out-of-line functions of fsdpx/checkpoint/dcp_reader.hpp: included by it (header-only) or by
// fsdpx/impl/src.hpp (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include <fsdpx/checkpoint/dcp_reader.hpp>
#include <fsdpx/checkpoint/detail/pickle.hpp>
#include <fsdpx/checkpoint/detail/slice_loader.hpp>
#include <fsdpx/checkpoint/detail/torch_io.hpp>
#include <fsdpx/checkpoint/state_dict.hpp>
#include <fsdpx/detail/file_io.hpp>

namespace fsdpx::checkpoint::dcp::detail {

/// A bytes entry's pickle as plain values; `what` names it in errors.
class PlainValues {
 public:
  PlainValues(const ::fsdpx::checkpoint::detail::pickle::Pickle& p, std::string what, int64_t max_values)
      : p_(p), what_(std::move(what)), left_(max_values) {}

  c10::IValue value(::fsdpx::checkpoint::detail::pickle::Id id, int depth = 0) {
    using ::fsdpx::checkpoint::detail::pickle::Kind;
    // Shared nodes are converted once per use: the value budget bounds a pickle that nests shared lists.
    FSDPX_CHECK_AS(IoError, --left_ >= 0 && depth <= max_depth, what_,
                   " holds more values, or nests deeper, than a plain value may (", max_depth, " levels)");
    const auto& n = p_[id];
    switch (n.kind) {
      case Kind::none: return {};
      case Kind::boolean: return n.integer != 0;
      case Kind::integer: return n.integer;
      case Kind::floating: return n.floating;
      case Kind::string: return std::string(n.text);
      case Kind::tuple: {
        std::vector<c10::IValue> items;
        for (const auto item : n.items) items.push_back(value(item, depth + 1));
        return c10::ivalue::Tuple::create(std::move(items));
      }
      case Kind::list: {
        c10::impl::GenericList list(c10::AnyType::get());
        for (const auto item : n.items) list.push_back(value(item, depth + 1));
        return list;
      }
      case Kind::dict: {
        c10::impl::GenericDict dict(c10::AnyType::get(), c10::AnyType::get());
        for (size_t i = 0; i + 1 < n.items.size(); i += 2) {
          c10::IValue key = value(n.items[i], depth + 1);
          FSDPX_CHECK_AS(IoError, key.isString() || key.isInt() || key.isDouble() || key.isBool(), what_,
                         " has a dict key that is ",
                         ::fsdpx::checkpoint::detail::pickle::to_string(p_[n.items[i]].kind),
                         "; plain values have str, int, float or bool keys");
          dict.insert_or_assign(std::move(key), value(n.items[i + 1], depth + 1));
        }
        return dict;
      }
      default: break;
    }
    throw IoError(::fsdpx::detail::str("fsdpx: ", what_, " holds ",
                                       ::fsdpx::checkpoint::detail::pickle::to_string(n.kind), " (at byte ", n.offset,
                                       "): fsdpx reads plain values only (None, bool, int, float, str, and lists, "
                                       "tuples and dicts of them)"));
  }

 private:
  static constexpr int max_depth = 32;
  const ::fsdpx::checkpoint::detail::pickle::Pickle& p_;
  std::string what_;
  int64_t left_;
};

inline bool no_globals(std::string_view, std::string_view) { return false; }

/// The plain value of the torch.save archive at bytes [offset, offset + length) of `path`: its pickle only,
/// read by fsdpx's pickle reader with no global admitted (LibTorch's unpickler would make some classes, an
/// OrderedDict, None; and a plain value has no business holding any).
inline c10::IValue plain_archive_value(const fs::path& path, int64_t offset, int64_t length, const std::string& what,
                                       const ReaderOptions& options) {
  const std::vector<std::byte> data =
      ::fsdpx::checkpoint::detail::read_archive_pickle(path, offset, length, what, options.max_bytes_entry);
  ::fsdpx::checkpoint::detail::pickle::Limits limits;
  limits.max_bytes = options.max_bytes_entry;
  limits.max_values = options.max_bytes_values;
  const auto p = ::fsdpx::checkpoint::detail::pickle::parse(data, what, no_globals, limits);
  return PlainValues(p, what, options.max_bytes_values).value(p.root);
}

inline std::string box_text(const Chunk& c) {
  return ::fsdpx::detail::str("offsets ", c10::IntArrayRef(c.offsets), ", sizes ", c10::IntArrayRef(c.sizes));
}

}  // namespace fsdpx::checkpoint::dcp::detail

namespace fsdpx::checkpoint::dcp {

FSDPX_DECL bool is_checkpoint(const fs::path& dir) {
  std::error_code ec;
  return fs::is_directory(dir, ec) && fs::exists(dir / metadata_file_name, ec);
}

FSDPX_DECL Reader::Reader(fs::path dir, const ReaderOptions& options)
    : dir_(std::move(dir)), options_(options), md_(read_metadata(dir_ / metadata_file_name, options.metadata)) {
  // Each data file once: a regular file in the folder (read_metadata refused names with a directory part)
  // large enough for every range recorded in it, so a read never starts past a file's end.
  std::map<std::string, int64_t> sizes;
  for (const auto& [key, info] : md_.storage) {
    const std::string entry = key.offsets ? ::fsdpx::detail::str("entry '", key.fqn, "' (its chunk at offsets ",
                                                                 c10::IntArrayRef(*key.offsets), ")")
                                          : ::fsdpx::detail::str("bytes entry '", key.fqn, "'");
    if (info.transform_descriptors && !info.transform_descriptors->empty()) {
      throw IoError(::fsdpx::detail::str("fsdpx: DCP checkpoint '", dir_.string(), "': ", entry,
                                         " is stored through the transforms [",
                                         ::fsdpx::detail::join_names(*info.transform_descriptors),
                                         "] (a storage writer's extensions, such as a compressor), which fsdpx cannot "
                                         "undo; save it without extensions"));
    }
    auto it = sizes.find(info.relative_path);
    if (it == sizes.end()) {
      const fs::path path = dir_ / info.relative_path;
      const ::fsdpx::detail::Fd fd = ::fsdpx::detail::open_regular_file(path, "DCP data file");
      struct stat st{};
      if (::fstat(fd.get(), &st) != 0) ::fsdpx::detail::throw_io("stat of", path, errno);
      it = sizes.emplace(info.relative_path, int64_t{st.st_size}).first;
    }
    FSDPX_CHECK_AS(IoError, info.offset + info.length <= it->second, "DCP checkpoint '", dir_.string(), "': ", entry,
                   " lies at ", place(info), ", which has ", it->second, " bytes (truncated?)");
  }
}

FSDPX_DECL const TensorEntry* Reader::find_tensor(const std::string& fqn) const {
  const auto it = md_.entries.find(fqn);
  return it == md_.entries.end() ? nullptr : std::get_if<TensorEntry>(&it->second);
}

FSDPX_DECL const TensorEntry& Reader::tensor(const std::string& fqn) const {
  const TensorEntry* t = find_tensor(fqn);
  FSDPX_CHECK(t != nullptr, "DCP checkpoint '", dir_.string(), "' has no tensor '", fqn, "'",
              has_bytes(fqn) ? " (it is a bytes entry: read_bytes)" : "");
  return *t;
}

FSDPX_DECL bool Reader::has_bytes(const std::string& fqn) const {
  const auto it = md_.entries.find(fqn);
  return it != md_.entries.end() && std::holds_alternative<BytesEntry>(it->second);
}

FSDPX_DECL const StorageInfo& Reader::storage(const StorageIndex& key) const {
  return md_.storage.at(key);  // validate_metadata: every chunk and bytes entry has its record
}

FSDPX_DECL std::string Reader::place(const StorageInfo& info) const {
  return ::fsdpx::detail::str("bytes [", info.offset, ", ", info.offset, " + ", info.length, ") of '",
                              (dir_ / info.relative_path).string(), "'");
}

FSDPX_DECL void Reader::check_torch_save(const std::string& what, const StorageInfo& info) const {
  // DCP's default format is a torch.save (zip) archive per item; its other one (SerializationFormat.SAFETENSORS,
  // Hugging Face's storage writer) is one safetensors file per rank, which this reader does not parse.
  const fs::path path = dir_ / info.relative_path;
  const ::fsdpx::detail::Fd fd = ::fsdpx::detail::open_regular_file(path, "DCP data file");
  std::array<unsigned char, 9> head{};
  const int64_t n = std::min<int64_t>(info.length, static_cast<int64_t>(head.size()));
  ::fsdpx::detail::read_exact(fd.get(), path, info.offset, head.data(), n, info.offset + info.length);
  if (n >= 4 && std::memcmp(head.data(), "PK\x03\x04", 4) == 0) return;
  const bool safetensors = n == 9 && head[8] == '{';
  throw IoError(::fsdpx::detail::str(
      "fsdpx: ", what, " is not a torch.save archive (DCP's default storage format) but ",
      safetensors ? "a safetensors file (DCP's SerializationFormat.SAFETENSORS)" : "data of an unknown format",
      "; fsdpx reads DCP checkpoints written in the default format (FileSystemWriter's serialization_format="
      "TORCH_SAVE, no transforms)"));
}

FSDPX_DECL at::Tensor Reader::load_chunk(const std::string& fqn, const TensorEntry& t, const Chunk& c) const {
  const StorageInfo& info = storage({fqn, c.offsets});
  const std::string what = ::fsdpx::detail::str("DCP checkpoint '", dir_.string(), "': the chunk of '", fqn, "' (",
                                                detail::box_text(c), ") at ", place(info));
  check_torch_save(what, info);
  const c10::IValue v =
      ::fsdpx::checkpoint::detail::load_ivalue_range(dir_ / info.relative_path, info.offset, info.length, what);
  FSDPX_CHECK_AS(IoError, v.isTensor(), what, " holds ", v.tagKind(), ", not a tensor");
  const at::Tensor& chunk = v.toTensor();
  FSDPX_CHECK_AS(IoError, chunk.scalar_type() == t.dtype && chunk.sizes() == c10::IntArrayRef(c.sizes), what,
                 " holds a tensor of dtype ", chunk.scalar_type(), " and sizes ", chunk.sizes(), "; the metadata says ",
                 t.dtype, " and ", c10::IntArrayRef(c.sizes));
  ++chunks_read_;
  bytes_read_ += info.length;
  return chunk;
}

FSDPX_DECL void Reader::read_into(const std::string& fqn, int64_t begin, int64_t end, const at::Tensor& dst) const {
  const TensorEntry& t = tensor(fqn);
  const size_t nd = t.size.size();
  std::vector<int64_t> stride(nd, 1);  // row-major strides of the global shape
  int64_t numel = 1;
  for (size_t i = nd; i-- > 0;) {
    stride[i] = numel;
    numel *= t.size[i];  // validate_metadata: no overflow
  }
  FSDPX_CHECK(begin >= 0 && begin <= end && end <= numel, "reading elements [", begin, ", ", end, ") of DCP tensor '",
              fqn, "', which has ", numel);
  FSDPX_CHECK(dst.dim() == 1 && dst.numel() == end - begin, "reading elements [", begin, ", ", end, ") of DCP tensor '",
              fqn, "' into a tensor of sizes ", dst.sizes());
  if (begin == end) return;
  struct Piece {
    int64_t lo, hi, src;  // global flat [lo, hi), from the chunk's flat element src
  };
  std::vector<std::pair<int64_t, int64_t>> filled;
  at::NoGradGuard no_grad;
  for (const Chunk& c : t.chunks) {
    int64_t volume = 1, first = 0, last = 0;
    for (size_t i = 0; i < nd; ++i) {
      volume *= c.sizes[i];
      first += c.offsets[i] * stride[i];
      last += (c.offsets[i] + c.sizes[i] - 1) * stride[i];
    }
    if (volume == 0 || last < begin || first >= end) continue;
    // The chunk is runs of consecutive elements: dimensions from `full` on are whole in it, so one run spans
    // dimension full - 1's extent times theirs (one run for a box of whole rows: FSDP's dim-0 shards).
    size_t full = nd;
    while (full > 0 && c.offsets[full - 1] == 0 && c.sizes[full - 1] == t.size[full - 1]) --full;
    const size_t outer = full == 0 ? 0 : full - 1;  // the runs are indexed by dimensions [0, outer)
    const int64_t run = full == 0 ? numel : c.sizes[outer] * stride[outer];
    std::vector<Piece> pieces;
    std::vector<int64_t> idx(outer, 0);
    for (int64_t k = 0;; ++k) {
      int64_t start = full == 0 ? 0 : c.offsets[outer] * stride[outer];
      for (size_t i = 0; i < outer; ++i) start += (c.offsets[i] + idx[i]) * stride[i];
      if (start >= end) break;  // runs come in increasing order
      const int64_t lo = std::max(start, begin), hi = std::min(start + run, end);
      if (lo < hi) pieces.push_back({lo, hi, k * run + (lo - start)});
      size_t i = outer;  // the next run: count up the outer index, last dimension fastest
      while (i > 0 && ++idx[i - 1] == c.sizes[i - 1]) idx[--i] = 0;
      if (i == 0) break;
    }
    if (pieces.empty()) continue;
    const at::Tensor data = load_chunk(fqn, t, c).contiguous().view({-1});
    for (const Piece& p : pieces) {
      dst.narrow(0, p.lo - begin, p.hi - p.lo).copy_(data.narrow(0, p.src, p.hi - p.lo));
      filled.emplace_back(p.lo, p.hi);
    }
  }
  std::sort(filled.begin(), filled.end());
  int64_t covered = begin;
  for (const auto& [lo, hi] : filled) {
    if (lo > covered) break;
    covered = std::max(covered, hi);
  }
  if (covered < end) {
    std::vector<int64_t> at(nd);
    for (size_t i = 0; i < nd; ++i) at[i] = covered / stride[i] % t.size[i];
    throw IoError(::fsdpx::detail::str("fsdpx: DCP checkpoint '", dir_.string(), "': no chunk of tensor '", fqn,
                                       "' (size ", c10::IntArrayRef(t.size), ") holds its element ", covered,
                                       " (flattened; at ", c10::IntArrayRef(at), ")"));
  }
}

FSDPX_DECL c10::IValue Reader::read_bytes(const std::string& fqn) const {
  FSDPX_CHECK(has_bytes(fqn), "DCP checkpoint '", dir_.string(), "' has no bytes entry '", fqn, "'",
              find_tensor(fqn) != nullptr ? " (it is a tensor: read)" : "");
  const StorageInfo& info = storage({fqn, std::nullopt});
  const std::string what =
      ::fsdpx::detail::str("DCP checkpoint '", dir_.string(), "': bytes entry '", fqn, "' at ", place(info));
  check_torch_save(what, info);
  ++chunks_read_;
  bytes_read_ += info.length;
  return detail::plain_archive_value(dir_ / info.relative_path, info.offset, info.length, what, options_);
}

FSDPX_DECL c10::IValue read_plain_file(const fs::path& path, const ReaderOptions& options) {
  std::error_code ec;
  const auto size = fs::file_size(path, ec);  // a stat: no open, so nothing that could block
  FSDPX_CHECK_AS(IoError, !ec, "cannot read '", path.string(), "': ", ec.message());
  return detail::plain_archive_value(path, 0, static_cast<int64_t>(size), ::fsdpx::detail::str("'", path.string(), "'"),
                                     options);
}

}  // namespace fsdpx::checkpoint::dcp

namespace fsdpx {

FSDPX_DECL void load_model_state_dict(core::ShardedModel& model, const checkpoint::dcp::Reader& reader,
                                      const DcpLoadOptions& options) {
  model.wait_for_shard_readers();  // a background checkpoint copy may still read the shards
  model.reshard_all();             // the next forward gathers the loaded shards
  // Floating-point values are cast, as from Hugging Face's files: a bf16 checkpoint loads into float32 masters.
  detail::SliceLoader loader("model", /*cast_floating=*/true);
  // Where each model tensor is in the checkpoint: an entry of its own, or a run of a larger one (placed_in).
  struct Source {
    std::string fqn;  // the entry, prefix included
    int64_t offset = 0;
    std::optional<std::vector<int64_t>> placed_shape;  // the larger entry's shape, when placed
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
  detail::add_param_targets(loader, model, wanted);
  if (options.buffers) detail::add_buffer_targets(loader, model, wanted);
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
    const checkpoint::dcp::TensorEntry* t = reader.find_tensor(src.fqn);
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
    const checkpoint::dcp::TensorEntry& t = reader.tensor(src.fqn);
    if (begin == end) {
      feed(empty_slice(name, shape, t.dtype));  // seen (or its shape mismatch named) without a byte read
      continue;
    }
    feed(TensorSlice{name, shape, begin, end, {{"data", reader.read(src.fqn, src.offset + begin, src.offset + end)}}});
  }
  for (const auto& [fqn, entry] : reader.metadata().entries) {
    const auto* t = std::get_if<checkpoint::dcp::TensorEntry>(&entry);
    if (t == nullptr || used.count(fqn) != 0 || fqn.compare(0, options.prefix.size(), options.prefix) != 0) continue;
    const std::string name = fqn.substr(options.prefix.size());
    if (options.ignore && options.ignore(name)) continue;
    feed(empty_slice(name, t->size, t->dtype));  // not in the model: named by finish() when strict
  }
  loader.finish(options.strict);
}

}  // namespace fsdpx

namespace fsdpx::detail {

/// A number of a DCP param group (a Python float, int or bool); `what` names it in errors.
inline double group_number(const c10::IValue& v, const std::string& what) {
  if (v.isDouble()) return v.toDouble();
  if (v.isInt()) return static_cast<double>(v.toInt());
  if (v.isBool()) return v.toBool() ? 1.0 : 0.0;
  throw IoError(::fsdpx::detail::str("fsdpx: ", what, " is ", v.tagKind(), ", not a number"));
}

/// Param group `g` of a DCP checkpoint's optimizer state (`param_groups.<g>.<key>` under `prefix`) as the
/// hyperparameters fsdpx restores (group_hyperparameters' keys for `options`' optimizer).
inline std::map<std::string, std::vector<double>> dcp_param_group(const checkpoint::dcp::Reader& reader,
                                                                  const std::string& prefix, size_t g,
                                                                  torch::optim::OptimizerOptions& options) {
  std::map<std::string, std::vector<double>> out;
  for (const auto& [key, want] : group_hyperparameters(options)) {
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

}  // namespace fsdpx::detail

namespace fsdpx {

FSDPX_DECL void load_optimizer_state_dict(torch::optim::Optimizer& optimizer, core::ShardedModel& model,
                                          const checkpoint::dcp::Reader& reader, const DcpLoadOptions& options) {
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
        const auto* t = std::get_if<checkpoint::dcp::TensorEntry>(&it->second);
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
      sd.param_groups.push_back(
          ::fsdpx::detail::dcp_param_group(reader, options.prefix, g, optimizer.param_groups()[g].options()));
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
  load_optimizer_state_dict(optimizer, model, [&](const auto& fn) { fn(sd); });
}

}  // namespace fsdpx
