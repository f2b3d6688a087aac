// Out-of-line functions of fsdpx/checkpoint/dcp_metadata.hpp: included by it (header-only) or by
// fsdpx/impl/src.hpp (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <fsdpx/checkpoint/dcp_metadata.hpp>

#include <algorithm>
#include <set>

#include <c10/util/ArrayRef.h>

#include <fsdpx/checkpoint/detail/pickle.hpp>

namespace fsdpx::checkpoint::dcp::detail {

namespace pickle = ::fsdpx::checkpoint::detail::pickle;

inline constexpr std::string_view metadata_module = "torch.distributed.checkpoint.metadata";
inline constexpr std::string_view filesystem_module = "torch.distributed.checkpoint.filesystem";
inline constexpr std::string_view layout_module = "torch.serialization";

struct DtypeName {
  std::string_view name;
  std::optional<c10::ScalarType> type;  // nullopt: a dtype torch has and fsdpx does not map
};

/// Every dtype by the name it pickles as (torch.<name>).
inline constexpr DtypeName dtype_names[] = {
    {"float32", c10::kFloat},
    {"bfloat16", c10::kBFloat16},
    {"float16", c10::kHalf},
    {"float64", c10::kDouble},
    {"int64", c10::kLong},
    {"int32", c10::kInt},
    {"int16", c10::kShort},
    {"int8", c10::kChar},
    {"uint8", c10::kByte},
    {"bool", c10::kBool},
    {"uint16", c10::ScalarType::UInt16},
    {"uint32", c10::ScalarType::UInt32},
    {"uint64", c10::ScalarType::UInt64},
    {"complex32", c10::kComplexHalf},
    {"complex64", c10::kComplexFloat},
    {"complex128", c10::kComplexDouble},
    {"float8_e4m3fn", c10::ScalarType::Float8_e4m3fn},
    {"float8_e5m2", c10::ScalarType::Float8_e5m2},
    {"float8_e4m3fnuz", c10::ScalarType::Float8_e4m3fnuz},
    {"float8_e5m2fnuz", c10::ScalarType::Float8_e5m2fnuz},
    {"float8_e8m0fnu", c10::ScalarType::Float8_e8m0fnu},
    {"float4_e2m1fn_x2", c10::ScalarType::Float4_e2m1fn_x2},
    // quantized, bit-packed and sub-byte dtypes: named (so that the error says which), not mapped
    {"qint8", std::nullopt},
    {"quint8", std::nullopt},
    {"qint32", std::nullopt},
    {"quint4x2", std::nullopt},
    {"quint2x4", std::nullopt},
    {"bits1x8", std::nullopt},
    {"bits2x4", std::nullopt},
    {"bits4x2", std::nullopt},
    {"bits8", std::nullopt},
    {"bits16", std::nullopt},
    {"int1", std::nullopt},
    {"int2", std::nullopt},
    {"int3", std::nullopt},
    {"int4", std::nullopt},
    {"int5", std::nullopt},
    {"int6", std::nullopt},
    {"int7", std::nullopt},
    {"uint1", std::nullopt},
    {"uint2", std::nullopt},
    {"uint3", std::nullopt},
    {"uint4", std::nullopt},
    {"uint5", std::nullopt},
    {"uint6", std::nullopt},
    {"uint7", std::nullopt},
};

inline bool is_one_of(std::string_view name, std::initializer_list<std::string_view> names) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

/// The globals a `.metadata` may name: DCP's dataclasses, dtypes, torch.Size, the layout and memory
/// format helpers, and the path class StorageMeta's checkpoint_id may be. Nothing callable of these is
/// ever called: the reader records them.
inline bool admitted_global(std::string_view module, std::string_view name) {
  if (module == metadata_module) {
    return is_one_of(name, {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                            "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"});
  }
  if (module == filesystem_module) return name == "_StorageInfo";
  if (module == layout_module) return name == "_get_layout";
  if (module == "torch") {
    return name == "Size" || std::any_of(std::begin(dtype_names), std::end(dtype_names),
                                         [&](const DtypeName& d) { return d.name == name; });
  }
  // pathlib._local: Python 3.13's home of the path classes
  if (module == "pathlib" || module == "pathlib._local") return name == "PosixPath" || name == "PurePosixPath";
  return false;
}

// ---- the pickle's graph -> Metadata -----------------------------------------------------------------

/// Reads DCP's fixed schema off a parsed pickle. Each level of the schema is read once on the way down,
/// so a pickle that nests deeper or holds itself is refused as a value of the wrong kind, never
/// followed; values the pickle shares (through its memo) are counted each time they are read, against
/// the same limit, so that sharing cannot multiply what is made.
class MetadataReader {
 public:
  MetadataReader(const pickle::Pickle& p, std::string_view what, int64_t max_values)
      : p_(p), what_(what), max_values_(max_values) {}

  Metadata read() {
    Metadata md;
    bool has_entries = false, has_storage = false;
    const pickle::Node& root = object(p_.root, "Metadata", "the file's value");
    fields(root, "Metadata", [&](std::string_view key, pickle::Id v) {
      if (key == "state_dict_metadata") {
        has_entries = true;
        entries(v, md);
      } else if (key == "storage_data") {
        has_storage = true;
        storage(v, md);
      } else if (key == "planner_data") {
        if (!none(v)) md.planner_data = planner_data(v);
      } else if (key == "storage_meta") {
        if (!none(v)) md.storage_meta = storage_meta(v);
      } else if (key == "version") {
        if (!none(v)) md.version = std::string(string(v, "Metadata.version"));
      } else {
        return false;
      }
      return true;
    });
    if (!has_entries) fail(root, "Metadata has no state_dict_metadata");
    if (!has_storage) fail(root, "Metadata has no storage_data");
    return md;
  }

 private:
  template <class... Args>
  [[noreturn]] void fail(const pickle::Node& at, const Args&... args) const {
    throw IoError(::fsdpx::detail::str("fsdpx: '", what_, "': ", args..., " (the value made at byte ", at.offset, ")"));
  }
  void spend(size_t n, const pickle::Node& at) {
    if (n > static_cast<uint64_t>(max_values_ - used_)) {
      fail(at, "makes more than ", max_values_, " values (entries, chunks, dimensions), the limit");
    }
    used_ += static_cast<int64_t>(n);
  }

  const pickle::Node& get(pickle::Id id, pickle::Kind kind, std::string_view field) const {
    const pickle::Node& n = p_[id];
    if (n.kind != kind) fail(n, field, " is ", to_string(n.kind), ", not ", to_string(kind));
    return n;
  }
  bool none(pickle::Id id) const { return p_[id].kind == pickle::Kind::none; }
  std::string_view string(pickle::Id id, std::string_view field) const {
    return get(id, pickle::Kind::string, field).text;
  }
  int64_t integer(pickle::Id id, std::string_view field) const { return get(id, pickle::Kind::integer, field).integer; }
  bool boolean(pickle::Id id, std::string_view field) const {
    return get(id, pickle::Kind::boolean, field).integer != 0;
  }
  std::optional<std::string> optional_string(pickle::Id id, std::string_view field) const {
    if (none(id)) return std::nullopt;
    return std::string(string(id, field));
  }
  /// The elements of a tuple or a list.
  const std::vector<pickle::Id>& sequence(pickle::Id id, std::string_view field) const {
    const pickle::Node& n = p_[id];
    if (n.kind != pickle::Kind::tuple && n.kind != pickle::Kind::list) {
      fail(n, field, " is ", to_string(n.kind), ", not a tuple or a list");
    }
    return n.items;
  }

  /// An instance of `module`.`cls`: made by NEWOBJ without arguments (a dataclass) or, when `reduced`,
  /// by REDUCE (a call: torch.Size(...)).
  const pickle::Node& object(pickle::Id id, std::string_view cls, std::string_view field, bool reduced = false,
                             std::string_view module = metadata_module) const {
    const pickle::Node& n = get(id, pickle::Kind::object, field);
    const pickle::Node& c = p_[n.items[0]];
    if (c.text != module || c.name != cls) {
      fail(n, field, " is a ", c.text, ".", c.name, ", not a ", module, ".", cls);
    }
    if (n.reduced != reduced || (!reduced && !p_[n.items[1]].items.empty())) {
      fail(n, field, " is a ", cls, " made ", n.reduced ? "by a call" : "with arguments", ", not as torch writes one");
    }
    return n;
  }
  /// The arguments of a REDUCE'd object: exactly n.
  const std::vector<pickle::Id>& arguments(const pickle::Node& obj, size_t n, std::string_view field) const {
    const std::vector<pickle::Id>& args = p_[obj.items[1]].items;
    if (args.size() != n) fail(obj, field, " is made with ", args.size(), " arguments, not ", n);
    if (obj.items.size() > 2) fail(obj, field, " has a state, which torch never gives it");
    return args;
  }
  /// Calls f(key, value) for each field of a dataclass's state dict (none when it has no state); f says
  /// whether it knows the field. A field torch's class does not have is refused: a newer torch's field
  /// may change what the others mean.
  template <class F>
  void fields(const pickle::Node& obj, std::string_view cls, F&& f) {
    if (obj.items.size() < 3 || none(obj.items[2])) return;
    const pickle::Node& state = get(obj.items[2], pickle::Kind::dict, std::string(cls) + "'s state");
    std::set<std::string_view> seen;
    for (size_t i = 0; i < state.items.size(); i += 2) {
      const std::string_view key = string(state.items[i], std::string(cls) + "'s field name");
      if (!seen.insert(key).second) fail(state, cls, " has the field '", key, "' twice");
      if (!f(key, state.items[i + 1])) {
        fail(state, cls, " has the field '", key, "', which torch's ", cls, " has not (a newer torch's file?)");
      }
    }
  }

  /// A torch.Size: REDUCE of torch.Size with one tuple of integers.
  std::vector<int64_t> size(pickle::Id id, std::string_view field) {
    const pickle::Node& n = object(id, "Size", field, true, "torch");
    const std::vector<pickle::Id>& dims = sequence(arguments(n, 1, field)[0], field);
    spend(dims.size(), n);
    std::vector<int64_t> out;
    out.reserve(dims.size());
    for (const pickle::Id d : dims) out.push_back(integer(d, field));
    return out;
  }

  void entries(pickle::Id id, Metadata& md) {
    const pickle::Node& d = get(id, pickle::Kind::dict, "state_dict_metadata");
    spend(d.items.size() / 2, d);
    for (size_t i = 0; i < d.items.size(); i += 2) {
      std::string fqn(string(d.items[i], "an entry's name"));
      const pickle::Node& v = get(d.items[i + 1], pickle::Kind::object, "entry '" + fqn + "'");
      Entry e = p_[v.items[0]].name == "BytesStorageMetadata" ? Entry(bytes_entry(d.items[i + 1], fqn))
                                                              : Entry(tensor_entry(d.items[i + 1], fqn));
      if (!md.entries.emplace(std::move(fqn), std::move(e)).second) {
        fail(v, "state_dict_metadata names the entry '", string(d.items[i], ""), "' twice");
      }
    }
  }

  BytesEntry bytes_entry(pickle::Id id, const std::string& fqn) {
    const pickle::Node& n = object(id, "BytesStorageMetadata", "entry '" + fqn + "'");
    fields(n, "BytesStorageMetadata", [](std::string_view, pickle::Id) { return false; });
    return {};
  }

  TensorEntry tensor_entry(pickle::Id id, const std::string& fqn) {
    const std::string where = "entry '" + fqn + "'";
    const pickle::Node& n = object(id, "TensorStorageMetadata", where);
    TensorEntry t;
    int present = 0;
    fields(n, "TensorStorageMetadata", [&](std::string_view key, pickle::Id v) {
      if (key == "properties") {
        properties(v, where, t);
      } else if (key == "size") {
        t.size = size(v, where + "'s size");
      } else if (key == "chunks") {
        const std::vector<pickle::Id>& chunks = sequence(v, where + "'s chunks");
        spend(chunks.size(), p_[v]);
        t.chunks.reserve(chunks.size());
        for (const pickle::Id c : chunks) t.chunks.push_back(chunk(c, where));
      } else {
        return false;
      }
      ++present;
      return true;
    });
    if (present != 3) fail(n, where, " lacks one of properties, size and chunks");
    return t;
  }

  Chunk chunk(pickle::Id id, const std::string& where) {
    const pickle::Node& n = object(id, "ChunkStorageMetadata", where + "'s chunk");
    Chunk c;
    int present = 0;
    fields(n, "ChunkStorageMetadata", [&](std::string_view key, pickle::Id v) {
      if (key == "offsets") {
        c.offsets = size(v, where + "'s chunk offsets");
      } else if (key == "sizes") {
        c.sizes = size(v, where + "'s chunk sizes");
      } else {
        return false;
      }
      ++present;
      return true;
    });
    if (present != 2) fail(n, where, " has a chunk without offsets or sizes");
    return c;
  }

  /// TensorProperties: its __getstate__'s tuple (dtype, layout, requires_grad, memory format encoding,
  /// pin_memory), or a dict of those fields (torch before __getstate__).
  void properties(pickle::Id id, const std::string& where, TensorEntry& t) {
    const pickle::Node& n = object(id, "TensorProperties", where + "'s properties");
    const auto set = [&](std::string_view key, pickle::Id v) {
      if (key == "dtype") {
        const pickle::Node& g = get(v, pickle::Kind::global, where + "'s dtype");
        const auto type = g.text == "torch" ? dtype_from_name(g.name) : std::nullopt;
        if (!type) fail(g, where, " has the dtype ", g.text, ".", g.name, ", which fsdpx does not map to a ScalarType");
        t.dtype = *type;
      } else if (key == "layout") {
        const pickle::Node& l = object(v, "_get_layout", where + "'s layout", true, layout_module);
        const std::string_view name = string(arguments(l, 1, where + "'s layout")[0], where + "'s layout");
        if (name != "torch.strided") fail(l, where, " has the layout ", name, "; DCP saves torch.strided tensors only");
      } else if (key == "requires_grad") {
        t.requires_grad = boolean(v, where + "'s requires_grad");
      } else if (key == "memory_format") {
        const pickle::Node& m = object(v, "_MEM_FORMAT_ENCODING", where + "'s memory format", true);
        const int64_t code = integer(arguments(m, 1, where + "'s memory format")[0], where + "'s memory format");
        if (code < 0 || code > 2) fail(m, where, " has the memory format encoding ", code, ", not 0, 1 or 2");
        t.memory_format = static_cast<MemoryFormat>(code);
      } else if (key == "pin_memory") {
        t.pin_memory = boolean(v, where + "'s pin_memory");
      } else {
        return false;
      }
      return true;
    };
    if (n.items.size() > 2 && p_[n.items[2]].kind == pickle::Kind::tuple) {
      const std::vector<pickle::Id>& state = p_[n.items[2]].items;
      if (state.size() != 5) fail(p_[n.items[2]], where, "'s properties are ", state.size(), " values, not 5");
      static constexpr std::string_view order[] = {"dtype", "layout", "requires_grad", "memory_format", "pin_memory"};
      for (size_t i = 0; i < 5; ++i) set(order[i], state[i]);
    } else {
      // A dict, with the dataclass's defaults for what it lacks: torch's default dtype is float32.
      fields(n, "TensorProperties", set);
    }
  }

  void storage(pickle::Id id, Metadata& md) {
    const pickle::Node& d = get(id, pickle::Kind::dict, "storage_data");
    spend(d.items.size() / 2, d);
    for (size_t i = 0; i < d.items.size(); i += 2) {
      StorageInfo info;
      StorageIndex key = storage_index(d.items[i], info);
      storage_info(d.items[i + 1], key.fqn, info);
      if (!md.storage.emplace(key, std::move(info)).second) {
        fail(p_[d.items[i]], "storage_data holds entry '", key.fqn, "'",
             key.offsets ? ::fsdpx::detail::str(" at offsets ", c10::IntArrayRef(*key.offsets)) : std::string(),
             " twice");
      }
    }
  }

  StorageIndex storage_index(pickle::Id id, StorageInfo& info) {
    const pickle::Node& n = object(id, "MetadataIndex", "a storage_data key");
    StorageIndex key;
    bool has_fqn = false;
    fields(n, "MetadataIndex", [&](std::string_view k, pickle::Id v) {
      if (k == "fqn") {
        key.fqn = string(v, "a storage_data key's fqn");
        has_fqn = true;
      } else if (k == "offset") {
        if (!none(v)) key.offsets = size(v, "a storage_data key's offset");
      } else if (k == "index") {
        if (!none(v)) info.chunk_index = integer(v, "a storage_data key's index");
      } else {
        return false;
      }
      return true;
    });
    if (!has_fqn) fail(n, "a storage_data key has no fqn");
    return key;
  }

  void storage_info(pickle::Id id, const std::string& fqn, StorageInfo& info) {
    const std::string where = "entry '" + fqn + "''s storage";
    const pickle::Node& n = object(id, "_StorageInfo", where, false, filesystem_module);
    int present = 0;
    fields(n, "_StorageInfo", [&](std::string_view k, pickle::Id v) {
      if (k == "relative_path") {
        info.relative_path = string(v, where + "'s relative_path");
      } else if (k == "offset") {
        info.offset = integer(v, where + "'s offset");
      } else if (k == "length") {
        info.length = integer(v, where + "'s length");
      } else if (k == "transform_descriptors") {
        if (none(v)) return true;
        const std::vector<pickle::Id>& items = sequence(v, where + "'s transform_descriptors");
        spend(items.size(), p_[v]);
        auto& out = info.transform_descriptors.emplace();
        for (const pickle::Id s : items) out.emplace_back(string(s, where + "'s transform descriptor"));
        return true;
      } else {
        return false;
      }
      ++present;
      return true;
    });
    if (present != 3) fail(n, where, " lacks one of relative_path, offset and length");
  }

  std::map<std::string, std::vector<PathStep>> planner_data(pickle::Id id) {
    const pickle::Node& d = get(id, pickle::Kind::dict, "planner_data (DefaultSavePlanner's)");
    spend(d.items.size() / 2, d);
    std::map<std::string, std::vector<PathStep>> out;
    for (size_t i = 0; i < d.items.size(); i += 2) {
      const std::string fqn(string(d.items[i], "a planner_data key"));
      const std::vector<pickle::Id>& steps = sequence(d.items[i + 1], "planner_data of '" + fqn + "'");
      spend(steps.size(), d);
      std::vector<PathStep> path;
      for (const pickle::Id s : steps) {
        if (p_[s].kind == pickle::Kind::integer) {
          path.emplace_back(p_[s].integer);
        } else {
          path.emplace_back(std::string(string(s, "a step of planner_data's path of '" + fqn + "'")));
        }
      }
      if (!out.emplace(fqn, std::move(path)).second) fail(d, "planner_data names '", fqn, "' twice");
    }
    return out;
  }

  StorageMeta storage_meta(pickle::Id id) {
    const pickle::Node& n = object(id, "StorageMeta", "storage_meta");
    StorageMeta m;
    fields(n, "StorageMeta", [&](std::string_view k, pickle::Id v) {
      if (k == "checkpoint_id") {
        if (p_[v].kind == pickle::Kind::object) {
          m.checkpoint_id = posix_path(v);
          m.checkpoint_id_is_path = true;
        } else {
          m.checkpoint_id = optional_string(v, "storage_meta.checkpoint_id");
        }
      } else if (k == "save_id") {
        m.save_id = optional_string(v, "storage_meta.save_id");
      } else if (k == "load_id") {
        m.load_id = optional_string(v, "storage_meta.load_id");
      } else if (k == "modules") {
        const std::vector<pickle::Id>& items = sequence(v, "storage_meta.modules");
        spend(items.size(), p_[v]);
        for (const pickle::Id s : items) m.modules.emplace_back(string(s, "a module of storage_meta.modules"));
      } else {
        return false;
      }
      return true;
    });
    return m;
  }

  /// pathlib.PosixPath(*parts): the parts joined as pathlib joins them.
  std::string posix_path(pickle::Id id) {
    const pickle::Node& n = get(id, pickle::Kind::object, "storage_meta.checkpoint_id");
    const pickle::Node& c = p_[n.items[0]];
    if (!c.text.starts_with("pathlib") || !n.reduced) fail(n, "storage_meta.checkpoint_id is not a str or a path");
    const std::vector<pickle::Id>& parts = p_[n.items[1]].items;
    if (n.items.size() > 2) fail(n, "storage_meta.checkpoint_id has a state, which a path never has");
    spend(parts.size(), n);
    std::string path;
    for (const pickle::Id part : parts) {
      const std::string_view s = string(part, "a part of storage_meta.checkpoint_id");
      if (s.starts_with('/') || path.empty()) {
        path = s;
      } else if (!s.empty()) {
        path += path.ends_with('/') ? "" : "/";
        path += s;
      }
    }
    return path.empty() ? "." : path;
  }

  const pickle::Pickle& p_;
  std::string_view what_;
  int64_t max_values_;
  int64_t used_ = 0;
};

// ---- checks -----------------------------------------------------------------------------------------

template <class... Args>
[[noreturn]] void refuse(bool writing, std::string_view what, const Args&... args) {
  const std::string message = ::fsdpx::detail::str("fsdpx: '", what, "': ", args...);
  if (writing) throw ConfigError(message);
  throw IoError(message);
}

/// A file name that stays in the checkpoint directory: no directory part, not "." or "..".
inline bool plain_file_name(std::string_view name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string_view::npos &&
         name.find('\0') == std::string_view::npos;
}

inline void check_tensor(const std::string& fqn, const TensorEntry& t, const Metadata& md, bool writing,
                         std::string_view what) {
  int64_t numel = 1;
  for (const int64_t d : t.size) {
    if (d < 0 || __builtin_mul_overflow(numel, d, &numel)) {
      refuse(writing, what, "entry '", fqn, "' has the size ", c10::IntArrayRef(t.size),
             ", whose element count is negative or overflows");
    }
  }
  int64_t covered = 0;
  bool overflow = false;  // overlapping chunks of more elements than an int64 counts
  std::set<std::vector<int64_t>> offsets;
  for (const Chunk& c : t.chunks) {
    const auto box = [&] {
      return ::fsdpx::detail::str("offsets ", c10::IntArrayRef(c.offsets), " and sizes ", c10::IntArrayRef(c.sizes));
    };
    if (c.offsets.size() != t.size.size() || c.sizes.size() != t.size.size()) {
      refuse(writing, what, "entry '", fqn, "' of size ", c10::IntArrayRef(t.size), " has a chunk of ", box());
    }
    int64_t volume = 1;
    for (size_t i = 0; i < t.size.size(); ++i) {
      int64_t end = 0;
      if (c.offsets[i] < 0 || c.sizes[i] < 0 || __builtin_add_overflow(c.offsets[i], c.sizes[i], &end) ||
          end > t.size[i]) {
        refuse(writing, what, "entry '", fqn, "' of size ", c10::IntArrayRef(t.size), " has a chunk of ", box(),
               ", which is not within it");
      }
      volume *= c.sizes[i];  // within the tensor, whose element count did not overflow
    }
    if (!offsets.insert(c.offsets).second) {
      refuse(writing, what, "entry '", fqn, "' has two chunks at the offsets ", c10::IntArrayRef(c.offsets));
    }
    if (md.storage.find(StorageIndex{fqn, c.offsets}) == md.storage.end()) {
      refuse(writing, what, "entry '", fqn, "' has no storage record for its chunk of ", box());
    }
    overflow = overflow || __builtin_add_overflow(covered, volume, &covered);
  }
  if (overflow || covered != numel) {
    refuse(writing, what, "entry '", fqn, "' of size ", c10::IntArrayRef(t.size), " has chunks of ",
           overflow ? std::string("more") : std::to_string(covered), " elements in all, not its ", numel,
           ": a chunk is missing or chunks overlap");
  }
}

inline void check_metadata(const Metadata& md, bool writing, std::string_view what) {
  for (const auto& [fqn, entry] : md.entries) {
    if (const auto* t = std::get_if<TensorEntry>(&entry)) {
      check_tensor(fqn, *t, md, writing, what);
    } else if (md.storage.find(StorageIndex{fqn, std::nullopt}) == md.storage.end()) {
      refuse(writing, what, "bytes entry '", fqn, "' has no storage record");
    }
  }
  for (const auto& [key, info] : md.storage) {
    const auto entry = md.entries.find(key.fqn);
    if (entry == md.entries.end()) refuse(writing, what, "storage_data holds '", key.fqn, "', which is no entry");
    if (const auto* t = std::get_if<TensorEntry>(&entry->second)) {
      if (!key.offsets ||
          std::none_of(t->chunks.begin(), t->chunks.end(), [&](const Chunk& c) { return c.offsets == *key.offsets; })) {
        refuse(writing, what, "storage_data holds a record of tensor entry '", key.fqn,
               "' that is none of its chunks' offsets");
      }
    } else if (key.offsets) {
      refuse(writing, what, "storage_data holds a record of bytes entry '", key.fqn, "' with chunk offsets");
    }
    int64_t end = 0;
    if (!plain_file_name(info.relative_path)) {
      refuse(writing, what, "entry '", key.fqn, "' is stored in '", info.relative_path,
             "', which is not a file name in the checkpoint directory");
    }
    if (info.offset < 0 || info.length < 0 || __builtin_add_overflow(info.offset, info.length, &end)) {
      refuse(writing, what, "entry '", key.fqn, "' is stored at offset ", info.offset, " with length ", info.length,
             ", which is no range of a file");
    }
    if (info.chunk_index && *info.chunk_index < 0) {
      refuse(writing, what, "entry '", key.fqn, "' has the chunk index ", *info.chunk_index);
    }
  }
}

// ---- Metadata -> pickle -----------------------------------------------------------------------------

inline void write_size(pickle::Writer& w, const std::vector<int64_t>& dims) {
  w.global("torch", "Size");
  w.tuple(1, [&](size_t) { w.tuple(dims.size(), [&](size_t i) { w.integer(dims[i]); }); });
  w.reduce();
}

inline void write_optional_string(pickle::Writer& w, const std::optional<std::string>& s) {
  if (s) {
    w.string(*s);
  } else {
    w.none();
  }
}

/// A dataclass with its state dict: the fields in order, each written by write(i) after its name.
template <class Write>
void write_dataclass(pickle::Writer& w, std::string_view module, std::string_view cls,
                     std::span<const std::string_view> names, Write&& write) {
  w.new_object(module, cls);
  w.dict(names.size(), [&](size_t i) {
    w.string(names[i]);
    write(names[i]);
  });
  w.build();
}

inline constexpr std::string_view tensor_fields[] = {"properties", "size", "chunks"};
inline constexpr std::string_view chunk_fields[] = {"offsets", "sizes"};
// MetadataIndex's __dict__: fqn, index, and offset only when there is one (its __init__ sets it then).
inline constexpr std::string_view index_fields[] = {"fqn", "index", "offset"};
// _StorageInfo's __getstate__ leaves out the fields that are None.
inline constexpr std::string_view storage_info_fields[] = {"relative_path", "offset", "length",
                                                           "transform_descriptors"};
inline constexpr std::string_view storage_meta_fields[] = {"checkpoint_id", "save_id", "load_id", "modules"};
// Metadata's __dict__: every field, in its order.
inline constexpr std::string_view metadata_fields[] = {"state_dict_metadata", "planner_data", "storage_data",
                                                       "storage_meta", "version"};

inline void write_tensor_entry(pickle::Writer& w, const TensorEntry& t) {
  write_dataclass(w, metadata_module, "TensorStorageMetadata", tensor_fields, [&](std::string_view field) {
    if (field == "properties") {
      // TensorProperties' __getstate__: a tuple, not a dict
      w.new_object(metadata_module, "TensorProperties");
      w.tuple(5, [&](size_t i) {
        if (i == 0) {
          w.global("torch", dtype_name(t.dtype));
        } else if (i == 1) {
          w.global(layout_module, "_get_layout");
          w.tuple(1, [&](size_t) { w.string("torch.strided"); });
          w.reduce();
        } else if (i == 2) {
          w.boolean(t.requires_grad);
        } else if (i == 3) {
          w.global(metadata_module, "_MEM_FORMAT_ENCODING");
          w.tuple(1, [&](size_t) { w.integer(static_cast<int64_t>(t.memory_format)); });
          w.reduce();
        } else {
          w.boolean(t.pin_memory);
        }
      });
      w.build();
    } else if (field == "size") {
      write_size(w, t.size);
    } else {
      w.list(t.chunks.size(), [&](size_t i) {
        write_dataclass(w, metadata_module, "ChunkStorageMetadata", chunk_fields, [&](std::string_view f) {
          write_size(w, f == "offsets" ? t.chunks[i].offsets : t.chunks[i].sizes);
        });
      });
    }
  });
}

inline void write_storage_record(pickle::Writer& w, const StorageIndex& key, const StorageInfo& info) {
  write_dataclass(w, metadata_module, "MetadataIndex", std::span(index_fields).first(key.offsets ? 3 : 2),
                  [&](std::string_view f) {
                    if (f == "fqn") {
                      w.string(key.fqn);
                    } else if (f == "offset") {
                      write_size(w, *key.offsets);
                    } else if (info.chunk_index) {
                      w.integer(*info.chunk_index);
                    } else {
                      w.none();
                    }
                  });
  write_dataclass(w, filesystem_module, "_StorageInfo",
                  std::span(storage_info_fields).first(info.transform_descriptors ? 4 : 3), [&](std::string_view f) {
                    if (f == "relative_path") {
                      w.string(info.relative_path);
                    } else if (f == "offset") {
                      w.integer(info.offset);
                    } else if (f == "length") {
                      w.integer(info.length);
                    } else {
                      const auto& d = *info.transform_descriptors;
                      w.list(d.size(), [&](size_t i) { w.string(d[i]); });
                    }
                  });
}

inline void write_storage_meta(pickle::Writer& w, const StorageMeta& m) {
  write_dataclass(w, metadata_module, "StorageMeta", storage_meta_fields, [&](std::string_view f) {
    if (f == "checkpoint_id" && m.checkpoint_id && m.checkpoint_id_is_path) {
      // PosixPath's __reduce__: the class and its parts, ("/", "tmp", "ckpt")
      std::vector<std::string> parts;
      const std::string& p = *m.checkpoint_id;
      if (p.starts_with('/')) parts.emplace_back("/");
      for (size_t b = 0; b < p.size();) {
        const size_t e = std::min(p.find('/', b), p.size());
        if (e > b && p.substr(b, e - b) != ".") parts.push_back(p.substr(b, e - b));
        b = e + 1;
      }
      w.global("pathlib", "PosixPath");
      w.tuple(parts.size(), [&](size_t i) { w.string(parts[i]); });
      w.reduce();
    } else if (f == "checkpoint_id") {
      write_optional_string(w, m.checkpoint_id);
    } else if (f == "save_id") {
      write_optional_string(w, m.save_id);
    } else if (f == "load_id") {
      write_optional_string(w, m.load_id);
    } else {
      w.list(m.modules.size(), [&](size_t i) { w.string(m.modules[i]); });
    }
  });
}

}  // namespace fsdpx::checkpoint::dcp::detail

namespace fsdpx::checkpoint::dcp {

FSDPX_DECL const char* dtype_name(c10::ScalarType t) {
  for (const auto& d : detail::dtype_names) {
    if (d.type == t) return d.name.data();  // the table's literals end in a NUL
  }
  throw ConfigError(::fsdpx::detail::str("fsdpx: DCP: the dtype ", t, " has no torch name fsdpx knows"));
}

FSDPX_DECL std::optional<c10::ScalarType> dtype_from_name(std::string_view name) {
  for (const auto& d : detail::dtype_names) {
    if (d.name == name) return d.type;
  }
  return std::nullopt;
}

FSDPX_DECL void validate_metadata(const Metadata& md, std::string_view what) {
  detail::check_metadata(md, false, what);
}

FSDPX_DECL Metadata parse_metadata(std::span<const std::byte> data, std::string_view what,
                                   const MetadataLimits& limits) {
  ::fsdpx::checkpoint::detail::pickle::Limits pickle_limits;
  pickle_limits.max_bytes = limits.max_bytes;
  pickle_limits.max_values = limits.max_values;
  const auto p = ::fsdpx::checkpoint::detail::pickle::parse(data, what, detail::admitted_global, pickle_limits);
  Metadata md = detail::MetadataReader(p, what, limits.max_values).read();
  validate_metadata(md, what);
  return md;
}

FSDPX_DECL Metadata read_metadata(const fs::path& path, const MetadataLimits& limits) {
  const std::vector<char> data = ::fsdpx::detail::read_file(path, "DCP metadata file", limits.max_bytes);
  return parse_metadata(std::as_bytes(std::span(data)), path.string(), limits);
}

FSDPX_DECL std::vector<std::byte> serialize_metadata(const Metadata& md) {
  detail::check_metadata(md, true, "DCP metadata to write");
  ::fsdpx::checkpoint::detail::pickle::Writer w;
  detail::write_dataclass(w, detail::metadata_module, "Metadata", detail::metadata_fields, [&](std::string_view f) {
    if (f == "state_dict_metadata") {
      w.dict(md.entries.size(), [&, it = md.entries.begin()](size_t) mutable {
        const auto& [fqn, entry] = *it++;
        w.string(fqn);
        if (const auto* t = std::get_if<TensorEntry>(&entry)) {
          detail::write_tensor_entry(w, *t);
        } else {
          w.new_object(detail::metadata_module, "BytesStorageMetadata");  // no state: no BUILD
        }
      });
    } else if (f == "planner_data") {
      if (!md.planner_data) return w.none();
      w.dict(md.planner_data->size(), [&, it = md.planner_data->begin()](size_t) mutable {
        const auto& [fqn, path] = *it++;
        w.string(fqn);
        w.tuple(path.size(), [&](size_t i) {
          if (const auto* s = std::get_if<std::string>(&path[i])) {
            w.string(*s);
          } else {
            w.integer(std::get<int64_t>(path[i]));
          }
        });
      });
    } else if (f == "storage_data") {
      w.dict(md.storage.size(), [&, it = md.storage.begin()](size_t) mutable {
        const auto& [key, info] = *it++;
        detail::write_storage_record(w, key, info);
      });
    } else if (f == "storage_meta") {
      if (!md.storage_meta) return w.none();
      detail::write_storage_meta(w, *md.storage_meta);
    } else {
      detail::write_optional_string(w, md.version);
    }
  });
  return std::move(w).finish();
}

FSDPX_DECL ::fsdpx::detail::WrittenFile write_metadata(const fs::path& path, const Metadata& md) {
  const std::vector<std::byte> bytes = serialize_metadata(md);
  return ::fsdpx::detail::write_file_durably(path, [&](const auto& sink) { sink(bytes.data(), bytes.size()); });
}

}  // namespace fsdpx::checkpoint::dcp
