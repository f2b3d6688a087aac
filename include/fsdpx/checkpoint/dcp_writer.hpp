// Writing PyTorch's Distributed Checkpoint (DCP) from an fsdpx model, so that `dcp.load` (FSDP2,
// LightRFT, torchtitan, a plain transformers model) reads what fsdpx trained:
//
//   fsdpx::checkpoint::dcp::save_model(dir, model);                                // collective
//   fsdpx::checkpoint::dcp::save_optimizer(dir / "optim_states", model, optimizer);  // LightRFT's layout
//
// Each rank writes its own data file, `__<rank>_0.distcp`, durably: for every parameter slice it holds
// (the sharded state dict: elements [begin, end) of the flattened parameter), the boxes that cover that
// range exactly (cover_flat_range), each a `torch.save` blob at a recorded offset, as DCP's
// FileSystemWriter writes them. fsdpx shards flattened elements while DCP's chunks are boxes in the
// tensor's shape; a range is cut into at most 2 * ndim - 1 boxes rather than exchanged with neighbours
// until each rank holds whole rows, because the cut costs no communication and no copy (each box is a
// view of the slice's memory), and DCP's readers take any set of boxes that covers a tensor. The ranks
// then gather what they wrote to rank 0, which writes `.metadata` last, durably (temporary file, fsync,
// rename): a folder without it is no checkpoint, for DCP as for fsdpx.
#pragma once

#include <fsdpx/detail/config.hpp>

#include <concepts>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <torch/optim/optimizer.h>

#include <fsdpx/checkpoint/dcp_metadata.hpp>
#include <fsdpx/checkpoint/state_dict.hpp>
#include <fsdpx/core/sharded_model.hpp>
#include <fsdpx/dist/any.hpp>
#include <fsdpx/detail/file_io.hpp>

namespace fsdpx::checkpoint::dcp {

/// The boxes that cover elements [begin, end) of a tensor of `shape` flattened row-major, exactly, in
/// order: a partial row, whole rows, a partial row, at each dimension (at most 2 * ndim - 1 boxes; one
/// when the range is a box already). A 0-dimensional tensor is one box of no dimensions.
FSDPX_DECL std::vector<Chunk> cover_flat_range(std::span<const int64_t> shape, int64_t begin, int64_t end);

/// DCP's data file of `rank` (FileSystemWriter's name for a rank's first file).
inline std::string data_file_name(int rank) { return ::fsdpx::detail::str("__", rank, "_0.distcp"); }

/// One tensor a rank saves: elements [begin, end) of the flattened tensor `fqn` of global `shape`, as
/// `values` (1-D, end - begin elements, on the CPU). `path`: where the entry sits in the nested state dict
/// dcp.load unflattens it into (planner_data), e.g. {"state", "model.norm.weight", "exp_avg"}; empty: {fqn}.
struct SavedTensor {
  std::string fqn;
  std::vector<int64_t> shape;
  int64_t begin = 0;
  int64_t end = 0;
  at::Tensor values;
  std::vector<PathStep> path;
};

/// A Python value a rank saves as a bytes entry (a torch.save'd object: an lr, a param group's names):
/// None, a bool, an int, a float, a str, or a list or tuple of those (what Reader::read_bytes reads back).
struct SavedBytes {
  std::string fqn;
  c10::IValue value;
  std::vector<PathStep> path;
};

/// What one rank writes to a DCP checkpoint. A tensor's pieces may come from several ranks (they must
/// agree on its dtype and shape, and together cover it exactly once); a bytes entry from one rank only.
struct RankState {
  std::vector<SavedTensor> tensors;
  std::vector<SavedBytes> bytes;
};

/// Writes a DCP checkpoint in `dir` (created if missing), collective over `world`: every rank writes
/// `state` as its data file, durably; then rank 0 writes `.metadata`, last, once all have and only if
/// all have (a rank that failed makes every rank throw, naming it, and no `.metadata` is written).
/// Returns rank 0's `.metadata` file (the others: an empty path).
FSDPX_DECL ::fsdpx::detail::WrittenFile save_state(const fs::path& dir, dist::AnyCommunicator& world,
                                                   const RankState& state);

/// How fsdpx's tensors are named in a DCP checkpoint.
struct SaveOptions {
  /// The name saved for an fsdpx name (e.g. another library's names for the same tensors); empty: the
  /// same. An entry whose name maps to "" is left out.
  std::function<std::string(const std::string&)> saved_name;
  /// Further names a model tensor is saved under too (after saved_name), as torch's state dicts hold a
  /// tied weight under each of its names (models::dcp_save_options: a tied LM head).
  std::function<std::vector<std::string>(const std::string&)> also_saved_as;
  /// Where a tensor (by its saved name) is saved as part of a larger one, as transformers 5 holds a mixture's
  /// experts stacked (models::dcp_save_options); nullopt: as itself. Its optimizer state goes alike.
  std::function<std::optional<Placement>(const std::string&)> placed_in;
};

/// A model state dict (sharded or full: each rank's slices; not local, whose entries are flat unit shards) as
/// the DCP tensors this rank saves, each under its saved names.
FSDPX_DECL std::vector<SavedTensor> model_tensors(const StateDict& sd, const SaveOptions& options = {});

/// An optimizer state dict (optimizer_state_dict's: this rank's slices of each parameter's state) as the DCP
/// tensors this rank saves in get_optimizer_state_dict's layout: state.<name>.<key>, and state.<name>.step
/// from the rank that holds the parameter's first element.
FSDPX_DECL std::vector<SavedTensor> optimizer_tensors(const StateDict& sd, const SaveOptions& options = {});

/// The optimizer's param groups as DCP bytes entries (param_groups.<g>.<key>; see save_optimizer), on world
/// rank 0 (empty on the others). Collective over the model's world: a group's parameters are found from every
/// rank's shards.
FSDPX_DECL std::vector<SavedBytes> param_group_entries(core::ShardedModel& model, torch::optim::Optimizer& optimizer,
                                                       const SaveOptions& options = {});

/// Saves `model`'s parameters and buffers as a DCP checkpoint in `dir`, each under its name (as
/// `dcp.save(model.state_dict())` or `dcp.save(get_model_state_dict(model))` does): collective over the
/// model's world; see save_state.
FSDPX_DECL ::fsdpx::detail::WrittenFile save_model(const fs::path& dir, core::ShardedModel& model,
                                                   const SaveOptions& options = {});

/// Saves `optimizer`'s state (an optimizer over `model`'s shards, as make_adamw builds) as a DCP
/// checkpoint in `dir`, in the layout of torch's `get_optimizer_state_dict(model, optimizer)`: per
/// parameter `state.<name>.exp_avg`, `state.<name>.exp_avg_sq` (`max_exp_avg_sq` with amsgrad;
/// `momentum_buffer` for SGD) in the parameter's shape and `state.<name>.step` (a float32 scalar), and per
/// param group `param_groups.<g>.<key>`: the keys torch.optim's class of the same name holds (LibTorch's
/// hyperparameters, and Python's flags at their defaults) and `params`, the group's parameter names. So
/// FSDP2's `set_optimizer_state_dict` takes it after `dcp.load` (LightRFT keeps it in `optim_states/`
/// beside the model's checkpoint). Collective over the model's world; see save_state.
FSDPX_DECL ::fsdpx::detail::WrittenFile save_optimizer(const fs::path& dir, core::ShardedModel& model,
                                                       torch::optim::Optimizer& optimizer,
                                                       const SaveOptions& options = {});

template <class F>
concept HasShardedModel = requires(F& f) {
  { f.sharded() } -> std::same_as<core::ShardedModel&>;
};

template <HasShardedModel F>
::fsdpx::detail::WrittenFile save_model(const fs::path& dir, F& fsdp, const SaveOptions& options = {}) {
  return save_model(dir, fsdp.sharded(), options);
}
template <HasShardedModel F>
::fsdpx::detail::WrittenFile save_optimizer(const fs::path& dir, F& fsdp, torch::optim::Optimizer& optimizer,
                                            const SaveOptions& options = {}) {
  return save_optimizer(dir, fsdp.sharded(), optimizer, options);
}

namespace detail {

/// What one rank wrote: its data file, the tensors it holds chunks of, the bytes entries, and where each
/// chunk and bytes item lies (gathered to rank 0, which makes `.metadata` of every rank's).
struct RankData {
  struct Piece {
    std::string fqn;
    Chunk chunk;
    int64_t offset = 0;
    int64_t length = 0;
  };
  struct Tensor {
    std::string fqn;
    c10::ScalarType dtype = c10::kFloat;
    std::vector<int64_t> size;
    std::vector<PathStep> path;
  };
  struct Bytes {
    std::string fqn;
    std::vector<PathStep> path;
    int64_t offset = 0;
    int64_t length = 0;
  };
  std::string relative_path;
  std::vector<Tensor> tensors;
  std::vector<Piece> pieces;
  std::vector<Bytes> bytes;
  /// The data file as written (empty path: none, the rank had nothing to write); not encoded.
  ::fsdpx::detail::WrittenFile file;
};

/// Writes `state` as `dir/data_file_name(rank)`, durably, and says what it wrote (no file when there is
/// nothing to write: a replica's rank).
FSDPX_DECL RankData write_rank_data(const fs::path& dir, int rank, const RankState& state);

/// The `.metadata` describing what every rank wrote. Ranks that disagree on a tensor's dtype or size, or
/// that both write a bytes entry, are an IoError naming it; so is a tensor whose chunks do not cover it
/// (validate_metadata).
FSDPX_DECL Metadata make_metadata(std::span<const RankData> ranks);

/// One rank's RankData as bytes (to gather at rank 0), and back; the decoding checks what it reads.
FSDPX_DECL std::string encode_rank_data(const RankData& data);
FSDPX_DECL RankData decode_rank_data(std::string_view bytes, int rank);

}  // namespace detail

}  // namespace fsdpx::checkpoint::dcp

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/checkpoint/impl/dcp_writer.ipp>
#endif
