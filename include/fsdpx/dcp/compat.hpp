// The spellings of PyTorch Distributed Checkpoint before it had a room of its own (2026-12): each still
// compiles, with a deprecation warning naming where it went, for one release. <fsdpx/dcp.hpp> includes this
// header, and so do the old headers (<fsdpx/checkpoint/dcp_metadata.hpp>, dcp_reader.hpp, dcp_writer.hpp);
// nothing else in the library uses it. CHANGELOG.md lists the moves.
#pragma once

#include <concepts>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <torch/optim/optimizer.h>

#include <fsdpx/core/model_ref.hpp>
#include <fsdpx/core/sharded_model.hpp>
#include <fsdpx/dcp/layouts.hpp>
#include <fsdpx/dcp/metadata.hpp>
#include <fsdpx/dcp/options.hpp>
#include <fsdpx/dcp/plan.hpp>
#include <fsdpx/dcp/reader.hpp>
#include <fsdpx/dcp/state_dict_loader.hpp>
#include <fsdpx/dcp/state_dict_saver.hpp>
#include <fsdpx/dcp/writer.hpp>

namespace fsdpx::checkpoint::dcp {

#define FSDPX_DCP_MOVED(old, now) [[deprecated("fsdpx::checkpoint::dcp::" old " is now " now " (<fsdpx/dcp.hpp>)")]]

namespace fs = std::filesystem;

// ---- the .metadata (now dcp/metadata.hpp) --------------------------------------------------------------

using Chunk FSDPX_DCP_MOVED("Chunk", "fsdpx::dcp::Chunk") = ::fsdpx::dcp::Chunk;
using MemoryFormat FSDPX_DCP_MOVED("MemoryFormat", "fsdpx::dcp::MemoryFormat") = ::fsdpx::dcp::MemoryFormat;
using TensorEntry FSDPX_DCP_MOVED("TensorEntry", "fsdpx::dcp::TensorEntry") = ::fsdpx::dcp::TensorEntry;
using BytesEntry FSDPX_DCP_MOVED("BytesEntry", "fsdpx::dcp::BytesEntry") = ::fsdpx::dcp::BytesEntry;
using Entry FSDPX_DCP_MOVED("Entry", "fsdpx::dcp::Entry") = ::fsdpx::dcp::Entry;
using StorageIndex FSDPX_DCP_MOVED("StorageIndex", "fsdpx::dcp::StorageIndex") = ::fsdpx::dcp::StorageIndex;
using StorageInfo FSDPX_DCP_MOVED("StorageInfo", "fsdpx::dcp::StorageInfo") = ::fsdpx::dcp::StorageInfo;
using PathStep FSDPX_DCP_MOVED("PathStep", "fsdpx::dcp::PathStep") = ::fsdpx::dcp::PathStep;
using StorageMeta FSDPX_DCP_MOVED("StorageMeta", "fsdpx::dcp::StorageMeta") = ::fsdpx::dcp::StorageMeta;
using Metadata FSDPX_DCP_MOVED("Metadata", "fsdpx::dcp::Metadata") = ::fsdpx::dcp::Metadata;
using MetadataLimits FSDPX_DCP_MOVED("MetadataLimits", "fsdpx::dcp::MetadataLimits") = ::fsdpx::dcp::MetadataLimits;
using Placement FSDPX_DCP_MOVED("Placement", "fsdpx::Placement") = ::fsdpx::Placement;

FSDPX_DCP_MOVED("metadata_file_name", "fsdpx::dcp::metadata_file_name")
inline constexpr const char* metadata_file_name = ::fsdpx::dcp::metadata_file_name;
FSDPX_DCP_MOVED("current_version", "fsdpx::dcp::current_version")
inline constexpr const char* current_version = ::fsdpx::dcp::current_version;

FSDPX_DCP_MOVED("dtype_name", "fsdpx::dcp::dtype_name")
inline const char* dtype_name(c10::ScalarType t) { return ::fsdpx::dcp::dtype_name(t); }
FSDPX_DCP_MOVED("dtype_from_name", "fsdpx::torch_dtype_from_name (<fsdpx/policies/dtype_names.hpp>)")
inline std::optional<c10::ScalarType> dtype_from_name(std::string_view name) {
  return ::fsdpx::torch_dtype_from_name(name);
}
FSDPX_DCP_MOVED("validate_metadata", "fsdpx::dcp::validate_metadata")
inline void validate_metadata(const ::fsdpx::dcp::Metadata& md, std::string_view what) {
  ::fsdpx::dcp::validate_metadata(md, what);
}
FSDPX_DCP_MOVED("parse_metadata", "fsdpx::dcp::parse_metadata")
inline ::fsdpx::dcp::Metadata parse_metadata(std::span<const std::byte> data,
                                             std::string_view what = ::fsdpx::dcp::metadata_file_name,
                                             const ::fsdpx::dcp::MetadataLimits& limits = {}) {
  return ::fsdpx::dcp::parse_metadata(data, what, limits);
}
FSDPX_DCP_MOVED("read_metadata", "fsdpx::dcp::read_metadata")
inline ::fsdpx::dcp::Metadata read_metadata(const fs::path& path, const ::fsdpx::dcp::MetadataLimits& limits = {}) {
  return ::fsdpx::dcp::read_metadata(path, limits);
}
FSDPX_DCP_MOVED("serialize_metadata", "fsdpx::dcp::serialize_metadata")
inline std::vector<std::byte> serialize_metadata(const ::fsdpx::dcp::Metadata& md) {
  return ::fsdpx::dcp::serialize_metadata(md);
}
FSDPX_DCP_MOVED("write_metadata", "fsdpx::dcp::write_metadata")
inline ::fsdpx::detail::WrittenFile write_metadata(const fs::path& path, const ::fsdpx::dcp::Metadata& md) {
  return ::fsdpx::dcp::write_metadata(path, md);
}

// ---- reading (now dcp/reader.hpp) ----------------------------------------------------------------------

using ReaderOptions FSDPX_DCP_MOVED("ReaderOptions", "fsdpx::dcp::ReaderOptions") = ::fsdpx::dcp::ReaderOptions;
using Reader FSDPX_DCP_MOVED("Reader", "fsdpx::dcp::Reader") = ::fsdpx::dcp::Reader;

FSDPX_DCP_MOVED("is_checkpoint", "fsdpx::dcp::is_checkpoint")
inline bool is_checkpoint(const fs::path& dir) { return ::fsdpx::dcp::is_checkpoint(dir); }
FSDPX_DCP_MOVED("read_plain_file", "fsdpx::dcp::read_plain_file")
inline c10::IValue read_plain_file(const fs::path& path, const ::fsdpx::dcp::ReaderOptions& options = {}) {
  return ::fsdpx::dcp::read_plain_file(path, options);
}

// ---- writing (now dcp/plan.hpp, writer.hpp, state_dict_saver.hpp) ---------------------------------------

using SavedTensor FSDPX_DCP_MOVED("SavedTensor", "fsdpx::dcp::SavedTensor") = ::fsdpx::dcp::SavedTensor;
using SavedBytes FSDPX_DCP_MOVED("SavedBytes", "fsdpx::dcp::SavedBytes") = ::fsdpx::dcp::SavedBytes;
using RankState FSDPX_DCP_MOVED("RankState", "fsdpx::dcp::RankState") = ::fsdpx::dcp::RankState;
using SaveOptions FSDPX_DCP_MOVED("SaveOptions", "fsdpx::dcp::SaveOptions") = ::fsdpx::dcp::SaveOptions;

FSDPX_DCP_MOVED("cover_flat_range", "fsdpx::dcp::cover_flat_range")
inline std::vector<::fsdpx::dcp::Chunk> cover_flat_range(std::span<const int64_t> shape, int64_t begin, int64_t end) {
  return ::fsdpx::dcp::cover_flat_range(shape, begin, end);
}
FSDPX_DCP_MOVED("data_file_name", "fsdpx::dcp::data_file_name")
inline std::string data_file_name(int rank) { return ::fsdpx::dcp::data_file_name(rank); }
FSDPX_DCP_MOVED("save_state", "fsdpx::dcp::save_state")
inline ::fsdpx::detail::WrittenFile save_state(const fs::path& dir, dist::AnyCommunicator& world,
                                               const ::fsdpx::dcp::RankState& state) {
  return ::fsdpx::dcp::save_state(dir, world, state);
}
FSDPX_DCP_MOVED("model_tensors", "fsdpx::dcp::model_tensors")
inline std::vector<::fsdpx::dcp::SavedTensor> model_tensors(const StateDict& sd,
                                                            const ::fsdpx::dcp::SaveOptions& options = {}) {
  return ::fsdpx::dcp::model_tensors(sd, options);
}
FSDPX_DCP_MOVED("optimizer_tensors", "fsdpx::dcp::optimizer_tensors")
inline std::vector<::fsdpx::dcp::SavedTensor> optimizer_tensors(const StateDict& sd,
                                                                const ::fsdpx::dcp::SaveOptions& options = {}) {
  return ::fsdpx::dcp::optimizer_tensors(sd, options);
}
FSDPX_DCP_MOVED("param_group_entries", "fsdpx::dcp::param_group_entries")
inline std::vector<::fsdpx::dcp::SavedBytes> param_group_entries(core::ShardedModel& model,
                                                                 torch::optim::Optimizer& optimizer,
                                                                 const ::fsdpx::dcp::SaveOptions& options = {}) {
  return ::fsdpx::dcp::param_group_entries(model, optimizer, options);
}

/// The concept these took (now fsdpx::ShardedModelLike, which every load, save and sync call takes).
template <class F>
concept HasShardedModel = ShardedModelLike<F>;

// save_model(dir, model) and save_optimizer(dir, model, optimizer): the model comes first now.
template <ShardedModelLike M>
FSDPX_DCP_MOVED("save_model(dir, model, ...)",
                "fsdpx::dcp::save_model(model, dir, ...): the model first")::fsdpx::detail::WrittenFile
    save_model(const fs::path& dir, M& model, const ::fsdpx::dcp::SaveOptions& options = {}) {
  return ::fsdpx::dcp::save_model(model, dir, options);
}
template <ShardedModelLike M>
FSDPX_DCP_MOVED("save_optimizer(dir, model, optimizer, ...)",
                "fsdpx::dcp::save_optimizer(model, optimizer, dir, ...): the model first")::fsdpx::detail::WrittenFile
    save_optimizer(const fs::path& dir, M& model, torch::optim::Optimizer& optimizer,
                   const ::fsdpx::dcp::SaveOptions& options = {}) {
  return ::fsdpx::dcp::save_optimizer(model, optimizer, dir, options);
}

#undef FSDPX_DCP_MOVED

}  // namespace fsdpx::checkpoint::dcp

namespace fsdpx {

// load_model_state_dict and load_optimizer_state_dict of a DCP checkpoint: now fsdpx::dcp::load_model and
// load_optimizer, the model first.
#define FSDPX_DCP_LOAD_MOVED(old, now)                                                                 \
  [[deprecated("fsdpx::" old " of a DCP checkpoint is now fsdpx::dcp::" now " (<fsdpx/dcp.hpp>): the " \
               "model first, as in every load, save and sync call")]]

FSDPX_DCP_LOAD_MOVED("load_model_state_dict(model, reader, options)", "load_model(model, reader, options)")
inline void load_model_state_dict(core::ShardedModel& model, const dcp::Reader& reader,
                                  const dcp::LoadOptions& options = {}) {
  dcp::load_model(model, reader, options);
}
FSDPX_DCP_LOAD_MOVED("load_model_state_dict(model, dir, options)", "load_model(model, dir, options)")
inline void load_model_state_dict(core::ShardedModel& model, const std::filesystem::path& dir,
                                  const dcp::LoadOptions& options = {}) {
  dcp::load_model(model, dir, options);
}
FSDPX_DCP_LOAD_MOVED("load_optimizer_state_dict(optimizer, model, reader, options)",
                     "load_optimizer(model, optimizer, reader, options)")
inline void load_optimizer_state_dict(torch::optim::Optimizer& optimizer, core::ShardedModel& model,
                                      const dcp::Reader& reader, const dcp::LoadOptions& options = {}) {
  dcp::load_optimizer(model, optimizer, reader, options);
}
FSDPX_DCP_LOAD_MOVED("load_optimizer_state_dict(optimizer, model, dir, options)",
                     "load_optimizer(model, optimizer, dir, options)")
inline void load_optimizer_state_dict(torch::optim::Optimizer& optimizer, core::ShardedModel& model,
                                      const std::filesystem::path& dir, const dcp::LoadOptions& options = {}) {
  dcp::load_optimizer(model, optimizer, dir, options);
}

#undef FSDPX_DCP_LOAD_MOVED

}  // namespace fsdpx
