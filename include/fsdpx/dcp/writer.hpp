// The storage a DCP checkpoint is written to (torch's FileSystemWriter): each rank writes its own data file,
// `__<rank>_0.distcp`, durably: for every piece of a tensor it holds, the boxes that cover that piece exactly
// (plan.hpp), each a `torch.save` blob at a recorded offset, as DCP's FileSystemWriter writes them; and its
// bytes entries (torch.save'd Python values), likewise. The ranks then gather what they wrote to rank 0,
// which writes `.metadata` last, durably (temporary file, fsync, rename): a folder without it is no
// checkpoint, for DCP as for fsdpx. state_dict_saver.hpp saves a model and its optimizer through this.
#pragma once

#include <fsdpx/detail/config.hpp>

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

#include <fsdpx/dcp/metadata.hpp>
#include <fsdpx/detail/file_io.hpp>
#include <fsdpx/dist/any.hpp>

namespace fsdpx::dcp {

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

/// Every rank's bytes, in rank order, on every rank (two all-gathers: the sizes, then the padded bytes).
FSDPX_DECL std::vector<std::string> all_gather_bytes(dist::AnyCommunicator& comm, const std::string& mine);

/// save_state with `state` made by `make` inside the part whose failure every rank learns of (taking a
/// state dict can fail: a host copy out of memory).
FSDPX_DECL ::fsdpx::detail::WrittenFile save_made_state(const fs::path& dir, dist::AnyCommunicator& world,
                                                        const std::function<RankState()>& make);

}  // namespace detail

}  // namespace fsdpx::dcp

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/dcp/impl/writer.ipp>
#endif
