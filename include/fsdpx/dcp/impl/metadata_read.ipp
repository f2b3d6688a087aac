// Reading a DCP `.metadata` (fsdpx/dcp/metadata.hpp): the pickle, run by fsdpx's restricted reader
// (fsdpx/pickle/pickle.hpp), and DCP's fixed schema read off its values. Included by metadata.hpp
// (header-only) or by fsdpx/impl/src.hpp (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <fsdpx/dcp/metadata.hpp>

#include <algorithm>
#include <set>

#include <c10/util/ArrayRef.h>

#include <fsdpx/dcp/detail/torch_classes.hpp>
#include <fsdpx/detail/file_io.hpp>
#include <fsdpx/pickle/pickle.hpp>
#include <fsdpx/policies/dtype_names.hpp>

namespace fsdpx::dcp::detail {

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
  if (module == "torch") return name == "Size" || is_torch_dtype_name(name);
  // pathlib._local: Python 3.13's home of the path classes
  if (module == "pathlib" || module == "pathlib._local") return name == "PosixPath" || name == "PurePosixPath";
  return false;
}

// ---- the pickle's graph -> Metadata -----------------------------------------------------------------

/// Reads DCP's fixed schema off a parsed pickle. Each level of the schema is read once on the way down,
/// so a pickle that nests deeper or holds itself is refused as a value of the wrong kind, never
/// followed; values the pickle shares (through its memo) are counted each time they are read, against
/// the same limit, and so are the bytes of each string copied out of it (MetadataLimits::max_text_bytes),
/// so that sharing cannot multiply what is made.
class MetadataReader {
 public:
  MetadataReader(const pickle::Pickle& p, std::string_view what, const MetadataLimits& limits)
      : p_(p), what_(what), max_values_(limits.max_values), max_text_bytes_(limits.max_text_bytes) {}

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
        if (!none(v)) md.version = copy(v, "Metadata.version");
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
  /// A string of the pickle, copied out: its bytes are counted against the limit each time.
  std::string copy(pickle::Id id, std::string_view field) {
    const std::string_view s = string(id, field);
    spend_text(s.size(), p_[id]);
    return std::string(s);
  }
  void spend_text(size_t n, const pickle::Node& at) {
    if (n > static_cast<uint64_t>(max_text_bytes_ - text_bytes_)) {
      fail(at, "makes strings of more than ", max_text_bytes_,
           " bytes in all (each copy of a string the pickle shares counted), the limit");
    }
    text_bytes_ += static_cast<int64_t>(n);
  }
  /// A name (an entry's), copied: UTF-8 as the JSON of a merge and every other library reads it.
  std::string name(pickle::Id id, std::string_view field) {
    std::string s = copy(id, field);
    if (!pickle::valid_utf8(s, /*strict=*/true)) {
      fail(p_[id], field, " '", pickle::escaped(s), "' is not valid UTF-8 (a lone surrogate or an overlong form)");
    }
    return s;
  }
  std::optional<std::string> optional_string(pickle::Id id, std::string_view field) {
    if (none(id)) return std::nullopt;
    return copy(id, field);
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
      std::string fqn = name(d.items[i], "an entry's name");
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
        const auto type = g.text == "torch" ? torch_dtype_from_name(g.name) : std::nullopt;
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
        key.fqn = name(v, "a storage_data key's fqn");
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
        info.relative_path = copy(v, where + "'s relative_path");
      } else if (k == "offset") {
        info.offset = integer(v, where + "'s offset");
      } else if (k == "length") {
        info.length = integer(v, where + "'s length");
      } else if (k == "transform_descriptors") {
        if (none(v)) return true;
        const std::vector<pickle::Id>& items = sequence(v, where + "'s transform_descriptors");
        spend(items.size(), p_[v]);
        auto& out = info.transform_descriptors.emplace();
        for (const pickle::Id s : items) out.push_back(copy(s, where + "'s transform descriptor"));
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
      const std::string fqn = copy(d.items[i], "a planner_data key");
      const std::vector<pickle::Id>& steps = sequence(d.items[i + 1], "planner_data of '" + fqn + "'");
      spend(steps.size(), d);
      std::vector<PathStep> path;
      for (const pickle::Id s : steps) {
        if (p_[s].kind == pickle::Kind::integer) {
          path.emplace_back(p_[s].integer);
        } else {
          path.emplace_back(copy(s, "a step of planner_data's path of '" + fqn + "'"));
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
        for (const pickle::Id s : items) m.modules.push_back(copy(s, "a module of storage_meta.modules"));
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
      spend_text(s.size() + 1, p_[part]);
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
  int64_t max_text_bytes_;
  int64_t text_bytes_ = 0;
};

}  // namespace fsdpx::dcp::detail

namespace fsdpx::dcp {

FSDPX_DECL Metadata parse_metadata(std::span<const std::byte> data, std::string_view what,
                                   const MetadataLimits& limits) {
  ::fsdpx::pickle::Limits pickle_limits;
  pickle_limits.max_bytes = limits.max_bytes;
  pickle_limits.max_values = limits.max_values;
  const std::string quoted = ::fsdpx::detail::str("'", what, "'");  // the pickle machine quotes nothing
  const auto p = ::fsdpx::pickle::parse(data, quoted, detail::admitted_global, pickle_limits);
  Metadata md = detail::MetadataReader(p, what, limits).read();
  validate_metadata(md, what);
  return md;
}

FSDPX_DECL Metadata read_metadata(const fs::path& path, const MetadataLimits& limits) {
  const std::vector<char> data = ::fsdpx::detail::read_file(path, "DCP metadata file", limits.max_bytes);
  return parse_metadata(std::as_bytes(std::span(data)), path.string(), limits);
}

}  // namespace fsdpx::dcp
