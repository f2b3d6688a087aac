// Out-of-line functions of fsdpx/checkpoint/merge.hpp: included by it (header-only) or by fsdpx/impl/src.hpp
// (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <fsdpx/checkpoint/merge.hpp>
#include <fsdpx/checkpoint/step_format.hpp>

namespace fsdpx::checkpoint {

FSDPX_DECL fs::path model_dir(const fs::path& dir) {
  const auto has_checkpoint = [](const fs::path& d) {
    std::error_code ec;
    if (!fs::is_directory(d, ec)) return false;
    if (fs::exists(d / config_file, ec)) return true;
    for (const auto& e : fs::directory_iterator(d, ec)) {
      if (parse_shard_file_name(e.path().filename().string())) return true;
    }
    return false;
  };
  if (!has_checkpoint(dir) && has_checkpoint(dir / "actor")) return dir / "actor";
  return dir;
}

namespace detail {

FSDPX_DECL std::string local_kind_message(const fs::path& what) {
  return ::fsdpx::detail::str("fsdpx: '", what.string(),
                              "' holds a \"local\" state dict (each unit's raw, padded "
                              "flat shard): it cannot be merged without the model, which alone knows how parameters "
                              "lie in the flat shards. Load it into the same model at the same world size and save "
                              "a full or sharded state dict, or save with ShardedStateDict/FullStateDict");
}

}  // namespace detail

FSDPX_DECL fs::path huggingface_dir(const fs::path& step_dir) {
  const fs::path dir = model_dir(step_dir);
  std::error_code ec;
  for (const fs::path& hf : {dir / "huggingface", dir.parent_path() / "huggingface"}) {
    if (fs::is_directory(hf, ec) && !fs::is_symlink(hf, ec)) return hf;
  }
  return {};
}

}  // namespace fsdpx::checkpoint

namespace fsdpx::checkpoint {

FSDPX_DECL hf::NamedTensors merge_checkpoint(const fs::path& step_dir, const MergeOptions& options,
                                             MergeReport* report) {
  const fs::path dir = model_dir(step_dir);
  FSDPX_CHECK_AS(IoError, fs::is_directory(dir), "checkpoint directory '", dir.string(), "' does not exist");
  // The step's format: its commit record says it; a folder without one may be another format's (DCP's)
  std::optional<CommitRecord> record;
  if (std::error_code ec; fs::exists(dir / config_file, ec)) record = parse_commit_record(dir / config_file);
  const CheckpointFormat format = record ? record->files_format : folder_format(dir).value_or(CheckpointFormat::fsdpx);
  MergeReport local_report;
  MergeReport& rep = report != nullptr ? *report : local_report;
  rep = MergeReport{};
  rep.format = format;
  return step_format(format, ::fsdpx::detail::str("merging the checkpoint in '", dir.string(), "'"))
      .merge(dir, record ? &*record : nullptr, options, &rep);
}

namespace detail {

FSDPX_DECL hf::NamedTensors merge_shard_files(const fs::path& dir, const CommitRecord* committed,
                                              const MergeOptions& options, MergeReport& rep) {
  rep.dir = dir;
  const auto warn = [&](const std::string& w) {
    rep.warnings.push_back(w);
    if (options.warn) {
      options.warn(w);
    } else {
      std::cerr << "fsdpx: warning: " << w << "\n";
    }
  };

  // ---- the model files present, and the world size --------------------------------------------------
  std::map<std::string, ShardFileName> present;  // model_* only
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (const auto parsed = parse_shard_file_name(name); parsed && parsed->component == Component::model) {
      present[name] = *parsed;
    }
  }
  FSDPX_CHECK_AS(IoError, !ec, "listing '", dir.string(), "' failed: ", ec.message());

  const fs::path config_path = dir / config_file;
  std::optional<CommitRecord> record;
  if (committed != nullptr) {
    record = *committed;
    // "complete": false is enough when the weights are committed (the optimizer state may not be yet).
    FSDPX_CHECK_AS(IoError, is_committed(*record, /*weights_only=*/true), "commit record '", config_path.string(),
                   "': the model component is not committed (its \"components\" omit \"model\")");
    FSDPX_CHECK_AS(IoError, record->kind != "local", detail::local_kind_message(config_path).substr(7));
    rep.world_size = record->world_size;
    rep.committed = true;
    rep.complete = record->complete;
    rep.step = record->step;
  } else {
    std::set<int> sizes;
    for (const auto& [name, p] : present) sizes.insert(p.world_size);
    FSDPX_CHECK_AS(IoError, !sizes.empty(), "'", dir.string(),
                   "' holds no model shard files (model_world_size_<W>_rank_<r>.pt) "
                   "and no ",
                   config_file, ": it is not a checkpoint step directory");
    if (sizes.size() > 1) {
      std::string files;
      for (const auto& [name, p] : present) files += "\n  " + (dir / name).string();
      FSDPX_FAIL(IoError, "'", dir.string(), "' has no ", config_file,
                 " (never committed) and its model "
                 "files come from ",
                 sizes.size(), " different world sizes; remove the stale ones:", files);
    }
    rep.world_size = *sizes.begin();
    warn(::fsdpx::detail::str("'", dir.string(), "' has no ", config_file,
                              ": this checkpoint was never committed "
                              "(a save that crashed or is still running); the world size, ",
                              rep.world_size,
                              ", comes from the file names and the files' checksums cannot be verified"));
  }
  const int world = rep.world_size;
  rep.checksums_verified = record.has_value() && !record->files.empty() && options.verify_checksums;

  // Names against the world size: every problem (the first 20 shown), each naming its file.
  {
    std::string problems;
    int count = 0;
    const auto problem = [&](const auto&... parts) {
      if (++count <= 20) problems += ::fsdpx::detail::str("\n  ", parts...);
    };
    for (const auto& [name, p] : present) {
      if (p.world_size != world) {
        problem("'", (dir / name).string(), "' is from world size ", p.world_size, ", not ", world,
                " (a stale file of another save?)");
      }
    }
    for (int r = 0; r < world; ++r) {
      const std::string name = shard_file_name(Component::model, world, r);
      if (present.count(name) == 0) problem("'", (dir / name).string(), "' (rank ", r, " of ", world, ") is missing");
    }
    if (count > 20) problems += ::fsdpx::detail::str("\n  and ", count - 20, " more");
    FSDPX_CHECK_AS(IoError, problems.empty(), "the checkpoint in '", dir.string(), "' (world size ", world,
                   record ? ", from " : ", from its file names", record ? config_path.string() : "",
                   ") does not match its model files:", problems);
  }

  int64_t model_file_bytes = 0;  // bounds what the files can describe
  for (int r = 0; r < world; ++r) {
    std::error_code size_ec;
    const auto n = fs::file_size(dir / shard_file_name(Component::model, world, r), size_ec);
    if (!size_ec) model_file_bytes += static_cast<int64_t>(n);
  }

  // ---- each rank's file in turn -----------------------------------------------------------------------
  struct Param {
    std::vector<int64_t> shape;
    at::Tensor flat;
    std::vector<std::pair<int64_t, int64_t>> filled;
  };
  std::map<std::string, Param> params;
  std::optional<StateDictKind> kind;
  for (int r = 0; r < world; ++r) {
    const std::string name = shard_file_name(Component::model, world, r);
    const fs::path path = dir / name;
    const StateDict sd = load_shard_file(
        dir, name, rep.checksums_verified ? std::optional<CommittedFile>(record->file(dir, name, true)) : std::nullopt);
    rep.files.push_back(path);
    FSDPX_CHECK_AS(IoError, sd.component == "model", "'", path.string(), "' holds a '", sd.component,
                   "' state dict, not a model");
    FSDPX_CHECK_AS(IoError, sd.kind != StateDictKind::local, detail::local_kind_message(path).substr(7));
    FSDPX_CHECK_AS(IoError, !kind || *kind == sd.kind, "'", path.string(), "' holds a ", to_string(sd.kind),
                   " state dict but the lower ranks' files hold ", to_string(*kind));
    kind = sd.kind;
    for (const TensorSlice& s : sd.entries) {
      const auto t = s.tensors.find("data");
      FSDPX_CHECK_AS(IoError, t != s.tensors.end(), "'", path.string(), "': entry '", s.name, "' has no 'data' tensor");
      FSDPX_CHECK_AS(IoError, t->second.numel() == s.end - s.begin, "'", path.string(), "': entry '", s.name,
                     "' holds ", t->second.numel(), " elements for the range [", s.begin, ", ", s.end, ")");
      auto [it, inserted] = params.try_emplace(s.name);
      Param& p = it->second;
      if (inserted) {
        // The whole tensor is made of the files' slices, so it cannot be larger than the files: a
        // shape that says otherwise (a crafted or corrupt file) must not make the merge allocate it.
        const int64_t bytes = s.global_numel() * static_cast<int64_t>(t->second.element_size());
        FSDPX_CHECK_AS(IoError, bytes <= model_file_bytes, "'", path.string(), "': parameter '", s.name,
                       "' has the shape ", c10::IntArrayRef(s.shape), " (", bytes, " bytes), more than all ", world,
                       " model files hold together (", model_file_bytes, " bytes): the file is corrupt");
        p.shape = s.shape;
        p.flat = at::empty({s.global_numel()}, t->second.options().device(at::kCPU));
      } else {
        FSDPX_CHECK_AS(IoError, p.shape == s.shape, "'", path.string(), "': parameter '", s.name, "' has shape ",
                       c10::IntArrayRef(s.shape), " here but ", c10::IntArrayRef(p.shape), " in a lower rank's file");
        FSDPX_CHECK_AS(IoError, p.flat.scalar_type() == t->second.scalar_type(), "'", path.string(), "': parameter '",
                       s.name, "' has dtype ", t->second.scalar_type(), " here but ", p.flat.scalar_type(),
                       " in a lower rank's file");
      }
      if (s.end > s.begin) {
        p.flat.narrow(0, s.begin, s.end - s.begin).copy_(t->second.reshape({-1}));
        p.filled.emplace_back(s.begin, s.end);
      }
    }
  }
  rep.kind = kind ? to_string(*kind) : "";
  if (record && !record->kind.empty() && kind) {
    FSDPX_CHECK_AS(IoError, record->kind == rep.kind, "'", config_path.string(), "' says the state dicts are ",
                   record->kind, " but the model files hold ", rep.kind, " ones");
  }

  // ---- coverage -------------------------------------------------------------------------------------
  // Every element in exactly one rank's file (only replica 0 of a shard group writes): a range in two
  // files would let the later one win silently.
  std::vector<std::string> gaps, twice;
  for (auto& [name, p] : params) {
    std::sort(p.filled.begin(), p.filled.end());
    int64_t covered = 0;
    const int64_t numel = p.flat.numel();
    for (const auto& [lo, hi] : p.filled) {
      if (lo > covered) gaps.push_back(::fsdpx::detail::str("'", name, "' elements [", covered, ", ", lo, ")"));
      if (lo < covered)
        twice.push_back(::fsdpx::detail::str("'", name, "' elements [", lo, ", ", std::min(hi, covered), ")"));
      covered = std::max(covered, hi);
    }
    if (covered < numel) gaps.push_back(::fsdpx::detail::str("'", name, "' elements [", covered, ", ", numel, ")"));
  }
  if (!twice.empty()) {
    FSDPX_FAIL(IoError, "the model files in '", dir.string(), "' (world size ", world,
               ") hold parts of parameters in more than one rank's file: ", ::fsdpx::detail::join_names(twice));
  }
  if (!gaps.empty()) {
    std::string list;
    for (size_t i = 0; i < gaps.size() && i < 20; ++i) list += "\n  " + gaps[i];
    if (gaps.size() > 20) list += ::fsdpx::detail::str("\n  and ", gaps.size() - 20, " more");
    FSDPX_FAIL(IoError, "the model files in '", dir.string(), "' (world size ", world,
               ") leave parts of parameters uncovered, in no rank's file:", list);
  }

  hf::NamedTensors out;
  for (auto& [name, p] : params) {  // a std::map: name order
    at::Tensor t = p.flat.view(p.shape);
    if (options.dtype && at::isFloatingType(t.scalar_type())) t = t.to(*options.dtype);
    out.emplace_back(name, std::move(t));
    p.flat = at::Tensor();
  }
  return out;
}

}  // namespace detail

}  // namespace fsdpx::checkpoint
