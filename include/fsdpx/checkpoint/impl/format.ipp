// Out-of-line functions of fsdpx/checkpoint/format.hpp: included by it (header-only) or by fsdpx/impl/src.hpp
// (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <fsdpx/checkpoint/format.hpp>
#include <fsdpx/pickle/pickle.hpp>

namespace fsdpx::checkpoint {

FSDPX_DECL std::optional<ShardFileName> parse_shard_file_name(const std::string& name) {
  for (const Component c : all_components) {
    const std::string prefix = std::string(to_string(c)) + "_world_size_";
    if (name.rfind(prefix, 0) != 0 || name.size() < 3 || name.substr(name.size() - 3) != ".pt") continue;
    int w = -1, r = -1;
    char tail = 0;
    if (std::sscanf(name.c_str() + prefix.size(), "%d_rank_%d.p%c", &w, &r, &tail) == 3 && tail == 't' && w > 0 &&
        r >= 0 && r < w && shard_file_name(c, w, r) == name) {
      return ShardFileName{c, w, r};
    }
  }
  return std::nullopt;
}

FSDPX_DECL c10::IValue to_ivalue(const StateDict& sd) {
  auto d = detail::new_dict();
  d.insert("format", std::string(format_name));
  d.insert("format_version", int64_t{format_version});
  d.insert("kind", std::string(to_string(sd.kind)));
  d.insert("component", sd.component);
  d.insert("world_size", int64_t{sd.world_size});
  d.insert("rank", int64_t{sd.rank});
  auto entries = detail::new_dict();
  for (const TensorSlice& s : sd.entries) {
    auto e = detail::new_dict();
    e.insert("shape", detail::int_list(s.shape));
    e.insert("begin", s.begin);
    e.insert("end", s.end);
    if (sd.component == "optim") e.insert("step", s.step);
    for (const auto& [key, t] : s.tensors) e.insert(key, key == "data" && s.is_whole() ? t.view(s.shape) : t);
    entries.insert(s.name, e);
  }
  d.insert("entries", entries);
  c10::impl::GenericList groups(c10::AnyType::get());
  for (const auto& g : sd.param_groups) {
    auto gd = detail::new_dict();
    for (const auto& [k, v] : g) gd.insert(k, detail::double_list(v));
    groups.push_back(gd);
  }
  d.insert("param_groups", groups);
  if (!sd.trained.empty()) {
    c10::impl::GenericList trained(c10::StringType::get());
    for (const auto& name : sd.trained) trained.push_back(name);
    d.insert("trained", trained);
  }
  return d;
}

}  // namespace fsdpx::checkpoint

namespace fsdpx::checkpoint::detail {

FSDPX_DECL int64_t checked_numel(const std::vector<int64_t>& shape, const fs::path& path, const std::string& name) {
  int64_t numel = 1;
  for (const int64_t d : shape) {
    FSDPX_CHECK_AS(IoError, d >= 0 && !__builtin_mul_overflow(numel, d, &numel), "'", path.string(), "': entry '", name,
                   "' has the shape ", c10::IntArrayRef(shape), ", whose element count is negative or overflows");
  }
  return numel;
}

FSDPX_DECL StateDict parse_state_dict(const c10::IValue& v, const fs::path& path) {
  const Fields f(v, path, "the file");
  FSDPX_CHECK_AS(IoError, f.text("format") == format_name, "'", path.string(), "' is not an fsdpx checkpoint file");
  const int64_t version = f.integer("format_version");
  FSDPX_CHECK_AS(IoError, version <= format_version, "'", path.string(), "' has format version ", version,
                 "; this fsdpx reads up to ", format_version, ": update fsdpx");
  StateDict sd;
  const std::string kind = f.text("kind");
  FSDPX_CHECK_AS(IoError, kind == "full" || kind == "sharded" || kind == "local", "'", path.string(),
                 "': unknown kind '", kind, "'");
  sd.kind = kind == "full" ? StateDictKind::full : kind == "local" ? StateDictKind::local : StateDictKind::sharded;
  sd.component = f.text("component");
  const int64_t world = f.integer("world_size"), rank = f.integer("rank");
  FSDPX_CHECK_AS(IoError, 0 < world && world <= max_world_size && 0 <= rank && rank < world, "'", path.string(),
                 "' says it is rank ", rank, " of ", world, ", which is no rank of a world of 1 to ", max_world_size);
  sd.world_size = static_cast<int>(world);
  sd.rank = static_cast<int>(rank);
  const Fields entries(f.get("entries"), path, "'entries'");
  for (const auto& item : entries.dict()) {
    FSDPX_CHECK_AS(IoError, item.key().isString(), "'", path.string(), "': an entry's name is not a string");
    const std::string name = item.key().toStringRef();
    FSDPX_CHECK_AS(IoError, ::fsdpx::pickle::valid_utf8(name, /*strict=*/true), "'", path.string(), "': the entry '",
                   ::fsdpx::pickle::escaped(name),
                   "' is not named in valid UTF-8 (a lone surrogate or an overlong form)");
    const Fields e(item.value(), path, "entry '" + name + "'");
    TensorSlice s;
    s.name = name;
    const c10::IValue& shape = e.get("shape");
    FSDPX_CHECK_AS(IoError, shape.isList() || shape.isIntList(), "'", path.string(), "': entry '", name,
                   "' has no shape list");
    for (const c10::IValue& x : shape.toListRef()) {
      FSDPX_CHECK_AS(IoError, x.isInt(), "'", path.string(), "': entry '", name, "' has a shape that is not integers");
      s.shape.push_back(x.toInt());
    }
    const int64_t numel = checked_numel(s.shape, path, name);
    s.begin = e.integer("begin");
    s.end = e.integer("end");
    if (e.has("step")) s.step = e.integer("step");
    for (const auto& field : e.dict()) {
      if (field.value().isTensor()) {
        FSDPX_CHECK_AS(IoError, field.key().isString(), "'", path.string(), "': entry '", name,
                       "' has a tensor without a name");
        s.tensors[field.key().toStringRef()] = field.value().toTensor().reshape({-1});
      }
    }
    FSDPX_CHECK_AS(IoError, 0 <= s.begin && s.begin <= s.end && s.end <= numel, "'", path.string(), "': entry '", name,
                   "' has the range [", s.begin, ", ", s.end, ") outside its ", numel, " elements");
    for (const auto& [key, t] : s.tensors) {
      FSDPX_CHECK_AS(IoError, t.numel() == s.end - s.begin, "'", path.string(), "': entry '", name, "' holds ",
                     t.numel(), " elements in '", key, "' for the range [", s.begin, ", ", s.end, ")");
    }
    sd.entries.push_back(std::move(s));
  }
  if (f.has("param_groups")) {
    const c10::IValue& groups = f.get("param_groups");
    FSDPX_CHECK_AS(IoError, groups.isList(), "'", path.string(), "': 'param_groups' is not a list");
    for (const c10::IValue& g : groups.toListRef()) {
      const Fields group(g, path, "a param group");
      std::map<std::string, std::vector<double>> values;
      for (const auto& item : group.dict()) {
        FSDPX_CHECK_AS(
            IoError,
            item.key().isString() && (item.value().isList() || item.value().isDoubleList() || item.value().isIntList()),
            "'", path.string(), "': a param group holds something other than named lists of numbers");
        for (const c10::IValue& x : item.value().toListRef()) {
          FSDPX_CHECK_AS(IoError, x.isInt() || x.isDouble(), "'", path.string(), "': a param group's '",
                         item.key().toStringRef(), "' holds something other than numbers");
        }
        values[item.key().toStringRef()] = to_doubles(item.value());
      }
      sd.param_groups.push_back(std::move(values));
    }
  }
  if (f.has("trained")) {
    const c10::IValue& trained = f.get("trained");
    FSDPX_CHECK_AS(IoError, trained.isList(), "'", path.string(), "': 'trained' is not a list");
    for (const c10::IValue& x : trained.toListRef()) {
      FSDPX_CHECK_AS(IoError, x.isString(), "'", path.string(), "': 'trained' holds something other than names");
      sd.trained.push_back(x.toStringRef());
    }
  }
  return sd;
}

}  // namespace fsdpx::checkpoint::detail

namespace fsdpx::checkpoint {

FSDPX_DECL StateDict state_dict_from_ivalue(const c10::IValue& v, const fs::path& path) {
  try {
    return detail::parse_state_dict(v, path);
  } catch (const c10::Error& e) {  // a type the checks above did not foresee
    throw IoError(::fsdpx::detail::str("fsdpx: '", path.string(),
                                       "' is not a well-formed fsdpx checkpoint file: ", e.what_without_backtrace()));
  }
}

FSDPX_DECL c10::IValue load_committed_ivalue(const fs::path& path, const std::optional<CommittedFile>& committed) {
  if (committed) {
    // Looked at without following a link, so that a link is refused by the open below, never measured.
    std::error_code ec;
    const fs::file_status status = fs::symlink_status(path, ec);
    FSDPX_CHECK_AS(IoError, fs::exists(status), "checkpoint file '", path.string(), "' is missing (listed in ",
                   config_file, ")");
    if (!fs::is_symlink(status)) {
      FSDPX_CHECK_AS(IoError, fs::is_regular_file(status), "checkpoint file '", path.string(),
                     "' is not a regular file");
      const auto size = static_cast<int64_t>(fs::file_size(path, ec));
      FSDPX_CHECK_AS(IoError, !ec && size == committed->bytes, "'", path.string(), "' has ", size, " bytes but ",
                     config_file, " records ", committed->bytes, ": the file is truncated or was replaced");
    }
  }
  // A committed file is opened without following links (O_NOFOLLOW): one put in place after the look above
  // is refused too. An uncommitted one (a foreign folder, a merge input) may be reached through a link.
  return committed ? detail::load_ivalue(path, committed->crc32c, committed->bytes, ::fsdpx::detail::Links::refuse)
                   : detail::load_ivalue(path);
}

FSDPX_DECL StateDict load_shard_file(const fs::path& dir, const std::string& name,
                                     const std::optional<CommittedFile>& committed) {
  const fs::path path = dir / name;
  const auto parsed = parse_shard_file_name(name);
  FSDPX_CHECK_AS(IoError, parsed.has_value(), "'", path.string(), "' is not named like a shard file ",
                 "(<component>_world_size_<W>_rank_<r>.pt)");
  StateDict sd = state_dict_from_ivalue(load_committed_ivalue(path, committed), path);
  FSDPX_CHECK_AS(IoError, sd.world_size == parsed->world_size && sd.rank == parsed->rank, "'", path.string(),
                 "' says it is rank ", sd.rank, " of ", sd.world_size, ", but its name says rank ", parsed->rank,
                 " of ", parsed->world_size, " (a renamed file?)");
  return sd;
}

}  // namespace fsdpx::checkpoint

namespace fsdpx::checkpoint {

FSDPX_DECL const char* to_string(Component c) {
  switch (c) {
    case Component::model: return "model";
    case Component::optim: return "optim";
    case Component::extra_state: return "extra_state";
  }
  return "?";
}

FSDPX_DECL const char* to_string(CheckpointFormat f) {
  switch (f) {
    case CheckpointFormat::fsdpx: return "fsdpx";
    case CheckpointFormat::dcp: return "dcp";
  }
  return "?";
}

FSDPX_DECL std::optional<CheckpointFormat> format_from_string(std::string_view name) {
  for (const CheckpointFormat f : {CheckpointFormat::fsdpx, CheckpointFormat::dcp}) {
    if (name == to_string(f)) return f;
  }
  return std::nullopt;
}

FSDPX_DECL detail::Fields::Fields(const c10::IValue& v, const fs::path& path, std::string where)
    : path_(path), where_(std::move(where)) {
  FSDPX_CHECK_AS(IoError, v.isGenericDict(), "'", path_.string(), "': ", where_, " is not a dict");
  dict_ = v.toGenericDict();
}

FSDPX_DECL const c10::IValue& detail::Fields::get(const char* key) const {
  const auto it = dict_.find(key);
  FSDPX_CHECK_AS(IoError, it != dict_.end(), "'", path_.string(), "' is not an fsdpx checkpoint file: ", where_,
                 " has no '", key, "'");
  return it->value();
}

FSDPX_DECL const c10::IValue& detail::Fields::checked(bool ok, const char* key) const {
  FSDPX_CHECK_AS(IoError, ok, "'", path_.string(), "': ", where_, "'s '", key, "' has the wrong type");
  return get(key);
}

}  // namespace fsdpx::checkpoint

namespace fsdpx::checkpoint::detail {

FSDPX_DECL c10::impl::GenericList int_list(const std::vector<int64_t>& v) {
  c10::impl::GenericList l(c10::AnyType::get());
  for (const int64_t x : v) l.push_back(x);
  return l;
}

FSDPX_DECL c10::impl::GenericList double_list(const std::vector<double>& v) {
  c10::impl::GenericList l(c10::AnyType::get());
  for (const double x : v) l.push_back(x);
  return l;
}

FSDPX_DECL std::vector<double> to_doubles(const c10::IValue& v) {
  std::vector<double> out;
  for (const c10::IValue& x : v.toListRef()) out.push_back(x.isInt() ? static_cast<double>(x.toInt()) : x.toDouble());
  return out;
}

}  // namespace fsdpx::checkpoint::detail
