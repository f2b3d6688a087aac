// Writing a DCP `.metadata` (fsdpx/dcp/metadata.hpp) as torch writes it: the same objects, in pickle protocol 2
// (fsdpx/pickle/pickle.hpp's Writer says why). Included by metadata.hpp (header-only) or by fsdpx/impl/src.hpp
// (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <fsdpx/dcp/metadata.hpp>

#include <fsdpx/dcp/detail/torch_classes.hpp>
#include <fsdpx/detail/file_io.hpp>
#include <fsdpx/pickle/pickle.hpp>

namespace fsdpx::dcp::detail {

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

}  // namespace fsdpx::dcp::detail

namespace fsdpx::dcp {

FSDPX_DECL std::vector<std::byte> serialize_metadata(const Metadata& md) {
  detail::check_metadata(md, true, "DCP metadata to write");
  ::fsdpx::pickle::Writer w;
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
        const auto& [fqn, steps] = *it++;
        const auto& path = steps;  // a structured binding is captured by lambdas from clang 16 only
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

}  // namespace fsdpx::dcp
