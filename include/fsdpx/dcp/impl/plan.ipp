// Out-of-line functions of fsdpx/dcp/plan.hpp: included by it (header-only) or by fsdpx/impl/src.hpp
// (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <fsdpx/dcp/plan.hpp>

#include <algorithm>
#include <limits>

namespace fsdpx::dcp::detail {

/// Appends the boxes covering elements [begin, end) of the sub-tensor at `dim` selected by `prefix`.
inline void cover(std::span<const int64_t> shape, std::span<const int64_t> strides, size_t dim, int64_t begin,
                  int64_t end, std::vector<int64_t>& prefix, std::vector<Chunk>& out) {
  if (begin >= end) return;
  // A box: the prefix's indices, `count` indices from `start` at `dim`, everything after it.
  const auto box = [&](int64_t start, int64_t count) {
    Chunk c;
    c.offsets = prefix;
    c.sizes.assign(prefix.size(), 1);
    c.offsets.push_back(start);
    c.sizes.push_back(count);
    for (size_t d = dim + 1; d < shape.size(); ++d) {
      c.offsets.push_back(0);
      c.sizes.push_back(shape[d]);
    }
    out.push_back(std::move(c));
  };
  const int64_t per_index = strides[dim];
  if (dim + 1 == shape.size()) return box(begin, end - begin);
  const auto inside = [&](int64_t index, int64_t b, int64_t e) {
    prefix.push_back(index);
    cover(shape, strides, dim + 1, b - index * per_index, e - index * per_index, prefix, out);
    prefix.pop_back();
  };
  int64_t first = begin / per_index;
  const int64_t last = (end - 1) / per_index;
  if (first == last) return inside(first, begin, end);
  if (begin % per_index != 0) inside(first, begin, (first + 1) * per_index), ++first;
  const bool partial_tail = end % per_index != 0;
  const int64_t whole_end = partial_tail ? last : last + 1;
  if (whole_end > first) box(first, whole_end - first);
  if (partial_tail) inside(last, last * per_index, end);
}

}  // namespace fsdpx::dcp::detail

namespace fsdpx::dcp {

FSDPX_DECL std::vector<int64_t> row_major_strides(std::span<const int64_t> shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (size_t d = shape.size(); d-- > 1;) strides[d - 1] = strides[d] * shape[d];
  return strides;
}

FSDPX_DECL int64_t flat_offset(const Chunk& box, std::span<const int64_t> strides) {
  int64_t at = 0;
  for (size_t d = 0; d < box.offsets.size(); ++d) at += box.offsets[d] * strides[d];
  return at;
}

FSDPX_DECL std::vector<Chunk> cover_flat_range(std::span<const int64_t> shape, int64_t begin, int64_t end) {
  int64_t numel = 1;
  for (const int64_t d : shape) {
    FSDPX_CHECK(d >= 0, "a tensor's size cannot be negative (", d, ")");
    FSDPX_CHECK(d == 0 || numel <= std::numeric_limits<int64_t>::max() / d, "a tensor's element count overflows");
    numel *= d;
  }
  FSDPX_CHECK(0 <= begin && begin <= end && end <= numel, "elements [", begin, ", ", end,
              ") are not within a tensor of ", numel, " elements");
  std::vector<Chunk> out;
  if (begin == end) return out;
  if (shape.empty()) return {Chunk{}};
  const std::vector<int64_t> strides = row_major_strides(shape);
  std::vector<int64_t> prefix;
  detail::cover(shape, strides, 0, begin, end, prefix, out);
  return out;
}

FSDPX_DECL std::vector<ChunkRun> chunk_runs(std::span<const int64_t> size, std::span<const int64_t> stride,
                                            const Chunk& c, int64_t begin, int64_t end) {
  const size_t nd = size.size();
  int64_t numel = 1, volume = 1, first = 0, last = 0;
  for (size_t i = 0; i < nd; ++i) {
    numel *= size[i];  // validate_metadata: no overflow
    volume *= c.sizes[i];
    first += c.offsets[i] * stride[i];
    last += (c.offsets[i] + c.sizes[i] - 1) * stride[i];
  }
  std::vector<ChunkRun> runs;
  if (volume == 0 || last < begin || first >= end) return runs;
  // The chunk is runs of consecutive elements: dimensions from `full` on are whole in it, so one run spans
  // dimension full - 1's extent times theirs.
  size_t full = nd;
  while (full > 0 && c.offsets[full - 1] == 0 && c.sizes[full - 1] == size[full - 1]) --full;
  const size_t outer = full == 0 ? 0 : full - 1;  // the runs are indexed by dimensions [0, outer)
  const int64_t run = full == 0 ? numel : c.sizes[outer] * stride[outer];
  std::vector<int64_t> idx(outer, 0);
  for (int64_t k = 0;; ++k) {
    int64_t start = full == 0 ? 0 : c.offsets[outer] * stride[outer];
    for (size_t i = 0; i < outer; ++i) start += (c.offsets[i] + idx[i]) * stride[i];
    if (start >= end) break;  // runs come in increasing order
    const int64_t lo = std::max(start, begin), hi = std::min(start + run, end);
    if (lo < hi) runs.push_back({lo, hi, k * run + (lo - start)});
    size_t i = outer;  // the next run: count up the outer index, last dimension fastest
    while (i > 0 && ++idx[i - 1] == c.sizes[i - 1]) idx[--i] = 0;
    if (i == 0) break;
  }
  return runs;
}

}  // namespace fsdpx::dcp
