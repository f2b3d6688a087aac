// The C++ side of python_dcp_metadata_test.py: DCP's .metadata as JSON, both ways.
//   fsdpx_dcp_metadata_tool dump <.metadata>           prints what read_metadata says, as JSON
//   fsdpx_dcp_metadata_tool write <json> <.metadata>   writes (write_metadata) what the JSON says
// The JSON: {"entries": {fqn: {"type": "tensor", "dtype", "size", "chunks": [{"offsets", "sizes"}],
// "requires_grad", "pin_memory", "memory_format"} or {"type": "bytes"}}, "storage": [{"fqn", "offsets",
// "index", "relative_path", "offset", "length", "transform_descriptors"}], "planner_data": {fqn: [steps]},
// "storage_meta": {"checkpoint_id", "checkpoint_id_is_path", "save_id", "load_id", "modules"}, "version"},
// null where the file has None. An error is printed and exits with 1.
#include <iostream>
#include <string>

#include <fsdpx/dcp/metadata.hpp>
#include <fsdpx/detail/json.hpp>

namespace dcp = fsdpx::dcp;
using fsdpx::detail::Json;

namespace {

template <class T>
Json optional_json(const std::optional<T>& v) {
  return v ? Json(*v) : Json(nullptr);
}
template <class T>
std::optional<T> optional_from(const Json& v) {
  return v.is_null() ? std::nullopt : std::optional<T>(v.get<T>());
}

Json to_json(const dcp::Metadata& md) {
  Json entries = Json::object();
  for (const auto& [fqn, entry] : md.entries) {
    if (const auto* t = std::get_if<dcp::TensorEntry>(&entry)) {
      Json chunks = Json::array();
      for (const auto& c : t->chunks) chunks.push_back({{"offsets", c.offsets}, {"sizes", c.sizes}});
      entries[fqn] = {{"type", "tensor"},
                      {"dtype", dcp::dtype_name(t->dtype)},
                      {"size", t->size},
                      {"chunks", chunks},
                      {"requires_grad", t->requires_grad},
                      {"pin_memory", t->pin_memory},
                      {"memory_format", static_cast<int>(t->memory_format)}};
    } else {
      entries[fqn] = {{"type", "bytes"}};
    }
  }
  Json storage = Json::array();
  for (const auto& [key, info] : md.storage) {
    storage.push_back({{"fqn", key.fqn},
                       {"offsets", optional_json(key.offsets)},
                       {"index", optional_json(info.chunk_index)},
                       {"relative_path", info.relative_path},
                       {"offset", info.offset},
                       {"length", info.length},
                       {"transform_descriptors", optional_json(info.transform_descriptors)}});
  }
  Json planner = nullptr;
  if (md.planner_data) {
    planner = Json::object();
    for (const auto& [fqn, path] : *md.planner_data) {
      Json steps = Json::array();
      for (const auto& s : path) std::visit([&](const auto& v) { steps.push_back(v); }, s);
      planner[fqn] = steps;
    }
  }
  Json meta = nullptr;
  if (const auto& m = md.storage_meta) {
    meta = {{"checkpoint_id", optional_json(m->checkpoint_id)},
            {"checkpoint_id_is_path", m->checkpoint_id_is_path},
            {"save_id", optional_json(m->save_id)},
            {"load_id", optional_json(m->load_id)},
            {"modules", m->modules}};
  }
  return {{"entries", entries},
          {"storage", storage},
          {"planner_data", planner},
          {"storage_meta", meta},
          {"version", optional_json(md.version)}};
}

dcp::Metadata from_json(const Json& j) {
  dcp::Metadata md;
  for (const auto& [fqn, e] : j.at("entries").items()) {
    if (e.at("type") == "bytes") {
      md.entries[fqn] = dcp::BytesEntry{};
      continue;
    }
    dcp::TensorEntry t;
    const auto dtype = fsdpx::torch_dtype_from_name(e.at("dtype").get<std::string>());
    if (!dtype) throw std::runtime_error("unknown dtype " + e.at("dtype").dump());
    t.dtype = *dtype;
    t.size = e.at("size").get<std::vector<int64_t>>();
    for (const auto& c : e.at("chunks")) t.chunks.push_back({c.at("offsets"), c.at("sizes")});
    t.requires_grad = e.at("requires_grad");
    t.pin_memory = e.at("pin_memory");
    t.memory_format = static_cast<dcp::MemoryFormat>(e.at("memory_format").get<int>());
    md.entries[fqn] = t;
  }
  for (const auto& s : j.at("storage")) {
    md.storage[{s.at("fqn"), optional_from<std::vector<int64_t>>(s.at("offsets"))}] = {
        .relative_path = s.at("relative_path"),
        .offset = s.at("offset"),
        .length = s.at("length"),
        .chunk_index = optional_from<int64_t>(s.at("index")),
        .transform_descriptors = optional_from<std::vector<std::string>>(s.at("transform_descriptors"))};
  }
  if (!j.at("planner_data").is_null()) {
    auto& planner = md.planner_data.emplace();
    for (const auto& [fqn, steps] : j.at("planner_data").items()) {
      auto& path = planner[fqn];
      for (const auto& s : steps) {
        if (s.is_string()) {
          path.emplace_back(s.get<std::string>());
        } else {
          path.emplace_back(s.get<int64_t>());
        }
      }
    }
  }
  if (const Json& m = j.at("storage_meta"); !m.is_null()) {
    md.storage_meta = dcp::StorageMeta{.checkpoint_id = optional_from<std::string>(m.at("checkpoint_id")),
                                       .checkpoint_id_is_path = m.at("checkpoint_id_is_path"),
                                       .save_id = optional_from<std::string>(m.at("save_id")),
                                       .load_id = optional_from<std::string>(m.at("load_id")),
                                       .modules = m.at("modules")};
  }
  md.version = optional_from<std::string>(j.at("version"));
  return md;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string mode = argc > 1 ? argv[1] : "";
    if (mode == "dump" && argc == 3) {
      std::cout << to_json(dcp::read_metadata(argv[2])).dump(1) << "\n";
      return 0;
    }
    if (mode == "write" && argc == 4) {
      const Json j = fsdpx::detail::parse_json(fsdpx::detail::read_text(argv[2]), argv[2]);
      dcp::write_metadata(argv[3], from_json(j));
      return 0;
    }
    std::cerr << "usage: fsdpx_dcp_metadata_tool dump <.metadata> | write <json> <.metadata>\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
}
