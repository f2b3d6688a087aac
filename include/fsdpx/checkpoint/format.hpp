// The checkpoint format (docs/checkpoint.md is its specification):
//
//   <root>/global_step_<N>/actor/model_world_size_<W>_rank_<r>.pt        (+ optim_, extra_state_)
//   <root>/global_step_<N>/actor/fsdp_config.json                        written last: the commit record
//   <root>/global_step_<N>/actor/.done/<component>_rank_<r>.<run>.json    one per durable file
//   <root>/latest_state_dict_iteration.txt, latest_checkpointed_iteration.txt
//
// Each .pt file is torch.save's zip format holding plain dicts, lists, numbers, strings and tensors,
// so Python reads it with torch.load(path, weights_only=True).
#pragma once

#include <fsdpx/detail/config.hpp>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/core/ivalue.h>

#include <fsdpx/checkpoint/detail/torch_io.hpp>
#include <fsdpx/checkpoint/state_dict.hpp>
#include <fsdpx/error.hpp>

namespace fsdpx {

/// The files a step's state is written as (CheckpointOptions::format; a commit record's "files_format"). The
/// commit record, the iteration files, rotation and resuming are the same for both; what differs is behind
/// checkpoint::StepFormat (checkpoint/step_format.hpp).
enum class CheckpointFormat {
  /// fsdpx's own: model_/optim_world_size_W_rank_r.pt, each CRC-32C checked on load.
  fsdpx,
  /// PyTorch Distributed Checkpoint in LightRFT's layout: the model's DCP in the step folder, the optimizer's
  /// in optim_states/ (get_optimizer_state_dict's layout), each `.metadata` written by rank 0 when every
  /// rank's data file is durable, before the commit record; FSDP2, LightRFT and torch's format_utils read the
  /// step folder as it is. The extra state (RNG, scheduler, client state) stays fsdpx's file beside them.
  /// The model's StateDict policy must be sharded or full. Its code is <fsdpx/dcp.hpp>'s: a program that
  /// writes or reads this format includes that header in one of its translation units.
  dcp,
};

}  // namespace fsdpx

namespace fsdpx::checkpoint {

namespace fs = std::filesystem;

/// The commit record's name of a format ("fsdpx", "dcp").
FSDPX_DECL const char* to_string(CheckpointFormat f);
/// The format a commit record names; nullopt for a name this fsdpx does not know.
FSDPX_DECL std::optional<CheckpointFormat> format_from_string(std::string_view name);

inline constexpr int format_version = 1;
inline constexpr const char* format_name = "fsdpx";
/// The largest world size a checkpoint may record: readers allocate per rank, so a crafted record
/// must not make them allocate without bound.
inline constexpr int max_world_size = 1 << 17;

/// What one save writes per rank. Weights alone are enough for weight sync and export.
enum class Component { model, optim, extra_state };
inline constexpr Component all_components[] = {Component::model, Component::optim, Component::extra_state};

FSDPX_DECL const char* to_string(Component c);

inline std::string shard_file_name(Component c, int world_size, int rank) {
  return ::fsdpx::detail::str(to_string(c), "_world_size_", world_size, "_rank_", rank, ".pt");
}

/// Parses "<component>_world_size_<W>_rank_<r>.pt"; nullopt for any other name.
struct ShardFileName {
  Component component;
  int world_size;
  int rank;
};
FSDPX_DECL std::optional<ShardFileName> parse_shard_file_name(const std::string& name);

inline fs::path step_dir(const fs::path& root, int64_t step) {
  return root / ::fsdpx::detail::str("global_step_", step) / "actor";
}
inline constexpr const char* state_dict_iteration_file = "latest_state_dict_iteration.txt";
inline constexpr const char* checkpointed_iteration_file = "latest_checkpointed_iteration.txt";
inline constexpr const char* config_file = "fsdp_config.json";
/// Rank `rank`'s marker that its file of component `c` is durable. `run` names the coordinator run
/// that wrote it (one id shared by the run's ranks), so that a marker an interrupted run left behind
/// is never taken for this run's when a step is saved again.
inline fs::path done_marker(const fs::path& dir, Component c, int rank, std::string_view run) {
  return dir / ".done" / ::fsdpx::detail::str(to_string(c), "_rank_", rank, ".", run, ".json");
}
inline fs::path failed_marker(const fs::path& dir, int rank, std::string_view run) {
  return dir / ".done" / ::fsdpx::detail::str("failed_rank_", rank, ".", run, ".txt");
}

// ---- StateDict <-> the file's dict ------------------------------------------------------------------

namespace detail {

inline c10::impl::GenericDict new_dict() { return c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get()); }
// Plain (untyped) lists: typed ones pickle through torch.jit helpers that torch.load(weights_only) refuses.
FSDPX_DECL c10::impl::GenericList int_list(const std::vector<int64_t>& v);
FSDPX_DECL c10::impl::GenericList double_list(const std::vector<double>& v);

/// A field of a loaded dict, or an IoError naming the file and the field.
class Fields {
 public:
  FSDPX_DECL Fields(const c10::IValue& v, const fs::path& path, std::string where);
  FSDPX_DECL const c10::IValue& get(const char* key) const;
  bool has(const char* key) const { return dict_.find(key) != dict_.end(); }
  int64_t integer(const char* key) const { return checked(get(key).isInt(), key).toInt(); }
  std::string text(const char* key) const { return checked(get(key).isString(), key).toStringRef(); }
  c10::impl::GenericDict dictionary(const char* key) const {
    return checked(get(key).isGenericDict(), key).toGenericDict();
  }
  const c10::impl::GenericDict& dict() const { return dict_; }

 private:
  FSDPX_DECL const c10::IValue& checked(bool ok, const char* key) const;
  fs::path path_;
  std::string where_;
  c10::impl::GenericDict dict_ = new_dict();
};

FSDPX_DECL std::vector<double> to_doubles(const c10::IValue& v);

}  // namespace detail

FSDPX_DECL c10::IValue to_ivalue(const StateDict& sd);

namespace detail {

/// The product of `shape` (its element count), or an IoError when a dimension is negative or the
/// product overflows: a crafted file must not defeat the range checks that use it.
FSDPX_DECL int64_t checked_numel(const std::vector<int64_t>& shape, const fs::path& path, const std::string& name);

FSDPX_DECL StateDict parse_state_dict(const c10::IValue& v, const fs::path& path);

}  // namespace detail

/// A state dict from a loaded file; anything malformed (a crafted file) is an IoError naming the file.
FSDPX_DECL StateDict state_dict_from_ivalue(const c10::IValue& v, const fs::path& path);

/// Writes a state dict durably (Python: torch.load(path, weights_only=True)).
inline ::fsdpx::detail::WrittenFile save_state_dict(const fs::path& path, const StateDict& sd) {
  return detail::save_ivalue(path, to_ivalue(sd));
}

/// Reads a state dict file; a missing, truncated, corrupt or foreign file is an IoError naming it.
inline StateDict load_state_dict_file(const fs::path& path, std::optional<uint32_t> expected_crc32c = std::nullopt) {
  return state_dict_from_ivalue(detail::load_ivalue(path, expected_crc32c), path);
}

/// What a commit record (fsdp_config.json) says of one file.
struct CommittedFile {
  int64_t bytes = 0;
  std::optional<uint32_t> crc32c;  // nullopt: not checked
};

/// Reads a file of a committed step, checked against `committed` when given: present, its recorded
/// size, and its CRC-32C on the very bytes that are parsed (so a file replaced meanwhile cannot slip
/// between a check and a second read). Every failure is an IoError naming the file.
FSDPX_DECL c10::IValue load_committed_ivalue(const fs::path& path, const std::optional<CommittedFile>& committed);

/// Reads the shard file `dir / name` of a step (load_committed_ivalue), and checks its own world size
/// and rank against its name.
FSDPX_DECL StateDict load_shard_file(const fs::path& dir, const std::string& name,
                                     const std::optional<CommittedFile>& committed = std::nullopt);

}  // namespace fsdpx::checkpoint

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/checkpoint/impl/format.ipp>
#endif
