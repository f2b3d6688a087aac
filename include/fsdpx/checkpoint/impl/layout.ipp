// Out-of-line functions of fsdpx/checkpoint/layout.hpp: included by it (header-only) or by fsdpx/impl/src.hpp
// (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <fsdpx/checkpoint/layout.hpp>
#include <fsdpx/detail/json.hpp>

namespace fsdpx::checkpoint {

FSDPX_DECL std::optional<int64_t> read_iteration_file(const fs::path& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return std::nullopt;
  const std::string text = ::fsdpx::detail::read_text(path, "iteration file");
  size_t used = 0;
  int64_t step = -1;
  try {
    step = std::stoll(text, &used);
  } catch (...) {
  }
  FSDPX_CHECK_AS(IoError, step >= 0 && text.find_first_not_of(" \n\r\t", used) == std::string::npos, "iteration file '",
                 path.string(), "' does not hold a step number: '", text.substr(0, 40), "'");
  return step;
}

FSDPX_DECL CommitRecord parse_commit_record(const fs::path& config) {
  using ::fsdpx::detail::json_find;
  using ::fsdpx::detail::json_get;
  CommitRecord r;
  r.path = config;
  const std::string doc = config.string();
  const auto j = ::fsdpx::detail::parse_json(::fsdpx::detail::read_text(config, "commit record"), doc);
  FSDPX_CHECK_AS(IoError, j.is_object() && json_find<std::string>(j, "format", doc) == std::string(format_name),
                 "commit record '", doc, "': it is not an fsdpx commit record (no \"format\": \"", format_name, "\")");
  const int64_t version = json_get<int64_t>(j, "format_version", doc);
  FSDPX_CHECK_AS(IoError, version <= format_version, "commit record '", doc, "': format version ", version,
                 "; this fsdpx reads up to ", format_version, ": update fsdpx");
  // Bounded: every reader allocates per rank (merge, resume, verify).
  r.world_size = json_get<int>(j, "world_size", doc);
  FSDPX_CHECK_AS(IoError, r.world_size > 0 && r.world_size <= max_world_size, "commit record '", doc,
                 "': world_size is ", r.world_size, "; it must be in [1, ", max_world_size, "]");
  r.step = json_find<int64_t>(j, "step", doc);
  if (const auto mesh = j.find("mesh"); mesh != j.end() && mesh->is_object()) {
    r.mesh_shard = json_find<int64_t>(*mesh, "shard", doc + "\": \"mesh");
  }
  r.kind = json_find<std::string>(j, "state_dict_kind", doc).value_or("");
  r.complete = json_find<bool>(j, "complete", doc).value_or(false);
  const std::string files_format = json_find<std::string>(j, "files_format", doc).value_or("fsdpx");
  const auto format = format_from_string(files_format);
  FSDPX_CHECK_AS(IoError, format.has_value(), "commit record '", doc, "': \"files_format\" is \"", files_format,
                 "\"; this fsdpx reads \"fsdpx\" and \"dcp\"");
  r.files_format = *format;
  if (const auto comps = j.find("components"); comps != j.end()) {
    FSDPX_CHECK_AS(IoError, comps->is_array(), "commit record '", doc, "': \"components\" is not an array");
    for (const auto& c : *comps)
      r.components.push_back(::fsdpx::detail::json_as<std::string>(c, "'" + doc + "': a component"));
  }
  if (const auto files = j.find("files"); files != j.end()) {
    FSDPX_CHECK_AS(IoError, files->is_object(), "commit record '", doc, "': \"files\" is not an object");
    for (const auto& [name, f] : files->items()) {
      const std::string what = doc + "\": \"files\": \"" + name;
      r.files[name] = {json_get<int64_t>(f, "bytes", what), json_get<uint32_t>(f, "crc32c", what)};
      // Readers look files up by the record's world size: a record that disagrees with its own files
      // would otherwise read as a checkpoint that lacks them.
      if (const auto parsed = parse_shard_file_name(name)) {
        FSDPX_CHECK_AS(IoError, parsed->world_size == r.world_size && parsed->rank < r.world_size, "commit record '",
                       doc, "': world_size is ", r.world_size, " but it lists '", name, "', a file of rank ",
                       parsed->rank, " of a world of ", parsed->world_size,
                       ": the record is corrupt or from another checkpoint");
      }
    }
  }
  return r;
}

FSDPX_DECL std::vector<StepDir> list_steps(const fs::path& root) {
  std::vector<StepDir> out;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("global_step_", 0) != 0 || !entry.is_directory()) continue;
    try {
      size_t used = 0;
      const int64_t step = std::stoll(name.substr(12), &used);
      if (used == name.size() - 12 && step >= 0) out.push_back({step, entry.path()});
    } catch (...) {
    }
  }
  std::sort(out.begin(), out.end(), [](const StepDir& a, const StepDir& b) { return a.step < b.step; });
  return out;
}

FSDPX_DECL std::optional<int64_t> find_committed_before(const fs::path& root, int64_t before, bool weights_only) {
  std::optional<int64_t> newest;
  for (const StepDir& s : list_steps(root)) {
    if (s.step >= before) break;
    try {
      if (const auto record = read_commit_record(s.path / "actor"); record && is_committed(*record, weights_only))
        newest = s.step;
    } catch (const IoError&) {  // a garbled record is not a commit
    }
  }
  return newest;
}

FSDPX_DECL std::optional<int64_t> find_latest_checkpoint(const fs::path& root, bool weights_only) {
  const fs::path file = root / (weights_only ? state_dict_iteration_file : checkpointed_iteration_file);
  if (const auto step = read_iteration_file(file)) {
    const auto record = read_commit_record(step_dir(root, *step));
    FSDPX_CHECK_AS(IoError, record, "'", file.string(), "' names step ", *step, ", but ",
                   step_dir(root, *step).string(), " has no commit record (", config_file,
                   "): the checkpoint root was modified by hand");
    FSDPX_CHECK_AS(IoError, is_committed(*record, weights_only), "'", file.string(), "' names step ", *step,
                   ", but its commit record '", record->path.string(), "' ",
                   weights_only ? "does not commit the model (\"components\" lacks \"model\")"
                                : "is not complete (\"complete\" is not true)",
                   ": the checkpoint root was modified by hand");
    return step;
  }
  return find_committed_before(root, std::numeric_limits<int64_t>::max(), weights_only);
}

}  // namespace fsdpx::checkpoint

namespace fsdpx::checkpoint::detail {

FSDPX_DECL bool lease_is_live(const fs::path& lease) {
  const auto young = [&] {
    std::error_code ec;
    const auto modified = fs::last_write_time(lease, ec);
    return !ec && fs::file_time_type::clock::now() - modified < lease_write_grace;
  };
  char host[256] = {};
  long pid = 0;
  std::string text;
  try {
    text = ::fsdpx::detail::read_text(lease, "lease");
  } catch (const IoError&) {
    return young();  // gone (false) or being replaced
  }
  if (std::sscanf(text.c_str(), "%255s %ld", host, &pid) != 2) return young();
  if (host_name() != host) return true;
  return ::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM;
}

}  // namespace fsdpx::checkpoint::detail

namespace fsdpx::checkpoint {

FSDPX_DECL int64_t directory_bytes(const fs::path& dir) {
  int64_t total = 0;
  std::error_code ec;
  for (const auto& e : fs::recursive_directory_iterator(dir, ec)) {
    if (e.is_regular_file(ec)) total += static_cast<int64_t>(e.file_size(ec));
  }
  return total;
}

FSDPX_DECL void delete_step(const fs::path& root, const StepDir& s) {
  const fs::path doomed = root / ::fsdpx::detail::str(".deleting_global_step_", s.step);
  std::error_code ec;
  fs::rename(s.path, doomed, ec);
  if (ec) {
    TORCH_WARN("fsdpx: could not delete old checkpoint '", s.path.string(), "': ", ec.message());
    return;
  }
  fs::remove_all(doomed, ec);
}

}  // namespace fsdpx::checkpoint

namespace fsdpx::checkpoint {

FSDPX_DECL void verify_step(const fs::path& dir, const CommitRecord& record, bool verify_checksums,
                            const std::vector<std::string>& components) {
  for (const auto& entry : record.files) {
    const std::string& name = entry.first;  // not a structured binding: lambdas capture those from clang 16 only
    if (std::none_of(components.begin(), components.end(),
                     [&](const std::string& c) { return name.rfind(c + "_world_size_", 0) == 0; })) {
      continue;
    }
    load_shard_file(dir, name, record.file(dir, name, verify_checksums));
  }
}

FSDPX_DECL void rotate_checkpoints(const fs::path& root, const RotationPolicy& policy,
                                   const std::set<int64_t>& in_flight) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    if (e.path().filename().string().rfind(".deleting_global_step_", 0) == 0) fs::remove_all(e.path(), ec);
  }
  std::set<int64_t> named;
  try {
    for (const char* file : {state_dict_iteration_file, checkpointed_iteration_file}) {
      if (const auto step = read_iteration_file(root / file)) named.insert(*step);
    }
  } catch (const IoError& e) {  // which steps are in use is unknown: delete nothing
    TORCH_WARN("fsdpx: checkpoint rotation skipped: ", e.what());
    return;
  }
  std::vector<StepDir> committed, debris;
  for (const StepDir& s : list_steps(root)) {
    std::optional<CommitRecord> record;
    try {
      record = read_commit_record(s.path / "actor");
    } catch (const IoError&) {
    }
    (record && is_committed(*record, /*weights_only=*/true) ? committed : debris).push_back(s);
  }
  if (committed.empty()) return;
  const int64_t newest = named.empty() ? committed.back().step : *named.rbegin();
  const auto in_use = [&](const StepDir& s) {
    return named.count(s.step) != 0 || in_flight.count(s.step) != 0 || is_leased(s.path);
  };
  for (const StepDir& s : debris) {
    if (s.step < newest && !in_use(s)) delete_step(root, s);
  }
  int kept = 0;
  int64_t bytes = 0;
  for (auto it = committed.rbegin(); it != committed.rend(); ++it) {
    if (it->step > newest) continue;
    const int64_t size = directory_bytes(it->path);
    const bool over = (policy.max_to_keep > 0 && kept >= policy.max_to_keep) ||
                      (policy.max_bytes > 0 && bytes + size > policy.max_bytes);
    if (it->step == newest || !over || in_use(*it)) {
      ++kept;
      bytes += size;
      continue;
    }
    delete_step(root, *it);
  }
}

FSDPX_DECL CheckpointLease::CheckpointLease(const fs::path& root, int64_t step) {
  static std::atomic<int> counter{0};
  // Checked first (no debris for a step already gone) and again after the lease exists (rotation
  // may have taken the step in between).
  FSDPX_CHECK_AS(IoError, read_commit_record(step_dir(root, step)).has_value(), "cannot lease step ", step,
                 ": it is not (or no longer) committed");
  const fs::path dir = root / ::fsdpx::detail::str("global_step_", step) / ".leases";
  std::error_code ec;
  fs::create_directories(dir, ec);
  FSDPX_CHECK_AS(IoError, !ec, "cannot lease step ", step, ": creating '", dir.string(), "': ", ec.message());
  path_ = dir / ::fsdpx::detail::str(detail::host_name(), "-", ::getpid(), "-", counter++);
  ::fsdpx::detail::write_text_durably(path_, ::fsdpx::detail::str(detail::host_name(), " ", ::getpid(), "\n"));
  // The step may have been rotated away between the reader's choice and the lease.
  if (!read_commit_record(step_dir(root, step))) {
    fs::remove(path_, ec);
    FSDPX_FAIL(IoError, "cannot lease step ", step, ": it is not (or no longer) committed");
  }
}

}  // namespace fsdpx::checkpoint

namespace fsdpx::checkpoint {

FSDPX_DECL std::optional<CommitRecord> read_commit_record(const fs::path& dir) {
  std::error_code ec;
  const fs::path config = dir / config_file;
  if (!fs::exists(config, ec)) return std::nullopt;
  return parse_commit_record(config);
}

FSDPX_DECL bool is_committed(const CommitRecord& record, bool weights_only) {
  const auto& c = record.components;
  return weights_only ? std::find(c.begin(), c.end(), "model") != c.end() : record.complete;
}

FSDPX_DECL bool is_leased(const fs::path& step_root) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(step_root / ".leases", ec)) {
    if (detail::lease_is_live(entry.path())) return true;
  }
  return false;
}

}  // namespace fsdpx::checkpoint
