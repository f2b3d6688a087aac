// Fixture checkpoints for the merger's tests: a few tensors of awkward shapes, sliced the way FSDP
// shards them (each unit's parameters concatenated, padded to a multiple of the shard size, split
// into equal contiguous shards), written with checkpoint::save_state_dict plus a fsdp_config.json
// that records each file's size and CRC-32C.
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include <unistd.h>

#include <ATen/ATen.h>

#include <fsdpx/detail/file_io.hpp>
#include <fsdpx/detail/json.hpp>
#include <fsdpx/checkpoint/format.hpp>
#include <fsdpx/hf/safetensors.hpp>

namespace merge_fixture {

namespace fs = std::filesystem;
namespace ckpt = fsdpx::checkpoint;
using fsdpx::hf::NamedTensors;

/// A fresh directory under the system's temporary directory, removed at the end of the test.
struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& prefix = "fsdpx_test_merge_") {
    static int n = 0;
    path = fs::temp_directory_path() / (prefix + std::to_string(::getpid()) + "_" + std::to_string(n++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

struct Param {
  std::string name;
  std::vector<int64_t> shape;
  int unit;
};

/// Two units; shapes chosen so shard boundaries fall inside parameters, and one is a 0-d scalar.
inline std::vector<Param> params() {
  return {{"embed.weight", {7, 5}, 0},        {"layers.0.norm.weight", {5}, 0},
          {"layers.0.scale", {}, 0},          {"layers.0.attn.qkv.weight", {5, 3, 2}, 1},
          {"layers.0.attn.qkv.bias", {3}, 1}, {"lm_head.weight", {11, 13}, 1}};
}

/// Deterministic float32 values (the same on every machine).
inline NamedTensors originals() {
  NamedTensors out;
  int k = 0;
  for (const Param& p : params()) {
    int64_t numel = 1;
    for (const int64_t d : p.shape) numel *= d;
    const at::Tensor t = (at::sin(at::arange(numel, at::kFloat) * 0.37 + k) * (k + 1)).reshape(p.shape);
    out.emplace_back(p.name, t);
    ++k;
  }
  return out;
}

/// The model state dict of every rank: `shard` ranks per replica, `replicate` replicas; only the
/// first replica's ranks hold slices (as fsdpx saves HSDP), the others have empty entries.
inline std::vector<fsdpx::StateDict> shard(const NamedTensors& full, int shard_size, int replicate = 1,
                                           fsdpx::StateDictKind kind = fsdpx::StateDictKind::sharded) {
  const int world = shard_size * replicate;
  std::vector<fsdpx::StateDict> out(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    out[r].kind = kind;
    out[r].component = "model";
    out[r].world_size = world;
    out[r].rank = r;
  }
  const auto ps = params();
  for (int unit = 0; unit < 2; ++unit) {
    int64_t unit_numel = 0;
    std::vector<std::pair<size_t, int64_t>> offsets;  // index into ps/full, flat offset
    for (size_t i = 0; i < ps.size(); ++i) {
      if (ps[i].unit != unit) continue;
      offsets.emplace_back(i, unit_numel);
      unit_numel += full[i].second.numel();
    }
    const int64_t chunk = (unit_numel + shard_size - 1) / shard_size;
    for (int s = 0; s < shard_size; ++s) {
      const int64_t lo = s * chunk, hi = (s + 1) * chunk;
      for (const auto& [i, off] : offsets) {
        const at::Tensor& t = full[i].second;
        const int64_t b = std::max(lo, off), e = std::min(hi, off + t.numel());
        if (b >= e) continue;
        out[s].entries.push_back(
            {ps[i].name, ps[i].shape, b - off, e - off, {{"data", t.reshape({-1}).narrow(0, b - off, e - b).clone()}}});
      }
    }
  }
  return out;
}

/// Writes the state dicts as step `step` under `root` (global_step_<step>/actor), an empty optimizer
/// file per rank, a huggingface/config.json, the commit record (unless `commit` is false) and
/// latest_checkpointed_iteration.txt. Returns the step directory.
inline fs::path write_checkpoint(const fs::path& root, int64_t step, const std::vector<fsdpx::StateDict>& sds,
                                 bool commit = true) {
  const fs::path dir = ckpt::step_dir(root, step);
  fs::create_directories(dir / "huggingface");
  const int world = static_cast<int>(sds.size());
  fsdpx::detail::Json files = fsdpx::detail::Json::object();
  for (const fsdpx::StateDict& sd : sds) {
    const auto w = ckpt::save_state_dict(dir / ckpt::shard_file_name(ckpt::Component::model, world, sd.rank), sd);
    files[w.path.filename().string()] = {{"bytes", w.bytes}, {"crc32c", w.crc32c}};
    fsdpx::StateDict optim;
    optim.component = "optim";
    optim.world_size = world;
    optim.rank = sd.rank;
    const auto o = ckpt::save_state_dict(dir / ckpt::shard_file_name(ckpt::Component::optim, world, sd.rank), optim);
    files[o.path.filename().string()] = {{"bytes", o.bytes}, {"crc32c", o.crc32c}};
  }
  fsdpx::detail::write_text_durably(dir / "huggingface" / "config.json", "{\"model_type\": \"fsdpx-test\"}\n");
  if (commit) {
    const fsdpx::detail::Json config = {{"format", "fsdpx"},
                                        {"format_version", 1},
                                        {"step", step},
                                        {"world_size", world},
                                        {"mesh", {{"shard", world}, {"replicate", 1}}},
                                        {"state_dict_kind", fsdpx::to_string(sds.at(0).kind)},
                                        {"param_dtype", "Float"},
                                        {"complete", true},
                                        {"components", {"model", "optim"}},
                                        {"files", std::move(files)}};
    fsdpx::detail::write_text_durably(dir / ckpt::config_file, config.dump(2) + "\n");
    fsdpx::detail::write_text_durably(root / ckpt::checkpointed_iteration_file, std::to_string(step) + "\n");
  }
  return dir;
}

}  // namespace merge_fixture
