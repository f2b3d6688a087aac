// Writing PyTorch's Distributed Checkpoint (DCP) from an fsdpx model, so that `dcp.load` (FSDP2,
// LightRFT, torchtitan, a plain transformers model) reads what fsdpx trained:
//
//   fsdpx::checkpoint::dcp::save_model(dir, model);   // collective over the model's world
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

#include <cstdint>
#include <filesystem>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

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

/// What one rank wrote: its data file, the tensors it holds chunks of, and where each chunk lies.
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
  };
  std::string relative_path;
  std::vector<Tensor> tensors;
  std::vector<Piece> pieces;
};

/// Maps an fsdpx name to the name saved (e.g. transformers' names for fsdpx's decoder); empty: the same.
using SavedName = std::function<std::string(const std::string&)>;

/// Writes the model slices of `sd` (this rank's "data" tensors) as `dir/data_file_name(rank)`, durably,
/// and says what it wrote (no file when there is nothing to write: a replica's rank). An entry whose
/// name maps to "" is left out.
FSDPX_DECL RankData write_rank_data(const fs::path& dir, int rank, const StateDict& sd, const SavedName& name_of = {});

/// The `.metadata` describing what every rank wrote: each tensor's dtype, global size and chunks, and
/// each chunk's file, offset and length. Ranks that disagree on a tensor's dtype or size are a
/// CheckpointError naming it; so is a tensor whose chunks do not cover it (validate_metadata).
FSDPX_DECL Metadata make_metadata(std::span<const RankData> ranks);

/// One rank's RankData as bytes (to gather at rank 0), and back; the decoding checks what it reads.
FSDPX_DECL std::string encode_rank_data(const RankData& data);
FSDPX_DECL RankData decode_rank_data(std::string_view bytes, int rank);

/// Saves `model`'s parameters and buffers as a DCP checkpoint in `dir` (created if missing): collective
/// over the model's world. Every rank writes its data file; rank 0 writes `.metadata` once all have,
/// and only if all have (a rank that failed makes every rank throw, and no `.metadata` is written).
/// Returns rank 0's `.metadata` file (the others: an empty path).
FSDPX_DECL ::fsdpx::detail::WrittenFile save_model(const fs::path& dir, core::ShardedModel& model,
                                                   const SavedName& name_of = {});
template <class F>
  requires requires(F& f) {
    { f.sharded() } -> std::same_as<core::ShardedModel&>;
  } ::fsdpx::detail::WrittenFile
save_model(const fs::path& dir, F& fsdp, const SavedName& name_of = {}) {
  return save_model(dir, fsdp.sharded(), name_of);
}

}  // namespace fsdpx::checkpoint::dcp

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/checkpoint/impl/dcp_writer.ipp>
#endif
