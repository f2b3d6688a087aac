// The plan: how fsdpx's shards (elements [begin, end) of a flattened tensor) meet DCP's chunks (boxes in the
// tensor's shape), both ways. Saving, a rank's range is cut into the boxes that cover it exactly; loading, a
// rank reads, of each chunk that overlaps its range, the runs of consecutive elements that fall in it.
//
// fsdpx shards flattened elements while DCP's chunks are boxes: a range is cut into at most 2 * ndim - 1
// boxes rather than exchanged with neighbours until each rank holds whole rows, because the cut costs no
// communication and no copy (each box is a view of the slice's memory), and DCP's readers take any set of
// boxes that covers a tensor.
#pragma once

#include <fsdpx/detail/config.hpp>

#include <cstdint>
#include <span>
#include <vector>

#include <fsdpx/dcp/metadata.hpp>

namespace fsdpx::dcp {

/// The boxes that cover elements [begin, end) of a tensor of `shape` flattened row-major, exactly, in
/// order: a partial row, whole rows, a partial row, at each dimension (at most 2 * ndim - 1 boxes; one
/// when the range is a box already). A 0-dimensional tensor is one box of no dimensions.
FSDPX_DECL std::vector<Chunk> cover_flat_range(std::span<const int64_t> shape, int64_t begin, int64_t end);

/// The strides of a tensor of `shape` laid out row-major.
FSDPX_DECL std::vector<int64_t> row_major_strides(std::span<const int64_t> shape);

/// The flattened index of a box's first element (its offsets) in a tensor of these row-major strides.
FSDPX_DECL int64_t flat_offset(const Chunk& box, std::span<const int64_t> strides);

/// A run of consecutive elements that one chunk holds and a read wants: global flattened elements [lo, hi),
/// which are the chunk's own flattened elements from `src` on.
struct ChunkRun {
  int64_t lo = 0;
  int64_t hi = 0;
  int64_t src = 0;
};

/// The runs of `chunk` (a validated box of a tensor of `size`, whose row-major strides are `strides`) that fall
/// in flattened elements [begin, end), in increasing order; none when the chunk holds none of them. A box of
/// whole rows (FSDP's dim-0 shards) is one run.
FSDPX_DECL std::vector<ChunkRun> chunk_runs(std::span<const int64_t> size, std::span<const int64_t> strides,
                                            const Chunk& chunk, int64_t begin, int64_t end);

}  // namespace fsdpx::dcp

#if defined(FSDPX_HEADER_ONLY)
#include <fsdpx/dcp/impl/plan.ipp>
#endif
