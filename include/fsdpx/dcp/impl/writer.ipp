// Out-of-line functions of fsdpx/dcp/writer.hpp: included by it (header-only) or by fsdpx/impl/src.hpp
// (FSDPX_SEPARATE_COMPILATION; fsdpx/detail/config.hpp).
#pragma once

#include <fsdpx/dcp/writer.hpp>

#include <algorithm>
#include <exception>
#include <map>
#include <optional>
#include <utility>
#include <variant>

#include <ATen/ATen.h>

#include <fsdpx/checkpoint/detail/torch_io.hpp>
#include <fsdpx/dcp/plan.hpp>
#include <fsdpx/detail/json.hpp>
#include <fsdpx/dist/outcome.hpp>

namespace fsdpx::dcp::detail {

FSDPX_DECL std::vector<std::string> all_gather_bytes(dist::AnyCommunicator& comm, const std::string& mine) {
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

FSDPX_DECL RankData write_rank_data(const fs::path& dir, int rank, const RankState& state) {
  RankData out;
  out.relative_path = data_file_name(rank);
  std::optional<::fsdpx::detail::DurableFile> file;  // none for a rank with nothing to save (a replica)
  const auto open = [&]() -> ::fsdpx::detail::DurableFile& {
    if (!file) file.emplace(dir / out.relative_path);
    return *file;
  };
  const auto append = [&](const c10::IValue& value) {
    ::fsdpx::checkpoint::detail::write_ivalue(value, [&](const void* bytes, size_t n) { open().append(bytes, n); });
  };
  const auto path_of = [](const std::string& fqn, const std::vector<PathStep>& path) {
    return path.empty() ? std::vector<PathStep>{PathStep(fqn)} : path;
  };
  for (const SavedTensor& t : state.tensors) {
    const at::Tensor data = t.values.contiguous();
    FSDPX_CHECK_AS(InternalError, data.is_cpu() && data.numel() == t.end - t.begin, "the part of '", t.fqn,
                   "' to save holds ", data.numel(), " elements on ", data.device(), ", not ", t.end - t.begin,
                   " on the CPU");
    out.tensors.push_back({t.fqn, data.scalar_type(), t.shape, path_of(t.fqn, t.path)});
    const std::vector<int64_t> strides = row_major_strides(t.shape);
    for (Chunk& chunk : cover_flat_range(t.shape, t.begin, t.end)) {
      // A view of the part's memory (no copy): torch.save writes a tensor's whole storage, so the box
      // is its own storage rather than a view into the part's.
      const int64_t first = (chunk.offsets.empty() ? 0 : flat_offset(chunk, strides)) - t.begin;
      const at::Tensor box =
          at::from_blob(static_cast<char*>(data.data_ptr()) + first * static_cast<int64_t>(data.element_size()),
                        chunk.sizes, data.options());
      const int64_t offset = open().bytes();
      append(box);
      out.pieces.push_back({t.fqn, std::move(chunk), offset, file->bytes() - offset});
    }
  }
  for (const SavedBytes& b : state.bytes) {
    const int64_t offset = open().bytes();
    append(b.value);
    out.bytes.push_back({b.fqn, path_of(b.fqn, b.path), offset, file->bytes() - offset});
  }
  if (file) out.file = file->commit();
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
                     c10::IntArrayRef(t.size), held ? "" : ", another as a bytes entry");
      if (fresh) (*md.planner_data)[t.fqn] = t.path;
    }
    for (const RankData::Piece& p : rank.pieces) {
      auto& entry = std::get<TensorEntry>(md.entries.at(p.fqn));
      const int64_t index = static_cast<int64_t>(entry.chunks.size());
      entry.chunks.push_back(p.chunk);
      md.storage[StorageIndex{p.fqn, p.chunk.offsets}] = StorageInfo{
          .relative_path = rank.relative_path, .offset = p.offset, .length = p.length, .chunk_index = index};
    }
    for (const RankData::Bytes& b : rank.bytes) {
      FSDPX_CHECK_AS(IoError, md.entries.try_emplace(b.fqn, BytesEntry{}).second, "DCP save: '", b.fqn,
                     "' is saved twice (a bytes entry comes from one rank, and is no tensor)");
      (*md.planner_data)[b.fqn] = b.path;
      md.storage[StorageIndex{b.fqn, std::nullopt}] =
          StorageInfo{.relative_path = rank.relative_path, .offset = b.offset, .length = b.length};
    }
  }
  validate_metadata(md, "the DCP checkpoint being saved");
  return md;
}

namespace {

::fsdpx::detail::Json path_json(const std::vector<PathStep>& path) {
  auto j = ::fsdpx::detail::Json::array();
  for (const PathStep& step : path) std::visit([&](const auto& v) { j.push_back(v); }, step);
  return j;
}

std::vector<PathStep> path_from_json(const ::fsdpx::detail::Json& j) {
  std::vector<PathStep> path;
  for (const auto& step : j) {
    if (step.is_string()) {
      path.emplace_back(step.get<std::string>());
    } else {
      path.emplace_back(step.get<int64_t>());  // anything else: a type error, reported by the caller
    }
  }
  return path;
}

}  // namespace

FSDPX_DECL std::string encode_rank_data(const RankData& data) {
  ::fsdpx::detail::Json j;
  j["path"] = data.relative_path;
  j["tensors"] = ::fsdpx::detail::Json::array();
  for (const auto& t : data.tensors) j["tensors"].push_back({t.fqn, dtype_name(t.dtype), t.size, path_json(t.path)});
  j["pieces"] = ::fsdpx::detail::Json::array();
  for (const auto& p : data.pieces) j["pieces"].push_back({p.fqn, p.chunk.offsets, p.chunk.sizes, p.offset, p.length});
  j["bytes"] = ::fsdpx::detail::Json::array();
  for (const auto& b : data.bytes) j["bytes"].push_back({b.fqn, path_json(b.path), b.offset, b.length});
  return j.dump();
}

FSDPX_DECL RankData decode_rank_data(std::string_view bytes, int rank) {
  try {
    const auto j = ::fsdpx::detail::Json::parse(bytes);
    RankData out;
    out.relative_path = j.at("path").get<std::string>();
    for (const auto& t : j.at("tensors")) {
      const auto dtype = torch_dtype_from_name(t.at(1).get<std::string>());
      FSDPX_CHECK_AS(IoError, dtype.has_value(), "dtype ", t.at(1).dump());
      out.tensors.push_back(
          {t.at(0).get<std::string>(), *dtype, t.at(2).get<std::vector<int64_t>>(), path_from_json(t.at(3))});
    }
    for (const auto& p : j.at("pieces")) {
      out.pieces.push_back({p.at(0).get<std::string>(),
                            Chunk{p.at(1).get<std::vector<int64_t>>(), p.at(2).get<std::vector<int64_t>>()},
                            p.at(3).get<int64_t>(), p.at(4).get<int64_t>()});
    }
    for (const auto& b : j.at("bytes")) {
      out.bytes.push_back(
          {b.at(0).get<std::string>(), path_from_json(b.at(1)), b.at(2).get<int64_t>(), b.at(3).get<int64_t>()});
    }
    return out;
  } catch (const std::exception& e) {
    throw IoError(::fsdpx::detail::str("fsdpx: DCP save: what rank ", rank, " wrote cannot be read: ", e.what()));
  }
}

FSDPX_DECL ::fsdpx::detail::WrittenFile save_made_state(const fs::path& dir, dist::AnyCommunicator& world,
                                                        const std::function<RankState()>& make) {
  // Every rank takes part in each collective whatever happened to it: dist::agree_on_outcome tells all
  // of them what failed where, and every rank throws.
  std::optional<RankData> mine;
  std::exception_ptr failure = dist::capture_failure([&] {
    std::error_code ec;
    fs::create_directories(dir, ec);
    FSDPX_CHECK_AS(IoError, !ec, "cannot create '", dir.string(), "': ", ec.message());
    mine = write_rank_data(dir, world.rank(), make());
  });
  dist::agree_on_outcome<IoError>(
      world, failure,
      ::fsdpx::detail::str("the DCP save's data files in '", dir.string(), "' (no .metadata is written)"));
  std::vector<RankData> ranks;
  const std::vector<std::string> all = all_gather_bytes(world, encode_rank_data(*mine));
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

}  // namespace fsdpx::dcp::detail

namespace fsdpx::dcp {

FSDPX_DECL ::fsdpx::detail::WrittenFile save_state(const fs::path& dir, dist::AnyCommunicator& world,
                                                   const RankState& state) {
  return detail::save_made_state(dir, world, [&] { return state; });
}

}  // namespace fsdpx::dcp
