// Out-of-line functions of fsdpx/checkpoint/dcp_writer.hpp: included by it (header-only) or by
// fsdpx/impl/src.hpp (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <fsdpx/checkpoint/dcp_writer.hpp>

#include <algorithm>
#include <limits>
#include <exception>
#include <map>
#include <optional>
#include <utility>

#include <ATen/ATen.h>

#include <fsdpx/checkpoint/detail/torch_io.hpp>
#include <fsdpx/detail/json.hpp>
#include <fsdpx/dist/outcome.hpp>

namespace fsdpx::checkpoint::dcp {

namespace detail {

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

inline int64_t flat_offset(const Chunk& c, std::span<const int64_t> strides) {
  int64_t at = 0;
  for (size_t d = 0; d < c.offsets.size(); ++d) at += c.offsets[d] * strides[d];
  return at;
}

inline std::vector<int64_t> row_major_strides(std::span<const int64_t> shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (size_t d = shape.size(); d-- > 1;) strides[d - 1] = strides[d] * shape[d];
  return strides;
}

/// Every rank's bytes, in rank order, on every rank (two all-gathers: the sizes, then the padded bytes).
inline std::vector<std::string> all_gather_bytes(dist::AnyCommunicator& comm, const std::string& mine) {
  const int n = comm.size();
  at::Tensor sizes = at::empty({n}, at::kLong);
  comm.all_gather(sizes, at::tensor({static_cast<int64_t>(mine.size())}, at::kLong));
  int64_t largest = 0;
  for (int r = 0; r < n; ++r) largest = std::max(largest, sizes[r].item<int64_t>());
  at::Tensor padded = at::zeros({std::max<int64_t>(largest, 1)}, at::kByte);
  std::copy(mine.begin(), mine.end(), reinterpret_cast<char*>(padded.data_ptr()));
  at::Tensor all = at::empty({n * padded.numel()}, at::kByte);
  comm.all_gather(all, padded);
  std::vector<std::string> out;
  const char* base = reinterpret_cast<const char*>(all.const_data_ptr());
  for (int r = 0; r < n; ++r) out.emplace_back(base + r * padded.numel(), sizes[r].item<int64_t>());
  return out;
}

}  // namespace detail

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
  const std::vector<int64_t> strides = detail::row_major_strides(shape);
  std::vector<int64_t> prefix;
  detail::cover(shape, strides, 0, begin, end, prefix, out);
  return out;
}

FSDPX_DECL RankData write_rank_data(const fs::path& dir, int rank, const StateDict& sd, const SavedName& name_of) {
  RankData out;
  out.relative_path = data_file_name(rank);
  std::optional<::fsdpx::detail::DurableFile> file;  // none for a rank with nothing to save (a replica)
  for (const TensorSlice& slice : sd.entries) {
    const std::string fqn = name_of ? name_of(slice.name) : slice.name;
    if (fqn.empty()) continue;
    const at::Tensor data = slice.tensors.at("data").contiguous();
    FSDPX_CHECK_AS(InternalError, data.is_cpu() && data.numel() == slice.end - slice.begin, "the slice of '",
                   slice.name, "' holds ", data.numel(), " elements on ", data.device(), ", not ",
                   slice.end - slice.begin, " on the CPU");
    out.tensors.push_back({fqn, data.scalar_type(), slice.shape});
    if (!file) file.emplace(dir / out.relative_path);
    const std::vector<int64_t> strides = detail::row_major_strides(slice.shape);
    for (Chunk& chunk : cover_flat_range(slice.shape, slice.begin, slice.end)) {
      // A view of the slice's memory (no copy): torch.save writes a tensor's whole storage, so the box
      // is its own storage rather than a view into the slice's.
      const int64_t first = (chunk.offsets.empty() ? 0 : detail::flat_offset(chunk, strides)) - slice.begin;
      const at::Tensor box =
          at::from_blob(static_cast<char*>(data.data_ptr()) + first * static_cast<int64_t>(data.element_size()),
                        chunk.sizes, data.options());
      const int64_t offset = file->bytes();
      ::fsdpx::checkpoint::detail::write_ivalue(box, [&](const void* bytes, size_t n) { file->append(bytes, n); });
      out.pieces.push_back({fqn, std::move(chunk), offset, file->bytes() - offset});
    }
  }
  if (file) file->commit();
  return out;
}

FSDPX_DECL Metadata make_metadata(std::span<const RankData> ranks) {
  Metadata md;
  md.version = current_version;
  md.planner_data.emplace();
  for (const RankData& rank : ranks) {
    for (const RankData::Tensor& t : rank.tensors) {
      auto [it, fresh] = md.entries.try_emplace(t.fqn, TensorEntry{.dtype = t.dtype, .size = t.size});
      const auto* held = std::get_if<TensorEntry>(&it->second);
      FSDPX_CHECK_AS(IoError, held && held->dtype == t.dtype && held->size == t.size,
                     "DCP save: the ranks disagree on '", t.fqn, "': one holds it as ", c10::toString(t.dtype), " ",
                     c10::IntArrayRef(t.size));
      if (fresh) (*md.planner_data)[t.fqn] = {PathStep(t.fqn)};
    }
    for (const RankData::Piece& p : rank.pieces) {
      auto& entry = std::get<TensorEntry>(md.entries.at(p.fqn));
      const int64_t index = static_cast<int64_t>(entry.chunks.size());
      entry.chunks.push_back(p.chunk);
      md.storage[StorageIndex{p.fqn, p.chunk.offsets}] = StorageInfo{
          .relative_path = rank.relative_path, .offset = p.offset, .length = p.length, .chunk_index = index};
    }
  }
  validate_metadata(md, "the DCP checkpoint being saved");
  return md;
}

FSDPX_DECL std::string encode_rank_data(const RankData& data) {
  ::fsdpx::detail::Json j;
  j["path"] = data.relative_path;
  j["tensors"] = ::fsdpx::detail::Json::array();
  for (const auto& t : data.tensors) j["tensors"].push_back({t.fqn, dtype_name(t.dtype), t.size});
  j["pieces"] = ::fsdpx::detail::Json::array();
  for (const auto& p : data.pieces) j["pieces"].push_back({p.fqn, p.chunk.offsets, p.chunk.sizes, p.offset, p.length});
  return j.dump();
}

FSDPX_DECL RankData decode_rank_data(std::string_view bytes, int rank) {
  try {
    const auto j = ::fsdpx::detail::Json::parse(bytes);
    RankData out;
    out.relative_path = j.at("path").get<std::string>();
    for (const auto& t : j.at("tensors")) {
      const auto dtype = dtype_from_name(t.at(1).get<std::string>());
      FSDPX_CHECK_AS(IoError, dtype.has_value(), "dtype ", t.at(1).dump());
      out.tensors.push_back({t.at(0).get<std::string>(), *dtype, t.at(2).get<std::vector<int64_t>>()});
    }
    for (const auto& p : j.at("pieces")) {
      out.pieces.push_back({p.at(0).get<std::string>(),
                            Chunk{p.at(1).get<std::vector<int64_t>>(), p.at(2).get<std::vector<int64_t>>()},
                            p.at(3).get<int64_t>(), p.at(4).get<int64_t>()});
    }
    return out;
  } catch (const std::exception& e) {
    throw IoError(::fsdpx::detail::str("fsdpx: DCP save: what rank ", rank, " wrote cannot be read: ", e.what()));
  }
}

FSDPX_DECL ::fsdpx::detail::WrittenFile save_model(const fs::path& dir, core::ShardedModel& model,
                                                   const SavedName& name_of) {
  dist::AnyCommunicator& world = model.mesh().world();
  // Every rank takes part in each collective whatever happened to it: dist::agree_on_outcome tells all
  // of them what failed where, and every rank throws.
  std::optional<RankData> mine;
  std::exception_ptr failure = dist::capture_failure([&] {
    std::error_code ec;
    fs::create_directories(dir, ec);
    FSDPX_CHECK_AS(IoError, !ec, "cannot create '", dir.string(), "': ", ec.message());
    mine = write_rank_data(dir, world.rank(), sharded_state_dict(model), name_of);
  });
  dist::agree_on_outcome<IoError>(
      world, failure,
      ::fsdpx::detail::str("the DCP save's data files in '", dir.string(), "' (no .metadata is written)"));
  std::vector<RankData> ranks;
  const std::vector<std::string> all = detail::all_gather_bytes(world, encode_rank_data(*mine));
  for (int r = 0; r < static_cast<int>(all.size()); ++r) ranks.push_back(decode_rank_data(all[r], r));
  // Rank 0 writes .metadata, last; then every rank learns whether it could.
  ::fsdpx::detail::WrittenFile written;
  failure =
      world.rank() == 0
          ? dist::capture_failure([&] { written = write_metadata(dir / metadata_file_name, make_metadata(ranks)); })
          : nullptr;
  dist::agree_on_outcome<IoError>(world, failure,
                                  ::fsdpx::detail::str("writing the DCP save's .metadata in '", dir.string(), "'"));
  return written;
}

}  // namespace fsdpx::checkpoint::dcp
